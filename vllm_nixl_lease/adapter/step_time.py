"""The connector's own time per engine step, on the scheduler side and on the worker side.

Each hook vLLM calls on the connector facade costs one ``perf_counter`` pair (a hook that calls
another one is counted once). ``get_kv_connector_stats``, which vLLM calls once per step on each
side (the scheduler after ``update_connector_output``, the model runner after
``get_block_ids_with_load_errors``), closes the step: its total becomes one sample of
``vllm:nixl_lease_connector_step_seconds{side=...}``. Samples ride along with the side's next stats,
or ship on their own every ``STEP_FLUSH`` steps, so a quiet engine does not ship stats every step.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter
from typing import Any

from .stats import STEP_TIME_KEYS, LeaseKVConnectorStats

STEP_FLUSH = 64
SCHEDULER_HOOKS = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
)
WORKER_HOOKS = (
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "clear_connector_metadata",
)


class ConnectorStepTimer:
    """Mixin placed before vLLM's connector facade in the bases: times its per-step hooks."""

    _step_s = 0.0  # this step's hook time so far
    _hook_depth = 0
    _step_samples: list[float] | None = None  # closed steps not shipped yet

    def get_kv_connector_stats(self) -> Any:
        facade: Any = super()  # vLLM's connector facade, after this mixin in the bases
        start = perf_counter()
        stats = facade.get_kv_connector_stats()
        self._step_s += perf_counter() - start
        pending = self._step_samples
        if pending is None:
            pending = self._step_samples = []
        pending.append(self._step_s)
        self._step_s = 0.0
        if stats is None and len(pending) < STEP_FLUSH:
            return None
        out = stats if isinstance(stats, LeaseKVConnectorStats) else _adopt(stats)
        side = "scheduler" if getattr(self, "connector_scheduler", None) is not None else "worker"
        out.data[STEP_TIME_KEYS[side]].extend(pending)
        pending.clear()
        return out


def _adopt(stats: Any) -> LeaseKVConnectorStats:
    """Our stats holding `stats`' items (a stock worker's NixlKVConnectorStats, or None)."""
    out = LeaseKVConnectorStats()
    for key, items in (stats.data if stats is not None else {}).items():
        out.data.setdefault(key, []).extend(items)
    return out


def _timed(name: str) -> Callable[..., Any]:
    def hook(self: ConnectorStepTimer, *args: Any, **kwargs: Any) -> Any:
        parent = getattr(super(ConnectorStepTimer, self), name)
        if self._hook_depth:
            return parent(*args, **kwargs)
        self._hook_depth = 1
        start = perf_counter()
        try:
            return parent(*args, **kwargs)
        finally:
            self._step_s += perf_counter() - start
            self._hook_depth = 0

    hook.__name__ = hook.__qualname__ = name
    return hook


for _name in SCHEDULER_HOOKS + WORKER_HOOKS:
    setattr(ConnectorStepTimer, _name, _timed(_name))
