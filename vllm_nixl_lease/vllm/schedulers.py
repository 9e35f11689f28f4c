"""Scheduler classes: vLLM's pull/push schedulers with the heartbeat tracker."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import NixlPushConnectorScheduler

from .config import LeaseConfig
from .d_scheduler import HeartbeatSchedulerMixin
from .fence_scheduler import LeaseParamsSchedulerMixin


class LeaseNixlPullConnectorScheduler(
    LeaseParamsSchedulerMixin, HeartbeatSchedulerMixin, NixlPullConnectorScheduler
):
    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        lease_config = LeaseConfig.from_vllm_config(vllm_config)
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self._setup_heartbeat_scheduler(lease_config)


class LeaseNixlPushConnectorScheduler(HeartbeatSchedulerMixin, NixlPushConnectorScheduler):
    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        lease_config = LeaseConfig.from_vllm_config(vllm_config)
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self._setup_heartbeat_scheduler(lease_config)
