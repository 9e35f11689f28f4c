"""Scheduler classes: vLLM's pull/push schedulers, each upstream hook
overridden once, calling the lease components in order.

Components (all per scheduler process):
- ``heartbeats``: ``HeartbeatSchedule`` (D) -- which heartbeats are due, as bytes;
- ``lease_views``: ``LeaseViewCollector`` (D, pull) -- views of P's leases for the read fence;
- ``_intake``: the core's ``Intake`` (D, pull; the schedule's) -- the step's arrivals and departures;
- ``lease_params``: ``LeaseParams`` (P, pull) -- the lease terms D gets, and this P's instance.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import NixlPushConnectorScheduler

from ..decode.intake import heartbeat_target
from .config import LeaseConfig
from .d_scheduler.heartbeat_schedule import HeartbeatSchedule
from .d_scheduler.lease_view_collector import LeaseViewCollector
from .metadata import LEASE_IDLE_ATTR, LeaseConnectorMetadata, NewView, executor_pickles
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
        intake = self._intake = self.heartbeats.intake
        intake.views = self.lease_views
        intake.view_type = NewView
        intake.tags = lease_config.heartbeat_tags
        intake.arrive_slow = self._arrive_slow
        self._intake_events = intake.events
        # No component but the heartbeat schedule has anything to ship (no view
        # news, no repack, P's instance shipped) until a hook below says otherwise:
        # most steps then touch only the schedule (they run with caches others
        # have evicted).
        self._quiet = False
        # Whether the heartbeat tracker may hold a request.  A P's never does,
        # and a quiet step that does not call into the schedule at all costs
        # several microseconds less once other work has evicted the caches.
        self._tracking = True

    # D: the hooks only queue arrivals and departures; build_connector_meta
    # applies them in order with one call into the core (decode/intake.py),
    # which tracks, untracks and collects the views.  Upstream's own heartbeat
    # dicts are never built and then undone.
    def on_new_request(self, request: Any) -> None:
        self._quiet = False
        params = request.kv_transfer_params
        if params is None or not params.get("do_remote_prefill"):
            super().on_new_request(request)  # P's truncation; nothing to heartbeat
            return
        if params.get("do_remote_decode"):
            # Both roles: upstream's truncation, without its heartbeat entry (ours instead).
            self._truncate_request_for_prefill(request)
        self._intake_events.append((request.request_id, params))

    def _arrive_slow(self, req_id: str, params: Any) -> None:
        # The core's way for a request it does not read itself (a stock P, fields
        # malformed or of unusual types): the same tracking, and the log lines.
        engine_id = params.get("remote_engine_id")
        remote_id = params.get("remote_request_id")
        host = params.get("remote_host")
        port = params.get("remote_port")
        tp_size = params.get("tp_size")
        if engine_id is None or remote_id is None or host is None or port is None or tp_size is None:
            return
        target = heartbeat_target(params, host, port, tp_size)
        self._track(req_id, engine_id, remote_id, target, params)

    def _track(
        self, req_id: str, engine_id: str, remote_id: str, target: tuple[Any, ...], params: Any
    ) -> None:
        # The request's own params say what its P takes (never an engine id's past);
        # acknowledged heartbeats exist to renew the read fence's views.
        terms = self.lease_views.terms_of(req_id, engine_id, params)
        self._tracking = True
        taken = self.heartbeats.track_request(
            req_id, engine_id, remote_id, target, terms, self.lease_config.heartbeat_tags
        )
        if taken is not None and terms is not None:
            instance, name = taken
            chunk = self.heartbeats.tracker.chunk_of(req_id)  # the tracker's own: once per arrival
            self.lease_views.add(req_id, engine_id, instance, name, terms, chunk)

    def _stop_heartbeat(self, req_id: str) -> None:
        self._quiet = False
        self._intake_events.append(req_id)
        if self._heartbeat_req_engine:  # empty unless a hook of upstream's recorded one
            super()._stop_heartbeat(req_id)

    def update_connector_output(self, connector_output: Any) -> None:
        # Upstream's only stops heartbeats of the finished READs: queued here at once.
        finished = connector_output.finished_recving
        if finished:
            self._quiet = False
            self._intake_events.extend(finished)
            if self._heartbeat_req_engine:
                for req_id in finished:
                    super()._stop_heartbeat(req_id)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        # Upstream's by name: super() resolves through the MRO on every call,
        # bypassing the type's attribute cache, the costliest part of an idle
        # step run with caches others have evicted.
        if self._intake_events:
            self._intake.apply()  # the step's arrivals and departures, in order
            self._tracking = True
        meta = NixlPullConnectorScheduler.build_connector_meta(self, scheduler_output)
        # LeaseConnectorMetadata.adopt, inlined: a call costs more than the swap
        # on a quiet step run with caches others have evicted.
        if self._compact_pickle and type(meta) is NixlConnectorMetadata:
            meta.__class__ = LeaseConnectorMetadata
        if self._tracking:  # every step while tracking: paced chunks fall due by the clock
            self._tracking = self.heartbeats.attach(meta)
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
        # Upstream's by name, as in build_connector_meta: once per finished request.
        delay_free, params = NixlPullConnectorScheduler.request_finished(self, request, block_ids)
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
