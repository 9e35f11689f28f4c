"""Brute-force model of the lease core: obviously correct, O(n) everything.

The property tests run it beside the Cython core and the Python twin.

Tombstones are a plain list of free events ``(time, key)`` in the order they
happened, keys ``("id", req_id)`` or ``("tag", digest)``; a key is a
tombstone while some event of it is in the list, and events leave it when
they age out (``time + tombstone_s < now``) or, past ``max_tombstones``
events, oldest first.  Tags are computed from the id whenever needed.
"""

from __future__ import annotations

import math
import re

from vllm_nixl_lease._wire import PUSH_REG_PREFIX, heartbeat_payload, is_heartbeat
from vllm_nixl_lease.lease_tags import parse_tag, tag_digest

_COMPLETION = re.compile(rb"\A(.+):([0-9]{1,10})\Z", re.DOTALL)


class ReferenceRouter:
    def __init__(
        self,
        extension: float,
        *,
        tombstone_s: float | None = None,
        tag_bits: int = 64,
        max_tombstones: int = 1_000_000,
    ) -> None:
        self.extension = extension
        self.tombstone_s = 2 * extension if tombstone_s is None else tombstone_s
        self.tag_mask = 2**tag_bits - 1
        self.max_tombstones = max_tombstones
        self.leases: dict[str, tuple[float, int]] = {}
        self.seq = 0
        self.in_batch: set[str] = set()
        self.counts: dict[str, int] = {}
        self.expected: dict[str, int] = {}
        self.key: bytes | None = None
        self.now = -math.inf
        self.events: list[tuple[float, tuple]] = []
        self.ambiguous: set[str] = set()
        self.overflows = 0
        self.overflow_until = -math.inf

    # tags and tombstones
    def set_tag_key(self, key: bytes) -> None:
        if self.key is not None and key != self.key and self.leases:
            raise ValueError(key)
        self.key = key

    def tag_of(self, req_id: str) -> int | None:
        if self.key is None:
            return None
        digest = tag_digest(req_id, self.key)
        return None if digest is None else digest & self.tag_mask

    def observe(self, now: float) -> None:
        self.now = max(self.now, now)

    def prune(self) -> None:
        self.events = [(t, k) for t, k in self.events if t + self.tombstone_s >= self.now]

    def tombstoned(self, key: tuple) -> bool:
        self.prune()
        return any(k == key for _, k in self.events)

    def bury(self, key: tuple) -> None:
        self.prune()
        if len(self.events) >= self.max_tombstones:
            t, old = self.events.pop(0)
            if not any(k == old for _, k in self.events):
                self.overflows += 1
                self.overflow_until = max(self.overflow_until, t + self.tombstone_s)
        self.events.append((self.now, key))

    def free(self, req_id: str) -> None:
        """``req_id``'s lease is gone (released, expired or read)."""
        del self.leases[req_id]
        self.ambiguous.discard(req_id)
        self.bury(("id", req_id))
        tag = self.tag_of(req_id)
        if tag is not None:
            for other in self.leases:
                if self.tag_of(other) == tag:
                    self.ambiguous.add(other)
            self.bury(("tag", tag))

    def tombstones(self) -> int:
        self.prune()
        return len({k for _, k in self.events})

    # table
    def grant(self, req_id: str, deadline: float) -> None:
        self.seq += 1
        self.leases[req_id] = (deadline, self.seq)
        tag = self.tag_of(req_id)
        if (
            (self.overflows and self.now <= self.overflow_until)
            or self.tombstoned(("id", req_id))
            or (tag is not None and self.tombstoned(("tag", tag)))
        ):
            self.ambiguous.add(req_id)

    def extend_counted(self, payload: bytes, now: float) -> tuple[int, int]:
        now = check_now(now)
        self.observe(now)
        extended = seen = 0
        for raw in payload.split(b","):
            if not raw:
                continue
            seen += 1
            try:
                rid = raw.decode()
            except UnicodeDecodeError:
                continue
            if rid in self.leases:
                d, s = self.leases[rid]
                self.leases[rid] = (max(d, now + self.extension), s)
                extended += 1
        return extended, seen

    def extend_acked(self, payload: bytes, now: float) -> tuple[int, int, list[str] | None]:
        now = check_now(now)
        self.observe(now)
        extended = named = 0
        not_held: list[str] | None = []
        for raw in payload.split(b","):
            if not raw:
                continue
            named += 1
            try:
                rid = raw.decode()
            except UnicodeDecodeError:
                not_held = None
                continue
            if rid in self.leases:
                d, s = self.leases[rid]
                self.leases[rid] = (max(d, now + self.extension), s)
                extended += 1
            if (rid not in self.leases or rid in self.ambiguous) and not_held is not None:
                not_held.append(rid)
        return extended, named, not_held

    def extend_tagged(self, payload: bytes, now: float) -> tuple[int, int, list[str] | None]:
        now = check_now(now)
        self.observe(now)
        fields = [f for f in payload.split(b",") if f]
        if any(b >= 0x80 for b in payload):
            return 0, len(fields), None
        extended = 0
        unknown = []
        for field in fields:
            digest = parse_tag(field.decode())
            named = (
                [] if digest is None else [r for r in self.leases if self.tag_of(r) == digest & self.tag_mask]
            )
            if not named or any(r in self.ambiguous for r in named):
                unknown.append(field.decode())
            for rid in named:
                d, s = self.leases[rid]
                self.leases[rid] = (max(d, now + self.extension), s)
                extended += 1
        return extended, len(fields), unknown

    def release(self, req_id: str) -> bool:
        if req_id not in self.leases:
            return False
        self.free(req_id)
        return True

    # a read count lives only while its request is leased or in a batch
    def router_release(self, req_id: str) -> bool:
        held = self.release(req_id)
        if req_id not in self.in_batch:
            self.counts.pop(req_id, None)
            self.expected.pop(req_id, None)
        return held

    def discard_in_batch(self, req_id: str) -> None:
        self.in_batch.discard(req_id)
        if req_id not in self.leases:
            self.counts.pop(req_id, None)
            self.expected.pop(req_id, None)

    def pop_expired(self, now: float, limit: int | None = None) -> list[str]:
        now = check_now(now)
        limit = check_limit(limit)
        self.observe(now)
        due = sorted((d, s, r) for r, (d, s) in self.leases.items() if d <= now)
        if limit is not None:
            due = due[:limit]
        for _, _, r in due:
            self.free(r)
        return [r for _, _, r in due]

    def next_deadline(self) -> float | None:
        return min((d for d, _ in self.leases.values()), default=None)

    # router
    def route(self, notifs: dict[str, list[bytes]], now: float) -> dict:
        now = check_now(now)
        self.observe(now)
        out = {"completed": [], "hb": [0, 0, 0], "unknown": [], "malformed": 0, "passthrough": {}}
        for agent, msgs in notifs.items():
            if type(msgs) not in (list, tuple):
                out["malformed"] += 1
                continue
            for msg in msgs:
                if not isinstance(msg, bytes):
                    out["malformed"] += 1
                    continue
                if msg.startswith(b"HB:,"):  # the lease protocol's escape
                    out["passthrough"].setdefault(agent, []).append(msg)
                    continue
                if is_heartbeat(msg):
                    ext, seen = self.extend_counted(heartbeat_payload(msg), now)
                    out["hb"][0] += 1
                    out["hb"][1] += seen
                    out["hb"][2] += ext
                    continue
                if msg.startswith(PUSH_REG_PREFIX):
                    out["passthrough"].setdefault(agent, []).append(msg)
                    continue
                m = _COMPLETION.match(msg)
                rid = None
                if m and 0 < int(m.group(2)) < 2**31:
                    try:
                        rid = m.group(1).decode()
                    except UnicodeDecodeError:
                        rid = None
                if rid is None:
                    out["malformed"] += 1
                    continue
                expected = int(m.group(2))
                if rid not in self.in_batch and rid not in self.leases:
                    out["unknown"].append(rid if len(rid) <= 64 else rid[:64] + "...")
                    continue
                self.expected[rid] = expected
                self.counts[rid] = self.counts.get(rid, 0) + 1
                if self.counts[rid] == expected:
                    del self.counts[rid], self.expected[rid]
                    self.in_batch.discard(rid)
                    if rid in self.leases:
                        self.free(rid)
                    out["completed"].append(rid)
        return out

    def expire(self, now: float, limit: int | None = None) -> tuple[list[str], dict[str, int]]:
        """(expired ids earliest first, {id: reads seen} for those read at all)."""
        ids = self.pop_expired(now, limit)
        reads = {}
        for rid in ids:
            self.expected.pop(rid, None)
            self.in_batch.discard(rid)
            count = self.counts.pop(rid, 0)
            if count:
                reads[rid] = count
        return ids, reads


def check_now(now: object) -> float:
    """The documented contract for ``now``, written out independently."""
    if isinstance(now, (str, bytes, bytearray)) or not isinstance(now, (int, float)):
        raise TypeError(now)
    try:
        value = float(now)
    except OverflowError:
        raise ValueError(now) from None
    if not math.isfinite(value):
        raise ValueError(now)
    return value


def check_limit(limit: object) -> int | None:
    """The documented contract for a sweep's ``limit``, written out independently."""
    if limit is None:
        return None
    if type(limit) is not int:
        raise TypeError(limit)
    if limit < 0 or limit >= 2**63:
        raise ValueError(limit)
    return limit
