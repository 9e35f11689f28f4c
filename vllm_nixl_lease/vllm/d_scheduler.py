"""D scheduler: heartbeat bookkeeping on the core's ``HeartbeatTracker``.

Upstream keeps ``_heartbeat_by_engine`` (sets of ids per engine) and ships
those sets to the workers, which re-join them into one unbounded message per
engine every tick.  Here the tracker keeps per-engine chunks whose encoded
bytes are cached, and the metadata carries those bytes.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.logger import init_logger

from .. import HeartbeatTracker
from .config import LeaseConfig
from .fence_scheduler import LeaseViewSchedulerMixin
from .idle import LEASE_IDLE_ATTR, step_is_idle
from .metadata import LEASE_HEARTBEATS_ATTR, EngineHeartbeats

logger = init_logger(__name__)


class HeartbeatSchedulerMixin(LeaseViewSchedulerMixin):
    """Mixed in front of vLLM's pull/push scheduler classes."""

    lease_config: LeaseConfig
    heartbeat_tracker: Any

    def _setup_heartbeat_scheduler(self, lease_config: LeaseConfig) -> None:
        self.lease_config = lease_config
        self._heartbeat_interval = lease_config.heartbeat_interval
        self.heartbeat_tracker = HeartbeatTracker(
            lease_config.heartbeat_interval, lease_config.max_heartbeat_bytes
        )
        # engine id -> (host, port, tp, dcp, pp) of the first live request, as upstream
        self._heartbeat_targets: dict[str, tuple[str, int, int, int, int]] = {}
        self._setup_lease_views()

    def on_new_request(self, request: Any) -> None:
        # Upstream validates the remote fields and records the request in its
        # own dicts; move it from there into the tracker so those stay empty
        # (and upstream's build_connector_meta never ships id sets).
        super().on_new_request(request)  # type: ignore[misc]
        local_id = request.request_id
        entry = self._heartbeat_req_engine.get(local_id)  # type: ignore[attr-defined]
        if entry is None:
            return
        engine_id, remote_id = entry
        info = self._heartbeat_by_engine[engine_id]  # type: ignore[attr-defined]
        super()._stop_heartbeat(local_id)  # type: ignore[misc]
        self._add_lease_view(local_id, engine_id, remote_id, request.kv_transfer_params)
        try:
            self.heartbeat_tracker.track(local_id, engine_id, remote_id)
        except (TypeError, ValueError) as exc:
            # An id we cannot put on the wire (e.g. contains ','): its lease
            # will simply not be renewed, exactly what upstream would get.
            logger.warning("Not heartbeating request %s (remote id %r): %s", local_id, remote_id, exc)
            return
        if engine_id not in self._heartbeat_targets:
            self._heartbeat_targets[engine_id] = (
                info.host,
                info.port,
                info.tp_size,
                info.dcp_size,
                info.pp_size,
            )

    def _stop_heartbeat(self, req_id: str) -> None:
        self._drop_lease_view(req_id)
        tracker = self.heartbeat_tracker
        engine_id = tracker.engine_of(req_id)
        if engine_id is not None:
            tracker.untrack(req_id)
            if engine_id not in tracker.engines():
                self._heartbeat_targets.pop(engine_id, None)
        super()._stop_heartbeat(req_id)  # type: ignore[misc]

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)  # type: ignore[misc]
        out: dict[str, EngineHeartbeats] = {}
        if len(self.heartbeat_tracker):
            for engine_id, messages in self.heartbeat_tracker.poll(time.perf_counter()).items():
                target = self._heartbeat_targets.get(engine_id)
                if target is not None and messages:
                    out[engine_id] = EngineHeartbeats(messages, *target)
        setattr(meta, LEASE_HEARTBEATS_ATTR, out)
        self._attach_lease_views(meta)
        setattr(meta, LEASE_IDLE_ATTR, step_is_idle(scheduler_output, meta))
        return meta
