"""The connector's own time per engine step, on the scheduler side and on the worker side.

Each hook vLLM calls on the connector facade costs one ``perf_counter`` pair (a hook that calls
another one is counted once). ``get_kv_connector_stats``, which vLLM calls once per step on each
side (the scheduler after ``update_connector_output``, the model runner after
``get_block_ids_with_load_errors``), closes the step: its total becomes one sample of
``vllm:nixl_lease_connector_step_seconds{side=...}``. Samples ride along with the side's next stats,
or ship on their own every ``STEP_FLUSH`` steps, so a quiet engine does not ship stats every step.
"""

from __future__ import annotations

import inspect
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
    """Mixin placed before vLLM's connector facade in the bases: times its per-step hooks.

    A class that names it among its bases gets each hook bound, when the class is made, to
    the facade method it wraps (the next one in its MRO): a call then touches one function, not
    ``super()`` and every class dict of the MRO, which costs microseconds per hook once the
    engine's other work has evicted the caches."""

    _step_s = 0.0  # this step's hook time so far
    _hook_depth = 0
    _step_samples: list[float] | None = None  # closed steps not shipped yet

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if ConnectorStepTimer in cls.__bases__:
            _bind_hooks(cls)

    def get_kv_connector_stats(self) -> Any:
        facade: Any = super()  # vLLM's connector facade, after this mixin in the bases
        return _close_step(self, facade.get_kv_connector_stats)


def _close_step(timer: ConnectorStepTimer, facade_stats: Callable[..., Any], *args: Any) -> Any:
    """``get_kv_connector_stats``: the facade's stats, with the step's time as one sample."""
    start = perf_counter()
    stats = facade_stats(*args)
    timer._step_s += perf_counter() - start
    pending = timer._step_samples
    if pending is None:
        pending = timer._step_samples = []
    pending.append(timer._step_s)
    timer._step_s = 0.0
    if stats is None and len(pending) < STEP_FLUSH:
        return None
    out = stats if isinstance(stats, LeaseKVConnectorStats) else _adopt(stats)
    side = "scheduler" if getattr(timer, "connector_scheduler", None) is not None else "worker"
    out.data[STEP_TIME_KEYS[side]].extend(pending)
    pending.clear()
    return out


def _adopt(stats: Any) -> LeaseKVConnectorStats:
    """Our stats holding `stats`' items (a stock worker's NixlKVConnectorStats, or None)."""
    out = LeaseKVConnectorStats()
    for key, items in (stats.data if stats is not None else {}).items():
        out.data.setdefault(key, []).extend(items)
    return out


def _through_super(name: str) -> Callable[..., Any]:
    """Calls the facade's ``name`` through ``super()`` (the hooks of a class the timer's
    ``__init_subclass__`` did not bind)."""

    def facade_hook(self: ConnectorStepTimer, *args: Any, **kwargs: Any) -> Any:
        return getattr(super(ConnectorStepTimer, self), name)(*args, **kwargs)

    return facade_hook


def _bound(name: str, facade_hook: Callable[..., Any]) -> Callable[..., Any]:
    """The hook ``name`` calling ``facade_hook`` (a plain function of the facade) directly."""

    def hook(self: ConnectorStepTimer, *args: Any, **kwargs: Any) -> Any:
        if self._hook_depth:
            return facade_hook(self, *args, **kwargs)
        self._hook_depth = 1
        start = perf_counter()
        try:
            return facade_hook(self, *args, **kwargs)
        finally:
            self._step_s += perf_counter() - start
            self._hook_depth = 0

    hook.__name__ = hook.__qualname__ = name
    return hook


def _bound_stats(facade_stats: Callable[..., Any]) -> Callable[..., Any]:
    def get_kv_connector_stats(self: ConnectorStepTimer) -> Any:
        return _close_step(self, facade_stats, self)

    return get_kv_connector_stats


def _bind_hooks(cls: type) -> None:
    """On ``cls`` (which names the timer among its bases), each hook it does not define itself,
    bound to the function the facade after the timer in ``cls``'s MRO defines for it."""
    mro = cls.__mro__
    after = mro[mro.index(ConnectorStepTimer) + 1 :]
    for name in (*SCHEDULER_HOOKS, *WORKER_HOOKS, "get_kv_connector_stats"):
        if name in vars(cls):
            continue
        facade_hook = next((vars(k)[name] for k in after if name in vars(k)), None)
        if not inspect.isfunction(facade_hook):
            continue  # absent from this vLLM, or not a plain method: the generic hook stays
        if name == "get_kv_connector_stats":
            setattr(cls, name, _bound_stats(facade_hook))
        else:
            setattr(cls, name, _bound(name, facade_hook))


for _name in SCHEDULER_HOOKS + WORKER_HOOKS:
    setattr(ConnectorStepTimer, _name, _bound(_name, _through_super(_name)))
