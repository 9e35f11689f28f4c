"""The connector classes vLLM instantiates.

They subclass vLLM's own facades and differ only in which scheduler/worker
they build and which stats/metrics classes they report through.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
    NixlPullConnector,
    NixlPushConnector,
)

from .compat import check_supported
from .config import LeaseConfig
from .schedulers import LeaseNixlPullConnectorScheduler, LeaseNixlPushConnectorScheduler
from .stats import LeaseKVConnectorStats, LeasePromMetrics
from .step_time import ConnectorStepTimer
from .workers import LeaseNixlPullConnectorWorker, LeaseNixlPushConnectorWorker


class _LeaseConnectorMixin:
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> LeaseKVConnectorStats:
        return LeaseKVConnectorStats(data=data) if data is not None else LeaseKVConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> LeasePromMetrics:
        return LeasePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _base_init(
    self: NixlBaseConnector, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any
) -> None:
    # Validate before any NIXL or socket setup so a bad deployment fails with
    # a message about *our* constraints, not a later unrelated error.
    check_supported()
    LeaseConfig.from_vllm_config(vllm_config)
    # Skip NixlPull/PushConnector.__init__: it would build the stock
    # scheduler/worker (and a NIXL agent) only for us to replace them.
    NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)


class _StepTimerOnRequest:
    """Builds the step-timed twin of the class vLLM asked for when ``step_time_metric`` is on.

    The timer is a Python frame around every hook vLLM calls, several per request, each a few
    microseconds once the engine's other work has evicted the caches: a connector pays that
    only when its operator wants the metric."""

    _timed_twin: type | None = None  # set on each of our connector classes below

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        twin = cls.__dict__.get("_timed_twin")  # our classes' own, not a subclass's
        vllm_config = args[0] if args else kwargs.get("vllm_config")
        if twin is not None and LeaseConfig.from_vllm_config(vllm_config).step_time_metric:
            return super().__new__(twin)
        return super().__new__(cls)


class LeaseNixlPullConnector(_StepTimerOnRequest, _LeaseConnectorMixin, NixlPullConnector):
    """Pull (READ) connector with lease bookkeeping on the lease core."""

    connector_scheduler: LeaseNixlPullConnectorScheduler | None
    connector_worker: LeaseNixlPullConnectorWorker | None

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        _base_init(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = LeaseNixlPullConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = LeaseNixlPullConnectorWorker(vllm_config, self.engine_id, kv_cache_config)


class LeaseNixlPushConnector(_StepTimerOnRequest, _LeaseConnectorMixin, NixlPushConnector):
    """Push (WRITE) connector with lease bookkeeping on the lease core and
    heartbeats that renew P's leases even when D names the router's request
    id (``p_worker/push_aliases.py``)."""

    connector_scheduler: LeaseNixlPushConnectorScheduler | None
    connector_worker: LeaseNixlPushConnectorWorker | None

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        _base_init(self, vllm_config, role, kv_cache_config)
        if vllm_config.parallel_config.decode_context_parallel_size > 1:
            raise ValueError("NixlPushConnector does not support decode_context_parallel_size > 1.")
        self.connector_scheduler = None
        self.connector_worker = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = LeaseNixlPushConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = LeaseNixlPushConnectorWorker(vllm_config, self.engine_id, kv_cache_config)
        else:
            raise ValueError(f"Unsupported KVConnectorRole: {role}")


class StepTimedNixlConnector(ConnectorStepTimer, _LeaseConnectorMixin, NixlPullConnector):
    """Upstream's pull connector, its scheduler and worker unchanged, reporting its own time per
    step in ``vllm:nixl_lease_connector_step_seconds`` as ours does: stock measured the same way
    (``tools/bench_serve.py``). Load it with ``"kv_connector": "StepTimedNixlConnector"`` and
    ``"kv_connector_module_path": "vllm_nixl_lease.adapter.connector"``."""


class StepTimedLeaseNixlPullConnector(ConnectorStepTimer, LeaseNixlPullConnector):
    """``LeaseNixlPullConnector`` with ``step_time_metric`` on (built by its ``__new__``)."""


class StepTimedLeaseNixlPushConnector(ConnectorStepTimer, LeaseNixlPushConnector):
    """``LeaseNixlPushConnector`` with ``step_time_metric`` on (built by its ``__new__``)."""


LeaseNixlPullConnector._timed_twin = StepTimedLeaseNixlPullConnector
LeaseNixlPushConnector._timed_twin = StepTimedLeaseNixlPushConnector

# The pull connector is the default, as upstream's NixlConnector alias.
LeaseNixlConnector = LeaseNixlPullConnector

__all__ = ["LeaseNixlConnector", "LeaseNixlPullConnector", "LeaseNixlPushConnector", "StepTimedNixlConnector"]
