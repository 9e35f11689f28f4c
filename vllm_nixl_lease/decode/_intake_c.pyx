# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: language = c++
"""Cython D scheduler intake.

Same behaviour as ``vllm_nixl_lease/decode/_intake_py.py`` (the reference;
read its docstring).  The lease fields of the common case (float deadline and
extension, int protocol, str instance and tag) are read here in C; any other
type goes through ``_wire.lease_terms``, as in the twin.
"""

from cpython.long cimport PyLong_AsDouble
from cpython.type cimport PyType_Check, PyType_IsSubtype
from libc.math cimport isfinite

from ._heartbeat_tracker_c cimport HeartbeatTracker
from ._new_view cimport new_view

from .._wire import (
    CLAIM_HELLO_VERSION,
    LEASE_PROTOCOL_BASE,
    PARAM_LEASE_DEADLINE,
    PARAM_LEASE_EXTENSION,
    PARAM_LEASE_INSTANCE,
    PARAM_LEASE_INTERVAL,
    PARAM_LEASE_PROTOCOL,
    PARAM_LEASE_PROTOCOL_MAX,
    PARAM_LEASE_TAG,
    INSTANCE_HEX_DIGITS,
    lease_terms,
)

cdef object _BASE = LEASE_PROTOCOL_BASE
cdef long _BASE_C = LEASE_PROTOCOL_BASE
# As lease_terms: the newest version P may name (4 is used only by a D that claims reads)
cdef long _NEWEST_C = CLAIM_HELLO_VERSION
cdef Py_ssize_t _INSTANCE_LEN = INSTANCE_HEX_DIGITS
cdef str _DEADLINE = PARAM_LEASE_DEADLINE
cdef str _EXTENSION = PARAM_LEASE_EXTENSION
cdef str _INTERVAL = PARAM_LEASE_INTERVAL
cdef str _PROTOCOL = PARAM_LEASE_PROTOCOL
cdef str _PROTOCOL_MAX = PARAM_LEASE_PROTOCOL_MAX
cdef str _INSTANCE = PARAM_LEASE_INSTANCE
cdef str _TAG = PARAM_LEASE_TAG


cdef inline bint _is_instance(object value):
    """``_wire.is_instance``: 16 lowercase hex digits."""
    if type(value) is not str:
        return False
    cdef str s = <str>value
    if len(s) != _INSTANCE_LEN:
        return False
    cdef Py_UCS4 ch
    for ch in s:
        if not (u'0' <= ch <= u'9' or u'a' <= ch <= u'f'):
            return False
    return True


cdef inline bint _is_tag(object value):
    """``_wire.is_tag``: 11 characters of unpadded base64url."""
    if type(value) is not str:
        return False
    cdef str s = <str>value
    if len(s) != 11:
        return False
    cdef Py_UCS4 ch
    for ch in s:
        if not (u'A' <= ch <= u'Z' or u'a' <= ch <= u'z' or u'0' <= ch <= u'9' or ch == u'-' or ch == u'_'):
            return False
    return True


cdef inline object _finite_float(object value):
    """A float or int ``value`` as a finite float; None for anything else
    (another type, not finite, an int too large for a double)."""
    cdef double x
    if type(value) is float:
        x = <double>value
    elif type(value) is int:
        try:
            x = PyLong_AsDouble(value)
        except OverflowError:
            return None
    else:
        return None
    return x if isfinite(x) else None


cdef tuple _fast_terms(dict params):
    """``_wire.lease_terms(params)`` as a plain tuple when every field has its
    common type; None when ``lease_terms`` must decide (another type, no
    deadline, malformed)."""
    deadline = _finite_float(params.get(_DEADLINE))
    extension = _finite_float(params.get(_EXTENSION))
    if deadline is None or extension is None or <double>extension <= 0:
        return None
    interval = params.get(_INTERVAL)
    if interval is not None:
        interval = _finite_float(interval)
        if interval is None:
            return None
        if <double>interval < 0:
            interval = None
    protocol = params.get(_PROTOCOL)
    instance = params.get(_INSTANCE)
    if protocol is not None and type(protocol) is not int:
        return None
    if protocol is None or protocol != _BASE or not _is_instance(instance):
        return (deadline, extension, interval, "", None, _BASE)
    tag = params.get(_TAG)
    newest = params.get(_PROTOCOL_MAX)
    version = _BASE
    if newest is not None:
        if type(newest) is not int:
            return None
        if newest > _BASE:
            version = newest if newest < _NEWEST_C else _NEWEST_C  # the newest both speak
    return (deadline, extension, interval, instance, tag if _is_tag(tag) else None, version)


cdef class Intake:
    """D's scheduler-side bookkeeping of arriving and departing requests (see the twin).
    It takes this core's tracker only, as the twin takes the twin's: the choosers
    pick both together (this module cimports the tracker's)."""

    cdef readonly HeartbeatTracker tracker  # the Cython one (its cimport): called in C
    cdef public dict groups      # tracker key (one per group) -> the group
    cdef public dict keys        # (engine, instance, tagged) -> tracker key
    cdef public Py_ssize_t next_key
    cdef public set repacked     # groups whose chunks were repacked since the adapter looked
    cdef public list events      # arrivals (local id, params) and departures (a local id), in order
    cdef public object views
    cdef public object view_type
    cdef public bint tags
    cdef public object arrive_slow
    cdef public object new_group
    cdef public object untrackable

    def __init__(self, HeartbeatTracker tracker not None, new_group, untrackable):
        self.tracker = tracker
        self.groups = {}
        self.keys = {}
        self.next_key = 0
        self.repacked = set()
        self.events = []
        self.views = None
        self.view_type = tuple
        self.tags = False
        self.arrive_slow = None
        self.new_group = new_group
        self.untrackable = untrackable

    def apply(self):
        """Replay the queued events in order, then empty the queue (also when
        a callback raises: no event is replayed twice)."""
        cdef list events = self.events
        if not events:
            return
        cdef dict last_leave = {}
        cdef set cancelled = set()
        cdef Py_ssize_t i, leave_at, n = len(events)
        cdef bint fencing
        cdef dict new = None, chunks = None, shipped
        cdef list dropped
        try:
            for i in range(n):
                event = events[i]
                if type(event) is not tuple:
                    last_leave[event] = i
            views = self.views
            fencing = views is not None and views.enabled
            if views is not None:
                new, chunks, shipped, dropped = views.new, views.chunks, views.shipped, views.dropped
            for i in range(n):
                event = events[i]
                if type(event) is tuple:
                    leave_at = last_leave.get((<tuple>event)[0], -1)
                    self._arrive(
                        (<tuple>event)[0], (<tuple>event)[1], fencing, leave_at > i, cancelled, new, chunks
                    )
                else:
                    if views is not None:
                        chunks.pop(event, None)
                        if event in cancelled:  # as the view's add then drop would leave it
                            cancelled.discard(event)
                            new.pop(event, None)
                        elif new.pop(event, None) is None and shipped.pop(event, None) is not None:
                            dropped.append(event)
                    self.untrack(event)
        finally:
            del events[:]

    cdef _arrive(self, local_id, params, bint fencing, bint leaves, set cancelled, dict new, dict chunks):
        # ``new`` and ``chunks``: the views' tables, looked up once per step by ``apply``
        if type(params) is not dict or type(local_id) is not str:
            self._slow(local_id, params)
            return
        cdef dict p = <dict>params
        engine_id = p.get("remote_engine_id")
        remote_id = p.get("remote_request_id")
        host = p.get("remote_host")
        port = p.get("remote_port")
        tp_size = p.get("tp_size")
        if engine_id is None or remote_id is None or host is None or port is None or tp_size is None:
            return
        if type(engine_id) is not str or type(remote_id) is not str:
            self._slow(local_id, params)
            return
        cdef tuple terms = None
        if fencing:
            terms = _fast_terms(p)
            if terms is None:
                try:
                    found = lease_terms(p)
                except ValueError:
                    found = None
                if found is None:  # malformed, or a stock P: the adapter logs it
                    self._slow(local_id, params)
                    return
                terms = tuple(found)
        target = (
            host, port, tp_size, p.get("dcp_size", 1), p.get("pp_size", 1),
            p.get("remote_registration_generation", 0),
        )
        instance = "" if terms is None else terms[3]
        tag = None if terms is None else terms[4]
        cdef bint tagged = bool(instance) and self.tags and tag is not None
        name = tag if tagged else remote_id
        if not self.track(local_id, engine_id, instance, tagged, name, target) or terms is None:
            return
        if leaves:
            cancelled.add(local_id)  # its departure drops it as it would the view
            return
        view_type = self.view_type
        deadline, extension, interval, hello_version = terms[0], terms[1], terms[2], terms[5]
        if PyType_Check(view_type) and PyType_IsSubtype(<type>view_type, tuple):
            view = new_view(
                view_type, engine_id, instance, name, deadline, extension, interval, hello_version
            )
        else:  # as the twin: tuple.__new__ refuses it
            view = tuple.__new__(
                view_type, (engine_id, instance, name, deadline, extension, interval, hello_version)
            )
        new[local_id] = view
        chunk = self.tracker.chunk_of(local_id)
        if chunk is not None:
            chunks[local_id] = chunk

    cdef _slow(self, local_id, params):
        slow = self.arrive_slow
        if slow is not None:
            slow(local_id, params)

    cpdef bint track(self, local_id, engine_id, instance, bint tagged, name, target) except -1:
        """Heartbeat ``name`` for ``local_id`` in the group (engine, instance,
        tagged), made with ``target`` if new.  False when the tracker refuses
        it (``untrackable`` is told)."""
        group_id = (engine_id, instance, tagged)
        key = self.keys.get(group_id)
        if key is None:
            key = f"g{self.next_key}"
            self.next_key += 1
        try:
            self.tracker.track(local_id, key, name)
        except (TypeError, ValueError) as exc:
            self.untrackable(local_id, name, exc)
            return False
        if key not in self.groups:
            self.keys[group_id] = key
            self.groups[key] = self.new_group(engine_id, instance, tagged, target)
        return True

    cpdef untrack(self, local_id):
        cdef HeartbeatTracker tracker = self.tracker
        cdef Py_ssize_t repacks
        key = tracker.engine_of(local_id)
        if key is not None:
            repacks = tracker._repacks
            tracker.untrack(local_id)
            if not tracker.has_engine(key):
                group = self.groups.pop(key)
                del self.keys[(group.engine_id, group.instance, group.tagged)]
            elif tracker._repacks != repacks:
                self.repacked.add(key)
