"""Brute-force model of the lease core: obviously correct, O(n) everything.

The property tests run it beside the Cython core and the Python twin.
"""

from __future__ import annotations

import math
import re

from vllm_nixl_lease._wire import PUSH_REG_PREFIX, heartbeat_payload, is_heartbeat
from vllm_nixl_lease.lease_tags import lease_tag, tag_digest

_COMPLETION = re.compile(rb"\A(.+):([0-9]{1,10})\Z", re.DOTALL)


class ModelRouter:
    def __init__(self, extension: float) -> None:
        self.extension = extension
        self.leases: dict[str, tuple[float, int]] = {}
        self.seq = 0
        self.in_batch: set[str] = set()
        self.counts: dict[str, int] = {}
        self.expected: dict[str, int] = {}

    # table
    def grant(self, req_id: str, deadline: float) -> None:
        self.seq += 1
        self.leases[req_id] = (deadline, self.seq)

    def extend_counted(self, payload: bytes, now: float) -> tuple[int, int]:
        now = check_now(now)
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

    def extend_tagged(self, payload: bytes, now: float) -> tuple[int, int, list[str] | None]:
        now = check_now(now)
        fields = [f for f in payload.split(b",") if f]
        if any(b >= 0x80 for b in payload):
            return 0, len(fields), None
        extended = 0
        unknown = []
        for field in fields:
            named = [r for r in self.leases if tag_digest(r) is not None and lease_tag(r) == field.decode()]
            if not named:
                unknown.append(field.decode())
            for rid in named:
                d, s = self.leases[rid]
                self.leases[rid] = (max(d, now + self.extension), s)
                extended += 1
        return extended, len(fields), unknown

    def release(self, req_id: str) -> bool:
        return self.leases.pop(req_id, None) is not None

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
        due = sorted((d, s, r) for r, (d, s) in self.leases.items() if d <= now)
        if check_limit(limit) is not None:
            due = due[:limit]
        for _, _, r in due:
            del self.leases[r]
        return [r for _, _, r in due]

    def next_deadline(self) -> float | None:
        return min((d for d, _ in self.leases.values()), default=None)

    # router
    def route(self, notifs: dict[str, list[bytes]], now: float) -> dict:
        now = check_now(now)
        out = {"completed": [], "hb": [0, 0, 0], "unknown": [], "malformed": 0, "passthrough": {}}
        for agent, msgs in notifs.items():
            if type(msgs) not in (list, tuple):
                out["malformed"] += 1
                continue
            for msg in msgs:
                if not isinstance(msg, bytes):
                    out["malformed"] += 1
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
                    self.leases.pop(rid, None)
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
