# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# distutils: language = c++
"""Cython lease table.

Behaves exactly like ``vllm_nixl_lease/prefill/_lease_table_py.py`` (read that
first: it is the reference).  ``_lease_table_c.pxd`` declares the layout; the
router (``_notification_router_c.pyx``) cimports it.

Layout, and why:
- ``_slots``: one 40-byte C struct per lease (deadline, owned id, grant seq,
  hash, tag digest and chain) in a std::vector, reused through a free list,
  so a lease costs no Python object beyond the id string the caller already
  owns.
- ``_index``: open-addressing table (linear probing, load <= 0.7) of 4-byte
  slot numbers, small cells so that the index adds little to a lease's
  memory.  Ids are placed by SipHash-1-3 (``csrc/siphash.h``) of their UTF-8
  bytes under a random 16-byte key per table, so ids cannot be crafted to
  collide.  The key is our own, not CPython's hash secret, which
  PYTHONHASHSEED fixes (deployments set it for stable prefix-cache hashes,
  and 0 disables the key altogether).  Every hash the table stores or probes
  is this one.  A heartbeat finds the commas of its payload with a 64-byte
  bit mask (``csrc/comma_scan.h``) and hashes the byte spans in place (four
  ids per AVX2 register where the CPU has AVX2, ``csrc/siphash_x4.h``), so it
  creates no Python object per id, and looks ids up in groups with
  prefetches so that the cache misses of a group overlap.  The slot keeps 32
  bits of the hash, so probes compare the hash before the bytes and a resize
  never rehashes a string.  Deleted cells are purged by rehashing when they
  pile up, so unique ids churning forever stay O(n).
- ``_wheel``: a deadline-bucketed timing wheel: a std::map from bucket
  (deadline // (extension / 16)) to a vector of (deadline, seq << 32 | slot)
  entries, 16 bytes each.  Where the twin's heap pays O(log n) cache misses
  per due lease, a sweep here reads the due buckets front to back, sorts the
  few due entries by (deadline, seq) and is done; a sweep with nothing due
  is one comparison against a lower bound of every stored deadline.  Grant
  seqs are 31-bit (the top bit marks a request also in a batch, for the
  router); when they run out the live leases are renumbered in order, which
  keeps every tie-break as it was.  As in the twin, extensions only raise
  the slot's deadline; an outdated entry is moved to its bucket when its old
  bucket comes due, orphaned entries are dropped there, and the wheel is
  rebuilt when orphans outnumber leases.
- ``_backlog``: when a sweep with a ``limit`` finds more due than it may take
  (a dead D's leases, all renewed by one heartbeat, share one bucket), the due
  entries go into a binary min-heap once, O(n), and each later sweep pops its
  ``limit`` from it, O(limit log n), instead of sorting them all every step.
- ``_tag_keys``/``_tag_heads``: a second open-addressing table (linear
  probing, load <= 0.7), the tag digest of each taggable id
  (``lease_tags.tag_digest``) -> its first slot; further slots with the same
  digest are chained through ``Slot.tag_next``.  Cells are placed by the
  digest mixed with the table's random key, so ids ground offline to share
  low bits do not share a probe run.  ``extend_tagged`` parses each 11-byte
  tag in C, a group at a time with the cells prefetched, and extends the
  chain: an ``LHBT:`` heartbeat never builds a string.
- Tag digests: hashlib's keyed BLAKE2b under P's tag key
  (``lease_tags.tag_digest``), one call per grant of a taggable id.
- Tombstones (see the twin for the rules): ``_fifo`` is a std::deque of
  (time, key, kind) free events, oldest first, and ``_tombs`` counts the
  events per (kind, key) (``csrc/tombstones.h``).  An id is remembered by its
  64-bit SipHash fingerprint under the table's random key, not by its text,
  so a tombstone costs 16 bytes and keeps no string alive; two ids sharing a
  fingerprint (about 1 in 2**64 per pair, and nobody outside the process can
  aim one) make a lease ambiguous that the twin would not: the safe side.
  Ambiguity is a flag in the slot, set at grant and free and read for free by
  the heartbeat that touches the slot anyway.
- Shrink: when the live leases fall below a quarter of the slots, the slots
  are compacted and the index and heap rebuilt at the live size (amortised
  O(1)), so memory and per-operation cost follow the live count, not a
  past burst's peak.
"""

from cpython.ref cimport PyObject, Py_INCREF, Py_DECREF
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libcpp.vector cimport vector
from libcpp.functional cimport greater
from libcpp.algorithm cimport sort, make_heap, push_heap, pop_heap
from libc.math cimport floor, INFINITY, isfinite
from cpython.float cimport PyFloat_AS_DOUBLE
from libc.string cimport memchr
from cpython.unicode cimport PyUnicode_DecodeUTF8
from cython.operator cimport dereference as deref, preincrement as inc

import os
import sys
from hashlib import blake2b as _blake2b

from .._checks import (
    DEFAULT_MAX_TOMBSTONES, check_extension, check_limit, check_max_tombstones, check_now, check_tag_bits,
    check_tag_key, check_tombstone_s,
)


cdef object _MAXSIZE = sys.maxsize


cdef double checked_now(object now) except? -1.0:
    cdef double t
    if type(now) is float:
        t = PyFloat_AS_DOUBLE(now)
        if isfinite(t):
            return t
    return check_now(now)


cdef Py_ssize_t checked_limit(object limit) except? -2:
    if limit is None:
        return -1
    if type(limit) is int and 0 <= limit <= _MAXSIZE:
        return limit
    return check_limit(limit)


cdef extern from "prefetch.h":
    void VNL_PREFETCH(const void* p) nogil

cdef extern from "siphash_x4.h":
    void vnl_sip13_many(const char* base, Py_ssize_t n, const Py_ssize_t* starts, const Py_ssize_t* lens,
                        int m, uint64_t k0, uint64_t k1, uint64_t* out) nogil
    int vnl_set_simd(int on) nogil

cdef extern from "comma_scan.h":
    ctypedef struct vnl_scan:
        pass
    void vnl_scan_init(vnl_scan* s, const char* p, Py_ssize_t n) nogil
    Py_ssize_t vnl_scan_next(vnl_scan* s) nogil


def _set_simd(on):
    """Test hook: hash heartbeat ids with the AVX2 lanes (where the CPU has
    them) or with the portable ones; returns whether AVX2 is now used."""
    return bool(vnl_set_simd(1 if on else 0))


def _siphash13(key, data):
    """SipHash-1-3 of ``data`` under the 16-byte ``key`` (test hook: the
    table's own hash, checked against reference values)."""
    cdef bytes k = bytes(key)
    cdef bytes d = bytes(data)
    if len(k) != 16:
        raise ValueError("key must be 16 bytes")
    return vnl_sip13(d, len(d), int.from_bytes(k[:8], "little"), int.from_bytes(k[8:], "little"))


# base64url character -> its 6 bits, 255 for any other byte (lease_tags.py's alphabet)
cdef unsigned char _B64[256]
for _i in range(256):
    _B64[_i] = 255
_ALPHABET = list(bytearray(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"))
for _i in range(64):
    _B64[<int>_ALPHABET[_i]] = _i


cdef inline bint _parse_tag(const unsigned char* p, uint64_t* out) noexcept:
    """``lease_tags.parse_tag`` of 11 bytes: the digest (little endian) of a
    canonical tag; False for anything else."""
    cdef uint64_t bits = 0, v, le = 0
    cdef int i
    for i in range(10):
        v = _B64[p[i]]
        if v == 255:
            return False
        bits = (bits << 6) | v
    v = _B64[p[10]]
    if v == 255 or v & 3:  # the last character carries 4 bits; its low 2 must be 0
        return False
    bits = (bits << 4) | (v >> 2)  # the 8 bytes, big endian
    for i in range(8):
        le = (le << 8) | ((bits >> (8 * i)) & 0xFF)
    out[0] = le
    return True


cdef Py_ssize_t MIN_STALE_FOR_REBUILD = 64   # same constant as the twin
cdef size_t MIN_INDEX_SIZE = 16            # a power of two

# A C constant: a bare 0xFFFFFFFF in an expression is a Python int to Cython (it
# does not fit a C int), which would box every operand it meets.
cdef uint64_t LOW32 = 0xFFFFFFFF
cdef uint64_t MIX1 = 0xBF58476D1CE4E5B9  # splitmix64's multipliers (tag cells)
cdef uint64_t MIX2 = 0x94D049BB133111EB
cdef uint32_t MAX_SEQ = 0x7FFFFFFF
cdef size_t MIN_SLOTS_TO_COMPACT = 256      # below this, a sparse slot vector is cheap
cdef double WHEEL_BUCKETS_PER_EXTENSION = 16.0
cdef double MAX_BUCKET = 4.0e18          # bucket numbers are clamped (deadline may be +-inf)
DEF HB_GROUP = 16                           # heartbeat ids looked up together (prefetch depth)


cdef class LeaseTable:
    """Leases held by a prefill worker: request id -> deadline (Cython)."""

    def __cinit__(self, extension, *, bint tags=True, tombstone_s=None, tag_bits=64,
                  max_tombstones=DEFAULT_MAX_TOMBSTONES, int _hash_bits=64):
        extension = check_extension(extension)
        if not 1 <= _hash_bits <= 64:
            raise ValueError("_hash_bits must be in 1..64")
        self._tombstone_s = check_tombstone_s(tombstone_s, extension)
        cdef int bits = check_tag_bits(tag_bits)
        self._tag_mask = 0xFFFFFFFFFFFFFFFF if bits == 64 else ((<uint64_t>1 << bits) - 1)
        self._max_tombstones = check_max_tombstones(max_tombstones)
        self._tag_key = None
        self._now = -INFINITY
        self._overflows = 0
        self._overflow_until = -INFINITY
        self._extension = extension
        self._index_tags = tags
        self._width = extension / WHEEL_BUCKETS_PER_EXTENSION
        self._lower = INFINITY
        self._entries = 0
        # Test hook: fewer hash bits force collisions so the probing gets exercised.
        self._hash_mask = 0xFFFFFFFFFFFFFFFF if _hash_bits == 64 else ((<uint64_t>1 << _hash_bits) - 1)
        key = os.urandom(16)
        self._k0 = int.from_bytes(key[:8], "little")
        self._k1 = int.from_bytes(key[8:], "little")
        self._tombs.seed = int.from_bytes(os.urandom(8), "little")
        self._index.assign(MIN_INDEX_SIZE, EMPTY)
        self._tag_keys.assign(MIN_INDEX_SIZE, 0)
        self._tag_heads.assign(MIN_INDEX_SIZE, EMPTY)

    def __dealloc__(self):
        cdef size_t i
        vnl_tomb_clear(&self._tombs)
        for i in range(self._slots.size()):
            if self._slots[i].seq != 0:
                Py_DECREF(<object>self._slots[i].req_id)

    # -- slot and map maintenance ---------------------------------------
    cdef uint32_t _alloc_slot(self):
        cdef uint32_t idx
        cdef Slot s
        if self._free:
            idx = self._free - 1
            self._free = self._slots[idx].link
            return idx
        s.seq = 0
        s.link = 0
        s.req_id = NULL
        s.deadline = 0
        s.tag = 0
        s.tag_next = 0
        s.flags = 0
        self._slots.push_back(s)
        return <uint32_t>(self._slots.size() - 1)

    cdef void _index_insert(self, uint32_t idx) except *:
        """Add live slot ``idx`` (not yet indexed) under its stored hash."""
        cdef size_t mask = self._index.size() - 1
        cdef size_t i = self._slots[idx].link & mask
        while self._index[i] != EMPTY and self._index[i] != DELETED:
            i = (i + 1) & mask
        if self._index[i] == EMPTY:
            self._index_used += 1
        self._index[i] = idx + 1
        if self._index_used * 10 > self._index.size() * 7:
            self._rehash()

    cdef void _rehash(self) except *:
        """Rebuild the index at load <= 0.5, dropping deleted cells."""
        cdef size_t size = MIN_INDEX_SIZE
        cdef size_t i, j, mask
        while size < 2 * <size_t>self._live + 2:
            size *= 2
        self._index.assign(size, EMPTY)
        mask = size - 1
        self._index_used = 0
        for i in range(self._slots.size()):
            if self._slots[i].seq != 0:
                j = self._slots[i].link & mask
                while self._index[j] != EMPTY:
                    j = (j + 1) & mask
                self._index[j] = <uint32_t>(i + 1)
                self._index_used += 1
        if self._index.capacity() > 2 * size:
            self._index.shrink_to_fit()

    cdef void _unlink(self, uint32_t idx) except *:
        """Free slot ``idx``: its keys become tombstones, then it leaves the
        index (and its tag's chain)."""
        self._freed(idx)
        cdef size_t mask = self._index.size() - 1
        cdef size_t i = self._slots[idx].link & mask
        while self._index[i] != idx + 1:
            i = (i + 1) & mask
        self._index[i] = DELETED
        if self._slots[idx].flags & TAGGED:
            self._tag_unlink(idx)
        if self._slots[idx].seq & IN_BATCH:
            self._in_batch -= 1
        Py_DECREF(<object>self._slots[idx].req_id)
        self._slots[idx].req_id = NULL
        self._slots[idx].seq = 0
        self._slots[idx].flags = 0
        self._slots[idx].link = self._free
        self._free = idx + 1
        self._live -= 1

    cdef inline uint64_t _tag_mix(self, uint64_t tag) noexcept:
        """The digest mixed with this table's key (splitmix64): where cells go."""
        cdef uint64_t z = tag ^ self._k1
        z = (z ^ (z >> 30)) * MIX1
        z = (z ^ (z >> 27)) * MIX2
        return z ^ (z >> 31)

    cdef inline size_t _tag_home(self, uint64_t tag) noexcept:
        """The tag's first cell."""
        return <size_t>self._tag_mix(tag) & (self._tag_heads.size() - 1)

    cdef inline size_t _tag_cell(self, uint64_t tag) noexcept:
        """The cell holding ``tag``, or the first EMPTY cell of its probe run."""
        cdef size_t mask = self._tag_heads.size() - 1
        cdef size_t i = self._tag_home(tag)
        cdef uint32_t c = self._tag_heads[i]
        while c != EMPTY and (c == DELETED or self._tag_keys[i] != tag):
            i = (i + 1) & mask
            c = self._tag_heads[i]
        return i

    cdef void _tag_link(self, uint32_t idx) except *:
        """Put tagged slot ``idx`` first in its tag's chain."""
        cdef uint64_t tag = self._slots[idx].tag
        cdef size_t mask, i = self._tag_cell(tag)
        if self._tag_heads[i] != EMPTY:
            self._slots[idx].tag_next = self._tag_heads[i]
            self._tag_heads[i] = idx + 1
            return
        # a new tag: the first DELETED cell of the run will do, else this EMPTY one
        mask = self._tag_heads.size() - 1
        i = self._tag_home(tag)
        while self._tag_heads[i] != EMPTY and self._tag_heads[i] != DELETED:
            i = (i + 1) & mask
        if self._tag_heads[i] == EMPTY:
            self._tag_used += 1
        self._tag_keys[i] = tag
        self._tag_heads[i] = idx + 1
        self._slots[idx].tag_next = 0
        self._tag_live += 1
        if self._tag_used * 10 > self._tag_heads.size() * 7:
            self._tag_resize(NULL)

    cdef void _tag_unlink(self, uint32_t idx) except *:
        cdef size_t i = self._tag_cell(self._slots[idx].tag)
        cdef uint32_t prev = self._tag_heads[i]
        if prev == idx + 1:
            if self._slots[idx].tag_next:
                self._tag_heads[i] = self._slots[idx].tag_next
            else:
                self._tag_heads[i] = DELETED
                self._tag_live -= 1
        else:
            prev -= 1
            while self._slots[prev].tag_next != idx + 1:
                prev = self._slots[prev].tag_next - 1
            self._slots[prev].tag_next = self._slots[idx].tag_next
        self._slots[idx].flags &= ~TAGGED
        self._slots[idx].tag_next = 0

    cdef void _tag_resize(self, const uint32_t* moved) except *:
        """Rebuild the tag table at load <= 0.5 of its live cells, dropping
        deleted ones; with ``moved`` (old slot -> new slot + 1, after a
        compaction) the heads are renumbered too.  Reads the old cells in
        order; their homes in the new table come in the same cyclic order, so
        the writes sweep it a few times instead of landing at random (a
        compaction after a mass expiry does this with cold caches)."""
        cdef size_t size = MIN_INDEX_SIZE
        cdef size_t i, j, mask
        cdef uint32_t head
        cdef vector[uint64_t] keys
        cdef vector[uint32_t] heads
        while size < 2 * <size_t>self._tag_live + 2:
            size *= 2
        keys.assign(size, 0)
        heads.assign(size, EMPTY)
        mask = size - 1
        for i in range(self._tag_heads.size()):
            head = self._tag_heads[i]
            if head == EMPTY or head == DELETED:
                continue
            if moved != NULL:
                head = moved[head - 1]
            j = <size_t>self._tag_mix(self._tag_keys[i]) & mask
            while heads[j] != EMPTY:
                j = (j + 1) & mask
            keys[j] = self._tag_keys[i]
            heads[j] = head
        self._tag_keys.swap(keys)
        self._tag_heads.swap(heads)
        self._tag_used = <size_t>self._tag_live

    cdef int _tag_of(self, const char* p, Py_ssize_t n, uint64_t* out) except -1:
        """``lease_tags.tag_digest`` of an id's UTF-8 bytes under the table's
        key, cut to ``tag_bits``; 0 when the id gets no tag (no key yet, a
        table without tags, or a ',' in the id)."""
        if self._tag_key is None or not self._index_tags or memchr(p, 44, <size_t>n) != NULL:
            return 0
        digest = _blake2b(PyBytes_FromStringAndSize(p, n), key=self._tag_key, digest_size=8).digest()
        out[0] = (<uint64_t>int.from_bytes(digest, "little")) & self._tag_mask
        return 1

    # -- tombstones -------------------------------------------------------
    cdef void _freed(self, uint32_t idx) except *:
        """Slot ``idx`` (still linked) is being freed: its id and tag become
        tombstones, and the live leases sharing its tag become ambiguous."""
        cdef Py_ssize_t n
        cdef const char* s = _stored_utf8(self._slots[idx].req_id, &n)
        cdef uint64_t tag
        cdef uint32_t c
        self._bury(vnl_sip13(s, <size_t>n, self._k0, self._k1), TOMB_ID)
        if not self._slots[idx].flags & TAGGED:
            return
        tag = self._slots[idx].tag
        c = self._tag_heads[self._tag_cell(tag)]
        while c:
            if c != idx + 1:
                self._slots[c - 1].flags |= AMBIGUOUS
            c = self._slots[c - 1].tag_next
        self._bury(tag, TOMB_TAG)

    cdef bint _tombstoned(self, uint64_t fingerprint, bint tagged, uint64_t tag) except -1:
        """Whether a lease granted now on these keys is ambiguous."""
        if self._overflows and self._now <= self._overflow_until:
            return True
        if self._tombs.live == 0:
            return False
        self._prune()
        return (vnl_tomb_has(&self._tombs, fingerprint, TOMB_ID)
                or (tagged and vnl_tomb_has(&self._tombs, tag, TOMB_TAG)))

    cdef void _bury(self, uint64_t key, uint32_t kind) except *:
        """Record a free event of (kind, key) at the latest ``now``; at the
        cap, the oldest event goes, and if it was its key's last, grants stay
        ambiguous until it would have aged out."""
        cdef TombEvent e
        self._prune()
        if <Py_ssize_t>self._fifo.size() >= self._max_tombstones:
            e = self._fifo.front()
            self._fifo.pop_front()
            if vnl_tomb_forget(&self._tombs, e.key, e.kind):
                self._overflows += 1
                if e.at + self._tombstone_s > self._overflow_until:
                    self._overflow_until = e.at + self._tombstone_s
        if vnl_tomb_add(&self._tombs, key, kind) < 0:
            raise MemoryError("lease table tombstones")
        e.at = self._now
        e.key = key
        e.kind = kind
        self._fifo.push_back(e)

    cdef void _prune(self) except *:
        """Drop the free events that aged out (freed at f, f + tombstone_s < now)."""
        cdef double horizon = self._now
        while not self._fifo.empty() and self._fifo.front().at + self._tombstone_s < horizon:
            vnl_tomb_forget(&self._tombs, self._fifo.front().key, self._fifo.front().kind)
            self._fifo.pop_front()

    cdef inline int64_t _bucket(self, double deadline) noexcept:
        cdef double k = floor(deadline / self._width)
        if k > MAX_BUCKET:
            return <int64_t>MAX_BUCKET
        if k < -MAX_BUCKET:
            return -<int64_t>MAX_BUCKET
        return <int64_t>k

    cdef inline bint _orphaned(self, uint64_t entry) noexcept:
        """Whether a (deadline, seq << 32 | slot) entry's lease was released or
        granted again since the entry was stored."""
        return (self._slots[entry & LOW32].seq & SEQ_BITS) != <uint32_t>(entry >> 32)

    cdef inline void _push(self, double deadline, uint32_t seq, uint32_t idx) except *:
        self._wheel[self._bucket(deadline)].push_back(WheelEntry(deadline, (<uint64_t>seq << 32) | idx))
        self._entries += 1
        if deadline < self._lower:
            self._lower = deadline

    cdef void _maybe_rebuild_wheel(self, bint force=False) except *:
        cdef size_t i
        if force or (self._stale > MIN_STALE_FOR_REBUILD and self._stale > self._live):
            self._wheel.clear()
            self._backlog.clear()
            self._entries = 0
            self._lower = INFINITY
            for i in range(self._slots.size()):
                if self._slots[i].seq != 0:
                    self._push(self._slots[i].deadline, self._slots[i].seq & SEQ_BITS, <uint32_t>i)
            self._stale = 0

    cdef double _first_lower(self) noexcept:
        """Smallest stored deadline of the first bucket: a lower bound of all."""
        cdef double m = INFINITY
        cdef Bucket* bucket
        cdef size_t j
        if self._wheel.empty():
            return m
        bucket = &deref(self._wheel.begin()).second
        for j in range(bucket.size()):
            if bucket[0][j].first < m:
                m = bucket[0][j].first
        return m

    cdef bint _clean_bucket(self, Wheel.iterator it, double t, vector[WheelEntry]* due,
                            vector[WheelEntry]* refile) except -1:
        """Drop orphans from bucket ``it``, move entries whose lease was
        extended to another bucket into ``refile`` and those due at ``t`` into
        ``due`` (with their real deadline).  Entries stored after ``t`` are
        kept without reading their slot.  With ``due`` NULL nothing is due and
        every entry's slot is read, so the bucket is left holding only live
        entries at their real deadlines.  Returns whether the bucket is empty."""
        cdef Bucket* bucket = &deref(it).second
        cdef size_t j, keep = 0
        if due != NULL and due.capacity() < due.size() + bucket.size():
            due.reserve(2 * (due.size() + bucket.size()))  # a dead D's bucket: no copy per doubling
        cdef WheelEntry e
        cdef uint32_t idx
        cdef double d
        for j in range(bucket.size()):
            e = bucket[0][j]
            if due != NULL and e.first > t:
                bucket[0][keep] = e
                keep += 1
                continue
            if self._orphaned(e.second):
                self._stale -= 1
                self._entries -= 1
                continue
            idx = <uint32_t>(e.second & LOW32)
            d = self._slots[idx].deadline
            if due != NULL and d <= t:
                due.push_back(WheelEntry(d, e.second))
                self._entries -= 1
            elif self._bucket(d) == deref(it).first:
                bucket[0][keep] = WheelEntry(d, e.second)
                keep += 1
            else:
                refile.push_back(WheelEntry(d, e.second))
                self._entries -= 1
        bucket.resize(keep)
        return keep == 0

    cdef void _renumber(self) except *:
        """Give live leases seqs 1..n in their current order (seqs ran out)."""
        cdef vector[uint64_t] order
        cdef size_t i, idx
        for i in range(self._slots.size()):
            if self._slots[i].seq != 0:
                order.push_back((<uint64_t>(self._slots[i].seq & SEQ_BITS) << 32) | i)
        sort(order.begin(), order.end())
        for i in range(order.size()):
            idx = order[i] & LOW32
            self._slots[idx].seq = (self._slots[idx].seq & IN_BATCH) | <uint32_t>(i + 1)
        self._seq = <uint32_t>order.size()
        self._stale = self._live + 1  # force the rebuild: old entries carry old seqs
        self._maybe_rebuild_wheel(True)

    def _debug_set_seq(self, seq):
        """Test hook: jump the grant counter (to reach renumbering quickly)."""
        if not self._live and 0 <= seq <= MAX_SEQ:
            self._seq = seq
        else:
            raise ValueError("only on an empty table, 0 <= seq < 2**31")

    # -- public API -----------------------------------------------------
    def grant(self, req_id, deadline):
        """Start (or overwrite) the lease of ``req_id`` until ``deadline``."""
        self._grant(req_id, deadline)

    cdef long _grant(self, object req_id, object deadline) except -1:
        """``grant``; returns the lease's slot."""
        cdef Py_ssize_t n
        cdef const char* p
        cdef double d
        cdef long idx
        cdef uint32_t h
        cdef uint64_t full
        cdef Slot* slot
        # check_req_id and check_deadline, in C: the id's bytes are needed anyway
        if not isinstance(req_id, str):
            raise TypeError(f"request id must be str, got {type(req_id).__name__}")
        try:
            p = PyUnicode_AsUTF8AndSize(req_id, &n)
        except UnicodeEncodeError as exc:
            raise ValueError(f"request id {req_id!r} is not encodable as UTF-8") from exc
        # hashed first, and its index cell prefetched: the hash's rounds and
        # the cell's miss overlap the checks below
        full = vnl_sip13(p, <size_t>n, self._k0, self._k1)  # _hash, and the id's fingerprint
        h = <uint32_t>(full & self._hash_mask)
        VNL_PREFETCH(&self._index[h & (self._index.size() - 1)])
        d = float(deadline)
        if d != d:
            raise ValueError("lease deadline must not be NaN")
        if self._slots.size() >= 0xFFFFFFFE:
            raise OverflowError("too many leases")
        if self._seq == MAX_SEQ:
            self._renumber()
        self._seq += 1
        idx = self._find(p, n, h)
        if idx >= 0:
            self._stale += 1
        else:
            idx = self._alloc_slot()
            Py_INCREF(req_id)
            self._slots[idx].req_id = <PyObject*>req_id
            self._slots[idx].link = h
            self._slots[idx].seq = 1  # live before it is indexed (rehash skips free slots)
            self._live += 1
            self._index_insert(<uint32_t>idx)
            if self._tag_of(p, n, &self._slots[idx].tag):
                self._slots[idx].flags = TAGGED
                self._tag_link(<uint32_t>idx)
        slot = &self._slots[idx]
        if not slot.flags & AMBIGUOUS and self._tombstoned(full, slot.flags & TAGGED, slot.tag):
            slot.flags |= AMBIGUOUS
        slot.deadline = d
        slot.seq = (slot.seq & IN_BATCH) | self._seq
        self._push(d, self._seq, <uint32_t>idx)
        self._maybe_rebuild_wheel()
        return idx

    cdef (Py_ssize_t, Py_ssize_t) _extend_span(self, const char* p, Py_ssize_t n, double new_deadline,
                                               list not_held) except *:
        """Extend every lease named in the comma-separated span ``p[:n]``;
        with ``not_held`` (the span is valid UTF-8), append to it each id that
        holds no lease or an ambiguous one.

        Ids are taken HB_GROUP at a time: find them with the comma scanner,
        hash them (four per AVX2 register where possible) and prefetch their
        index cells, then prefetch the slots those
        cells name, then the stored ids, and only then compare.  A lookup is
        about three dependent cache misses (cell, slot, id); this way a
        group's misses overlap instead of queueing one behind the other."""
        cdef Py_ssize_t pos = 0, end, extended = 0, seen = 0
        cdef Py_ssize_t starts[HB_GROUP]
        cdef Py_ssize_t lens[HB_GROUP]
        cdef uint64_t full[HB_GROUP]
        cdef uint32_t hashes[HB_GROUP]
        cdef uint32_t cells[HB_GROUP]
        cdef int k, m
        cdef uint32_t c
        cdef size_t i
        cdef Py_ssize_t length
        cdef const char* s
        cdef vnl_scan scan
        cdef bint collect = not_held is not None
        cdef uint64_t hmask = self._hash_mask
        cdef size_t mask = self._index.size() - 1
        cdef const uint32_t* index = self._index.data()
        cdef Slot* slots = self._slots.data()
        vnl_scan_init(&scan, p, n)
        while pos <= n:
            m = 0
            while m < HB_GROUP and pos <= n:
                end = vnl_scan_next(&scan)
                if end > pos:
                    starts[m] = pos
                    lens[m] = end - pos
                    m += 1
                pos = end + 1
            vnl_sip13_many(p, n, starts, lens, m, self._k0, self._k1, full)
            for k in range(m):
                hashes[k] = <uint32_t>(full[k] & hmask)
                VNL_PREFETCH(&index[hashes[k] & mask])
            seen += m
            for k in range(m):
                c = index[hashes[k] & mask]
                cells[k] = c
                if c - 1 < DELETED - 1:  # neither EMPTY nor DELETED
                    VNL_PREFETCH(&slots[c - 1])
            for k in range(m):
                c = cells[k]
                if c - 1 < DELETED - 1 and slots[c - 1].link == hashes[k]:
                    # header and (compact ASCII) text of the stored id
                    VNL_PREFETCH(slots[c - 1].req_id)
                    VNL_PREFETCH(<const char*>slots[c - 1].req_id + 64)
            for k in range(m):
                # _find, starting from the cell already read
                c = cells[k]
                i = hashes[k] & mask
                while c != EMPTY:
                    if c != DELETED and slots[c - 1].link == hashes[k]:
                        s = _stored_utf8(slots[c - 1].req_id, &length)
                        if length == lens[k] and vnl_eq(s, p + starts[k], <size_t>length):
                            if new_deadline > slots[c - 1].deadline:
                                slots[c - 1].deadline = new_deadline
                            extended += 1
                            break
                    i = (i + 1) & mask
                    c = index[i]
                # c: the lease's cell, or EMPTY when the id holds none
                if collect and (c == EMPTY or slots[c - 1].flags & AMBIGUOUS):
                    not_held.append(PyUnicode_DecodeUTF8(p + starts[k], lens[k], NULL))
        return extended, seen

    def extend(self, payload, now):
        """Apply one heartbeat payload; return how many leases it extended."""
        return self.extend_counted(payload, now)[0]

    def extend_counted(self, payload, now):
        """Like ``extend``; returns ``(extended, non-empty ids in payload)``."""
        cdef double t = checked_now(now)
        cdef double new_deadline = self._extended_deadline(t)
        cdef Py_ssize_t n
        cdef const char* p
        cdef const unsigned char[::1] view
        self._observe(t)
        if isinstance(payload, str):
            try:
                p = PyUnicode_AsUTF8AndSize(payload, &n)
            except UnicodeEncodeError:
                # Lone surrogates: their bytes can match no (valid UTF-8) lease.
                payload = payload.encode("utf-8", "surrogatepass")
                p = PyBytes_AS_STRING(payload)
                n = PyBytes_GET_SIZE(payload)
            return self._extend_span(p, n, new_deadline, None)
        if PyBytes_CheckExact(payload):
            n = PyBytes_GET_SIZE(payload)
            return self._extend_span(PyBytes_AS_STRING(payload), n, new_deadline, None)
        view = payload
        if view.shape[0] == 0:
            return (0, 0)
        return self._extend_span(<const char*>&view[0], view.shape[0], new_deadline, None)

    def extend_acked(self, payload, now):
        """Apply one ``LHB:`` payload (comma-separated ids): extend every held
        lease it names, ambiguous ones too.  Returns ``(leases extended, ids
        named, the ids not held)``: the non-empty ids, in payload order, that
        hold no lease here or whose lease is ambiguous.  The last is None when
        the payload is not UTF-8 (the answer then counts none as extended;
        the held ids that could be read are extended all the same)."""
        cdef double t = checked_now(now)
        cdef double new_deadline = self._extended_deadline(t)
        cdef Py_ssize_t n = 0, extended, named
        cdef const char* p = NULL
        cdef bytes data = None
        cdef list not_held = []
        self._observe(t)
        if isinstance(payload, str):
            try:
                p = PyUnicode_AsUTF8AndSize(payload, &n)
            except UnicodeEncodeError:
                data = payload.encode("utf-8", "surrogatepass")  # not UTF-8: matches no lease
                not_held = None
        else:
            data = payload if PyBytes_CheckExact(payload) else bytes(payload)
            if not data.isascii():  # CPython checks a word at a time
                try:
                    PyUnicode_DecodeUTF8(PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data), NULL)
                except UnicodeDecodeError:
                    not_held = None
        if data is not None:
            p = PyBytes_AS_STRING(data)
            n = PyBytes_GET_SIZE(data)
        extended, named = self._extend_span(p, n, new_deadline, not_held)
        return extended, named, not_held

    def extend_tagged(self, payload, now):
        """Apply one ``LHBT:`` payload (comma-separated tags, ``lease_tags.py``):
        extend every lease a tag names, ambiguous ones too.  Returns ``(leases
        extended, tags named, the tags not held)``: those naming no lease, or
        a lease that is ambiguous.  The last is None, and nothing is extended,
        when the payload is not ASCII.  An empty field names nothing."""
        cdef double t = checked_now(now)
        cdef double new_deadline = self._extended_deadline(t)
        cdef bytes data = bytes(payload)
        cdef const unsigned char[::1] view = data
        cdef Py_ssize_t n = view.shape[0], pos = 0, end, named = 0, extended = 0
        cdef const unsigned char* p = &view[0] if n else NULL
        cdef uint32_t c
        cdef list unknown = []
        cdef size_t i
        cdef int k, m
        cdef Py_ssize_t starts[HB_GROUP]
        cdef Py_ssize_t lens[HB_GROUP]
        cdef uint64_t tags[HB_GROUP]
        cdef size_t cells[HB_GROUP]
        cdef uint32_t firsts[HB_GROUP]
        cdef bint valid[HB_GROUP]
        cdef uint32_t flags
        cdef Slot* slot
        cdef uint64_t tag_mask = self._tag_mask
        self._observe(t)
        cdef size_t mask = self._tag_heads.size() - 1
        cdef const uint32_t* heads = self._tag_heads.data()
        cdef const uint64_t* keys = self._tag_keys.data()
        cdef Slot* slots = self._slots.data()
        if not data.isascii():  # CPython checks a word at a time, so this costs little
            while pos <= n:  # count as the twin does: non-empty fields
                end = pos
                while end < n and p[end] != 44:
                    end += 1
                named += end > pos
                pos = end + 1
            return 0, named, None
        # Tags HB_GROUP at a time, as _extend_span does ids: parse them, then
        # prefetch their cells, then the slots those cells head, then extend,
        # so that a group's cache misses overlap.
        while pos <= n:
            m = 0
            while m < HB_GROUP and pos <= n:
                end = pos
                while end < n and p[end] != 44:  # ','
                    end += 1
                if end > pos:
                    starts[m] = pos
                    lens[m] = end - pos
                    valid[m] = end - pos == 11 and _parse_tag(p + pos, &tags[m])
                    if valid[m]:
                        tags[m] &= tag_mask
                        cells[m] = self._tag_home(tags[m])
                        VNL_PREFETCH(&heads[cells[m]])
                        VNL_PREFETCH(&keys[cells[m]])
                    m += 1
                pos = end + 1
            named += m
            for k in range(m):
                firsts[k] = 0
                if valid[k]:
                    i = cells[k]
                    c = heads[i]
                    while c != EMPTY and (c == DELETED or keys[i] != tags[k]):
                        i = (i + 1) & mask
                        c = heads[i]
                    if c != EMPTY:
                        firsts[k] = c
                        VNL_PREFETCH(&slots[c - 1])
            for k in range(m):
                c = firsts[k]
                flags = 0 if c else AMBIGUOUS  # no lease: not held either
                while c:
                    slot = &slots[c - 1]
                    if new_deadline > slot.deadline:
                        slot.deadline = new_deadline
                    extended += 1
                    flags |= slot.flags
                    c = slot.tag_next
                if flags & AMBIGUOUS:
                    unknown.append((<bytes>p[starts[k]:starts[k] + lens[k]]).decode("ascii"))
        return extended, named, unknown

    def holds_tag(self, tag):
        """Does ``tag`` (its text, ``lease_tags.lease_tag``) name a lease held
        here, none of them ambiguous?  Nothing is extended."""
        cdef bytes data = tag.encode("ascii") if isinstance(tag, str) and tag.isascii() else b""
        cdef uint64_t digest
        cdef uint32_t c
        if len(data) != 11 or not _parse_tag(<const unsigned char*>PyBytes_AS_STRING(data), &digest):
            return False
        c = self._tag_heads[self._tag_cell(digest & self._tag_mask)]
        if c == EMPTY or c == DELETED:
            return False
        while c:
            if self._slots[c - 1].flags & AMBIGUOUS:
                return False
            c = self._slots[c - 1].tag_next
        return True

    def release(self, req_id):
        """Drop the lease of ``req_id``; return whether it held one."""
        cdef long idx = self._find_str(req_id)
        if idx < 0:
            return False
        if self._slots[idx].seq & IN_BATCH:
            self._batch_spill.add(req_id)  # it stays in its batch
        self._release_slot(<uint32_t>idx)
        self._maybe_compact()
        return True

    cdef void _release_slot(self, uint32_t idx) except *:
        """Release without compacting (slot numbers stay valid for the caller)."""
        self._unlink(idx)
        self._stale += 1
        self._maybe_rebuild_wheel()

    cdef void _maybe_compact(self) except *:
        """After a burst has drained, give back what only the peak needed."""
        if self._slots.size() > MIN_SLOTS_TO_COMPACT and <size_t>self._live * 4 < self._slots.size():
            self._compact()

    cdef void _compact(self) except *:
        """Move live slots to the front of a right-sized vector, then rebuild
        the index and heap for them (slot numbers change, order does not:
        ties are broken by grant seq, never by slot)."""
        cdef vector[Slot] live
        cdef vector[uint32_t] moved  # old slot -> new slot + 1
        cdef size_t i
        live.reserve(<size_t>self._live)
        moved.assign(self._slots.size(), 0)
        for i in range(self._slots.size()):
            if self._slots[i].seq != 0:
                live.push_back(self._slots[i])
                moved[i] = <uint32_t>live.size()
        self._slots.swap(live)
        self._free = 0
        self._rehash()
        # Tag chains name slots: renumber them, the heads while the tag table
        # is rebuilt at the live size.
        self._tag_resize(moved.data())
        for i in range(self._slots.size()):
            if self._slots[i].tag_next:
                self._slots[i].tag_next = moved[self._slots[i].tag_next - 1]
        self._maybe_rebuild_wheel(True)

    def pop_expired(self, now, limit=None):
        """Remove and return the leases with deadline <= now, earliest first:
        all of them, or the ``limit`` earliest (the rest stay due)."""
        cdef list expired = []
        cdef list marked = [] if self._in_batch else None
        self._pop_due(checked_now(now), checked_limit(limit), expired, marked, True)
        if marked:
            self._batch_spill.update(marked)  # they stay in their batch
        return expired

    cdef void _pop_due(self, double t, Py_ssize_t cap, list expired, list others, bint marked) except *:
        """``pop_expired`` into ``expired``; with ``others``, also the ids
        among them whose slot was (``marked``) or was not marked IN_BATCH."""
        cdef vector[WheelEntry] due, refile
        cdef Wheel.iterator it
        cdef int64_t last
        cdef size_t j, cell
        cdef uint32_t idx
        self._observe(t)
        if cap == 0 or (t < self._lower and (self._backlog.empty() or self._backlog[0].first > t)):
            return
        if t >= self._lower:
            last = self._bucket(t)
            it = self._wheel.begin()
            while it != self._wheel.end() and deref(it).first <= last:
                if self._clean_bucket(it, t, &due, &refile):
                    it = self._wheel.erase(it)
                else:
                    inc(it)
            for j in range(refile.size()):
                idx = <uint32_t>(refile[j].second & LOW32)
                self._push(refile[j].first, <uint32_t>(refile[j].second >> 32), idx)
            self._lower = self._first_lower()
        if self._backlog.empty() and (cap < 0 or due.size() <= <size_t>cap):
            # (deadline, seq << 32 | slot): ties go to the earlier grant, as in the twin
            sort(due.begin(), due.end())
        else:
            self._from_backlog(due, t, cap)
        for j in range(due.size()):
            # the slot 16 entries ahead, and the id and index cell of the one 8
            # ahead (its slot is cached by now): their misses overlap this one
            if j + 16 < due.size():
                VNL_PREFETCH(&self._slots[due[j + 16].second & LOW32])
            if j + 8 < due.size():
                idx = <uint32_t>(due[j + 8].second & LOW32)
                VNL_PREFETCH(self._slots[idx].req_id)
                VNL_PREFETCH(&self._index[self._slots[idx].link & (self._index.size() - 1)])
                if self._slots[idx].flags & TAGGED:
                    cell = self._tag_home(self._slots[idx].tag)
                    VNL_PREFETCH(&self._tag_heads[cell])
                    VNL_PREFETCH(&self._tag_keys[cell])
            idx = <uint32_t>(due[j].second & LOW32)
            expired.append(<object>self._slots[idx].req_id)
            if others is not None and ((self._slots[idx].seq & IN_BATCH) != 0) == marked:
                others.append(<object>self._slots[idx].req_id)
            self._unlink(idx)
        if due.size():
            self._maybe_compact()

    cdef void _from_backlog(self, vector[WheelEntry]& due, double t, Py_ssize_t cap) except *:
        """More is due than a limited sweep takes (a dead D's leases): heap
        the due entries into the backlog (O(n) once, not a sort per sweep) and
        leave in ``due`` the ``cap`` earliest still due, in order."""
        cdef greater[WheelEntry] later
        cdef size_t j
        if self._backlog.empty():
            self._backlog.swap(due)
            make_heap(self._backlog.begin(), self._backlog.end(), later)
        else:
            for j in range(due.size()):
                self._backlog.push_back(due[j])
                push_heap(self._backlog.begin(), self._backlog.end(), later)
        due.clear()
        while (cap < 0 or due.size() < <size_t>cap) and self._settle_backlog() <= t:
            due.push_back(self._backlog[0])
            pop_heap(self._backlog.begin(), self._backlog.end(), later)
            self._backlog.pop_back()

    cdef double _settle_backlog(self) except? -1.0:
        """Earliest deadline in the backlog, after dropping orphans and
        re-placing extended entries from its top (INFINITY if empty)."""
        cdef greater[WheelEntry] later
        cdef WheelEntry e
        cdef double d
        cdef bint orphaned
        while not self._backlog.empty():
            e = self._backlog[0]
            orphaned = self._orphaned(e.second)
            d = self._slots[e.second & LOW32].deadline
            if not orphaned and d == e.first:
                return d
            pop_heap(self._backlog.begin(), self._backlog.end(), later)
            self._backlog.pop_back()
            if orphaned:
                self._stale -= 1  # released or granted again since
            else:  # extended since: back at its place
                self._backlog.push_back(WheelEntry(d, e.second))
                push_heap(self._backlog.begin(), self._backlog.end(), later)
        return INFINITY

    cdef double _settle_first(self) except? -1.0:
        """Clean buckets from the front until the first holds a live entry at
        its real deadline; return the earliest deadline (live leases exist)."""
        cdef vector[WheelEntry] refile
        cdef Wheel.iterator it
        cdef size_t j
        while not self._wheel.empty():
            it = self._wheel.begin()
            refile.clear()
            # nothing is due (NULL): every entry is checked against its slot
            empty = self._clean_bucket(it, -INFINITY, NULL, &refile)
            if empty:
                self._wheel.erase(it)
            for j in range(refile.size()):
                self._push(refile[j].first, <uint32_t>(refile[j].second >> 32),
                           <uint32_t>(refile[j].second & LOW32))
            if not empty:
                self._lower = self._first_lower()
                return self._lower
        self._lower = INFINITY
        return INFINITY  # every live lease is in the backlog

    def deadline(self, req_id):
        cdef long idx = self._find_str(req_id)
        return None if idx < 0 else self._slots[idx].deadline

    def set_tag_key(self, key):
        """The key tags are indexed with (P's, for life).  The first key also
        indexes the leases already held; the same key again changes nothing;
        another key while leases are held raises ValueError."""
        cdef bytes k = check_tag_key(key)
        cdef size_t i
        cdef Py_ssize_t n
        cdef const char* p
        if k == self._tag_key:
            return
        if self._tag_key is not None and self._live:
            raise ValueError("the tag key cannot change while leases are held")
        self._tag_key = k
        self._tag_keys.assign(MIN_INDEX_SIZE, 0)
        self._tag_heads.assign(MIN_INDEX_SIZE, EMPTY)
        self._tag_used = 0
        self._tag_live = 0
        for i in range(self._slots.size()):
            if self._slots[i].seq == 0:
                continue
            self._slots[i].flags &= ~TAGGED
            self._slots[i].tag_next = 0
            p = _stored_utf8(self._slots[i].req_id, &n)
            if self._tag_of(p, n, &self._slots[i].tag):
                self._slots[i].flags |= TAGGED
                self._tag_link(<uint32_t>i)

    def is_ambiguous(self, req_id):
        """Whether ``req_id`` holds a lease that answers never call held."""
        cdef long idx = self._find_str(req_id)
        return idx >= 0 and (self._slots[idx].flags & AMBIGUOUS) != 0

    def tombstones(self):
        """Keys (ids and tag digests) with a live tombstone now."""
        self._prune()
        return self._tombs.live

    @property
    def tombstone_overflows(self):
        """Live tombstones dropped at ``max_tombstones`` (each made the grants
        until it would have aged out ambiguous)."""
        return self._overflows

    def next_deadline(self):
        """Earliest deadline of any live lease (None when empty)."""
        if self._live == 0:
            return None
        return min(self._settle_backlog(), self._settle_first())

    def ids(self):
        """Ids of all live leases (no particular order)."""
        cdef size_t i
        return [<object>self._slots[i].req_id for i in range(self._slots.size()) if self._slots[i].seq != 0]

    def scheduled_entries(self):
        """Entries in the expiry schedule (the wheel and the backlog), live and stale
        (for memory-bound tests)."""
        return self._entries + self._backlog.size()

    def nbytes(self):
        """Bytes this table allocated itself (ids excluded), from real capacities."""
        cdef size_t wheel = 0
        cdef Wheel.iterator it = self._wheel.begin()
        while it != self._wheel.end():
            # entries, plus a map node: key, vector header, three pointers and a colour
            wheel += deref(it).second.capacity() * sizeof(WheelEntry) + 64
            inc(it)
        return (type(self).__basicsize__ + self._slots.capacity() * sizeof(Slot)
                + wheel + self._backlog.capacity() * sizeof(WheelEntry)
                + self._index.capacity() * sizeof(uint32_t)
                + self._tag_keys.capacity() * sizeof(uint64_t) + self._tag_heads.capacity() * sizeof(uint32_t)
                + (self._tombs.size + self._tombs.old_size + self._tombs.next_size) * 16
                + self._fifo.size() * sizeof(TombEvent))

    def __len__(self):
        return self._live

    def __contains__(self, req_id):
        return self._find_str(req_id) >= 0

    def __repr__(self):
        return f"<LeaseTable leases={self._live} extension={self._extension}>"
