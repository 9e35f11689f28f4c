"""Pure-Python twin of the P-side lease table (the readable reference).

The Cython module ``_lease_table_c`` must behave exactly like this one; the
property tests in ``tests/test_core_properties.py`` hold them to it.

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

Leases are also indexed by tag (``lease_tags.tag_digest`` of the id -> the ids
holding it), for ``extend_tagged``: our D's ``LHBT:`` heartbeats name leases
by an 11-byte tag instead of the id.

After a burst drains (fewer than a quarter of the peak's leases left) the
dict is copied and the heap rebuilt at the live size, so memory and
per-operation cost follow the live count, not the peak (a dict never shrinks
on deletion by itself).
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Iterator

from .._checks import check_deadline, check_extension, check_limit, check_now, check_req_id
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


class LeaseTable:
    """Leases held by a prefill worker: request id -> deadline.

    Times are plain floats supplied by the caller; the table never reads a
    clock, so behaviour is exact and testable.  ``tags=False``: leases are
    not indexed by tag (push mode, whose D never names tags), and
    ``extend_tagged`` finds none.
    """

    __slots__ = ("_extension", "_leases", "_heap", "_seq", "_stale", "_peak", "_routed", "_by_tag", "_tags")

    def __init__(self, extension: float, *, tags: bool = True, _hash_bits: int = 64) -> None:
        # _hash_bits only exists for parity with the Cython table's test hook.
        if not 1 <= _hash_bits <= 64:
            raise ValueError("_hash_bits must be in 1..64")
        self._extension = check_extension(extension)
        # req_id -> [deadline, seq of the grant that owns the live heap entry]
        self._leases: dict[str, list] = {}
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

    def grant(self, req_id: str, deadline: float) -> None:
        """Start (or overwrite) the lease of ``req_id`` until ``deadline``."""
        req_id = check_req_id(req_id)
        deadline = check_deadline(deadline)
        self._seq += 1
        if req_id in self._leases:
            self._stale += 1  # the old heap entry is orphaned
        else:
            self._tag(req_id)
        self._leases[req_id] = [deadline, self._seq]
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
        new_deadline = self._extended_deadline(check_now(now))
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

    def extend_tagged(self, payload: bytes, now: float) -> tuple[int, int, list[str] | None]:
        """Apply one ``LHBT:`` payload (comma-separated tags, ``lease_tags.py``):
        extend every lease a tag names.  Returns ``(leases extended, tags named,
        the tags naming no lease)``; the last is None, and nothing is extended,
        when the payload is not ASCII.  An empty field names nothing."""
        new_deadline = self._extended_deadline(check_now(now))
        raw = bytes(payload)
        try:
            fields = raw.decode("ascii").split(",")
        except UnicodeDecodeError:
            return 0, sum(1 for f in raw.split(b",") if f), None
        extended = named = 0
        unknown: list[str] = []
        for field in fields:
            if not field:
                continue
            named += 1
            digest = parse_tag(field)
            ids = self._by_tag.get(digest) if digest is not None else None
            if not ids:
                unknown.append(field)
                continue
            for req_id in ids:
                entry = self._leases[req_id]
                if new_deadline > entry[0]:
                    entry[0] = new_deadline
                extended += 1
        return extended, named, unknown

    def _extended_deadline(self, now: float) -> float:
        """The deadline a heartbeat applied at ``now`` gives a lease it names
        (a lease already later keeps its own)."""
        return now + self._extension

    def release(self, req_id: str) -> bool:
        """Drop the lease of ``req_id``; return whether it held one."""
        if self._leases.pop(req_id, None) is None:
            return False
        self._untag(req_id)
        self._stale += 1
        self._maybe_rebuild()
        self._maybe_compact()
        return True

    def pop_expired(self, now: float, limit: int | None = None) -> list[str]:
        """Remove and return the leases with deadline <= now, earliest first:
        all of them, or the ``limit`` earliest (the rest stay due)."""
        now = check_now(now)
        cap = check_limit(limit)
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
            self._untag(req_id)
            expired.append(req_id)
        if expired:
            self._maybe_compact()
        return expired

    def deadline(self, req_id: str) -> float | None:
        entry = self._leases.get(req_id)
        return None if entry is None else entry[0]

    def next_deadline(self) -> float | None:
        """Earliest deadline of any live lease (None when empty)."""
        if not self._leases:
            return None
        self._settle_top()
        return self._heap[0][0]

    def ids(self) -> list[str]:
        """Ids of all live leases (no particular order)."""
        return list(self._leases)

    def heap_size(self) -> int:
        """Entries in the heap, live and stale (for memory-bound tests)."""
        return len(self._heap)

    def nbytes(self) -> int:
        """Bytes held by the table's containers and deadlines (ids excluded)."""
        return (
            sys.getsizeof(self._leases)
            + sys.getsizeof(self._heap)
            + sum(sys.getsizeof(e) + sys.getsizeof(e[0]) for e in self._leases.values())
            + sum(sys.getsizeof(e) for e in self._heap)
        )

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._leases

    def __repr__(self) -> str:
        return f"<LeaseTable leases={len(self._leases)} extension={self._extension}>"

    def _tag(self, req_id: str) -> None:
        if not self._tags:
            return
        digest = tag_digest(req_id)
        if digest is not None:
            self._by_tag.setdefault(digest, []).append(req_id)

    def _untag(self, req_id: str) -> None:
        if not self._tags:
            return
        digest = tag_digest(req_id)
        ids = self._by_tag.get(digest) if digest is not None else None
        if ids:
            ids.remove(req_id)
            if not ids:
                del self._by_tag[digest]

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
            self._heap = [(d, s, r) for r, (d, s) in self._leases.items()]
            heapq.heapify(self._heap)
            self._stale = 0

    def _maybe_compact(self) -> None:
        if self._peak > _MIN_PEAK_TO_COMPACT and len(self._leases) * 4 < self._peak:
            self._leases = dict(self._leases)
            self._heap = [(d, s, r) for r, (d, s) in self._leases.items()]
            heapq.heapify(self._heap)
            self._stale = 0
            self._peak = len(self._leases)
