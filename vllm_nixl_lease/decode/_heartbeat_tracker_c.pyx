# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: language = c++
"""Cython D-side heartbeat tracker and encoder.

Same algorithm and results as ``vllm_nixl_lease/decode/_heartbeat_tracker_py.py`` (the
reference; read its docstring for the chunking scheme).  Messages are
written with one allocation and memcpy per id instead of a join over a list.
"""

from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.string cimport memchr, memcpy

import heapq
import math

from .._checks import (
    DEFAULT_MAX_MESSAGE_BYTES,
    check_interval,
    check_max_message_bytes,
    check_pace_phase,
    check_round_bytes,
    check_remote_id,
)
from .._wire import HEARTBEAT_PREFIX

cdef bytes PREFIX = HEARTBEAT_PREFIX
cdef Py_ssize_t PREFIX_LEN = len(PREFIX)


cdef bytes _encode(object ids, Py_ssize_t size):
    """``HEARTBEAT_PREFIX + b",".join(ids)`` where ``size`` is that length."""
    cdef bytes out = PyBytes_FromStringAndSize(NULL, size)
    cdef char* w = PyBytes_AS_STRING(out)
    cdef Py_ssize_t pos = PREFIX_LEN, n
    cdef bint first = True
    cdef bytes raw
    memcpy(w, <const char*>PREFIX, PREFIX_LEN)
    for raw in ids:
        if not first:
            w[pos] = c','
            pos += 1
        first = False
        n = PyBytes_GET_SIZE(raw)
        memcpy(w + pos, PyBytes_AS_STRING(raw), n)
        pos += n
    assert pos == size
    return out


cdef inline bytes _checked_id(object remote_req_id, Py_ssize_t limit):
    """``check_remote_id``, with the common case (a valid str) checked here;
    anything else goes to ``check_remote_id``, which raises its errors."""
    cdef bytes raw
    cdef Py_ssize_t n
    if type(remote_req_id) is str:
        raw = (<str>remote_req_id).encode("utf-8")
        n = PyBytes_GET_SIZE(raw)
        if n > 0 and PREFIX_LEN + n <= limit and memchr(PyBytes_AS_STRING(raw), c',', n) == NULL:
            return raw
    return check_remote_id(remote_req_id, limit)


def encode_heartbeats(ids, max_bytes=DEFAULT_MAX_MESSAGE_BYTES):
    """Pack ids, in order, into as few ``HB:a,b,...`` messages of at most
    ``max_bytes`` as greedy packing gives (see the twin)."""
    cdef Py_ssize_t limit = check_max_message_bytes(max_bytes)
    cdef list messages = []
    cdef list current = []
    cdef Py_ssize_t size = PREFIX_LEN, need
    cdef bytes raw
    for req_id in ids:
        raw = _checked_id(req_id, limit)
        need = PyBytes_GET_SIZE(raw) + (1 if current else 0)
        if size + need > limit:
            messages.append(_encode(current, size))
            current = []
            size = PREFIX_LEN
            need = PyBytes_GET_SIZE(raw)
        current.append(raw)
        size += need
    if current:
        messages.append(_encode(current, size))
    return messages


cdef double NOW = -math.inf  # due time of a chunk that must go out at the next paced poll


cdef class _Chunk:  # attributes: _heartbeat_tracker_c.pxd
    def __cinit__(self, str engine_id, Py_ssize_t key):
        self.ids = {}
        self.size = PREFIX_LEN
        self.message = None
        self.engine_id = engine_id
        self.due = NOW
        self.alive = True
        self.key = key
        self.version = 0


cdef class _Engine:  # attributes: _heartbeat_tracker_c.pxd
    def __cinit__(self, str engine_id):
        self.engine_id = engine_id
        self.chunks = []
        self.where = {}
        self.refs = {}
        self.size = 0


cdef class HeartbeatTracker:
    """Which P-side request ids D must keep alive, grouped per P engine
    (attributes: ``_heartbeat_tracker_c.pxd``)."""

    def __init__(self, interval, max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES, phase=0.0, round_bytes=0):
        self._interval = check_interval(interval)
        self._round_bytes = check_round_bytes(round_bytes)
        self._payload = 0
        self._max = check_max_message_bytes(max_message_bytes)
        self._phase = check_pace_phase(phase)
        self._engines = {}
        self._local = {}
        self._heap = []
        self._pushes = 0
        self._chunks = 0
        self._paced_at = None
        self._credit = self._phase
        self.next_poll_at = NOW
        self._keys = 0
        self._repacks = 0

    cpdef track(self, local_req_id, engine_id, remote_req_id):
        if not local_req_id:
            raise ValueError("empty local request id")
        if not engine_id:
            raise ValueError("empty engine id")
        cdef bytes raw = _checked_id(remote_req_id, self._max)
        cdef _Engine engine
        old = self._local.get(local_req_id)
        if old is not None:
            if old == (engine_id, raw):
                (<_Chunk>(<_Engine>self._engines[engine_id]).where[raw]).touch()  # a new joiner
                return
            self.untrack(local_req_id)
        self._local[local_req_id] = (engine_id, raw)
        engine = self._engines.get(engine_id)
        if engine is None:
            engine = _Engine(engine_id)
            self._engines[engine_id] = engine
        refs = engine.refs.get(raw)
        if refs is not None:
            engine.refs[raw] = <Py_ssize_t>refs + 1
            (<_Chunk>engine.where[raw]).touch()  # already in a message of this engine; a new joiner
            return
        engine.refs[raw] = 1
        cdef bint small = self._small_round()
        self._append(engine, raw)
        engine.size += PyBytes_GET_SIZE(raw)
        self._payload += PyBytes_GET_SIZE(raw) + 1
        if small and not self._small_round():
            self.next_poll_at = NOW  # the round outgrew the budget: paced from the next poll

    cdef void _append(self, _Engine engine, bytes raw, double new_due=NOW) except *:
        cdef _Chunk chunk = engine.chunks[len(engine.chunks) - 1] if engine.chunks else None
        cdef Py_ssize_t need = PyBytes_GET_SIZE(raw) + (1 if chunk is not None and chunk.ids else 0)
        if chunk is None or chunk.size + need > self._max:
            self._keys += 1
            chunk = _Chunk(engine.engine_id, self._keys)
            engine.chunks.append(chunk)
            self._chunks += 1
            self._schedule(chunk, new_due)
            need = PyBytes_GET_SIZE(raw)
        chunk.size += need
        chunk.ids[raw] = None
        chunk.touch()
        engine.where[raw] = chunk

    cpdef untrack(self, local_req_id):
        entry = self._local.pop(local_req_id, None)
        if entry is None:
            return False
        engine_id, raw = entry
        cdef _Engine engine = self._engines[engine_id]
        cdef Py_ssize_t refs = engine.refs[raw] - 1
        cdef _Chunk chunk
        if refs:
            engine.refs[raw] = refs
            return True
        del engine.refs[raw]
        chunk = engine.where.pop(raw)
        del chunk.ids[raw]
        chunk.size -= PyBytes_GET_SIZE(raw) + (1 if chunk.ids else 0)
        chunk.touch()
        engine.size -= PyBytes_GET_SIZE(raw)
        self._payload -= PyBytes_GET_SIZE(raw) + 1
        if not chunk.ids:
            engine.chunks.remove(chunk)
            chunk.alive = False
            self._chunks -= 1
            self.next_poll_at = NOW  # the pace changed
            if not engine.chunks:
                del self._engines[engine_id]
                return True
        if len(engine.chunks) > 1 and len(engine.chunks) > 2 * self._chunks_needed(engine):
            self._repack(engine)
        return True

    cpdef chunk_of(self, local_req_id):
        """``(key, version)`` of the chunk now naming ``local_req_id``'s remote id."""
        entry = self._local.get(local_req_id)
        if entry is None:
            return None
        cdef _Chunk chunk = (<_Engine>self._engines[entry[0]]).where[entry[1]]
        return chunk.key, chunk.version

    @property
    def repacks(self):
        return self._repacks

    cpdef engine_of(self, local_req_id):
        entry = self._local.get(local_req_id)
        return None if entry is None else entry[0]

    def engines(self):
        return list(self._engines)

    cpdef bint has_engine(self, engine_id) except -1:
        return engine_id in self._engines

    def __len__(self):
        return len(self._local)

    def __contains__(self, local_req_id):
        return local_req_id in self._local

    cdef Py_ssize_t _chunks_needed(self, _Engine engine):
        cdef Py_ssize_t payload = engine.size + len(engine.refs)  # ids plus separators
        return (payload + self._max - PREFIX_LEN - 1) // (self._max - PREFIX_LEN)

    def poll_paced_chunks(self, now):
        """The messages of the chunks due by ``now``, then of as many chunks
        next in due order as keep the pace (see the twin), per engine, each
        with its chunk and how many names it carries: ``(key, version,
        message, names)``.  Each sent chunk is due again ``interval`` later;
        then ``next_poll_at`` is the earliest time a call can send anything."""
        cdef double t = float(now)
        cdef double elapsed = 0.0 if self._paced_at is None else max(0.0, t - <double>self._paced_at)
        cdef double credit
        cdef dict out = {}
        cdef list sent = []
        cdef list heap = self._heap
        cdef tuple entry
        cdef _Chunk chunk
        cdef bint fresh = False  # a never-sent chunk among the due: a new round starts
        self._paced_at = t
        if self._interval > 0:
            credit = min(self._credit + self._chunks * elapsed / self._interval, <double>self._chunks)
        else:
            credit = <double>self._chunks  # every chunk every call
        while heap and <double>(<tuple>heap[0])[0] <= t:  # due: sent whatever the pace
            entry = heapq.heappop(heap)
            chunk = entry[2]
            if chunk.alive and chunk.due == <double>entry[0]:
                self._emit(out, chunk)
                sent.append(chunk)
                fresh = fresh or chunk.due == NOW
        cdef bint small = self._small_round()
        if small:  # a due chunk takes the whole round with it; nothing goes early otherwise
            credit = <double>self._chunks if sent else 0.0
        else:
            # They count toward the pace; a new round's early sends start at the phase.
            credit = max(self._phase if fresh else 0.0, credit - len(sent))
        while heap and credit >= 1:  # early, to keep the pace
            entry = heapq.heappop(heap)
            chunk = entry[2]
            if chunk.alive and chunk.due == <double>entry[0]:
                self._emit(out, chunk)
                sent.append(chunk)
                credit -= 1
        self._credit = credit
        cdef double next_due = t + self._interval
        for chunk in sent:  # after the loops: with interval 0, once per call
            self._schedule(chunk, next_due)
        cdef double credit_at
        if small:
            self._credit = 0.0  # pacing, should the round grow, starts afresh
            heap = self._heap
            self.next_poll_at = <double>(<tuple>heap[0])[0] if self._interval > 0 and heap else NOW
        elif self._interval > 0 and self._chunks:
            credit_at = t + (1.0 - credit) * self._interval / self._chunks
            heap = self._heap  # _schedule may have rebuilt it
            self.next_poll_at = min(<double>(<tuple>heap[0])[0], credit_at) if heap else credit_at
        else:
            self.next_poll_at = NOW
        return out

    cdef bint _small_round(self):
        cdef Py_ssize_t total = self._payload + self._chunks * PREFIX_LEN
        return 0 < total <= self._round_bytes

    cdef void _emit(self, dict out, _Chunk chunk) except *:
        if chunk.message is None:
            chunk.message = _encode(chunk.ids, chunk.size)
        item = (chunk.key, chunk.version, chunk.message, len(chunk.ids))
        msgs = out.get(chunk.engine_id)
        if msgs is None:
            out[chunk.engine_id] = [item]
        else:
            (<list>msgs).append(item)

    cdef void _schedule(self, _Chunk chunk, double due) except *:
        chunk.due = due
        self.next_poll_at = NOW
        self._pushes += 1
        cdef list heap = self._heap
        if len(heap) > 2 * self._chunks + 64:
            # Mostly stale entries (of removed or repacked chunks): rebuild from the live chunks.
            heap = [
                ((<_Chunk>c).due, i, c)
                for i, c in enumerate(c for e in self._engines.values() for c in (<_Engine>e).chunks)
            ]
            heapq.heapify(heap)
            self._heap = heap
            return  # ``chunk`` is live, so in it with its new due time
        heapq.heappush(heap, (due, self._pushes, chunk))

    cdef void _repack(self, _Engine engine) except *:
        # The new chunks are due when the earliest old one was (see the twin).
        cdef double due = min([(<_Chunk>chunk).due for chunk in engine.chunks])
        cdef list ids = [raw for chunk in engine.chunks for raw in (<_Chunk>chunk).ids]
        for chunk in engine.chunks:
            (<_Chunk>chunk).alive = False
        self._chunks -= len(engine.chunks)
        self._repacks += 1
        engine.chunks = []
        engine.where = {}
        for raw in ids:
            self._append(engine, raw, due)
