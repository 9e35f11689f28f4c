# cython: language_level=3
# distutils: language = c++
"""A view tuple (the adapter's ``NewView``, or any tuple type) made in C: the
type's own allocator, filled in place, as ``tuple.__new__(view_type, fields)``
does inside, without that Python-level call.  Inline, so the intake and the
view packing each compile it in."""

from cpython.object cimport PyObject
from cpython.ref cimport Py_DECREF, Py_INCREF
from cpython.tuple cimport PyTuple_SET_ITEM

cdef extern from "Python.h":
    ctypedef struct PyTypeObject:
        PyObject* (*tp_alloc)(PyTypeObject*, Py_ssize_t) except NULL


cdef inline void _put(object view, Py_ssize_t i, object value) noexcept:
    Py_INCREF(value)  # PyTuple_SET_ITEM steals a reference
    PyTuple_SET_ITEM(view, i, value)


cdef inline object new_view(
    object view_type, object engine_id, object instance, object name,
    object deadline, object extension, object interval, object hello_version,
):
    """``view_type`` must be a tuple type: the caller checks it."""
    cdef PyTypeObject* t = <PyTypeObject*>view_type
    cdef object view = <object>t.tp_alloc(t, 7)
    Py_DECREF(view)  # tp_alloc's reference, now held by ``view``
    _put(view, 0, engine_id)
    _put(view, 1, instance)
    _put(view, 2, name)
    _put(view, 3, deadline)
    _put(view, 4, extension)
    _put(view, 5, interval)
    _put(view, 6, hello_version)
    return view
