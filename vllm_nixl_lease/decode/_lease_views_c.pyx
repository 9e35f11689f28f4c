# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: language = c++
"""Cython LeaseViews and ReadClaims.

Same rules and results as ``vllm_nixl_lease/decode/_lease_views_py.py`` and
``read_claims.py`` (the references; read their docstrings).  A view is a C
struct in one vector, found through a dict from D's request id to its slot;
its strings live in lists indexed by the same slot.  D's worker calls this on
every step and every READ, so the per-READ check and a step's updates are one
call each.
"""

from libc.math cimport isfinite
from libcpp.vector cimport vector
from cpython.object cimport Py_EQ, PyObject_RichCompareBool
from cpython.tuple cimport PyTuple_Check, PyTuple_GET_SIZE

import math
from collections import OrderedDict

from . import read_claims as _read_claims_py

# ``admit_read``'s refusals (the twin's values: the adapter compares them)
FENCED = "fenced"
CLAIMED = "claimed"

cdef double INF = math.inf
cdef double ENDED = -math.inf  # the deadline of a view that ended


cdef class ReadClaims:
    """Which local request reads each lease; keys of ended claims until their expiry."""

    cdef dict _reader       # key -> (local reader, the end of a fresh view of it)
    cdef object _ended      # OrderedDict: key -> expiry, oldest first
    cdef object _unviewed   # OrderedDict: key -> reader, most recently read last
    cdef Py_ssize_t _max_unviewed
    cdef double _oldest     # the expiry of ``_ended``'s first key (INF: empty), tested per claim

    def __cinit__(self):
        self._reader = {}
        self._ended = OrderedDict()
        self._oldest = INF
        self._unviewed = OrderedDict()
        # Read when built, so a test may lower the twin's module constant first.
        self._max_unviewed = _read_claims_py.MAX_UNVIEWED

    def __len__(self):
        return len(self._reader) + len(self._ended) + len(self._unviewed)

    def claim_unviewed(self, key, local_id):
        unviewed = self._unviewed
        reader = unviewed.get(key)
        if reader is not None:
            return reader == local_id
        unviewed[key] = local_id
        if len(unviewed) > self._max_unviewed:
            unviewed.popitem(last=False)
        return True

    def claim(self, key, local_id, double expiry, double now, viewed):
        return self._claim(key, local_id, expiry, now, viewed)

    cdef bint _claim(self, object key, object local_id, double expiry, double now, object viewed) except -1:
        cdef double known
        if self._oldest <= now:
            self._prune(now, viewed)
        held = self._reader.get(key)
        if held is None:
            if key in self._ended:
                return False
            self._reader[key] = (local_id, expiry)
            return True
        reader = (<tuple>held)[0]
        known = (<tuple>held)[1]
        if reader != local_id:
            return False
        if expiry > known:
            self._reader[key] = (reader, expiry)
        return True

    def release(self, key):
        self._release(key)

    cdef int _release(self, object key) except -1:
        cdef double expiry
        held = self._reader.pop(key, None)
        if held is None:
            return 0
        expiry = (<tuple>held)[1]
        if isfinite(expiry):
            ended = self._ended
            before = len(ended)
            ended[key] = expiry
            if len(ended) == before:  # ended before (never seen: a key ends once), handled as the twin does
                ended.move_to_end(key)
                self._oldest = ended[next(iter(ended))]
            elif len(ended) == 1:
                self._oldest = expiry
        return 0

    def prune(self, double now, viewed):
        before = len(self._ended)
        self._prune(now, viewed)
        return before - len(self._ended)

    cdef void _prune(self, double now, object viewed) except *:
        ended = self._ended
        while ended:
            key = next(iter(ended))
            if <double>ended[key] > now:
                break
            del ended[key]
            if key in viewed:
                self._reader[key] = ("", ENDED)
        self._oldest = ended[next(iter(ended))] if ended else INF


cdef struct View:
    double grantor_deadline  # as reported by P, on P's clock
    double extension         # P's heartbeat extension (clamped to the cap)
    double margin            # fence a READ with this little left
    double local_deadline    # on D's clock, once converted
    double first_answer      # send time of the first answer applied to it, once answered
    long long chunk          # key of the heartbeat chunk naming it, if it has one
    long long joined         # that chunk's version when the view joined it
    bint alive               # False: a free slot
    bint converted           # local_deadline is set
    bint has_chunk
    bint answered            # first_answer is set
    bint acked               # of a P instance (renewed on answers), not a plain P


cdef class _ChunkAnswer:
    cdef long long version   # the latest answered message's version
    cdef double started      # ... and its send time (D's clock)
    cdef double chain_start  # the first send of the unbroken chain of answers it ends


cdef inline _ChunkAnswer _answer(long long version, double started, double chain_start):
    cdef _ChunkAnswer answer = _ChunkAnswer.__new__(_ChunkAnswer)
    answer.version = version
    answer.started = started
    answer.chain_start = chain_start
    return answer


cdef inline bint _same(object a, object b) except -1:
    """Items of two tuples equal as tuple comparison takes them: the same
    object, or ``==`` (two floats compared in C)."""
    if a is b:
        return True
    if type(a) is float and type(b) is float:
        return <double>a == <double>b
    return PyObject_RichCompareBool(a, b, Py_EQ)


cdef inline void _end(View* view):
    view.local_deadline = ENDED
    view.converted = True


cdef class LeaseViews:
    """Views of P's leases, keyed by D's request id and by (P engine, instance, name)."""

    cdef readonly double margin
    cdef readonly double extension_cap
    cdef readonly double max_extension
    cdef readonly ReadClaims claims
    cdef vector[View] _v
    cdef vector[Py_ssize_t] _free  # free slots
    cdef dict _slot_of             # local id -> slot
    cdef list _ids                 # slot -> local id (None: free)
    cdef list _engine              # slot -> P engine id
    cdef list _instance            # slot -> P instance ("" for a plain P)
    cdef list _name                # slot -> the name heartbeats give it
    cdef list _key                 # slot -> (engine, instance, name)
    cdef list _sharing             # slot -> its key's list in ``_by_remote`` (no hash on a drop)
    cdef list _names_of            # slot -> its (engine, instance)'s dict in ``_names``
    cdef list _waiting             # slot -> the dict of ``_first`` it waits in (None: in none)
    cdef dict _by_remote           # (engine, instance, name) -> local ids viewing it
    cdef dict _names               # (engine, instance) -> names viewed, oldest first
    cdef object _chunk_answers     # OrderedDict: (engine, chunk key) -> _ChunkAnswer
    cdef dict _first               # (engine, chunk key) -> {local id: None} waiting for a first answer
    cdef dict _proven              # engine -> the instance its answers last proved
    cdef dict _extension           # engine -> the shortest extension of its views

    def __init__(self, margin, extension_cap=math.inf):
        if not (math.isfinite(margin) and margin >= 0):
            raise ValueError(f"margin must be a finite number >= 0, got {margin!r}")
        if not extension_cap > 0:
            raise ValueError(f"extension_cap must be > 0, got {extension_cap!r}")
        self.margin = margin
        self.extension_cap = extension_cap
        self.max_extension = 0.0
        self.claims = ReadClaims()
        self._slot_of = {}
        self._ids = []
        self._engine = []
        self._instance = []
        self._name = []
        self._key = []
        self._sharing = []
        self._names_of = []
        self._waiting = []
        self._by_remote = {}
        self._names = {}
        self._chunk_answers = OrderedDict()
        self._first = {}
        self._proven = {}
        self._extension = {}

    def __len__(self):
        return len(self._slot_of)

    def __contains__(self, local_id):
        return local_id in self._slot_of

    cdef inline Py_ssize_t _slot(self, object local_id) except -2:
        slot = self._slot_of.get(local_id)
        return -1 if slot is None else <Py_ssize_t>slot

    # -- adding and dropping ---------------------------------------------------
    def add(
        self, local_id, engine_id, name, grantor_deadline, extension, instance="", chunk=None, margin=None
    ):
        return self._add(local_id, engine_id, name, grantor_deadline, extension, instance, chunk, margin)

    cdef bint _add(
        self, object local_id, object engine_id, object name, object grantor_deadline_, object extension_,
        object instance, object chunk, object margin_,
    ) except -1:
        cdef double grantor_deadline = grantor_deadline_
        cdef double extension = extension_
        cdef double margin
        cdef bint clamped
        cdef Py_ssize_t slot
        cdef View view
        if not (isfinite(grantor_deadline) and isfinite(extension) and extension > 0):
            raise ValueError(
                f"lease of {local_id!r}: deadline {grantor_deadline_!r} / extension {extension_!r} "
                "must be finite and the extension > 0"
            )
        if local_id in self._slot_of:
            self._drop(local_id)
        clamped = extension > self.extension_cap
        if clamped:
            extension = self.extension_cap
        if margin_ is None:
            margin = self.margin
        else:
            margin = margin_
            if not margin > 0.0:
                margin = 0.0
            if not margin < self.margin:
                margin = self.margin
        view.grantor_deadline = grantor_deadline
        view.extension = extension
        view.margin = margin
        view.local_deadline = 0.0
        view.first_answer = 0.0
        view.alive = True
        view.converted = False
        view.answered = False
        view.acked = bool(instance)
        view.has_chunk = chunk is not None
        if view.has_chunk:
            view.chunk = chunk[0]
            view.joined = chunk[1]
        else:
            view.chunk = 0
            view.joined = 0
        key = (engine_id, instance, name)
        sharing = self._by_remote.get(key)
        if sharing is None:
            sharing = self._by_remote[key] = []
            names = self._names.get((engine_id, instance))
            if names is None:
                names = self._names[(engine_id, instance)] = {}
            names[name] = None
        else:
            names = self._names_of[self._slot_of[(<list>sharing)[0]]]
        (<list>sharing).append(local_id)
        if self._free.empty():
            slot = self._v.size()
            self._v.push_back(view)
            self._ids.append(local_id)
            self._engine.append(engine_id)
            self._instance.append(instance)
            self._name.append(name)
            self._key.append(key)
            self._sharing.append(sharing)
            self._names_of.append(names)
            self._waiting.append(None)
        else:
            slot = self._free.back()
            self._free.pop_back()
            self._v[slot] = view
            self._ids[slot] = local_id
            self._engine[slot] = engine_id
            self._instance[slot] = instance
            self._name[slot] = name
            self._key[slot] = key
            self._sharing[slot] = sharing
            self._names_of[slot] = names
            self._waiting[slot] = None
        self._slot_of[local_id] = slot
        if view.has_chunk and view.acked:
            self._wait(local_id, slot, (engine_id, chunk[0]))  # ``_join`` for a fresh view
        if extension > self.max_extension:
            self.max_extension = extension
        shortest = self._extension.get(engine_id)
        if shortest is None or extension < <double>shortest:
            self._extension[engine_id] = extension
        return clamped

    def drop(self, local_id):
        return self._drop(local_id)

    cdef bint _drop(self, object local_id) except -1:
        cdef Py_ssize_t slot = self._slot(local_id)
        if slot < 0:
            return False
        del self._slot_of[local_id]
        self._unwait(local_id, slot)  # a no-op unless it waits for a first answer
        key = self._key[slot]
        sharing = <list>self._sharing[slot]
        if len(sharing) == 1:
            del self._by_remote[key]
            self.claims._release(key)
            names = <dict>self._names_of[slot]
            del names[self._name[slot]]
            if not names:
                del self._names[(self._engine[slot], self._instance[slot])]
        else:
            sharing.remove(local_id)
        self._v[slot].alive = False
        self._ids[slot] = None
        self._engine[slot] = None
        self._instance[slot] = None
        self._name[slot] = None
        self._key[slot] = None
        self._sharing[slot] = None
        self._names_of[slot] = None
        self._waiting[slot] = None
        self._free.push_back(slot)
        return True

    def drop_all(self, local_ids, also=()):
        cdef tuple tables = tuple(also)
        for local_id in local_ids:
            self._drop(local_id)
            for table in tables:
                if type(table) is dict:  # the worker's tables: a C call, not a method lookup
                    (<dict>table).pop(local_id, None)
                else:
                    table.pop(local_id, None)

    def terms_margin(self, double extension, double p_interval, double d_interval):
        return self._terms_margin(extension, p_interval, d_interval)

    cdef inline double _terms_margin(self, double extension, double p_interval, double d_interval):
        cdef double room = extension - d_interval - p_interval / 2
        return room / 2 if room / 2 < self.margin else self.margin  # ``min``, NaN included

    def add_views(self, new, chunks, double d_interval, double margin_floor, offsets):
        cdef Py_ssize_t clamped = 0
        cdef double margin, p_interval
        cdef list floored = []
        # The metadata's are dicts, read in C below; any other mapping is copied into one.
        if type(new) is not dict:
            new = dict(new)
        if type(chunks) is not dict:
            chunks = dict(chunks)
        for local_id, view in (<dict>new).items():
            if PyTuple_Check(view) and PyTuple_GET_SIZE(view) >= 6:
                # A NewView (a NamedTuple, or a plain tuple unpickled as one): by position
                engine_id = (<tuple>view)[0]
                instance = (<tuple>view)[1]
                name = (<tuple>view)[2]
                deadline = (<tuple>view)[3]
                extension = (<tuple>view)[4]
                interval = (<tuple>view)[5]
            else:
                engine_id, instance, name = view.engine_id, view.instance, view.name
                deadline, extension, interval = view.deadline, view.extension, view.interval
            p_interval = d_interval if interval is None else interval
            margin = self._terms_margin(extension, p_interval, d_interval)
            if not margin >= margin_floor:
                margin = margin_floor
                floored.append(local_id)
            clamped += self._add(
                local_id, engine_id, name, deadline, extension, instance, (<dict>chunks).get(local_id), margin
            )
        if len(chunks) > len(new):  # views whose names were repacked into new chunks
            for local_id, chunk in chunks.items():
                if local_id not in new:
                    engine_id = self.engine_of(local_id)
                    if engine_id is not None:
                        self.move_to_chunk(local_id, chunk, offsets.get(engine_id))
        return clamped, floored

    @staticmethod
    def note_terms(new, dict versions, dict terms, base_version, newest_version):
        cdef list changed = []
        for view in new.values():
            if PyTuple_Check(view) and PyTuple_GET_SIZE(view) >= 7:
                # A NewView by position (as add_views)
                instance = (<tuple>view)[1]
                if not instance:
                    continue
                engine_id = (<tuple>view)[0]
                extension = (<tuple>view)[4]
                interval = (<tuple>view)[5]
                hello_version = (<tuple>view)[6]
            else:
                instance = view.instance
                if not instance:
                    continue
                engine_id = view.engine_id
                extension, interval, hello_version = view.extension, view.interval, view.hello_version
            if hello_version > base_version:
                versions[(engine_id, instance)] = (
                    hello_version if hello_version < newest_version else newest_version
                )
            known = terms.get(engine_id)
            if (
                PyTuple_Check(known)
                and PyTuple_GET_SIZE(known) == 2
                and _same((<tuple>known)[0], extension)
                and _same((<tuple>known)[1], interval)
            ):
                continue  # the twin's ``!=`` of the two tuples, without building one per view
            terms[engine_id] = (extension, interval)
            changed.append((engine_id, extension, interval))
        return changed

    def any_name(self, engine_id, instance):
        names = self._names.get((engine_id, instance))
        return next(reversed(names)) if names else None

    # -- renewals ------------------------------------------------------------
    def heartbeat_sent(self, engine_id, remote_ids, double offset, double started, double finished):
        cdef Py_ssize_t renewed = 0, slot
        cdef double deadline
        cdef View* view
        by_remote, slot_of = self._by_remote, self._slot_of
        for name in remote_ids:
            sharing = by_remote.get((engine_id, "", name))
            if sharing is None:
                continue
            for local_id in <list>sharing:
                slot = <Py_ssize_t>slot_of[local_id]
                deadline = self._local(slot, offset)
                view = &self._v[slot]
                # Judged at the end of the send, renewed from its start.
                if deadline - finished > view.margin:
                    if started + view.extension > deadline:
                        view.local_deadline = started + view.extension
                    else:
                        view.local_deadline = deadline
                    renewed += 1
        return renewed

    def heartbeat_acked(self, engine_id, instance, remote_ids, double offset, double started, double now):
        cdef Py_ssize_t renewed = 0, slot
        cdef double deadline, renewed_to
        cdef View* view
        by_remote, slot_of = self._by_remote, self._slot_of
        for name in remote_ids:
            sharing = by_remote.get((engine_id, instance, name))
            if sharing is None:
                continue
            for local_id in <list>sharing:
                slot = <Py_ssize_t>slot_of[local_id]
                view = &self._v[slot]
                if not view.converted or (view.answered and view.has_chunk):
                    deadline = self._local(slot, offset)  # converts, or takes up a chunk's answer
                    view = &self._v[slot]
                else:
                    deadline = view.local_deadline
                renewed_to = started + view.extension
                if started < deadline and renewed_to > deadline and renewed_to > now:
                    view.local_deadline = renewed_to
                    renewed += 1
        return renewed

    def chunk_acked(
        self, engine_id, instance, long long key, long long version, double started, not_extended=(),
        offset=None, double now=-math.inf,
    ):
        cdef Py_ssize_t slot
        cdef double deadline, off, gap, shortest
        cdef View* view
        cdef _ChunkAnswer prior
        ack_key = (engine_id, key)
        by_remote, slot_of = self._by_remote, self._slot_of
        for name in not_extended:
            sharing = by_remote.get((engine_id, instance, name))
            if sharing is None:
                continue
            for local_id in <list>sharing:
                view = &self._v[<Py_ssize_t>slot_of[local_id]]
                # Only a view that joined this chunk after the message was built was
                # surely not in it; any other view of the name ends.
                if not view.has_chunk or view.chunk != key or view.joined <= version:
                    _end(view)
        if offset is None:
            return
        off = offset
        waiting = self._first.get(ack_key)
        if waiting:
            still = {}
            for local_id in <dict>waiting:
                slot = self._slot(local_id)
                if slot < 0:
                    continue
                view = &self._v[slot]
                if not view.has_chunk or view.chunk != key:
                    continue
                if view.joined > version:
                    still[local_id] = None
                    self._waiting[slot] = still
                    continue
                self._waiting[slot] = None
                deadline = self._local(slot, off)
                view = &self._v[slot]
                if started < deadline and now < started + view.extension:
                    if started + view.extension > deadline:
                        view.local_deadline = started + view.extension
                    else:
                        view.local_deadline = deadline
                    view.first_answer = started
                    view.answered = True
                else:
                    _end(view)  # lapsed before its first answer
            if still:
                self._first[ack_key] = still
            else:
                del self._first[ack_key]
        answers = self._chunk_answers
        found = answers.get(ack_key)
        if found is None:
            answers[ack_key] = _answer(version, started, started)
            return
        prior = <_ChunkAnswer>found
        if started > prior.started:
            # Messages are built and sent in order; a gap of an extension without an
            # answer breaks the chain (views renewed before it may have lapsed).
            gap = started - prior.started
            shortest = self._extension.get(engine_id, 0.0)
            answers[ack_key] = _answer(
                version if version > prior.version else prior.version,
                started,
                started if gap >= shortest else prior.chain_start,
            )
            answers.move_to_end(ack_key)

    def chunk_renewed_until(self, engine_id, key):
        if (engine_id, key) in self._first:
            return None
        answer = self._chunk_answers.get((engine_id, key))
        extension = self._extension.get(engine_id)
        if answer is None or extension is None:
            return None
        return (<_ChunkAnswer>answer).started + <double>extension

    def end(self, engine_id, instance, names):
        cdef Py_ssize_t ended = 0
        cdef View* view
        by_remote, slot_of = self._by_remote, self._slot_of
        for name in names:
            sharing = by_remote.get((engine_id, instance, name))
            if sharing is None:
                continue
            for local_id in <list>sharing:
                view = &self._v[<Py_ssize_t>slot_of[local_id]]
                if not (view.converted and view.local_deadline == ENDED):
                    _end(view)
                    ended += 1
        return ended

    def move_to_chunk(self, local_id, chunk, offset):
        cdef Py_ssize_t slot = self._slot(local_id)
        cdef long long key, version
        if slot < 0:
            return False
        if offset is not None and self._v[slot].converted:
            # Take up the old chunk's proof first; a view never converted must not be
            # converted here (the offset may be an unproven connection's, 4.1).
            self._local(slot, offset)
        key, version = chunk
        cdef View* view = &self._v[slot]
        if view.has_chunk and key == view.chunk:
            if version > view.joined:
                view.joined = version  # never lower ``joined``
        else:
            self._join(local_id, slot, key, version)
        return True

    def instance_proven(self, engine_id, instance):
        cdef Py_ssize_t ended = 0, slot
        cdef View* view
        if self._proven.get(engine_id) == instance:
            return 0
        self._proven[engine_id] = instance
        engines, instances = self._engine, self._instance
        for slot in range(<Py_ssize_t>self._v.size()):
            view = &self._v[slot]
            if (
                view.alive
                and not (view.converted and view.local_deadline == ENDED)
                and engines[slot] == engine_id
                and instances[slot] != instance
            ):
                _end(view)
                ended += 1
        return ended

    def prune_chunk_acks(self, double sent_before):
        cdef Py_ssize_t dropped = 0
        answers = self._chunk_answers
        while answers:
            key = next(iter(answers))
            if (<_ChunkAnswer>answers[key]).started >= sent_before:
                break
            answers.popitem(last=False)
            dropped += 1
        return dropped

    def forget_engines(self, keep):
        keep = set(keep)
        keep.update(engine_id for engine_id, _ in self._names)
        gone = {e for e in self._proven if e not in keep}
        gone.update(e for e in self._extension if e not in keep)
        gone.update(e for e, _ in self._chunk_answers if e not in keep)
        gone.update(e for e, _ in self._first if e not in keep)
        if not gone:
            return 0
        for engine_id in gone:
            self._proven.pop(engine_id, None)
            self._extension.pop(engine_id, None)
        for table in (self._chunk_answers, self._first):
            for key in [k for k in table if k[0] in gone]:
                del table[key]
        return len(gone)

    def prune_claims(self, double now):
        return self.claims.prune(now, self._by_remote)

    def engines_known(self):
        return len(
            self._proven.keys()
            | self._extension.keys()
            | {e for e, _ in self._chunk_answers}
            | {e for e, _ in self._first}
            | {e for e, _ in self._names}
        )

    cdef void _join(self, object local_id, Py_ssize_t slot, long long key, long long version) except *:
        self._unwait(local_id, slot)
        cdef View* view = &self._v[slot]
        view.has_chunk = True
        view.chunk = key
        view.joined = version
        view.answered = False
        if view.acked:
            self._wait(local_id, slot, (self._engine[slot], key))

    cdef inline void _wait(self, object local_id, Py_ssize_t slot, tuple wait_key) except *:
        """Put a view on its chunk's list of views waiting for a first answer, and
        keep that list in its slot (``setdefault`` without a new dict made and
        thrown away for each view of a chunk that has one)."""
        waiting = self._first.get(wait_key)
        if waiting is None:
            waiting = self._first[wait_key] = {}
        (<dict>waiting)[local_id] = None
        self._waiting[slot] = waiting

    cdef void _unwait(self, object local_id, Py_ssize_t slot) except *:
        """Take a view off its chunk's list of views waiting for a first answer."""
        # The slot holds the dict it waits in (kept as ``_first``'s own by ``_add``,
        # ``_join`` and ``chunk_acked``): no (engine, chunk) key built and hashed per drop.
        waiting = self._waiting[slot]
        if waiting is None:
            return
        self._waiting[slot] = None
        if local_id in <dict>waiting:
            del (<dict>waiting)[local_id]
            if not waiting:
                wait_key = (self._engine[slot], self._v[slot].chunk)
                if self._first.get(wait_key) is waiting:
                    del self._first[wait_key]

    # -- reads -----------------------------------------------------------------
    def remaining(self, local_id, double now, double offset):
        cdef Py_ssize_t slot = self._slot(local_id)
        if slot < 0:
            return None
        return self._local(slot, offset) - now

    def deadline_of(self, local_id, double offset):
        cdef Py_ssize_t slot = self._slot(local_id)
        if slot < 0:
            return None
        return self._local(slot, offset)

    def left_and_margin(self, local_id, double now, offsets):
        cdef Py_ssize_t slot = self._slot(local_id)
        if slot < 0:
            return None
        offset = offsets.get(self._engine[slot])
        if offset is None:
            return None
        return self._local(slot, offset) - now, self._v[slot].margin

    def may_read(self, local_id, double now, double offset):
        cdef Py_ssize_t slot = self._slot(local_id)
        if slot < 0:
            return None
        return self._local(slot, offset) - now > self._v[slot].margin

    def may_wait(self, local_id, double now, double offset):
        cdef Py_ssize_t slot = self._slot(local_id)
        if slot < 0:
            return None
        cdef View* view = &self._v[slot]
        if not view.converted:
            return view.grantor_deadline - offset - now > view.margin
        return self._local(slot, offset) - now > self._v[slot].margin

    def margin_of(self, local_id):
        cdef Py_ssize_t slot = self._slot(local_id)
        return None if slot < 0 else self._v[slot].margin

    def converted(self, local_id):
        cdef Py_ssize_t slot = self._slot(local_id)
        return None if slot < 0 else self._v[slot].converted

    def claim_read(self, local_id, double now, offset, unviewed=None):
        cdef Py_ssize_t slot = self._slot(local_id)
        cdef double expiry
        if slot < 0:
            if unviewed is None:
                return True
            return self.claims.claim_unviewed((unviewed[0], "", unviewed[1]), local_id)
        expiry = ENDED if offset is None else self._v[slot].grantor_deadline - <double>offset
        return self.claims._claim(self._key[slot], local_id, expiry, now, self._by_remote)

    def admit_read(self, local_id, double now, double offset):
        cdef Py_ssize_t slot = self._slot(local_id)
        if slot < 0:
            return None
        return self._admit(slot, local_id, now, offset)

    def admit_proven(self, local_id, double now, engine_id, agents, offsets, proven):
        cdef Py_ssize_t slot = self._slot(local_id)
        if slot < 0:
            return None
        instance = self._instance[slot]
        if not instance:
            return None
        if type(agents) is dict:
            connection = (<dict>agents).get(engine_id)
        else:
            connection = agents.get(engine_id)
        if type(offsets) is dict:
            offset = (<dict>offsets).get(engine_id)
        else:
            offset = offsets.get(engine_id)
        if not connection or offset is None:
            return None
        if type(connection) is not dict:  # upstream's is a dict: iterated in C below
            connection = dict(connection)
        for agent in (<dict>connection).values():
            if type(agent) is bytes:
                agent = (<bytes>agent).decode()
            elif isinstance(agent, bytes):
                agent = agent.decode()
            if type(proven) is dict:
                seen = (<dict>proven).get(agent)
            else:
                seen = proven.get(agent)
            if seen != instance:
                return None
        return self._admit(slot, local_id, now, offset)

    cdef object _admit(self, Py_ssize_t slot, object local_id, double now, double offset):
        cdef double deadline = self._local(slot, offset)
        cdef View* view = &self._v[slot]
        if not deadline - now > view.margin:
            return FENCED
        if not self.claims._claim(
            self._key[slot], local_id, view.grantor_deadline - offset, now, self._by_remote
        ):
            return CLAIMED
        return deadline

    def late_reads(self, done, failed, dict posted, double now, offsets):
        cdef Py_ssize_t slot
        cdef double left, margin, posted_deadline
        cdef list late = []
        cdef dict slot_of = self._slot_of
        # upstream's offsets are a dict: its C lookup, not a method call
        cdef dict offsets_dict = offsets if type(offsets) is dict else None
        for req_id in done:
            found = posted.pop(req_id, None)
            posted_deadline = ENDED if found is None else <double>found
            if req_id in failed:
                continue
            slot_obj = slot_of.get(req_id)
            if slot_obj is None:
                continue
            slot = <Py_ssize_t>slot_obj
            engine = self._engine[slot]
            offset = offsets_dict.get(engine) if offsets_dict is not None else offsets.get(engine)
            if offset is None:
                continue
            left = self._local(slot, offset) - now
            margin = self._v[slot].margin
            if left <= margin and now >= posted_deadline - margin:
                late.append(req_id)
        for req_id in failed:
            posted.pop(req_id, None)
        return late

    def answered(self, local_id):
        cdef Py_ssize_t slot = self._slot(local_id)
        return slot >= 0 and self._v[slot].answered

    def engine_of(self, local_id):
        cdef Py_ssize_t slot = self._slot(local_id)
        return None if slot < 0 else self._engine[slot]

    def instance_of(self, local_id):
        cdef Py_ssize_t slot = self._slot(local_id)
        return None if slot < 0 else self._instance[slot]

    cdef double _local(self, Py_ssize_t slot, double offset) except? -1:
        cdef View* view = &self._v[slot]
        cdef double deadline
        cdef _ChunkAnswer answer
        if not view.converted:
            deadline = view.local_deadline = view.grantor_deadline - offset
            view.converted = True
        elif view.local_deadline == ENDED:
            return ENDED
        else:
            deadline = view.local_deadline
        if view.answered and view.has_chunk:
            found = self._chunk_answers.get((self._engine[slot], view.chunk))
            view = &self._v[slot]
            if found is not None:
                answer = <_ChunkAnswer>found
                if (
                    answer.version >= view.joined
                    and answer.chain_start <= view.first_answer
                    and answer.started + view.extension > deadline
                ):
                    deadline = view.local_deadline = answer.started + view.extension
        return deadline
