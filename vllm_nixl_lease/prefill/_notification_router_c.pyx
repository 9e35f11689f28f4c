# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# distutils: language = c++
"""Cython notification router.

Behaves exactly like ``vllm_nixl_lease/prefill/_notification_router_py.py``
(read that first: it is the reference, ``HB:,`` escape included).  It takes
the Cython ``LeaseTable`` (``_lease_table_c.pxd``) and keeps batch membership
in the table's slots.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE, PyBytes_Check
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport uint32_t
from libc.string cimport memcmp

from ._lease_table_c cimport LeaseTable, checked_limit, checked_now

from .._checks import MESSAGES_TYPES, check_passthrough_prefixes
from .route_result import (
    MALFORMED_SAMPLE_SIZE, UNKNOWN_SAMPLE_SIZE, Expiry, RouteResult, malformed_sample, unknown_sample_id,
)
from .._wire import ESCAPE_PREFIX, HEARTBEAT_PREFIX, PUSH_REG_PREFIX
from .._wire import MAX_EXPECTED_CONSUMERS as _MAX_CONSUMERS

# The heartbeat prefix, matched in place on each message (the wire format lives in _wire.py).
cdef bytes _HB = HEARTBEAT_PREFIX
cdef Py_ssize_t _HB_LEN = len(_HB)
cdef bytes _ESC = ESCAPE_PREFIX  # starts with _HB
cdef Py_ssize_t _ESC_LEN = len(_ESC)
cdef long MAX_EXPECTED_CONSUMERS = _MAX_CONSUMERS


cdef class NotificationRouter:
    """P-side bookkeeping of requests being sent, updated from whole
    notification batches (Cython twin of ``_notification_router_py.NotificationRouter``)."""

    cdef readonly LeaseTable table
    cdef set _in_batch
    cdef dict _counts
    cdef dict _expected
    cdef tuple _passthrough

    def __init__(self, LeaseTable table not None, passthrough_prefixes=(PUSH_REG_PREFIX,)):
        self.table = table
        self._in_batch = set()
        if table._batch_spill is not None:
            raise ValueError("this LeaseTable already belongs to a NotificationRouter")
        table._batch_spill = self._in_batch
        self._counts = {}
        self._expected = {}
        self._passthrough = check_passthrough_prefixes(passthrough_prefixes)

    # Batch membership: an id with a lease is marked in its slot (IN_BATCH);
    # ``_in_batch`` holds the others.  A sweep or a completion then needs no
    # set operation for a leased request, which is nearly every one.  An id
    # marked in its slot is never also in the set.
    def add_in_batch(self, req_id):
        cdef long slot = self.table._find_str(req_id)
        if slot >= 0:
            self.table._set_in_batch(slot, True)
            if self._in_batch:
                self._in_batch.discard(req_id)
        else:
            self._in_batch.add(req_id)

    def discard_in_batch(self, req_id):
        cdef long slot = self.table._find_str(req_id)
        if slot >= 0:
            self.table._set_in_batch(slot, False)
        self._in_batch.discard(req_id)
        if self._counts and slot < 0:
            self._forget_reads(req_id)

    def release(self, req_id):
        """Drop the lease of ``req_id`` (and its read count, unless it is
        still in a batch); return whether it held a lease."""
        held = self.table.release(req_id)  # a marked id goes back to _in_batch (the spill)
        if self._counts and req_id not in self._in_batch:
            self._forget_reads(req_id)
        return held

    cdef void _forget_reads(self, object req_id) except *:
        self._counts.pop(req_id, None)
        self._expected.pop(req_id, None)

    def is_in_batch(self, req_id):
        cdef long slot = self.table._find_str(req_id)
        return (slot >= 0 and self.table._is_in_batch(slot)) or req_id in self._in_batch

    def grant(self, req_id, deadline):
        """Lease ``req_id`` until ``deadline`` if it is in a batch."""
        cdef LeaseTable table = self.table
        cdef long slot
        if req_id in self._in_batch:
            slot = table._grant(req_id, deadline)
            self._in_batch.discard(req_id)
            table._set_in_batch(slot, True)
            return True
        slot = table._find_str(req_id)
        if slot < 0 or not table._is_in_batch(slot):
            return False
        table._grant(req_id, deadline)
        return True

    def received(self, req_id):
        """Read completions received so far for a request still waiting (see the twin)."""
        return self._counts.get(req_id, 0)

    def in_batch_count(self):
        return len(self._in_batch) + self.table._in_batch

    cdef bint _is_passthrough(self, const char* p, Py_ssize_t n):
        cdef bytes prefix
        for prefix in self._passthrough:
            if n >= len(prefix) and memcmp(p, PyBytes_AS_STRING(prefix), len(prefix)) == 0:
                return True
        return False

    cdef void _malformed(self, object result, object msg) except *:
        result.malformed += 1
        if len(result.malformed_sample) < MALFORMED_SAMPLE_SIZE:
            result.malformed_sample.append(malformed_sample(msg))

    def route(self, notifs, now):
        """Route one step's notifications (see the twin for the contract)."""
        cdef LeaseTable table = self.table
        cdef double t = checked_now(now)
        cdef double new_deadline = table._extended_deadline(t)
        try:
            items = notifs.items()
        except AttributeError:
            raise TypeError(f"notifications must be a mapping, got {type(notifs).__name__}") from None
        table._observe(t)  # completions date their tombstones with it
        cdef object result = RouteResult()
        cdef Py_ssize_t n, colon, i, hb_msgs = 0, hb_ids = 0, hb_ext = 0, unknown_n = 0
        cdef const char* p
        cdef long expected
        cdef object req_id, prev
        cdef list completed = result.completed
        cdef list unknown = result.unknown_sample
        cdef Py_ssize_t ext, seen
        cdef long count, slot
        for agent, messages in items:
            if not isinstance(messages, MESSAGES_TYPES):
                self._malformed(result, messages)
                continue
            for msg in messages:
                if not PyBytes_Check(msg):
                    self._malformed(result, msg)
                    continue
                p = PyBytes_AS_STRING(msg)
                n = PyBytes_GET_SIZE(msg)
                if n >= _HB_LEN and memcmp(p, <const char*>_HB, _HB_LEN) == 0:
                    if n >= _ESC_LEN and memcmp(p, <const char*>_ESC, _ESC_LEN) == 0:  # one of ours
                        result.passthrough.setdefault(agent, []).append(msg)
                        continue
                    ext, seen = table._extend_span(p + _HB_LEN, n - _HB_LEN, new_deadline, None)
                    hb_msgs += 1
                    hb_ids += seen
                    hb_ext += ext
                    continue
                if self._is_passthrough(p, n):
                    result.passthrough.setdefault(agent, []).append(msg)
                    continue
                # "<req_id>:<expected_consumers>", split on the last colon
                colon = n - 1
                while colon >= 0 and p[colon] != c':':
                    colon -= 1
                expected = 0
                if 0 < colon < n - 1 and n - 1 - colon <= 10:
                    for i in range(colon + 1, n):
                        if p[i] < c'0' or p[i] > c'9':
                            expected = 0
                            break
                        expected = expected * 10 + (p[i] - c'0')
                    if expected > MAX_EXPECTED_CONSUMERS:
                        expected = 0
                req_id = None
                slot = -1
                if expected > 0:
                    # A leased id is found from the bytes and its stored str
                    # reused: no decode, no new str, a cached hash for the sets.
                    slot = table._find(p, colon, table._hash(p, colon))
                    if slot >= 0:
                        req_id = <object>table._slots[slot].req_id
                    else:
                        try:
                            req_id = PyUnicode_DecodeUTF8(p, colon, NULL)
                        except UnicodeDecodeError:
                            req_id = None
                if req_id is None:
                    self._malformed(result, msg)
                    continue
                if slot < 0 and req_id not in self._in_batch:
                    unknown_n += 1
                    if len(unknown) < UNKNOWN_SAMPLE_SIZE:
                        unknown.append(unknown_sample_id(req_id))
                    continue
                # _counts and _expected hold an entry for exactly the same ids
                prev = self._counts.get(req_id) if self._counts else None
                if prev is None and expected == 1:  # the common case: one reader
                    if slot < 0 or not table._is_in_batch(slot):
                        self._in_batch.discard(req_id)
                    if slot >= 0:
                        table._release_slot(<uint32_t>slot)
                    completed.append(req_id)
                    continue
                self._expected[req_id] = expected
                count = 1 if prev is None else <long>prev + 1
                if count == expected:
                    if prev is not None:
                        del self._counts[req_id]
                    del self._expected[req_id]
                    if slot < 0 or not table._is_in_batch(slot):
                        self._in_batch.discard(req_id)
                    if slot >= 0:
                        table._release_slot(<uint32_t>slot)
                    completed.append(req_id)
                else:
                    self._counts[req_id] = count
        if completed:
            table._maybe_compact()
        result.heartbeat_messages = hb_msgs
        result.heartbeat_ids = hb_ids
        result.extended = hb_ext
        result.unknown = unknown_n
        return result

    def expire(self, now, limit=None):
        """Remove the leases due at ``now`` (all, or the ``limit`` earliest);
        return them as an ``Expiry``: ids earliest deadline first, and the
        reads seen of those that had been read by some consumer."""
        cdef double t = checked_now(now)
        cdef Py_ssize_t cap = checked_limit(limit)
        cdef list ids = []
        cdef list not_in_batch = [] if self._in_batch else None
        cdef dict reads = {}
        self.table._pop_due(t, cap, ids, not_in_batch, False)
        if not_in_batch:
            for req_id in not_in_batch:
                self._in_batch.discard(req_id)
        if self._expected:
            for req_id in ids:
                if self._expected.pop(req_id, None) is not None:
                    count = self._counts.pop(req_id, 0)
                    if count:
                        reads[req_id] = count
        return tuple.__new__(Expiry, (ids, reads))  # Expiry(ids, reads) without its Python __new__
