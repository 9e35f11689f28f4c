# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: language = c++
"""Cython D-side heartbeat tracker and encoder.

Same algorithm and results as ``vllm_nixl_lease/_heartbeat_py.py`` (the
reference; read its docstring for the chunking scheme).  Messages are
written with one allocation and memcpy per id instead of a join over a list.
"""

from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.string cimport memcpy

import math

from ._heartbeat_py import DEFAULT_MAX_MESSAGE_BYTES, check_max_message_bytes, check_remote_id
from ._wire import HEARTBEAT_PREFIX

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


def encode_heartbeats(ids, max_bytes=DEFAULT_MAX_MESSAGE_BYTES):
    """Pack ids, in order, into as few ``HB:a,b,...`` messages of at most
    ``max_bytes`` as greedy packing gives (see the twin)."""
    cdef Py_ssize_t limit = check_max_message_bytes(max_bytes)
    cdef list messages = []
    cdef list current = []
    cdef Py_ssize_t size = PREFIX_LEN, need
    cdef bytes raw
    for req_id in ids:
        raw = check_remote_id(req_id, limit)
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


cdef class _Chunk:
    cdef dict ids          # ordered set of raw ids
    cdef Py_ssize_t size   # encoded length
    cdef object message    # cached bytes, None when dirty

    def __cinit__(self):
        self.ids = {}
        self.size = PREFIX_LEN
        self.message = None


cdef class _Engine:
    cdef list chunks
    cdef dict where        # raw id -> _Chunk
    cdef dict refs         # raw id -> local requests tracking it
    cdef Py_ssize_t size   # sum of id lengths

    def __cinit__(self):
        self.chunks = []
        self.where = {}
        self.refs = {}
        self.size = 0


cdef class HeartbeatTracker:
    """Which P-side request ids D must keep alive, grouped per P engine."""

    cdef double _interval
    cdef Py_ssize_t _max
    cdef dict _engines     # engine id -> _Engine
    cdef dict _local       # local id -> (engine id, raw remote id)
    cdef object _last_sent

    def __init__(self, interval, max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES):
        interval = float(interval)
        if not (math.isfinite(interval) and interval >= 0):
            raise ValueError(f"heartbeat interval must be a finite number >= 0, got {interval!r}")
        self._interval = interval
        self._max = check_max_message_bytes(max_message_bytes)
        self._engines = {}
        self._local = {}
        self._last_sent = None

    @property
    def interval(self):
        return self._interval

    @property
    def max_message_bytes(self):
        return self._max

    def track(self, local_req_id, engine_id, remote_req_id):
        if not local_req_id:
            raise ValueError("empty local request id")
        if not engine_id:
            raise ValueError("empty engine id")
        cdef bytes raw = check_remote_id(remote_req_id, self._max)
        cdef _Engine engine
        old = self._local.get(local_req_id)
        if old is not None:
            if old == (engine_id, raw):
                return
            self.untrack(local_req_id)
        self._local[local_req_id] = (engine_id, raw)
        engine = self._engines.get(engine_id)
        if engine is None:
            engine = _Engine()
            self._engines[engine_id] = engine
        refs = engine.refs.get(raw)
        if refs is not None:
            engine.refs[raw] = <Py_ssize_t>refs + 1
            return  # already in a message of this engine
        engine.refs[raw] = 1
        self._append(engine, raw)
        engine.size += PyBytes_GET_SIZE(raw)

    cdef void _append(self, _Engine engine, bytes raw) except *:
        cdef _Chunk chunk = engine.chunks[len(engine.chunks) - 1] if engine.chunks else None
        cdef Py_ssize_t need = PyBytes_GET_SIZE(raw) + (1 if chunk is not None and chunk.ids else 0)
        if chunk is None or chunk.size + need > self._max:
            chunk = _Chunk()
            engine.chunks.append(chunk)
            need = PyBytes_GET_SIZE(raw)
        chunk.size += need
        chunk.ids[raw] = None
        chunk.message = None
        engine.where[raw] = chunk

    def untrack(self, local_req_id):
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
        chunk.message = None
        engine.size -= PyBytes_GET_SIZE(raw)
        if not chunk.ids:
            engine.chunks.remove(chunk)
            if not engine.chunks:
                del self._engines[engine_id]
        return True

    def engine_of(self, local_req_id):
        entry = self._local.get(local_req_id)
        return None if entry is None else entry[0]

    def engines(self):
        return list(self._engines)

    def ids_for(self, engine_id):
        cdef _Engine engine = self._engines.get(engine_id)
        return [] if engine is None else list(engine.refs)

    def __len__(self):
        return len(self._local)

    def __contains__(self, local_req_id):
        return local_req_id in self._local

    def due(self, now):
        return self._last_sent is None or float(now) - <double>self._last_sent >= self._interval

    def mark_sent(self, now):
        self._last_sent = float(now)

    cdef list _messages_for(self, _Engine engine):
        cdef Py_ssize_t nchunks = len(engine.chunks)
        cdef Py_ssize_t payload = engine.size + len(engine.refs)
        cdef Py_ssize_t needed = (payload + self._max - PREFIX_LEN - 1) // (self._max - PREFIX_LEN)
        cdef list out = []
        cdef _Chunk chunk
        if nchunks > 1 and nchunks > 2 * needed:
            self._repack(engine)
        for chunk in engine.chunks:
            if chunk.message is None:
                chunk.message = _encode(chunk.ids, chunk.size)
            out.append(chunk.message)
        return out

    def messages_for(self, engine_id):
        """The engine's current messages (cached; rebuilt only where changed)."""
        engine = self._engines.get(engine_id)
        if engine is None:
            return []
        return self._messages_for(engine)

    def messages(self):
        cdef dict out = {}
        for engine_id, engine in self._engines.items():
            out[engine_id] = self._messages_for(engine)
        return out

    def poll(self, now):
        """All engines' messages if a heartbeat is due (and mark it sent).
        Nothing tracked means nothing sent, so the throttle is not reset."""
        if not self._engines or not self.due(now):
            return {}
        self.mark_sent(now)
        return self.messages()

    cdef void _repack(self, _Engine engine) except *:
        cdef list ids = [raw for chunk in engine.chunks for raw in (<_Chunk>chunk).ids]
        engine.chunks = []
        engine.where = {}
        for raw in ids:
            self._append(engine, raw)
