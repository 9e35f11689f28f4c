"""P side: the leases this worker holds, on the lease core.

Everything P does with a lease happens here:
- granted: upstream's ``start_load_kv`` assigns ``_reqs_to_send[req] = deadline``;
  that dict is ``deadlines`` (``upstream_state.py``), so the grant lands in the router;
- extended: ``route`` for pull's ``HB:`` (in the core, with the step's other
  notifications), ``extend`` for every other heartbeat form (see its table);
- released on read: ``route`` returns the requests every consumer has read;
- expired: ``expire`` sweeps the table once per step, at most
  ``max_expiries_per_step`` leases, and logs through ``expiry_log.log_expired``.
  After a step gap longer than ``stall_s`` (P itself stalled: a long step, a
  stopped process), the leases that fell due during the gap wait one more
  heartbeat interval (``grace_s``): D's heartbeats sent while P could not
  listen are drained and applied first, so P does not take its own silence
  for D's.  Holding a lease longer is always safe.
- tagged: the tag index is keyed with this P's secret (``adopt_instance``,
  from the scheduler's metadata), so tags match the ones D got in its params.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Iterable, Mapping

from vllm.logger import init_logger

from ..._wire import ACK_PREFIXES, PUSH_REG_PREFIX
from ...prefill.expiry_log import log_expired
from ...prefill.lease_holders import LeaseHolders
from ...prefill.lease_table import LeaseTable
from ...prefill.notification_router import NotificationRouter
from ..config import LeaseConfig
from ..metadata import LEASE_INSTANCE_ATTR
from ..ratelimit import RateLimitedLog
from ..upstream import UpstreamWorker
from .claim_gate import ClaimGate
from .push_aliases import LeaseAliases
from .upstream_state import ReqsToProcessSet, ReqsToSendDict

logger = init_logger(__name__)


class HeartbeatForm(enum.Enum):
    """How a heartbeat names the leases it renews (``LeaseKeeper.extend``)."""

    IDS = "ids"  # P's request ids
    TAGS = "tags"  # lease tags (lease_tags.py), one per lease
    PUSH = "push"  # push mode: P's request ids, or the router's ids P's are suffixed from


# The members as module globals: an Enum member looked up through its class
# costs more than the rest of a small heartbeat's dispatch.
_TAGS, _PUSH = HeartbeatForm.TAGS, HeartbeatForm.PUSH


class LeaseKeeper:
    """Grants, extends, releases and expires P's leases for one worker."""

    def __init__(self, upstream: UpstreamWorker, lease_config: LeaseConfig, *, push: bool = False) -> None:
        self._upstream = upstream
        self.extension = lease_config.lease_extension
        self.max_expiries_per_step = lease_config.max_expiries_per_step
        # Ack messages (ours) pass through the core to the ack components.
        # Push's D never names leases by tag: its table skips the tag index (a cost per grant).
        self.router = NotificationRouter(
            LeaseTable(lease_config.lease_extension, tags=not push), (PUSH_REG_PREFIX, *ACK_PREFIXES)
        )
        # Push mode only: D names leases by the router's id, not P's (push_aliases.py).
        self.aliases: LeaseAliases | None = LeaseAliases() if push else None
        # Stand-ins for upstream's _reqs_to_send / _reqs_to_process.
        self.deadlines = ReqsToSendDict(self.router, self._granted, self._released)
        self.in_batch = ReqsToProcessSet(self.router)
        self._active_reported = 0
        self._malformed_log = RateLimitedLog(logger)
        self._unknown_log = RateLimitedLog(logger)
        # This P process, as its scheduler named it (empty until the first metadata).
        self.instance = ""
        # P's own stalls (see the module docstring).
        self.stall_s = lease_config.stall_s
        self._own_interval = lease_config.heartbeat_interval
        # The longest interval a D said it heartbeats at (the ack answerer's, when wired).
        self.peer_interval: Callable[[], float] = lambda: 0.0
        self._last_sweep: float | None = None
        self._grace_until = -math.inf
        self._stall_began = 0.0
        # kv_lease_claim_reads (pull): the D agents holding each lease (claim_gate.py).
        self.claims: ClaimGate | None = None
        if lease_config.claim_reads and not push:
            self.claims = ClaimGate(upstream, self.router, LeaseHolders())

    @property
    def table(self) -> LeaseTable:
        return self.router.table

    def adopt_instance(self, metadata: object) -> None:
        """Take this P's instance and tag key from the scheduler's metadata (once)."""
        shipped: tuple[str, bytes] | None = getattr(metadata, LEASE_INSTANCE_ATTR, None)
        if shipped is None or shipped[0] == self.instance:
            return
        instance, tag_key = shipped
        try:
            self.router.table.set_tag_key(tag_key)
        except ValueError as exc:  # a second scheduler instance for one worker: keep the first
            self._malformed_log.warning(1, "Ignoring P instance %s from the scheduler: %s", instance, exc)
            return
        self.instance = instance
        if self.claims is not None:
            self.claims.tag_key = tag_key

    @property
    def grace_s(self) -> float:
        """How long leases that fell due while P stalled wait: one heartbeat
        interval, the longest any D said it keeps (never past the extension)."""
        return min(self.extension, max(self._own_interval, self.peer_interval(), self.stall_s / 4))

    # -- grant / release (called by the views) ------------------------------
    def _granted(self, req_id: str) -> None:
        self._upstream.xfer_stats.add("num_leases_granted", 1)
        if self.aliases is not None:
            self.aliases.add(req_id)

    def _released(self, req_id: str) -> None:
        if self.aliases is not None:
            self.aliases.discard(req_id)
        if self.claims is not None:
            self.claims.forget((req_id,))

    # -- pull: one step's notifications -------------------------------------
    def route(self, notifs: Mapping[str, list[bytes]]) -> tuple[set[str], dict[str, list[bytes]]]:
        """Route one step's notifications (pull): ``HB:`` heartbeats extend and
        completions release, in the core; return the requests read by all
        consumers, and the heartbeat-ack messages (per agent) for the ack
        components, whose heartbeats come back through ``extend``."""
        if not notifs:
            return set(), {}
        start = time.perf_counter_ns()
        freed: list[str] = []
        if self.claims is not None and self.claims.holders:
            notifs, freed = self.claims.gate(notifs)  # completions of leases other Ds still hold
        result = self.router.route(notifs, time.perf_counter())
        if freed:
            result.completed.extend(freed)
        stats = self._upstream.xfer_stats
        stats.observe_time("lease_route_time", (time.perf_counter_ns() - start) / 1e9)
        if result.heartbeat_messages:
            self._account_heartbeats(result.heartbeat_messages, result.heartbeat_ids, result.extended)
        if result.unknown:
            # Upstream's counter (one item per notification) and ours; one
            # rate-limited line with a few cut ids, not one line per message.
            stats.record_notifications_after_expiry(result.unknown)
            stats.add("num_unknown_completions", result.unknown)
            self._unknown_log.warning(
                result.unknown,
                "Potentially invalid KV blocks for %d unrecognized request(s) were retrieved by "
                "a decode worker, e.g. %s. They may have expired.",
                result.unknown,
                result.unknown_sample,
            )
        if result.malformed:
            stats.add("num_malformed_notifs", result.malformed)
            self._malformed_log.warning(
                result.malformed,
                "Skipped %d malformed NIXL notification(s) (neither a heartbeat nor 'id:count'), e.g. %r",
                result.malformed,
                result.malformed_sample[:1],
            )
        ack_messages = result.passthrough
        if ack_messages:
            push_regs = sum(m.startswith(PUSH_REG_PREFIX) for ms in ack_messages.values() for m in ms)
            if push_regs:
                # Pull workers never receive PUSH_REG; one arriving is a misrouted peer.
                self._malformed_log.warning(
                    push_regs, "Ignored %d PUSH_REG notification(s) on a pull worker", push_regs
                )
        for req_id in result.completed:
            self._released(req_id)  # its holders too
        return set(result.completed), ack_messages

    # -- every other heartbeat -----------------------------------------------
    def extend(
        self, form: HeartbeatForm, payloads: Iterable[bytes], now: float | None = None
    ) -> list[str] | None:
        """Extend the leases heartbeats name: every way in but pull's ``HB:``.

        ``payloads``: the heartbeats' name lists (no prefix, no seq); ``now``:
        P's clock when they arrived (None: now).  Which message takes which path:

        ===========================  =====  ==============================  ===========================
        message                      form   path                            returns
        ===========================  =====  ==============================  ===========================
        ``HB:<ids>``, pull           --     ``route``, not here: the core   (``route``'s result)
                                            router applies a step's ``HB:``
                                            in one pass, with completions
        ``LHB:<seq>:<ids>``          IDS    ``LeaseTable.extend_acked``     ids not held here (no lease,
                                                                            or an ambiguous one), for the
                                                                            answer (None: not UTF-8)
        ``LHBT:<seq>:<tags>``        TAGS   ``LeaseTable.extend_tagged``    tags naming no lease, or an
                                                                            ambiguous one (None: not ASCII)
        ``HB:<ids>``, push           PUSH   by id, then the ids left over   None
        (the writer thread's queue)         by the router's id
                                            (``LeaseAliases.extend``)
        upstream's                   IDS    ``LeaseTable.extend_acked``     as ``LHB:`` (ignored)
        ``_handle_heartbeat``
        ===========================  =====  ==============================  ===========================

        Every form counts the messages, ids and unknown ids it saw; PUSH also
        times itself as ``lease_route_time``, as ``route`` is timed for pull.
        """
        if now is None:
            now = time.perf_counter()
        if form is _PUSH:
            self._extend_push(payloads, now)
            return None
        table = self.router.table
        messages = named = matched = 0
        unknown: list[str] | None = []
        if form is _TAGS:
            for payload in payloads:
                _, count, missing = table.extend_tagged(payload, now)
                messages += 1
                named += count
                if missing is None:
                    unknown = None  # not ASCII: nothing applied
                else:
                    matched += count - len(missing)  # tags, as ids are counted (a tag may name several)
                    if missing and unknown is not None:
                        unknown += missing
            self._upstream.xfer_stats.add("num_tagged_heartbeats_recv", messages)
        else:
            for payload in payloads:
                hit, count, missing = table.extend_acked(payload, now)
                messages += 1
                named += count
                matched += hit
                if missing is None:
                    unknown = None  # not UTF-8: the answer counts none
                elif missing and unknown is not None:
                    unknown += missing
        self._account_heartbeats(messages, named, matched)
        return unknown

    def _extend_push(self, payloads: Iterable[bytes], now: float) -> None:
        start = time.perf_counter_ns()
        table = self.router.table
        messages = ids_total = extended_total = 0
        for payload in payloads:
            extended, ids = table.extend_counted(payload, now)
            if extended < ids and self.aliases:
                extended += self.aliases.extend(table, payload, now)
            messages += 1
            ids_total += ids
            extended_total += extended
        self._upstream.xfer_stats.observe_time("lease_route_time", (time.perf_counter_ns() - start) / 1e9)
        self._account_heartbeats(messages, ids_total, extended_total)

    def _account_heartbeats(self, messages: int, ids: int, extended: int) -> None:
        stats = self._upstream.xfer_stats
        stats.add("num_heartbeat_msgs_recv", messages)
        stats.add("num_heartbeat_ids_recv", ids)
        stats.add("num_heartbeat_ids_unknown", ids - extended)
        if extended:
            logger.debug("Heartbeat extended %d of %d lease(s) by %ss", extended, ids, self.extension)

    # -- expiry --------------------------------------------------------------
    def expire(self, done_sending: set[str]) -> None:
        """Free leases past their deadline into ``done_sending`` (at most
        ``max_expiries_per_step``, earliest first: a dead D's thousands are
        spread over steps); report the count held."""
        table = self.router.table
        now = time.perf_counter()
        if len(table):
            last = self._last_sweep
            if last is not None and now - last > self.stall_s:
                # P stalled (not D): what fell due meanwhile waits for D's heartbeats.
                self._grace_until, self._stall_began = now + self.grace_s, last
                self._upstream.xfer_stats.add("num_stalls_graced", 1)
            sweep_at = now if now >= self._grace_until else min(now, self._stall_began)
            self._sweep(sweep_at, done_sending)
        else:
            # Keep the table's clock current while it is empty: it dates the
            # tombstones of what the next steps free with it.
            table.pop_expired(now, 0)
        active = len(table)
        # A gap counts as P's stall only while P held leases across it.
        self._last_sweep = now if active else None
        if active != self._active_reported:
            self._active_reported = active
            self._upstream.xfer_stats.set_active_leases(getattr(self._upstream, "tp_rank", 0), active)

    def _sweep(self, sweep_at: float, done_sending: set[str]) -> None:
        """Free what is due at ``sweep_at``; a sweep that frees something is timed
        as ``lease_sweep_time`` (finding nothing due is a bound check in the core)."""
        start = time.perf_counter_ns()
        expired = self.router.expire(sweep_at, self.max_expiries_per_step)
        ids = expired.ids
        if not ids:
            return
        stats = self._upstream.xfer_stats
        stats.record_kv_expired_reqs(len(ids))
        if self.aliases is not None:  # push mode: the only per-id release work
            for req_id in ids:
                self._released(req_id)
        done_sending.update(ids)
        if self.claims is not None and self.claims.holders:
            self.claims.forget(ids)
        log_expired(logger, expired)
        stats.observe_time("lease_sweep_time", (time.perf_counter_ns() - start) / 1e9)
