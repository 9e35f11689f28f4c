"""Pure-Python twin of the P-side notification router.

Routes one engine step's ``get_new_notifs()`` batch with the semantics of
upstream vLLM's ``_get_new_notifs`` (0.33.0), except that a malformed message
is counted and skipped instead of raising and losing the rest of the batch.

Contract at the edges (the Cython router keeps it too): ``now`` that is not a
finite real number raises ``TypeError``/``ValueError`` before anything
changes; a message that is not ``bytes`` (str, None, memoryview, int, ...) or
an agent's message list that is not a list/tuple counts as malformed.  So
``route`` never raises half-way through a batch it has started applying.
A partial read count lives only as long as its request is leased or in a
batch: ``release`` and ``discard_in_batch`` drop it when neither holds.

``HB:,`` (``_wire.ESCAPE_PREFIX``, a heartbeat whose first id is empty)
is the lease protocol's escape (``docs/PROTOCOL.md`` section 2): no D names
an empty id, so every such message is one of ours and goes to
``passthrough`` with the other prefixes the router does not own.  Every
other ``HB:`` message is a heartbeat.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterable, Mapping

from .._checks import MESSAGES_TYPES, check_now, check_passthrough_prefixes
from .._wire import ESCAPE_PREFIX, HEARTBEAT_PREFIX, PUSH_REG_PREFIX, heartbeat_payload, parse_completion
from ._lease_table_py import LeaseTable
from .route_result import (
    MALFORMED_SAMPLE_SIZE,
    UNKNOWN_SAMPLE_SIZE,
    Expiry,
    RouteResult,
    malformed_sample,
    unknown_sample_id,
)

DEFAULT_PASSTHROUGH_PREFIXES: tuple[bytes, ...] = (PUSH_REG_PREFIX,)


class NotificationRouter:
    """P-side bookkeeping of requests being sent: leases, batch membership and
    read-completion counts, updated from whole notification batches.

    ``in_batch`` mirrors upstream's ``_reqs_to_process``: requests that were
    part of a batch and may be read before their lease is granted.
    """

    __slots__ = ("table", "_in_batch", "_counts", "_expected", "_passthrough")

    def __init__(
        self,
        table: LeaseTable,
        passthrough_prefixes: Iterable[bytes] = DEFAULT_PASSTHROUGH_PREFIXES,
    ) -> None:
        self.table = table
        if table._routed:
            raise ValueError("this LeaseTable already belongs to a NotificationRouter")
        table._routed = True
        self._in_batch: set[str] = set()
        self._counts: dict[str, int] = {}
        self._expected: dict[str, int] = {}
        self._passthrough = check_passthrough_prefixes(passthrough_prefixes)

    # -- batch membership -------------------------------------------------
    def add_in_batch(self, req_id: str) -> None:
        self._in_batch.add(req_id)

    def discard_in_batch(self, req_id: str) -> None:
        self._in_batch.discard(req_id)
        if self._counts and req_id not in self.table:
            self._forget_reads(req_id)

    def release(self, req_id: str) -> bool:
        """Drop the lease of ``req_id`` (and its read count, unless it is
        still in a batch); return whether it held a lease."""
        held = self.table.release(req_id)
        if self._counts and req_id not in self._in_batch:
            self._forget_reads(req_id)
        return held

    def _forget_reads(self, req_id: str) -> None:
        self._counts.pop(req_id, None)
        self._expected.pop(req_id, None)

    def is_in_batch(self, req_id: str) -> bool:
        return req_id in self._in_batch

    def grant(self, req_id: str, deadline: float) -> bool:
        """Lease ``req_id`` until ``deadline`` if it is in a batch (upstream's
        rule: a lease only for a request not read yet)."""
        if req_id not in self._in_batch:
            return False
        self.table.grant(req_id, deadline)
        return True

    def received(self, req_id: str) -> int:
        """Read completions received so far for a request still waiting.  For
        tests: a count that outlives its request's lease and batch membership
        is a leak that no other result shows."""
        return self._counts.get(req_id, 0)

    def in_batch_count(self) -> int:
        return len(self._in_batch)

    # -- one engine step --------------------------------------------------
    def route(self, notifs: Mapping[str, Iterable[bytes]], now: float) -> RouteResult:
        now = check_now(now)
        items = _items_of(notifs)
        result = RouteResult()
        table = self.table
        table._observe(now)  # completions date their tombstones with it
        for agent, messages in items:
            if not isinstance(messages, MESSAGES_TYPES):
                _count_malformed(result, messages)
                continue
            for msg in messages:
                if not isinstance(msg, bytes):
                    _count_malformed(result, msg)
                    continue
                if msg.startswith(HEARTBEAT_PREFIX) and not msg.startswith(ESCAPE_PREFIX):
                    extended, seen = table.extend_counted(heartbeat_payload(msg), now)
                    result.heartbeat_messages += 1
                    result.heartbeat_ids += seen
                    result.extended += extended
                    continue
                if msg.startswith(self._passthrough):
                    result.passthrough.setdefault(agent, []).append(msg)
                    continue
                parsed = parse_completion(msg)
                if parsed is None:
                    _count_malformed(result, msg)
                    continue
                req_id, expected = parsed
                if req_id not in self._in_batch and req_id not in table:
                    result.unknown += 1
                    if len(result.unknown_sample) < UNKNOWN_SAMPLE_SIZE:
                        result.unknown_sample.append(unknown_sample_id(req_id))
                    continue
                self._expected[req_id] = expected
                count = self._counts.get(req_id, 0) + 1
                if count == expected:
                    self._counts.pop(req_id, None)
                    del self._expected[req_id]
                    self._in_batch.discard(req_id)
                    table.release(req_id)
                    result.completed.append(req_id)
                else:
                    self._counts[req_id] = count
        return result

    def expire(self, now: float, limit: int | None = None) -> Expiry:
        """Remove the leases due at ``now`` (all, or the ``limit`` earliest);
        return them as an ``Expiry``: ids earliest deadline first, and the
        reads seen of those that had been read by some consumer."""
        ids = self.table.pop_expired(now, limit)
        reads: dict[str, int] = {}
        for req_id in ids:
            self._in_batch.discard(req_id)
            if self._expected.pop(req_id, None) is not None:
                count = self._counts.pop(req_id, 0)
                if count:
                    reads[req_id] = count
        return Expiry(ids, reads)


def _items_of(notifs: Mapping[str, Iterable[bytes]]) -> ItemsView[str, Iterable[bytes]]:
    try:
        return notifs.items()
    except AttributeError:
        raise TypeError(f"notifications must be a mapping, got {type(notifs).__name__}") from None


def _count_malformed(result: RouteResult, msg: object) -> None:
    result.malformed += 1
    if len(result.malformed_sample) < MALFORMED_SAMPLE_SIZE:
        result.malformed_sample.append(malformed_sample(msg))
