# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: language = c++
"""Cython packing of D's lease view updates.

Same output as ``vllm_nixl_lease/decode/_view_updates_py.py`` (the reference;
its docstring gives the layout), written and read in C.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.float cimport PyFloat_AsDouble
from cpython.tuple cimport PyTuple_Check, PyTuple_GET_SIZE
from cpython.unicode cimport PyUnicode_GET_LENGTH
from libc.math cimport isnan, NAN
from libc.stdint cimport int64_t, uint64_t, uint8_t

from ._new_view cimport new_view

cdef extern from "Python.h":
    int PyFloat_Pack8(double x, char *p, int le) except -1
    double PyFloat_Unpack8(const char *p, int le) except? -1.0
    object PyUnicode_Substring(object text, Py_ssize_t start, Py_ssize_t end)

cdef Py_ssize_t _HEADER = 24  # three int64
cdef Py_ssize_t _NEW = 48  # three float64, three int64
cdef Py_ssize_t _CHUNK = 16  # two int64
cdef Py_ssize_t _LENGTH = 8  # an int64 per string

NO_CHUNK = (-1, -1)


cdef inline void _put_int(char* p, int64_t value) noexcept:
    cdef uint64_t v = <uint64_t>value
    cdef int i
    for i in range(8):
        p[i] = <char>(<uint8_t>(v >> (8 * i)))


cdef inline int64_t _get_int(const char* p) noexcept:
    cdef uint64_t v = 0
    cdef int i
    for i in range(8):
        v |= (<uint64_t>(<uint8_t>p[i])) << (8 * i)
    return <int64_t>v


def pack_views(dict new, list dropped, dict chunks):
    cdef list repacked = [local_id for local_id in chunks if local_id not in new]
    cdef Py_ssize_t n_new = len(new), n_repacked = len(repacked)
    cdef Py_ssize_t n_strings = 4 * n_new + len(dropped) + n_repacked, i
    numbers = PyBytes_FromStringAndSize(
        NULL, _HEADER + _NEW * n_new + _CHUNK * n_repacked + _LENGTH * n_strings
    )
    cdef char* p = PyBytes_AS_STRING(numbers)
    _put_int(p, n_new)
    _put_int(p + 8, len(dropped))
    _put_int(p + 16, n_repacked)
    p += _HEADER
    cdef list strings = []
    cdef double interval
    for local_id, view in new.items():
        if not PyTuple_Check(view) or PyTuple_GET_SIZE(view) < 7:
            raise ValueError(f"view of {local_id!r} is not a NewView: {view!r}")
        strings.append(local_id)
        strings.append((<tuple>view)[0])
        strings.append((<tuple>view)[1])
        strings.append((<tuple>view)[2])
        chunk = chunks.get(local_id, NO_CHUNK)
        value = (<tuple>view)[5]
        interval = NAN if value is None else PyFloat_AsDouble(value)
        PyFloat_Pack8(PyFloat_AsDouble((<tuple>view)[3]), p, 1)
        PyFloat_Pack8(PyFloat_AsDouble((<tuple>view)[4]), p + 8, 1)
        PyFloat_Pack8(interval, p + 16, 1)
        _put_int(p + 24, <int64_t>(<tuple>view)[6])
        _put_int(p + 32, <int64_t>(<tuple>chunk)[0])
        _put_int(p + 40, <int64_t>(<tuple>chunk)[1])
        p += _NEW
    strings.extend(dropped)
    for local_id in repacked:
        chunk = chunks[local_id]
        _put_int(p, <int64_t>(<tuple>chunk)[0])
        _put_int(p + 8, <int64_t>(<tuple>chunk)[1])
        p += _CHUNK
    strings.extend(repacked)
    text = "".join(strings)  # TypeError for a string that is not a str
    for i in range(n_strings):  # p: the lengths' place, after the chunks
        _put_int(p + _LENGTH * i, PyUnicode_GET_LENGTH(strings[i]))
    return text, numbers


def unpack_views(tuple packed, view_type):
    text, numbers = packed
    if type(text) is not str or type(numbers) is not bytes or PyBytes_GET_SIZE(numbers) < _HEADER:
        raise ValueError("malformed view updates: not (str, bytes)")
    cdef const char* p = PyBytes_AS_STRING(numbers)
    cdef int64_t n_new = _get_int(p), n_dropped = _get_int(p + 8), n_repacked = _get_int(p + 16)
    cdef Py_ssize_t size = PyBytes_GET_SIZE(numbers)
    if (
        n_new < 0 or n_dropped < 0 or n_repacked < 0
        or n_new > size // _NEW or n_repacked > size // _CHUNK or n_dropped > size // _LENGTH
    ):
        raise ValueError("malformed view updates: counts do not match")
    # Each count is at most the size (above): no overflow here.
    cdef Py_ssize_t n_strings = 4 * n_new + n_dropped + n_repacked
    if size != _HEADER + _NEW * n_new + _CHUNK * n_repacked + _LENGTH * n_strings:
        raise ValueError("malformed view updates: counts do not match")
    cdef Py_ssize_t text_size = PyUnicode_GET_LENGTH(text), start = 0, length, s
    cdef const char* q = p + _HEADER + _NEW * n_new + _CHUNK * n_repacked
    cdef list names = []
    for s in range(n_strings):
        length = _get_int(q + _LENGTH * s)
        if length < 0 or length > text_size - start:
            raise ValueError("malformed view updates: string lengths do not match the text")
        names.append(PyUnicode_Substring(text, start, start + length))
        start += length
    if start != text_size:
        raise ValueError("malformed view updates: string lengths do not match the text")
    p += _HEADER
    cdef dict new = {}, chunks = {}
    cdef Py_ssize_t _n, i, at = 0
    cdef double interval
    cdef int64_t key
    if not (isinstance(view_type, type) and issubclass(view_type, tuple)):
        raise TypeError(f"view_type must be a tuple type, not {view_type!r}")
    for _n in range(n_new):
        local_id = names[at]
        interval = PyFloat_Unpack8(p + 16, 1)
        new[local_id] = new_view(
            view_type,
            names[at + 1],
            names[at + 2],
            names[at + 3],
            PyFloat_Unpack8(p, 1),
            PyFloat_Unpack8(p + 8, 1),
            None if isnan(interval) else interval,
            _get_int(p + 24),
        )
        key = _get_int(p + 32)
        if key >= 0:
            chunks[local_id] = (key, _get_int(p + 40))
        p += _NEW
        at += 4
    dropped = names[at : at + n_dropped]
    at += n_dropped
    for i in range(n_repacked):
        chunks[names[at + i]] = (_get_int(p), _get_int(p + 8))
        p += _CHUNK
    return new, dropped, chunks
