"""Pure-Python twin of the P-side lease table (the readable reference).

The Cython module ``_lease_table_c`` must behave exactly like this one; the
property tests in ``tests/core/test_core_properties.py`` hold them to it.

Data structure: a dict ``req_id -> [deadline, seq]`` plus a lazy min-heap of
``(deadline, seq, req_id)``.  ``extend`` only raises the deadline in the dict
(O(1) per id); the heap entry is left behind with the old, earlier deadline.
When ``pop_expired`` meets such an entry at the top it pushes it back with the
current deadline, so each live lease owns exactly one live heap entry and
extensions never grow the heap.  ``grant`` of an existing id and ``release``
orphan that entry ("stale": its seq no longer matches); stale entries are
dropped when they surface and, so that they cannot pile up, the heap is rebuilt
from the live leases whenever they outnumber the live ones (amortised O(1)).
Ties between equal deadlines go to the earlier ``grant``.

Leases are also indexed by tag (``lease_tags.tag_digest`` of the id under P's
tag key -> the ids holding it), for ``extend_tagged``: our D's ``LHBT:``
heartbeats name leases by an 11-byte tag instead of the id.  No tag is indexed
until ``set_tag_key`` gives the table its key.

Tombstones and ambiguity (``docs/PROTOCOL.md``, rules P3 and P4, section 5):
an answer may call a key (id or tag) "held" only if exactly the leases it
names now are the ones D meant.  So every key of a lease that is freed
(released or expired) is remembered as a tombstone for ``tombstone_s``; a
lease granted on a key with a live tombstone is **ambiguous** for its whole
life, and so are the live leases that shared a tag with a lease when it was
freed.  ``extend_acked`` and ``extend_tagged`` still extend ambiguous leases
(holding longer is safe) but list their keys as not held.  Time: the table
never reads a clock; it keeps the largest ``now`` any call gave it and dates
each free with that (``pop_expired(now, 0)`` only advances it).  Tombstones
are a dict ``key -> free events not yet aged out`` (ids as str, tag digests
as int) and a FIFO of ``(time, key)`` events, pruned from the front as they
age (amortised O(1)).  The FIFO holds at most ``max_tombstones`` events: past
that the oldest is dropped and, if it was its key's last, every lease granted
until it would have aged out is ambiguous instead (``tombstone_overflows``
counts those), so the cap never makes an answer less careful.

After a burst drains (fewer than a quarter of the peak's leases left) the
dict is copied and the heap rebuilt at the live size, so memory and
per-operation cost follow the live count, not the peak (a dict never shrinks
on deletion by itself).
"""

from __future__ import annotations

import heapq
import math
import sys
from collections import deque
from collections.abc import Iterator
from typing import Any

from .._checks import (
    DEFAULT_MAX_TOMBSTONES,
    check_deadline,
    check_extension,
    check_limit,
    check_max_tombstones,
    check_now,
    check_req_id,
    check_tag_bits,
    check_tag_key,
    check_tombstone_s,
)
from ..lease_tags import parse_tag, tag_digest

# Below this many stale entries the heap is never rebuilt: rebuilding a tiny
# heap costs more than carrying a few dead entries.
_MIN_STALE_FOR_REBUILD = 64
# Below this peak a drained table is not worth compacting.
_MIN_PEAK_TO_COMPACT = 256


def split_heartbeat_ids(payload: bytes | str) -> Iterator[str | None]:
    """Yield each non-empty id of a heartbeat payload (the text after ``HB:``),
    or None for an id that is not valid UTF-8 (it can match no lease)."""
    if isinstance(payload, str):
        for part in payload.split(","):
            if part:
                yield part
        return
    for raw in bytes(payload).split(b","):
        if raw:
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError:
                yield None


def payload_bytes(payload: bytes | str) -> bytes:
    """A heartbeat payload as bytes; a str's lone surrogates are kept as the
    bytes they would be, which are not UTF-8 (so they match no lease)."""
    if isinstance(payload, str):
        return payload.encode("utf-8", "surrogatepass")
    return bytes(payload)


class LeaseTable:
    """Leases held by a prefill worker: request id -> deadline.

    Times are plain floats supplied by the caller; the table never reads a
    clock, so behaviour is exact and testable.  ``tags=False``: leases are
    not indexed by tag (push mode, whose D never names tags), and
    ``extend_tagged`` finds none.  ``tombstone_s`` (default twice the
    extension): how long a freed lease's keys make new leases on them
    ambiguous.  ``tag_bits`` (test knob): keep only the low bits of every tag
    digest, so that tags collide on purpose.
    """

    __slots__ = (
        "_extension", "_leases", "_heap", "_seq", "_stale", "_peak", "_routed", "_by_tag", "_tags",
        "_tag_key", "_tag_mask", "_now", "_tombstone_s", "_max_tombstones", "_tombs", "_tomb_fifo",
        "_tomb_peak", "_overflows", "_overflow_until",
    )  # fmt: skip

    def __init__(
        self,
        extension: float,
        *,
        tags: bool = True,
        tombstone_s: float | None = None,
        tag_bits: int = 64,
        max_tombstones: int = DEFAULT_MAX_TOMBSTONES,
        _hash_bits: int = 64,
    ) -> None:
        # _hash_bits only exists for parity with the Cython table's test hook.
        if not 1 <= _hash_bits <= 64:
            raise ValueError("_hash_bits must be in 1..64")
        self._extension = check_extension(extension)
        self._tombstone_s = check_tombstone_s(tombstone_s, self._extension)
        self._tag_mask = (1 << check_tag_bits(tag_bits)) - 1
        self._max_tombstones = check_max_tombstones(max_tombstones)
        # req_id -> [deadline, seq of the grant that owns the live heap entry,
        #            ambiguous, tag digest (None: not indexed by tag)]
        self._leases: dict[str, list[Any]] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._seq = 0
        # A router owns this table (one at most: the Cython router keeps its
        # batch membership in the table's slots).
        self._routed = False
        self._stale = 0
        self._peak = 0  # most leases held since the last compaction
        # Tag digest -> the ids holding it (almost always one), for
        # ``extend_tagged``; ids with no tag (``tag_digest``) are left out.
        self._by_tag: dict[int, list[str]] = {}
        self._tags = bool(tags)
        self._tag_key: bytes | None = None
        self._now = -math.inf  # the largest ``now`` given so far
        # key (an id: str, a tag digest: int) -> free events of it in the FIFO
        self._tombs: dict[str | int, int] = {}
        self._tomb_fifo: deque[tuple[float, str | int]] = deque()
        self._tomb_peak = 0
        self._overflows = 0  # live tombstones dropped at the cap
        self._overflow_until = -math.inf  # grants up to then are ambiguous (once overflowed)

    def set_tag_key(self, key: bytes) -> None:
        """The key tags are indexed with (P's, for life).  The first key also
        indexes the leases already held; the same key again changes nothing;
        another key while leases are held raises ValueError."""
        key = check_tag_key(key)
        if key == self._tag_key:
            return
        if self._tag_key is not None and self._leases:
            raise ValueError("the tag key cannot change while leases are held")
        self._tag_key = key
        self._by_tag = {}
        for req_id, entry in self._leases.items():
            entry[3] = None
            self._tag(req_id, entry)

    def grant(self, req_id: str, deadline: float) -> None:
        """Start (or overwrite) the lease of ``req_id`` until ``deadline``.
        The lease is ambiguous if its id or tag has a live tombstone (or the
        tombstones overflowed recently); a lease granted again stays ambiguous."""
        req_id = check_req_id(req_id)
        deadline = check_deadline(deadline)
        self._seq += 1
        entry = self._leases.get(req_id)
        if entry is not None:
            self._stale += 1  # the old heap entry is orphaned
            entry[0], entry[1] = deadline, self._seq
        else:
            entry = [deadline, self._seq, False, None]
            self._leases[req_id] = entry
            self._tag(req_id, entry)
        if not entry[2] and self._tombstoned(req_id, entry[3]):
            entry[2] = True
        if len(self._leases) > self._peak:
            self._peak = len(self._leases)
        heapq.heappush(self._heap, (deadline, self._seq, req_id))
        self._maybe_rebuild()

    def extend(self, payload: bytes | str, now: float) -> int:
        """Apply one heartbeat payload; return how many leases it extended.

        Unknown, empty or undecodable ids are ignored: a heartbeat never
        creates a lease.
        """
        return self.extend_counted(payload, now)[0]

    def extend_counted(self, payload: bytes | str, now: float) -> tuple[int, int]:
        """Like ``extend``; returns ``(extended, non-empty ids in payload)``."""
        new_deadline = self._advance(now)
        extended = seen = 0
        leases = self._leases
        for req_id in split_heartbeat_ids(payload):
            seen += 1
            entry = leases.get(req_id) if req_id is not None else None
            if entry is not None:
                if new_deadline > entry[0]:
                    entry[0] = new_deadline
                extended += 1
        return extended, seen

    def extend_acked(self, payload: bytes | str, now: float) -> tuple[int, int, list[str] | None]:
        """Apply one ``LHB:`` payload (comma-separated ids): extend every held
        lease it names, ambiguous ones too.  Returns ``(leases extended, ids
        named, the ids not held)``: the non-empty ids, in payload order, that
        hold no lease here or whose lease is ambiguous.  The last is None when
        the payload is not UTF-8 (the answer then counts none as extended;
        the held ids that could be read are extended all the same)."""
        new_deadline = self._advance(now)
        raw = payload_bytes(payload)
        try:
            raw.decode("utf-8")
            not_held: list[str] | None = []
        except UnicodeDecodeError:
            not_held = None
        extended = named = 0
        leases = self._leases
        for part in raw.split(b","):
            if not part:
                continue
            named += 1
            try:
                req_id = part.decode("utf-8")
            except UnicodeDecodeError:
                continue  # matches no lease; the whole answer is None
            entry = leases.get(req_id)
            if entry is not None:
                if new_deadline > entry[0]:
                    entry[0] = new_deadline
                extended += 1
                if not entry[2]:
                    continue
            if not_held is not None:
                not_held.append(req_id)
        return extended, named, not_held

    def extend_tagged(self, payload: bytes, now: float) -> tuple[int, int, list[str] | None]:
        """Apply one ``LHBT:`` payload (comma-separated tags, ``lease_tags.py``):
        extend every lease a tag names, ambiguous ones too.  Returns ``(leases
        extended, tags named, the tags not held)``: those naming no lease, or
        a lease that is ambiguous.  The last is None, and nothing is extended,
        when the payload is not ASCII.  An empty field names nothing."""
        new_deadline = self._advance(now)
        raw = bytes(payload)
        try:
            fields = raw.decode("ascii").split(",")
        except UnicodeDecodeError:
            return 0, sum(1 for f in raw.split(b",") if f), None
        extended = named = 0
        unknown: list[str] = []
        mask = self._tag_mask
        leases = self._leases
        for field in fields:
            if not field:
                continue
            named += 1
            digest = parse_tag(field)
            ids = self._by_tag.get(digest & mask) if digest is not None else None
            if not ids:
                unknown.append(field)
                continue
            ambiguous = False
            for req_id in ids:
                entry = leases[req_id]
                if new_deadline > entry[0]:
                    entry[0] = new_deadline
                extended += 1
                ambiguous = ambiguous or entry[2]
            if ambiguous:
                unknown.append(field)
        return extended, named, unknown

    def holds_tag(self, tag: object) -> bool:
        """Does ``tag`` (its text, ``lease_tags.lease_tag``) name a lease held
        here, none of them ambiguous?  Nothing is extended."""
        digest = parse_tag(tag) if isinstance(tag, str) else None
        ids = self._by_tag.get(digest & self._tag_mask) if digest is not None else None
        if not ids:
            return False
        return not any(self._leases[req_id][2] for req_id in ids)

    def _advance(self, now: float) -> float:
        """Check ``now``, keep the largest seen, and return the deadline a
        heartbeat applied at ``now`` gives a lease it names (a lease already
        later keeps its own)."""
        now = check_now(now)
        if now > self._now:
            self._now = now
        return now + self._extension

    def _observe(self, now: float) -> None:
        """Keep ``now`` (already checked) if it is the largest seen (for the router)."""
        if now > self._now:
            self._now = now

    def release(self, req_id: str) -> bool:
        """Drop the lease of ``req_id``; return whether it held one.  Its keys
        become tombstones dated with the latest ``now`` the table was given."""
        entry = self._leases.pop(req_id, None)
        if entry is None:
            return False
        self._freed(req_id, entry)
        self._stale += 1
        self._maybe_rebuild()
        self._maybe_compact()
        return True

    def pop_expired(self, now: float, limit: int | None = None) -> list[str]:
        """Remove and return the leases with deadline <= now, earliest first:
        all of them, or the ``limit`` earliest (the rest stay due)."""
        now = check_now(now)
        cap = check_limit(limit)
        self._observe(now)
        heap = self._heap
        expired: list[str] = []
        while heap and heap[0][0] <= now and len(expired) != cap:
            stored, seq, req_id = heapq.heappop(heap)
            entry = self._leases.get(req_id)
            if entry is None or entry[1] != seq:
                self._stale -= 1
                continue
            if entry[0] > stored:
                # Extended since this entry was pushed: move it to its real place.
                heapq.heappush(heap, (entry[0], seq, req_id))
                continue
            del self._leases[req_id]
            self._freed(req_id, entry)
            expired.append(req_id)
        if expired:
            self._maybe_compact()
        return expired

    def deadline(self, req_id: str) -> float | None:
        entry = self._leases.get(req_id)
        return None if entry is None else entry[0]

    def is_ambiguous(self, req_id: str) -> bool:
        """Whether ``req_id`` holds a lease that answers never call held."""
        entry = self._leases.get(req_id)
        return entry is not None and entry[2]

    def tombstones(self) -> int:
        """Keys (ids and tag digests) with a live tombstone now."""
        self._prune()
        return len(self._tombs)

    @property
    def tombstone_overflows(self) -> int:
        """Live tombstones dropped at ``max_tombstones`` (each made the grants
        until it would have aged out ambiguous)."""
        return self._overflows

    def next_deadline(self) -> float | None:
        """Earliest deadline of any live lease (None when empty)."""
        if not self._leases:
            return None
        self._settle_top()
        return self._heap[0][0]

    def ids(self) -> list[str]:
        """Ids of all live leases (no particular order)."""
        return list(self._leases)

    def scheduled_entries(self) -> int:
        """Entries in the expiry schedule (the heap), live and stale (for memory-bound tests)."""
        return len(self._heap)

    def nbytes(self) -> int:
        """Bytes held by the table's containers and deadlines (ids excluded)."""
        return (
            sys.getsizeof(self._leases)
            + sys.getsizeof(self._heap)
            + sum(sys.getsizeof(e) + sys.getsizeof(e[0]) for e in self._leases.values())
            + sum(sys.getsizeof(e) for e in self._heap)
            + sys.getsizeof(self._tombs)
            + sys.getsizeof(self._tomb_fifo)
            + sum(sys.getsizeof(e) for e in self._tomb_fifo)
        )

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._leases

    def __repr__(self) -> str:
        return f"<LeaseTable leases={len(self._leases)} extension={self._extension}>"

    # -- tags ---------------------------------------------------------------
    def _tag(self, req_id: str, entry: list[Any]) -> None:
        if not self._tags or self._tag_key is None:
            return
        digest = tag_digest(req_id, self._tag_key)
        if digest is not None:
            entry[3] = digest & self._tag_mask
            self._by_tag.setdefault(entry[3], []).append(req_id)

    # -- tombstones ---------------------------------------------------------
    def _freed(self, req_id: str, entry: list[Any]) -> None:
        """A lease is gone: its id and tag become tombstones, and the live
        leases still sharing its tag become ambiguous."""
        self._bury(req_id)
        digest = entry[3]
        if digest is None:
            return
        ids = self._by_tag[digest]
        ids.remove(req_id)
        if ids:
            for other in ids:
                self._leases[other][2] = True
        else:
            del self._by_tag[digest]
        self._bury(digest)

    def _tombstoned(self, req_id: str, digest: int | None) -> bool:
        """Whether a lease granted now on these keys is ambiguous."""
        if self._overflows and self._now <= self._overflow_until:
            return True
        if not self._tombs:
            return False
        self._prune()
        return req_id in self._tombs or (digest is not None and digest in self._tombs)

    def _bury(self, key: str | int) -> None:
        """Record a free event of ``key`` at the latest ``now``."""
        self._prune()
        fifo = self._tomb_fifo
        tombs = self._tombs
        if len(fifo) >= self._max_tombstones:
            freed_at, old = fifo.popleft()
            if self._forget(old):
                # A live tombstone is lost: be careful until it would have aged out.
                self._overflows += 1
                self._overflow_until = max(self._overflow_until, freed_at + self._tombstone_s)
        fifo.append((self._now, key))
        tombs[key] = tombs.get(key, 0) + 1
        if len(tombs) > self._tomb_peak:
            self._tomb_peak = len(tombs)

    def _forget(self, key: str | int) -> bool:
        """One free event of ``key`` leaves the FIFO; True if it was the last."""
        left = self._tombs[key] - 1
        if left:
            self._tombs[key] = left
            return False
        del self._tombs[key]
        return True

    def _prune(self) -> None:
        """Drop the free events that aged out (freed at f, f + tombstone_s < now)."""
        fifo = self._tomb_fifo
        horizon = self._now
        ts = self._tombstone_s
        while fifo and fifo[0][0] + ts < horizon:
            self._forget(fifo.popleft()[1])
        if self._tomb_peak > _MIN_PEAK_TO_COMPACT and len(self._tombs) * 4 < self._tomb_peak:
            self._tombs = dict(self._tombs)  # a dict never shrinks on deletion by itself
            self._tomb_peak = len(self._tombs)

    # -- heap -----------------------------------------------------------------
    def _settle_top(self) -> None:
        """Make the heap top a live entry holding its lease's real deadline."""
        heap = self._heap
        while heap:
            stored, seq, req_id = heap[0]
            entry = self._leases.get(req_id)
            if entry is None or entry[1] != seq:
                heapq.heappop(heap)
                self._stale -= 1
            elif entry[0] > stored:
                heapq.heapreplace(heap, (entry[0], seq, req_id))
            else:
                return

    def _maybe_rebuild(self) -> None:
        if self._stale > _MIN_STALE_FOR_REBUILD and self._stale > len(self._leases):
            self._heap = [(e[0], e[1], r) for r, e in self._leases.items()]
            heapq.heapify(self._heap)
            self._stale = 0

    def _maybe_compact(self) -> None:
        if self._peak > _MIN_PEAK_TO_COMPACT and len(self._leases) * 4 < self._peak:
            self._leases = dict(self._leases)
            self._heap = [(e[0], e[1], r) for r, e in self._leases.items()]
            heapq.heapify(self._heap)
            self._stale = 0
            self._peak = len(self._leases)
