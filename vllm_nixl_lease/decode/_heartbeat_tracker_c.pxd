# cython: language_level=3
# distutils: language = c++
"""The tracker's declarations, so that ``_intake_c`` calls its methods in C
(``cimport``) rather than through Python's method calls: the intake calls it
several times per arriving and departing request."""


cdef class _Chunk:
    cdef dict ids          # ordered set of raw ids
    cdef Py_ssize_t size   # encoded length
    cdef object message    # cached bytes, None when dirty
    cdef str engine_id
    cdef double due        # paced sending: send by then
    cdef bint alive        # False once removed (its heap entries are stale)
    cdef Py_ssize_t key
    cdef Py_ssize_t version  # bumped by each change to ids (and each track of one)

    cdef inline void touch(self):
        self.version += 1
        self.message = None


cdef class _Engine:
    cdef str engine_id
    cdef list chunks
    cdef dict where        # raw id -> _Chunk
    cdef dict refs         # raw id -> local requests tracking it
    cdef Py_ssize_t size   # sum of id lengths


cdef class HeartbeatTracker:
    cdef double _interval
    cdef Py_ssize_t _max
    cdef dict _engines     # engine id -> _Engine
    cdef dict _local       # local id -> (engine id, raw remote id)
    cdef list _heap        # (due, push count, chunk), stale entries skipped
    cdef Py_ssize_t _pushes
    cdef Py_ssize_t _chunks  # live chunks, all engines
    cdef object _paced_at  # last poll_paced_chunks, or None
    cdef double _credit    # early sends earned and not yet made
    cdef double _phase     # the credit a round starts with (see the twin)
    cdef readonly double next_poll_at  # no poll before it sends anything (see the twin)
    cdef Py_ssize_t _keys  # chunk keys handed out
    cdef Py_ssize_t _repacks
    cdef Py_ssize_t _round_bytes  # a round this small goes whole (see the twin); 0: never
    cdef Py_ssize_t _payload      # distinct ids' bytes plus one separator each, all engines

    cpdef track(self, local_req_id, engine_id, remote_req_id)
    cpdef untrack(self, local_req_id)
    cpdef chunk_of(self, local_req_id)
    cpdef engine_of(self, local_req_id)
    cpdef bint has_engine(self, engine_id) except -1
    cdef void _append(self, _Engine engine, bytes raw, double new_due=*) except *
    cdef Py_ssize_t _chunks_needed(self, _Engine engine)
    cdef bint _small_round(self)
    cdef void _emit(self, dict out, _Chunk chunk) except *
    cdef void _schedule(self, _Chunk chunk, double due) except *
    cdef void _repack(self, _Engine engine) except *
