"""Read fencing, D worker side: never READ blocks P may already have freed.

The scheduler ships a view of each P lease (``d_scheduler/lease_view_collector.py``);
P's answers to heartbeats (``ack_requester.py``), or for a P that does not
answer the heartbeats this worker delivers, move the views forward
(``decode/lease_views.py`` says when that is safe).  A READ whose view has
``lease_safety_margin`` or less left is not issued but reported as a failed
load, so vLLM's ``kv_load_failure_policy`` applies (``recompute`` or
``fail``), the same path upstream takes for an expired turn-2 readback.

A READ that was issued but whose completion D sees only after the view ended
(it stalled: a partition, a congested link) is discarded the same way
(``discard_late``): P may have freed and reused the blocks while it ran.
Seen before the view ended, every byte was read while P still held the lease.
So was a READ seen complete before the deadline its view had when it was
posted: until then P frees the blocks only on the completion notification
that this READ itself carries, which can reach P, and P's "not held" answer
reach D, before D sees the READ complete.

Which process a READ reaches: a view of a P instance (a P that speaks our
protocol) is read only over a connection proven to reach that instance
(``ack_requester.py``); while the connection is not proven yet (a fresh or
repeated handshake) the READ waits (``parked``, tried again every step), and
once it is proven to reach another process the view has ended and the READ is
fenced.  While it waits, the view is judged with an estimate that converts
nothing (``LeaseViews.may_wait``): the unproven connection's clock offset may
be another process's, so it may only decide between waiting and fencing, and
is never stored in the view.  A plain P's view (no instance) is bound to the
connection it is first read over; if upstream replaced that connection since
(a repeated handshake, an invalid engine) the READ is fenced: the old process's
views end with it.  A plain view is fenced too when an agent of the current
connection has answered as one of our P instances: whoever granted the plain
lease did not speak our protocol, so it is not the process that connection
reaches (``reached``).  For the same reason a request with no view at all (a
stock P's lease) is fenced over such a connection, and its notify-only
completion withheld; over any other it is read as upstream reads it.

Every READ that waited and will not be posted is reported as a failed load
exactly once: its request ended meanwhile (an abort drops its view), so vLLM,
which keeps an aborted request's blocks until the worker reports it, frees
them, and upstream's ``_recving_metadata`` entry goes with the report
(``num_reads_parked_dropped``).

The verdict and upstream's own look at the connection (``_read_blocks_for_req``
defers a READ to an engine not connected yet) happen under upstream's
handshake lock (``workers._read_blocks_for_req`` and ``_post_read``), so the handshake's done-callback
cannot connect the engine between the two: a READ judged "not connected" is
deferred by upstream, and one judged on a connection is judged on its agents
and clock offset together.  A connection with agents but no offset yet (a
half-written pair) counts as unproven: the READ waits.

Completions without a READ (upstream's notify-only path: a full prefix-cache
hit, and the cleanup of a request aborted while queued, each an
``<id>:<count>`` notification P frees the lease on) are bound the same way:
for a view of instance I only over a connection proven I, for a plain view
only over the connection it is bound to (a first use binds it), and only
while the view is alive; otherwise D does not send it (``WITHHOLD``: the
lease expires on P instead; counted and logged).  Sent over whatever
connection exists, after a P restart it could free a lease of the new process
that shares the id (client-chosen ids).

Each view's margin follows the lease terms P advertised: at most
``lease_safety_margin``, and at most half the room between P's extension and
D's heartbeat interval plus P's answer delay, so P and D configured with
different ``kv_lease_duration`` values never fence reads P still holds.  It
never falls below ``lease_safety_margin * MARGIN_FLOOR_SHARE``: the margin also
covers the READ's own time and the clock-offset error, which do not shrink
with P's terms.  When P's terms leave less room than that floor (P's extension
too short for D's heartbeat interval), D logs it once per engine and counts the
view (``num_views_margin_floored``); such views may lapse between heartbeats,
and their READs are then fenced, never read late.

Completions (``discard_late``) are judged with the same margin: a READ that D
sees complete while its view has ``margin`` or less left is discarded, unless
D saw it complete before ``T - margin``, where ``T`` is the view's deadline
when the READ was posted.  The exception keeps a READ whose own completion
notification let P free the blocks (P's "not held" answer can end the view
before D sees the completion); the ``- margin`` keeps it honest against the
same clock error the posting check allows for: D saw the READ complete, so it
completed, at least ``margin`` before ``T`` by D's clock, and so before P's
deadline by P's as long as the offset error is under the margin.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from vllm.logger import init_logger

from ..._wire import heartbeat_ids
from ...decode.lease_views import CLAIMED, LeaseViews
from ..config import MARGIN_FLOOR_SHARE, LeaseConfig
from ..metadata import LEASE_VIEWS_ATTR, LeaseViewUpdates, NewView
from ..ratelimit import RateLimitedLog
from ..upstream import AgentName, ReadMeta, UpstreamWorker
from .ack_requester import OTHER, PENDING, PROVEN, agent_name
from .second_reader import SecondReaderFence

logger = init_logger(__name__)


READ, FENCE, WAIT, WITHHOLD = "read", "fence", "wait", "withhold"
# A READ judged by ``LeaseViews.admit_read``: let through (its lease claimed, its
# posted deadline kept), or refused as a second reader of its lease.
ADMITTED, SECOND_READER = "admitted", "second reader"
# kv_lease_claim_reads: the READ waits (parked) until P answers this D's claim (claim_requester.py)
CLAIM_WAIT = "claim wait"
# Engines whose short lease terms were logged (a bounded memory: oldest forgotten first).
MAX_LOGGED_ENGINES = 1024


class ReadFence:
    """D's views of P's leases, and the decision to skip a READ.

    ``proof(engine, instance)``: does the connection to ``engine`` reach
    ``instance`` (``AckRequester.proof``)?  None: this worker asks no P for
    acknowledgements, and never reads a view that needs them.
    ``reached(engine)``: the instance an agent of the current connection to
    ``engine`` answered as, None if none has (``AckRequester.reached``).
    ``proven_agents``: the instance each P agent's answers carry, the table
    ``proof`` reads (``AckRequester.proven_agents``): with it a READ over a
    proven connection is judged in one call into the core (``admit_proven``)."""

    def __init__(
        self,
        upstream: UpstreamWorker,
        views: LeaseViews,
        lease_config: LeaseConfig,
        proof: Callable[[str, str], str] | None = None,
        on_other: Callable[[str, str], None] | None = None,
        reached: Callable[[str], str | None] | None = None,
        proven_agents: Mapping[str, str] | None = None,
    ) -> None:
        self._upstream = upstream
        self.views = views
        self._proven_agents = proven_agents if proof is not None else None
        self._interval = lease_config.heartbeat_interval
        self._proof = proof
        self._on_other = on_other  # a view's connection proven another instance: (engine, instance)
        self._reached = reached
        self._margin_floor = views.margin * MARGIN_FLOOR_SHARE
        self._short_terms_logged: dict[str, None] = {}  # engines logged, oldest first
        # Plain views: the connection (its agents) each was first read over.
        self._bound: dict[str, frozenset[str]] = {}
        # READs waiting for the proof of their P instance: req id -> upstream's meta.
        self.parked: dict[str, ReadMeta] = {}
        # Parked READs already counted as waiting (take_parked empties ``parked`` every step).
        self._counted_waiting: set[str] = set()
        # READs in flight: req id -> its view's deadline (D's clock) when it was posted.
        self._posted: dict[str, float] = {}
        self._log = RateLimitedLog(logger)
        self._log_late = RateLimitedLog(logger)
        self._log_dropped = RateLimitedLog(logger)
        self._log_short = RateLimitedLog(logger)
        self._log_terms = RateLimitedLog(logger)
        self._log_withheld = RateLimitedLog(logger)
        self._second_reader = SecondReaderFence(upstream, views)  # one READ per lease
        # kv_lease_claim_reads: a READ waits (parked) until P answered its claim (claim_requester.py)
        self.claim_wait: Callable[[str, ReadMeta], bool] | None = None

    def _terms_margin(self, view: NewView) -> float:
        """What P's terms leave for a view's margin (``LeaseViews.terms_margin``);
        ``add_views`` keeps at least the floor, ``lease_safety_margin *
        MARGIN_FLOOR_SHARE``, and reports the views it floored."""
        p_interval = view.interval if view.interval is not None else self._interval
        return self.views.terms_margin(view.extension, p_interval, self._interval)

    def _short_terms(self, view: NewView) -> None:
        self._upstream.xfer_stats.add("num_views_margin_floored", 1)
        logged = self._short_terms_logged
        if view.engine_id in logged:
            return
        logged[view.engine_id] = None
        if len(logged) > MAX_LOGGED_ENGINES:
            del logged[next(iter(logged))]
        self._log_short.warning(
            1,
            "P engine %.64s extends a lease by %.3g s, too short for this D's heartbeat interval "
            "(%.3g s): its views keep a margin of %.3g s instead of %.3g s, and may lapse between "
            "heartbeats (such READs are fenced); give P and D the same kv_lease_duration",
            view.engine_id,
            view.extension,
            self._interval,
            self._margin_floor,
            max(0.0, self._terms_margin(view)),
        )

    # -- views shipped by the scheduler, around upstream's start_load_kv -----
    def add_views(self, metadata: object) -> None:
        updates: LeaseViewUpdates | None = getattr(metadata, LEASE_VIEWS_ATTR, None)
        if updates is None:
            return
        views = self.views
        # One call for the step: each view's margin from P's own terms (``LeaseViews.terms_margin``'s
        # rule; a longer extension never shrinks it below what the clamped one gives),
        # the renewals by at most the cap, and the views repacked into new chunks.
        clamped, floored = views.add_views(
            updates.new,
            getattr(updates, "chunks", None) or {},
            self._interval,
            self._margin_floor,
            self._upstream._engine_clock_offset,
        )
        for local_id in floored:
            self._short_terms(updates.new[local_id])
        if clamped:
            self._upstream.xfer_stats.add("num_lease_terms_clamped", clamped)
            self._log_terms.warning(
                clamped,
                "P advertised a lease extension over %.0f s for %d request(s); D renews its views by "
                "%.0f s at most (max_view_extension: its views only end sooner)",
                views.extension_cap,
                clamped,
                views.extension_cap,
            )

    def drop_views(self, metadata: object) -> None:
        # After the reads: an id whose tracking ended this step may still be read in it.
        updates: LeaseViewUpdates | None = getattr(metadata, LEASE_VIEWS_ATTR, None)
        if updates is not None:
            dropped = updates.dropped
            bound, posted, parked = self._bound, self._posted, self.parked
            self.views.drop_all(dropped, (bound, posted) if bound or posted else ())
            if parked:
                for local_id in dropped:
                    if local_id in parked:
                        self._drop_parked(local_id)

    def _drop_parked(self, req_id: str) -> None:
        """A parked READ that will never be posted (its request ended): report it
        as a failed load, once, so vLLM frees its blocks and upstream forgets it."""
        del self.parked[req_id]
        self._counted_waiting.discard(req_id)
        up = self._upstream
        up.xfer_stats.add("num_reads_parked_dropped", 1)
        self._log_dropped.warning(
            1,
            "READ of %s, waiting for proof of its P process or for P's answer to its claim, will not be "
            "posted (its request ended); reported as a failed load so that its KV blocks are freed",
            req_id,
        )
        up._handle_failed_transfer(req_id, None, up._recv_failures, record_failed_transfer=False)

    def _forget(self, local_id: str) -> None:
        self.views.drop(local_id)
        self._bound.pop(local_id, None)
        self._posted.pop(local_id, None)

    # -- one READ ----------------------------------------------------------
    def fenced(self, req_id: str, meta: ReadMeta) -> bool:
        """True when the READ must not be posted now: fenced (reported as a
        failed load) or waiting for proof (``parked``, tried again next step)."""
        admitted = None
        remote = meta.remote
        if self._proven_agents is not None and self.claim_wait is None and remote is not None:
            if any(meta.local_block_ids):
                # The common READ (a view of a P instance, read over a connection proven
                # to reach it) in one call; anything else the long way, ``_verdict``.
                up = self._upstream
                admitted = self.views.admit_proven(
                    req_id,
                    time.perf_counter(),
                    remote.engine_id,
                    up._remote_agents,
                    up._engine_clock_offset,
                    self._proven_agents,
                )
        if admitted is None:
            verdict = self._verdict(req_id, meta)
        elif isinstance(admitted, float):
            self._posted[req_id] = admitted
            if self._counted_waiting:
                self._counted_waiting.discard(req_id)
            return False
        else:
            verdict = self._admitted(req_id, admitted)
        if verdict != WAIT and self._counted_waiting:
            self._counted_waiting.discard(req_id)
        if verdict == ADMITTED:
            return False
        if verdict == CLAIM_WAIT:
            self.parked[req_id] = meta  # kv_lease_claim_reads: until P answers the claim
            return True
        if verdict == SECOND_READER:
            self._second_reader.refuse(req_id, meta)
            self._forget(req_id)
            return True
        if verdict == READ and self._second_reader.fenced(req_id, meta):
            self._forget(req_id)
            return True
        if verdict == READ:
            if meta.remote is not None:
                offset = self._upstream._engine_clock_offset.get(meta.remote.engine_id)
                if offset is not None:
                    deadline = self.views.deadline_of(req_id, offset)
                    if deadline is not None:
                        self._posted[req_id] = deadline
            return False
        if verdict == WITHHOLD:
            self._withhold(req_id, meta)
            return True
        if verdict == WAIT:
            if req_id not in self._counted_waiting:
                self._counted_waiting.add(req_id)
                self._upstream.xfer_stats.add("num_reads_waiting_proof", 1)
            self.parked[req_id] = meta
            return True
        assert meta.remote is not None  # _verdict lets every READ without a remote side through
        up = self._upstream
        up.xfer_stats.add("num_reads_fenced", 1)
        self._log.warning(
            1,
            "Not reading KV of %s from engine %s: its lease on P may already have ended (D's view "
            "has too little left, or P restarted since); reported as a failed load "
            "(kv_load_failure_policy applies)",
            req_id,
            meta.remote.engine_id,
        )
        self._forget(req_id)
        up._handle_failed_transfer(req_id, None, up._recv_failures, record_failed_transfer=False)
        return True

    def _withhold(self, req_id: str, meta: ReadMeta) -> None:
        """Do not send a notify-only completion that might reach another P process."""
        up = self._upstream
        up.xfer_stats.add("num_completions_withheld", 1)
        self._log_withheld.warning(
            1,
            "Not sending the completion of %s to engine %s: the connection is not proven to reach "
            "the P process that granted its lease (or its view ended); the lease expires on P instead",
            req_id,
            meta.remote.engine_id if meta.remote is not None else "?",
        )
        if getattr(meta, "awaiting_kvs", False):
            # As upstream after a notify-only send: the KV is local, report the load done.
            up._recving_transfers.setdefault(req_id, [])

    def take_parked(self) -> list[tuple[str, ReadMeta]]:
        """READs that waited for proof, to try again; those whose view is gone
        (their request ended meanwhile) are reported as failed loads."""
        if not self.parked:
            return []
        views = self.views
        gone = [req_id for req_id in self.parked if req_id not in views]
        for req_id in gone:
            self._drop_parked(req_id)
        parked, self.parked = self.parked, {}
        return list(parked.items())

    def _verdict(self, req_id: str, meta: ReadMeta) -> str:
        if meta.remote is None:
            return READ
        engine_id = meta.remote.engine_id
        instance = self.views.instance_of(req_id)  # None: not viewed
        if instance is None:
            # No view (a stock P's lease): read as upstream, unless the connection has
            # answered as one of our P processes, which is then not the grantor (A7).
            if self._reached is None or self._reached(engine_id) is None:
                return READ
            # A notify-only completion goes as upstream sends it: an aborted request of ours has
            # lost its view by the time its cleanup comes here, and withholding that would leave
            # P's blocks held to expiry (seen in tests/nixl/test_nixl_abort.py).
            return FENCE if any(len(group) > 0 for group in meta.local_block_ids) else READ
        # Not connected yet: upstream defers the read to after the handshake
        # and calls us again then, with the clock offset measured (the caller
        # holds the handshake lock, so upstream sees what this saw).
        agents = self._upstream._remote_agents.get(engine_id)
        if not agents:
            return READ
        offset = self._upstream._engine_clock_offset.get(engine_id)
        if offset is None:
            return WAIT  # agents without an offset: a half-written handshake, not ready
        # Nothing to read (a full prefix-cache hit, an aborted request's cleanup):
        # upstream only notifies P, which frees the lease on it.
        if not any(meta.local_block_ids):  # every group empty (as upstream tests it)
            return self._notify_verdict(req_id, engine_id, instance, agents, offset)
        if instance:
            proof = OTHER if self._proof is None else self._proof(engine_id, instance)
            if proof == OTHER:
                if self._on_other is not None:
                    self._on_other(engine_id, instance)
                return FENCE
            if proof == PENDING:
                # Judged without converting: this offset is not proven to be the grantor's.
                return WAIT if self.views.may_wait(req_id, time.perf_counter(), offset) else FENCE
        else:
            if self._reached is not None and self._reached(engine_id) is not None:
                return FENCE  # the connection reaches one of our P processes: not this lease's grantor
            connection = frozenset(agent_name(a) for a in agents.values())
            bound = self._bound.setdefault(req_id, connection)
            if bound != connection:
                return FENCE  # the process it was granted by may be gone with that connection
        # kv_lease_claim_reads: P has not answered this D's claim yet. Waits only while the view
        # could still be read: a claim whose answer never comes (lost, its P gone) then ends in
        # the margin check below, a fence, rather than a READ parked for good.
        if (
            self.claim_wait is not None
            and self.claim_wait(req_id, meta)
            and self.views.may_read(req_id, time.perf_counter(), offset)
        ):
            return CLAIM_WAIT
        # The margin, the second-reader claim and the deadline kept for ``discard_late``,
        # in one call: this runs once per READ.
        return self._admitted(req_id, self.views.admit_read(req_id, time.perf_counter(), offset))

    def _admitted(self, req_id: str, admitted: float | str | None) -> str:
        """The verdict for what ``admit_read`` (or ``admit_proven``) answered."""
        if isinstance(admitted, float):
            self._posted[req_id] = admitted
            return ADMITTED
        return SECOND_READER if admitted == CLAIMED else FENCE

    def _notify_verdict(
        self,
        req_id: str,
        engine_id: str,
        instance: str | None,
        agents: Mapping[tuple[int, int], AgentName],
        offset: float,
    ) -> str:
        """READ (send the completion) only over the connection the view is bound
        to, while the view is alive; else WITHHOLD."""
        if instance:
            proven = self._proof is not None and self._proof(engine_id, instance) == PROVEN
            if not proven:
                return WITHHOLD
        else:
            connection = frozenset(agent_name(a) for a in agents.values())
            if self._bound.setdefault(req_id, connection) != connection:
                return WITHHOLD
        return READ if self.views.may_read(req_id, time.perf_counter(), offset) else WITHHOLD

    # -- READs completed this step (after upstream's _pop_done_transfers) ----
    def discard_late(self, done: set[str], failed: set[str]) -> None:
        """Report as failed each completed READ whose view had its margin or less
        left when D saw it complete, unless D saw it complete more than the
        margin before the deadline the view had when the READ was posted."""
        posted = self._posted
        if not len(self.views):
            posted.clear()
            return
        late = self.views.late_reads(
            done, failed, posted, time.perf_counter(), self._upstream._engine_clock_offset
        )
        if not late:
            return
        failed.update(late)
        self._upstream.xfer_stats.add("num_reads_discarded", len(late))
        self._log_late.warning(
            len(late),
            "Discarding %d READ(s) seen complete with D's view of their lease on P ended or within its "
            "margin (e.g. %s): "
            "P may have freed the blocks while they ran; reported as failed loads "
            "(kv_load_failure_policy applies)",
            len(late),
            late[:3],
        )

    # -- heartbeats this worker delivered to a P that does not answer ---------
    # (HeartbeatSender's callback; answered heartbeats go through AckRequester)
    def heartbeat_delivered(
        self, engine_id: str, messages: list[bytes], started: float, finished: float
    ) -> None:
        offset = self._upstream._engine_clock_offset.get(engine_id)
        if offset is None or not len(self.views):
            return
        renewed = 0
        for msg in messages:
            renewed += self.views.heartbeat_sent(engine_id, heartbeat_ids(msg), offset, started, finished)
        self._upstream.xfer_stats.add("num_heartbeat_views_renewed", renewed)
