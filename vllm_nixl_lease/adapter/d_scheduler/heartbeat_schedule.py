"""D scheduler: which heartbeats go out this step, as bytes.

Upstream keeps ``_heartbeat_by_engine`` (sets of ids per engine) and ships
those sets to the workers, which re-join them into one unbounded message per
engine every tick.  Here the core's ``HeartbeatTracker`` keeps chunks whose
encoded bytes are cached, and the metadata carries those bytes
(``EngineHeartbeats``) to ``d_worker/heartbeat_sender.py``.

Requests are grouped by what their own ``kv_transfer_params`` say
(``_wire.lease_terms``), never by what an engine id said before: one group per
(P engine, P instance, naming).  A group of a plain P (stock, or a protocol
version D does not speak) is heartbeated with upstream's ``HB:`` by P's
request id; a group of a P instance that speaks ours is heartbeated
acknowledged, by each lease's tag when its params carry one and
``heartbeat_tags`` is on (a fixed 11 bytes instead of an id that is often
several times longer, so the same requests fit in fewer messages), else by
id.  Two instances of one engine id (a P restarted under it) never share a
message.

Each D paces its rounds at its own phase, drawn from its engine id
(``pace_phase``): D engines that got a burst of requests together would
otherwise send their chunks at the same moments, and P would take several at
once in one step.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Set
from dataclasses import dataclass

from vllm.logger import init_logger

from ..._wire import ACKED_HEARTBEAT_OVERHEAD, LeaseTerms
from ...decode.heartbeat_tracker import HeartbeatTracker
from ...decode.intake import Intake
from ..config import LeaseConfig
from ..metadata import LEASE_HEARTBEATS_ATTR, EngineHeartbeats
from ..upstream import HeartbeatTarget, UpstreamScheduler

logger = init_logger(__name__)

_NONE: frozenset[str] = frozenset()  # no engine repacked (most steps)


@dataclass(slots=True)
class HeartbeatGroup:
    """The requests of one P engine and instance that heartbeats name alike."""

    engine_id: str
    instance: str  # empty: a plain P
    tagged: bool
    # host, port, tp, dcp, pp and P's KV registration generation, of its first request
    target: tuple[str, int, int, int, int, int]


def _log_untrackable(local_id: str, name: str, exc: Exception) -> None:
    # An id we cannot put on the wire (e.g. contains ','): its lease will
    # simply not be renewed, exactly what upstream would get.
    logger.warning("Not heartbeating request %s (remote name %r): %s", local_id, name, exc)


def pace_phase(engine_id: str) -> float:
    """A fraction in [0, 1) that differs between D engines and is the same on every
    start of one engine id (reproducible in tests)."""
    # 48 bits: every quotient is exact in a double, so none rounds up to 1.0.
    digest = hashlib.blake2b(engine_id.encode(), digest_size=6).digest()
    return int.from_bytes(digest, "big") / 2**48


class HeartbeatSchedule:
    """The requests D heartbeats, per group, and the messages due each step."""

    def __init__(self, lease_config: LeaseConfig, engine_id: str) -> None:
        # ``engine_id``: this D's, which draws its pacing phase.
        # Chunked so that the acknowledged form (``HB:,LHBT:<seq>,``, longer than
        # ``HB:``) still fits max_heartbeat_bytes.
        self.tracker = HeartbeatTracker(
            lease_config.heartbeat_interval,
            lease_config.max_heartbeat_bytes - ACKED_HEARTBEAT_OVERHEAD,
            pace_phase(engine_id),
            lease_config.heartbeat_step_bytes,
        )
        # The groups (tracker key -> HeartbeatGroup; a group ends with its last
        # request) live in the core, which tracks a step's arrivals itself.
        self.intake = Intake(self.tracker, HeartbeatGroup, _log_untrackable)
        self.groups: dict[str, HeartbeatGroup] = self.intake.groups

    @staticmethod
    def target_of(info: HeartbeatTarget) -> tuple[str, int, int, int, int, int]:
        """Upstream's ``HeartbeatInfo`` as a group's target (it keeps no
        registration generation: 0, which tells the worker nothing)."""
        return (info.host, info.port, info.tp_size, info.dcp_size, info.pp_size, 0)

    def take_over(
        self,
        upstream: UpstreamScheduler,
        req_id: str,
        stop_upstream: Callable[[str], None],
        terms: LeaseTerms | None = None,
        tags: bool = False,
    ) -> tuple[str, str, str] | None:
        """Move a request upstream's ``on_new_request`` just recorded for
        heartbeats into this schedule, so upstream's own dicts stay empty (and
        its ``build_connector_meta`` never ships id sets).  ``stop_upstream``
        is upstream's ``_stop_heartbeat``; ``terms`` and ``tags``: see
        ``track_request``.
        Returns ``(engine id, instance, the name heartbeats give the lease)``;
        None when upstream did not record the request or it cannot be heartbeated."""
        entry = upstream._heartbeat_req_engine.get(req_id)
        if entry is None:
            return None
        engine_id, remote_id = entry
        # Read the target first: stopping the last request drops the engine.
        target = self.target_of(upstream._heartbeat_by_engine[engine_id])
        stop_upstream(req_id)
        taken = self.track_request(req_id, engine_id, remote_id, target, terms, tags)
        return None if taken is None else (engine_id, *taken)

    def track_request(
        self,
        req_id: str,
        engine_id: str,
        remote_id: str,
        target: tuple[str, int, int, int, int, int],
        terms: LeaseTerms | None = None,
        tags: bool = False,
    ) -> tuple[str, str] | None:
        """Heartbeat the lease of ``req_id`` on P ``engine_id`` (P's request id
        ``remote_id``; ``target``: where that P listens, as
        ``(host, port, tp, dcp, pp, registration generation)``).  ``terms``: the request's lease terms
        (None: a stock P; pass None too when D keeps no lease views, which
        acknowledged heartbeats exist to renew); ``tags``: name leases by tag
        where the terms allow.  Returns ``(instance, the name heartbeats give
        the lease)`` (P's request id or its tag; instance empty for a plain
        P); None when it cannot be heartbeated."""
        instance = terms.instance if terms is not None else ""
        tagged = bool(instance) and tags and terms is not None and terms.tag is not None
        name = terms.tag if tagged and terms is not None and terms.tag is not None else remote_id
        if self.track(req_id, engine_id, instance, tagged, name, target):
            return instance, name
        return None

    def track(
        self,
        local_id: str,
        engine_id: str,
        instance: str,
        tagged: bool,
        name: str,
        target: tuple[str, int, int, int, int, int],
    ) -> bool:
        return self.intake.track(local_id, engine_id, instance, tagged, name, target)

    def untrack(self, req_id: str) -> None:
        self.intake.untrack(req_id)

    def chunk_of(self, req_id: str) -> tuple[int, int] | None:
        """``(key, version)`` of the heartbeat chunk naming ``req_id`` now."""
        return self.tracker.chunk_of(req_id)

    def engine_of_group(self, key: str) -> str | None:
        group = self.groups.get(key)
        return None if group is None else group.engine_id

    def take_repacked(self) -> Set[str]:
        """P engines some of whose chunks were repacked since the last call."""
        repacked = self.intake.repacked
        if not repacked:
            return _NONE
        out = {self.groups[key].engine_id for key in repacked if key in self.groups}
        repacked.clear()
        return out

    def attach(self, meta: object) -> bool:
        """Put this step's messages on the workers' metadata: the round of
        every chunk is spread over the heartbeat interval
        (``poll_paced_chunks``), so 100k waiting requests cost each step a few
        messages, not one step a 100k-id spike.  False: no request is tracked,
        so no call can send anything until one is."""
        tracker = self.tracker
        if not len(tracker):
            return False
        now = time.perf_counter()
        if now < tracker.next_poll_at:  # most steps: nothing can fall due yet
            return True
        out: dict[str, EngineHeartbeats] = {}
        for key, sent in tracker.poll_paced_chunks(now).items():
            group = self.groups.get(key)
            if group is not None and sent:
                out[key] = EngineHeartbeats(
                    group.engine_id,
                    [msg for _, _, msg, _ in sent],
                    *group.target,
                    chunks=[(chunk, ver) for chunk, ver, _, _ in sent],
                    instance=group.instance,
                    tagged=group.tagged,
                    counts=[names for _, _, _, names in sent],
                )
        if out:  # the workers read no attribute as nothing due
            setattr(meta, LEASE_HEARTBEATS_ATTR, out)
        return True
