"""D scheduler: which heartbeats go out this step, as bytes.

Upstream keeps ``_heartbeat_by_engine`` (sets of ids per engine) and ships
those sets to the workers, which re-join them into one unbounded message per
engine every tick.  Here the core's ``HeartbeatTracker`` keeps per-engine
chunks whose encoded bytes are cached, and the metadata carries those bytes
(``EngineHeartbeats``) to ``heartbeat_sender.py``.

A P engine that takes lease tags (``_wire.takes_tags``, decided by the
engine's first request) is heartbeated by tag: the tracker holds each
request's tag (``lease_tags.py``) in place of P's request id, a fixed 11
bytes instead of an id that is often several times longer, so the same
requests fit in fewer messages.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

from ..._wire import ACKED_HEARTBEAT_OVERHEAD
from ...decode.heartbeat_tracker import HeartbeatTracker
from ...lease_tags import lease_tag
from ..config import LeaseConfig
from ..metadata import LEASE_HEARTBEATS_ATTR, EngineHeartbeats
from ..upstream import HeartbeatTarget, UpstreamScheduler

logger = init_logger(__name__)


class HeartbeatSchedule:
    """The requests D heartbeats, per P engine, and the messages due each step."""

    def __init__(self, lease_config: LeaseConfig) -> None:
        # Chunked so that the acknowledged form (``LHB:<seq>:``, longer than
        # ``HB:``) still fits max_heartbeat_bytes.
        self.tracker = HeartbeatTracker(
            lease_config.heartbeat_interval, lease_config.max_heartbeat_bytes - ACKED_HEARTBEAT_OVERHEAD
        )
        # engine id -> (host, port, tp, dcp, pp) of the first live request, as upstream
        self.targets: dict[str, tuple[str, int, int, int, int]] = {}
        # engines whose chunks were repacked since the last take_repacked()
        self._repacked: set[str] = set()
        # engines heartbeated by tag (while they have tracked requests)
        self.tagged: set[str] = set()

    def take_over(
        self,
        upstream: UpstreamScheduler,
        req_id: str,
        stop_upstream: Callable[[str], None],
        tags: bool = False,
    ) -> tuple[str, str] | None:
        """Move a request upstream's ``on_new_request`` just recorded for
        heartbeats into this schedule, so upstream's own dicts stay empty (and
        its ``build_connector_meta`` never ships id sets).  ``stop_upstream``
        is upstream's ``_stop_heartbeat``; ``tags``: its P takes lease tags.
        Returns ``(engine id, the name heartbeats give the lease)``: P's
        request id or its tag; None when upstream did not record the request."""
        entry = upstream._heartbeat_req_engine.get(req_id)
        if entry is None:
            return None
        engine_id, remote_id = entry
        # Read the target first: stopping the last request drops the engine.
        target = upstream._heartbeat_by_engine[engine_id]
        stop_upstream(req_id)
        # An engine's first tracked request decides for all of them while it has any.
        tagged = engine_id in self.tagged if engine_id in self.targets else tags
        if tagged:
            try:
                remote_id = lease_tag(remote_id)
            except (TypeError, ValueError) as exc:  # P sent a non-str id: as track() would
                self._not_tracked(req_id, remote_id, exc)
                return None
        self.track(req_id, engine_id, remote_id, target)
        if tagged and engine_id in self.targets:
            self.tagged.add(engine_id)
        return engine_id, remote_id

    def track(self, local_id: str, engine_id: str, remote_id: str, target: HeartbeatTarget) -> None:
        try:
            self.tracker.track(local_id, engine_id, remote_id)
        except (TypeError, ValueError) as exc:
            self._not_tracked(local_id, remote_id, exc)
            return
        if engine_id not in self.targets:
            self._add_target(engine_id, target)

    @staticmethod
    def _not_tracked(local_id: str, remote_id: str, exc: Exception) -> None:
        # An id we cannot put on the wire (e.g. contains ','): its lease
        # will simply not be renewed, exactly what upstream would get.
        logger.warning("Not heartbeating request %s (remote id %r): %s", local_id, remote_id, exc)

    def _add_target(self, engine_id: str, target: HeartbeatTarget) -> None:
        self.targets[engine_id] = (target.host, target.port, target.tp_size, target.dcp_size, target.pp_size)

    def untrack(self, req_id: str) -> None:
        tracker = self.tracker
        engine_id = tracker.engine_of(req_id)
        if engine_id is not None:
            repacks = tracker.repacks
            tracker.untrack(req_id)
            if engine_id not in tracker.engines():
                self.targets.pop(engine_id, None)
                self.tagged.discard(engine_id)
            elif tracker.repacks != repacks:
                self._repacked.add(engine_id)

    def chunk_of(self, req_id: str) -> tuple[int, int] | None:
        """``(key, version)`` of the heartbeat chunk naming ``req_id`` now."""
        return self.tracker.chunk_of(req_id)

    def take_repacked(self) -> set[str]:
        """Engines whose ids moved to new chunks since the last call."""
        out, self._repacked = self._repacked, set()
        return out

    def attach(self, meta: Any) -> None:
        """Put this step's messages on the workers' metadata: the round of
        every chunk is spread over the heartbeat interval (``poll_paced``), so
        100k waiting requests cost each step a few messages, not one step a
        100k-id spike."""
        out: dict[str, EngineHeartbeats] = {}
        if len(self.tracker):
            for engine_id, sent in self.tracker.poll_paced_chunks(time.perf_counter()).items():
                target = self.targets.get(engine_id)
                if target is not None and sent:
                    out[engine_id] = EngineHeartbeats(
                        [msg for _, _, msg in sent],
                        *target,
                        chunks=[(key, ver) for key, ver, _ in sent],
                        tagged=engine_id in self.tagged,
                    )
        setattr(meta, LEASE_HEARTBEATS_ATTR, out)
