"""Scheduler classes: vLLM's pull/push schedulers, each upstream hook
overridden once, calling the lease components in order.

Components (all per scheduler process):
- ``heartbeats``: ``HeartbeatSchedule`` (D) -- which heartbeats are due, as bytes;
- ``lease_views``: ``LeaseViewCollector`` (D, pull) -- views of P's leases for the read fence;
- ``lease_params``: ``LeaseParams`` (P, pull) -- the lease terms D gets, and this P's instance.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import NixlPushConnectorScheduler

from .config import LeaseConfig
from .d_scheduler.heartbeat_schedule import HeartbeatSchedule
from .d_scheduler.lease_view_collector import LeaseViewCollector
from .metadata import LEASE_IDLE_ATTR, LeaseConnectorMetadata, executor_pickles
from .p_scheduler.idle_step import step_is_idle
from .p_scheduler.lease_params import LeaseParams


class LeaseNixlPullConnectorScheduler(NixlPullConnectorScheduler):
    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        lease_config = LeaseConfig.from_vllm_config(vllm_config)  # fail before upstream's set-up
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self.lease_config = lease_config
        self._heartbeat_interval = lease_config.heartbeat_interval  # upstream reads it; keep ours
        self.heartbeats = HeartbeatSchedule(lease_config, engine_id)
        self.lease_views = LeaseViewCollector(lease_config, self._TRANSFER_MODE)
        self.lease_params = LeaseParams(lease_config)
        self._compact_pickle = executor_pickles(vllm_config)
        # No component but the heartbeat schedule has anything to ship (no view
        # news, no repack, P's instance shipped) until a hook below says otherwise:
        # most steps then touch only the schedule (they run with caches others
        # have evicted).
        self._quiet = False

    # D: upstream validates and records the request in its own heartbeat
    # dicts; our components take it over from there.
    def on_new_request(self, request: Any) -> None:
        super().on_new_request(request)
        self._quiet = False
        req_id = request.request_id
        entry = self._heartbeat_req_engine.get(req_id)
        if entry is None:
            return
        # The request's own params say what its P takes (never an engine id's past);
        # acknowledged heartbeats exist to renew the read fence's views.
        terms = self.lease_views.terms_of(req_id, entry[0], request.kv_transfer_params)
        taken = self.heartbeats.take_over(
            self, req_id, super()._stop_heartbeat, terms, self.lease_config.heartbeat_tags
        )
        if taken is not None and terms is not None:
            engine_id, instance, name = taken
            self.lease_views.add(req_id, engine_id, instance, name, terms, self.heartbeats.chunk_of(req_id))

    def _stop_heartbeat(self, req_id: str) -> None:
        self._quiet = False
        self.lease_views.drop(req_id)
        self.heartbeats.untrack(req_id)
        super()._stop_heartbeat(req_id)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        # Upstream's by name: super() resolves through the MRO on every call,
        # bypassing the type's attribute cache, the costliest part of an idle
        # step run with caches others have evicted.
        meta = NixlPullConnectorScheduler.build_connector_meta(self, scheduler_output)
        if self._compact_pickle:
            meta = LeaseConnectorMetadata.adopt(meta)
        self.heartbeats.attach(meta)  # every step: paced chunks fall due by the clock
        if self._quiet and not meta.reqs_to_send:
            return meta
        self.lease_views.rechunk(self.heartbeats.take_repacked(), self.heartbeats.chunk_of)
        self.lease_views.attach(meta)
        self.lease_params.attach(meta)
        if self.lease_config.idle_step_sleep_s > 0:  # read only by the idle pause
            setattr(meta, LEASE_IDLE_ATTR, step_is_idle(scheduler_output, meta))
        else:
            self._quiet = not self.lease_views.pending
        return meta

    # P: tell D when its lease ends (read fencing).
    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        self._quiet = False
        delay_free, params = super().request_finished(request, block_ids)
        if delay_free and params and params.get("do_remote_prefill"):
            self.lease_params.add(params, request.request_id, self._reqs_need_send.get(request.request_id))
        return delay_free, params


class LeaseNixlPushConnectorScheduler(NixlPushConnectorScheduler):
    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        lease_config = LeaseConfig.from_vllm_config(vllm_config)
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self.lease_config = lease_config
        self._heartbeat_interval = lease_config.heartbeat_interval  # upstream reads it; keep ours
        self.heartbeats = HeartbeatSchedule(lease_config, engine_id)
        # Push: P writes into D, D never reads; the collector stays disabled.
        self.lease_views = LeaseViewCollector(lease_config, self._TRANSFER_MODE)
        self._compact_pickle = executor_pickles(vllm_config)

    def on_new_request(self, request: Any) -> None:
        super().on_new_request(request)
        self.heartbeats.take_over(self, request.request_id, super()._stop_heartbeat)

    def _stop_heartbeat(self, req_id: str) -> None:
        self.heartbeats.untrack(req_id)
        super()._stop_heartbeat(req_id)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        # Not super(): see the pull scheduler's.
        meta = NixlPushConnectorScheduler.build_connector_meta(self, scheduler_output)
        if self._compact_pickle:
            meta = LeaseConnectorMetadata.adopt(meta)
        self.heartbeats.attach(meta)
        self.lease_views.attach(meta)
        if self.lease_config.idle_step_sleep_s > 0:  # read only by the idle pause
            setattr(meta, LEASE_IDLE_ATTR, step_is_idle(scheduler_output, meta))
        return meta
