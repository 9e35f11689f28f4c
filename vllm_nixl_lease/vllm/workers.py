"""Worker classes: vLLM's pull/push workers with the lease core mixed in."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

from .config import LeaseConfig
from .d_worker import HeartbeatSenderMixin
from .fence_worker import ReadFenceMixin
from .idle import IdleStepMixin
from .p_worker import LeaseSenderMixin
from .push_lease import PushLeaseSenderMixin


class _LeaseWorkerSetup:
    def _setup_lease(self, lease_config: LeaseConfig) -> None:
        """Install P- and D-side lease state (a worker can be both with kv_both).

        Separate from ``__init__`` so tests can build workers the way vLLM's
        own tests do, with ``object.__new__`` and hand-set attributes.
        """
        self._setup_lease_sender(lease_config)  # type: ignore[attr-defined]
        self._setup_heartbeat_sender(lease_config.max_heartbeat_bytes)  # type: ignore[attr-defined]
        self._setup_idle_pause(lease_config.idle_step_sleep_s)  # type: ignore[attr-defined]


class LeaseNixlPullConnectorWorker(
    _LeaseWorkerSetup,
    ReadFenceMixin,
    IdleStepMixin,
    LeaseSenderMixin,
    HeartbeatSenderMixin,
    NixlPullConnectorWorker,
):
    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        lease_config = LeaseConfig.from_vllm_config(vllm_config)  # fail before NIXL setup
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self._setup_lease(lease_config)

    def _setup_lease(self, lease_config: LeaseConfig) -> None:
        super()._setup_lease(lease_config)
        self._setup_read_fence(lease_config)


class LeaseNixlPushConnectorWorker(
    _LeaseWorkerSetup, IdleStepMixin, PushLeaseSenderMixin, HeartbeatSenderMixin, NixlPushConnectorWorker
):
    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        lease_config = LeaseConfig.from_vllm_config(vllm_config)
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self._setup_lease(lease_config)
