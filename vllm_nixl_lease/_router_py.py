"""Pure-Python twin of the P-side notification router.

Routes one engine step's ``get_new_notifs()`` batch with the semantics of
upstream vLLM's ``_get_new_notifs`` (0.33.0), except that a malformed message
is counted and skipped instead of raising and losing the rest of the batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ._lease_table_py import LeaseTable
from ._route_result import MALFORMED_SAMPLE_BYTES, MALFORMED_SAMPLE_SIZE, RouteResult
from ._wire import HEARTBEAT_PREFIX, PUSH_REG_PREFIX, heartbeat_payload, parse_completion

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
        self._in_batch: set[str] = set()
        self._counts: dict[str, int] = {}
        self._expected: dict[str, int] = {}
        self._passthrough = tuple(bytes(p) for p in passthrough_prefixes)
        if any(not p or p.startswith(HEARTBEAT_PREFIX) for p in self._passthrough):
            raise ValueError(
                "passthrough prefixes must be non-empty and not start with " + HEARTBEAT_PREFIX.decode()
            )

    # -- batch membership -------------------------------------------------
    def add_in_batch(self, req_id: str) -> None:
        self._in_batch.add(req_id)

    def discard_in_batch(self, req_id: str) -> None:
        self._in_batch.discard(req_id)

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
        """Read completions received so far for a request still waiting."""
        return self._counts.get(req_id, 0)

    def in_batch_count(self) -> int:
        return len(self._in_batch)

    def in_batch_ids(self) -> list[str]:
        """Ids in a batch (no particular order)."""
        return list(self._in_batch)

    # -- one engine step --------------------------------------------------
    def route(self, notifs: Mapping[str, Iterable[bytes]], now: float) -> RouteResult:
        result = RouteResult()
        table = self.table
        for agent, messages in notifs.items():
            for msg in messages:
                if msg.startswith(HEARTBEAT_PREFIX):
                    extended, seen = table.extend_counted(heartbeat_payload(msg), now)
                    result.heartbeat_messages += 1
                    result.heartbeat_ids += seen
                    result.extended += extended
                    continue
                if self._passthrough and msg.startswith(self._passthrough):
                    result.passthrough.setdefault(agent, []).append(msg)
                    continue
                parsed = parse_completion(msg)
                if parsed is None:
                    result.malformed += 1
                    if len(result.malformed_sample) < MALFORMED_SAMPLE_SIZE:
                        result.malformed_sample.append(bytes(msg[:MALFORMED_SAMPLE_BYTES]))
                    continue
                req_id, expected = parsed
                if req_id not in self._in_batch and req_id not in table:
                    result.unknown_completions.append(req_id)
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

    def expire(self, now: float) -> list[tuple[str, int]]:
        """Remove every lease due at ``now``; return ``(req_id, reads seen)``
        pairs, earliest deadline first."""
        out = []
        for req_id in self.table.pop_expired(now):
            self._expected.pop(req_id, None)
            self._in_batch.discard(req_id)
            out.append((req_id, self._counts.pop(req_id, 0)))
        return out
