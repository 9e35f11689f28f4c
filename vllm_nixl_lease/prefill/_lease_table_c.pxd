# distutils: language = c++
"""The Cython ``LeaseTable``'s layout, shared with the Cython router
(``_notification_router_c.pyx``), which keeps batch membership in the table's
slots and looks ids up in its index.  The methods the router calls on every
message are defined here, inline, so that they compile into the router too."""

from cpython.ref cimport PyObject
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libcpp.deque cimport deque
from libcpp.map cimport map as cmap
from libcpp.pair cimport pair
from libcpp.vector cimport vector


cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object o, Py_ssize_t* size) except NULL
    const char* _utf8_of_ptr "PyUnicode_AsUTF8AndSize"(PyObject* o, Py_ssize_t* size)
    bint PyUnicode_IS_COMPACT_ASCII(PyObject* o)
    void* PyUnicode_DATA(PyObject* o)
    Py_ssize_t PyUnicode_GET_LENGTH(PyObject* o)

cdef extern from "siphash.h":
    uint64_t vnl_sip13(const char* p, size_t n, uint64_t k0, uint64_t k1) nogil

cdef extern from "lease_index.h":
    # C constants: a bare 0xFFFFFFFF in an expression is a Python int to
    # Cython (it does not fit a C int), which would box every operand it met.
    const uint32_t EMPTY "VNL_EMPTY"
    const uint32_t DELETED "VNL_DELETED"
    const uint32_t IN_BATCH "VNL_IN_BATCH"
    const uint32_t SEQ_BITS "VNL_SEQ_BITS"
    const uint32_t TAGGED "VNL_TAGGED"
    const uint32_t AMBIGUOUS "VNL_AMBIGUOUS"
    bint vnl_eq(const char* a, const char* b, size_t n) nogil

cdef extern from "tombstones.h":
    const uint32_t TOMB_ID "VNL_TOMB_ID"
    const uint32_t TOMB_TAG "VNL_TOMB_TAG"
    ctypedef struct vnl_tombs:
        size_t size
        size_t live
        size_t old_size
        size_t next_size
        uint64_t seed
    int vnl_tomb_has(const vnl_tombs* t, uint64_t key, uint32_t kind) nogil
    int vnl_tomb_add(vnl_tombs* t, uint64_t key, uint32_t kind) nogil
    int vnl_tomb_forget(vnl_tombs* t, uint64_t key, uint32_t kind) nogil
    void vnl_tomb_clear(vnl_tombs* t) nogil


ctypedef pair[double, uint64_t] WheelEntry   # (deadline, seq << 32 | slot)
ctypedef vector[WheelEntry] Bucket
ctypedef cmap[int64_t, Bucket] Wheel


cdef struct Slot:
    double deadline
    PyObject* req_id    # owned reference to the id (a str)
    uint32_t seq        # grant order | IN_BATCH; 0: free slot
    uint32_t link       # live: low 32 bits of the id's hash; free: next free slot + 1
    uint64_t tag        # lease_tags.tag_digest of the id, cut to tag_bits (when TAGGED)
    uint32_t tag_next   # next slot + 1 with the same tag, 0: none
    uint32_t flags      # TAGGED: in _tag_heads under ``tag``; AMBIGUOUS: never answered held


cdef struct TombEvent:
    double at           # the table's latest ``now`` when the key was freed
    uint64_t key        # an id's 64-bit SipHash fingerprint, or a tag digest
    uint32_t kind       # TOMB_ID or TOMB_TAG


cdef inline const char* _stored_utf8(PyObject* o, Py_ssize_t* n) noexcept:
    """UTF-8 bytes of a stored id.  ASCII ids (the norm) are read in place with
    no call and no refcount traffic; others use CPython's cached UTF-8 copy
    (cannot fail: only encodable ids are ever stored)."""
    if PyUnicode_IS_COMPACT_ASCII(o):
        n[0] = PyUnicode_GET_LENGTH(o)
        return <const char*>PyUnicode_DATA(o)
    return _utf8_of_ptr(o, n)


# ``now`` and ``limit`` as the table and router take them: the engine passes a
# finite float and an int every step, which skip the Python-level checks of
# ``_checks`` (every other value goes through them, errors included).
cdef double checked_now(object now) except? -1.0
cdef Py_ssize_t checked_limit(object limit) except? -2


cdef class LeaseTable:
    cdef double _extension
    cdef vector[Slot] _slots
    cdef Wheel _wheel
    cdef vector[WheelEntry] _backlog  # due leases a limited sweep left: a min-heap
    cdef size_t _entries             # in the wheel, live and stale
    cdef double _width               # of a bucket, seconds
    cdef double _lower               # no stored deadline is below this
    cdef uint32_t _free              # head of free slot list (+1), 0 = none
    cdef Py_ssize_t _live
    cdef Py_ssize_t _in_batch        # live slots marked IN_BATCH
    cdef set _batch_spill            # the router's in_batch set, once a router owns the table
    cdef Py_ssize_t _stale
    cdef uint32_t _seq
    cdef vector[uint32_t] _index
    cdef size_t _index_used          # live + deleted cells
    cdef uint64_t _hash_mask
    cdef uint64_t _k0, _k1           # SipHash key: random per table
    cdef vector[uint64_t] _tag_keys    # tag digest per cell
    cdef vector[uint32_t] _tag_heads   # first slot + 1 per cell, or EMPTY / DELETED
    cdef size_t _tag_used              # live + deleted cells
    cdef Py_ssize_t _tag_live          # live cells
    cdef bint _index_tags              # False: grants are not indexed by tag
    cdef object _tag_key               # P's tag key (bytes), None until set_tag_key
    cdef uint64_t _tag_mask            # low bits of every tag digest kept (tag_bits)
    cdef double _now                   # the largest ``now`` given so far
    cdef double _tombstone_s
    cdef Py_ssize_t _max_tombstones
    cdef vnl_tombs _tombs              # (kind, key) -> free events of it in _fifo
    cdef deque[TombEvent] _fifo        # free events, oldest first
    cdef Py_ssize_t _overflows         # live tombstones dropped at the cap
    cdef double _overflow_until        # grants up to then are ambiguous (once overflowed)

    # -- used by the router (defined here, so inlined there too) ----------
    cdef inline uint32_t _hash(self, const char* p, Py_ssize_t n) noexcept nogil:
        """The table's keyed hash of an id's UTF-8 bytes (every stored or probed
        hash is this one; ``_extend_span`` computes the same four at a time)."""
        return <uint32_t>(vnl_sip13(p, <size_t>n, self._k0, self._k1) & self._hash_mask)

    cdef inline long _find(self, const char* p, Py_ssize_t n, uint32_t h) noexcept:
        """Slot of the id with these UTF-8 bytes and hash, or -1."""
        cdef size_t mask = self._index.size() - 1
        cdef size_t i = h & mask
        cdef uint32_t c
        cdef Py_ssize_t length
        cdef const char* s
        while True:
            c = self._index[i]
            if c == EMPTY:
                return -1
            if c != DELETED and self._slots[c - 1].link == h:
                s = _stored_utf8(self._slots[c - 1].req_id, &length)
                if length == n and vnl_eq(s, p, <size_t>n):
                    return c - 1
            i = (i + 1) & mask

    cdef inline long _find_str(self, object req_id) except -2:
        cdef Py_ssize_t n
        cdef const char* p
        if not isinstance(req_id, str):
            return -1
        try:
            p = PyUnicode_AsUTF8AndSize(req_id, &n)
        except UnicodeEncodeError:
            return -1  # such an id can never have been granted
        return self._find(p, n, self._hash(p, n))

    cdef inline double _extended_deadline(self, double now) noexcept nogil:
        """The deadline a heartbeat applied at ``now`` gives a lease it names
        (a lease already later keeps its own)."""
        return now + self._extension

    cdef inline void _observe(self, double now) noexcept nogil:
        """Keep ``now`` (already checked) if it is the largest seen: frees are
        dated with it."""
        if now > self._now:
            self._now = now

    cdef inline bint _is_in_batch(self, long idx) noexcept:
        return (self._slots[idx].seq & IN_BATCH) != 0

    cdef inline void _set_in_batch(self, long idx, bint on) noexcept:
        if on and not self._slots[idx].seq & IN_BATCH:
            self._slots[idx].seq |= IN_BATCH
            self._in_batch += 1
        elif not on and self._slots[idx].seq & IN_BATCH:
            self._slots[idx].seq &= SEQ_BITS
            self._in_batch -= 1

    cdef long _grant(self, object req_id, object deadline) except -1
    cdef (Py_ssize_t, Py_ssize_t) _extend_span(self, const char* p, Py_ssize_t n, double new_deadline,
                                               list not_held) except *
    cdef void _release_slot(self, uint32_t idx) except *
    cdef void _maybe_compact(self) except *
    cdef void _pop_due(self, double t, Py_ssize_t cap, list expired, list others, bint marked) except *

    # -- the table's own (defined in _lease_table_c.pyx) -------------------
    cdef uint32_t _alloc_slot(self)
    cdef void _index_insert(self, uint32_t idx) except *
    cdef void _rehash(self) except *
    cdef void _unlink(self, uint32_t idx) except *
    cdef inline uint64_t _tag_mix(self, uint64_t tag) noexcept
    cdef inline size_t _tag_home(self, uint64_t tag) noexcept
    cdef inline size_t _tag_cell(self, uint64_t tag) noexcept
    cdef void _tag_link(self, uint32_t idx) except *
    cdef void _tag_unlink(self, uint32_t idx) except *
    cdef void _tag_resize(self, const uint32_t* moved) except *
    cdef int _tag_of(self, const char* p, Py_ssize_t n, uint64_t* out) except -1
    cdef void _freed(self, uint32_t idx) except *
    cdef bint _tombstoned(self, uint64_t fingerprint, bint tagged, uint64_t tag) except -1
    cdef void _bury(self, uint64_t key, uint32_t kind) except *
    cdef void _prune(self) except *
    cdef inline int64_t _bucket(self, double deadline) noexcept
    cdef inline bint _orphaned(self, uint64_t entry) noexcept
    cdef inline void _push(self, double deadline, uint32_t seq, uint32_t idx) except *
    cdef void _maybe_rebuild_wheel(self, bint force=*) except *
    cdef double _first_lower(self) noexcept
    cdef bint _clean_bucket(self, Wheel.iterator it, double t, vector[WheelEntry]* due,
                            vector[WheelEntry]* refile) except -1
    cdef void _renumber(self) except *
    cdef void _compact(self) except *
    cdef void _from_backlog(self, vector[WheelEntry]& due, double t, Py_ssize_t cap) except *
    cdef double _settle_backlog(self) except? -1.0
    cdef double _settle_first(self) except? -1.0
