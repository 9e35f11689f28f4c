"""The lease holder's (D's) conservative view of the leases P granted it.

P frees a request's KV blocks when its lease ends; D must never READ them after
that.  D cannot see P's table, so it keeps a *view* that is never later than
P's real deadline (Gray and Cheriton's rule: the holder lets a lease expire
earlier than the grantor does).  ``docs/PROTOCOL.md`` section 4 is the
specification; this is it in code.

Every view belongs to a P engine and one of its **instances** (a P process:
a P restarted under the same engine id is another instance); the instance is
empty for a *plain* P, which does not speak our protocol.

- A view starts at the deadline P reported (P's clock), converted with the
  clock offset measured at the NIXL handshake.
- Acknowledged views (an instance): P's answer to a heartbeat D sent at local
  time ``s`` renews the view to ``s + extension`` (``ack_ledger.py`` says why
  that needs no assumption about delivery), but only if ``s`` is before the
  view's deadline: a view that lapsed never revives, so a late answer about
  another lease that shares the name (a reused id, a colliding tag) cannot
  bring it back; an answer to a send the extension has already outlived is
  ignored (it could renew nothing); an answer naming the view's key as not
  held ends it at once.
- Plain views: a heartbeat D sent at ``s`` renews the view to ``s +
  extension`` only if the view still had more than its margin left when the
  send finished (``heartbeat_sent``).  That assumes delivery within the margin,
  which a partition breaks; acknowledged views assume nothing about delivery.
- Before D reads, ``remaining`` must exceed the view's ``margin`` (room for the
  READ itself and for the clock-offset estimate), or D fences the read.
- A view is converted to D's clock only with the offset of a connection proven
  to reach its instance (plain views: the connection they are read over).
  While the connection is unproven, ``may_wait`` judges the view with an
  estimate it does not store, and ``move_to_chunk`` converts nothing.
- When P's own answers prove that an engine now runs instance J
  (``instance_proven``), every view of that engine with another instance, and
  every plain view of it, ends: those leases died with their process.

Renewed per chunk, not per id.  D's scheduler packs the names it heartbeats
into chunks, each one message (``HeartbeatTracker``); a chunk has a key and a
version bumped whenever its names change or one of them is tracked again.  A
view knows its chunk and the version at which it joined (``joined``).  An
answer to the message of chunk ``key`` at version ``v`` sent at ``s``
(``chunk_acked``) names every view that joined at or before ``v``:
- a view's first such answer is applied to it at once (``_first``: views that
  joined since the chunk's last answer wait, in arrival order), which records
  when its renewals began;
- after that the chunk's answers are stored once per chunk, O(1) instead of
  O(names), with the start of the chunk's unbroken chain of answers (each
  sent less than an extension after the one before); a view takes the latest
  up when it is read (``_local``), if the chain began no later than the
  view's first answer: then the view was alive at every answer in between.
A break in the chain (an extension without an answer) leaves the views where
they were: they lapse.

Bounds: views are per queued request; ``_by_remote`` and ``_names`` are
pruned with them.  Per-engine state (``_proven``, ``_extension``,
``_chunk_answers``, ``_first``) is forgotten by ``forget_engines`` for engines
D neither connects to nor views (the engine reaper's sweep), so it does not
grow with P restarts under fresh engine ids.  A view renews by at most
``extension_cap`` (P's terms above it are clamped: that only shortens it),
which bounds ``max_extension`` and with it how long D keeps unanswered sends.

No vLLM imports: the vLLM adapter feeds it (``adapter/d_worker/read_fence.py``,
``adapter/d_worker/ack_requester.py``).  This is the pure-Python twin (the
reference); ``_lease_views_c.pyx`` behaves identically.

The adapter's hot path calls it once per step for the step's updates
(``add_views``, ``drop_all``), once per READ (``admit_proven``; the long way,
``admit_read`` after ``instance_of``) and once per step for the completed READs
(``late_reads``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

from .read_claims import ReadClaims

_ENDED = -math.inf  # the deadline of a view that ended
# ``admit_read``'s answers for a READ it refuses (any other answer is a deadline, a float)
FENCED = "fenced"  # the view has its margin or less left
CLAIMED = "claimed"  # another local request reads the lease (``read_claims.py``)


class ViewTerms(Protocol):
    """A view to start, as the scheduler ships it (the adapter's ``NewView``).
    ``_lease_views_c`` reads a tuple's fields by position, in this order."""

    @property
    def engine_id(self) -> str: ...
    @property
    def instance(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def deadline(self) -> float: ...
    @property
    def extension(self) -> float: ...
    @property
    def interval(self) -> float | None: ...
    @property
    def hello_version(self) -> int: ...


@dataclass(slots=True)
class _View:
    engine_id: str
    instance: str  # the P process that granted it; empty: a plain P
    name: str  # how heartbeats name it: P's request id or its tag
    grantor_deadline: float  # as reported by P, on P's clock
    extension: float  # P's heartbeat extension
    margin: float  # fence a READ with this little left
    local_deadline: float | None = None  # on D's clock, once converted
    chunk: int | None = None  # key of the heartbeat chunk naming it
    joined: int = 0  # that chunk's version when the view joined it
    first_answer: float | None = None  # send time of the first answer applied to it


@dataclass(slots=True)
class _ChunkAnswer:
    version: int  # the latest answered message's version
    started: float  # ... and its send time (D's clock)
    chain_start: float  # the first send of the unbroken chain of answers it ends


class LeaseViews:
    """Views of P's leases, keyed by D's request id and by (P engine, instance, name)."""

    def __init__(self, margin: float, extension_cap: float = math.inf) -> None:
        if not (math.isfinite(margin) and margin >= 0):
            raise ValueError(f"margin must be a finite number >= 0, got {margin!r}")
        if not extension_cap > 0:
            raise ValueError(f"extension_cap must be > 0, got {extension_cap!r}")
        self.margin = margin  # the most any view keeps (lease_safety_margin)
        # The longest extension a view renews by: P's terms above it are clamped
        # (a renewal to ``s + cap`` only shortens the view), and ``max_extension``,
        # which sets how long D keeps unanswered sends and chunk answers, stays bounded.
        self.extension_cap = extension_cap
        self._views: dict[str, _View] = {}
        # (engine, instance, name) -> the local ids viewing it (several D
        # requests may wait on one P request; an answer about it renews each)
        self._by_remote: dict[tuple[str, str, str], list[str]] = {}
        # (engine, instance) -> names viewed, oldest first (a live one for D's hello)
        self._names: dict[tuple[str, str], dict[str, None]] = {}
        self.max_extension = 0.0  # the longest extension any view had
        # (engine, chunk key) -> the latest answer to that chunk; oldest first (for pruning)
        self._chunk_answers: OrderedDict[tuple[str, int], _ChunkAnswer] = OrderedDict()
        # (engine, chunk key) -> acknowledged views waiting for their first answer
        self._first: dict[tuple[str, int], dict[str, None]] = {}  # a dict: O(1) removal
        # engine -> the instance P's answers last proved it runs (to end the
        # views of the one before once, not at every answer)
        self._proven: dict[str, str] = {}
        # engine -> the shortest extension of its views (breaks a chunk's chain of answers)
        self._extension: dict[str, float] = {}
        self.claims = ReadClaims()  # one local reader per lease (read_claims.py)

    def __len__(self) -> int:
        return len(self._views)

    def __contains__(self, local_id: object) -> bool:
        return local_id in self._views

    def add(
        self,
        local_id: str,
        engine_id: str,
        name: str,
        grantor_deadline: float,
        extension: float,
        instance: str = "",
        chunk: tuple[int, int] | None = None,
        margin: float | None = None,
    ) -> bool:
        """Start viewing a lease P reported; a second add for the same id replaces
        the first.  ``instance``: the P process (empty: a plain P, renewed on
        sends).  ``chunk``: ``(key, version)`` of the heartbeat chunk naming it,
        as ``HeartbeatTracker.chunk_of`` returned right after tracking it.
        ``margin``: this view's (at most ``self.margin``).  Returns True when
        P's extension was above ``extension_cap`` and clamped to it."""
        if not (math.isfinite(grantor_deadline) and math.isfinite(extension) and extension > 0):
            raise ValueError(
                f"lease of {local_id!r}: deadline {grantor_deadline!r} / extension {extension!r} "
                "must be finite and the extension > 0"
            )
        if local_id in self._views:
            self.drop(local_id)
        clamped = extension > self.extension_cap
        extension = float(self.extension_cap if clamped else extension)
        # ``min(self.margin, max(0.0, margin))`` without two builtin calls (once per view)
        if margin is None:
            margin = self.margin
        else:
            if not margin > 0.0:
                margin = 0.0
            if not margin < self.margin:
                margin = self.margin
        if chunk is None:
            view = _View(engine_id, instance, name, float(grantor_deadline), extension, margin)
        else:
            # ``_join`` for a fresh view: it waits on no chunk's list yet
            view = _View(engine_id, instance, name, float(grantor_deadline), extension, margin, None, *chunk)
            if instance:
                self._first.setdefault((engine_id, chunk[0]), {})[local_id] = None
        self._views[local_id] = view
        key = (engine_id, instance, name)
        sharing = self._by_remote.get(key)
        if sharing is None:
            self._by_remote[key] = [local_id]
            names = self._names.get((engine_id, instance))
            if names is None:
                names = self._names[(engine_id, instance)] = {}
            names[name] = None
        else:
            sharing.append(local_id)
        if extension > self.max_extension:
            self.max_extension = extension
        if extension < self._extension.get(engine_id, math.inf):
            self._extension[engine_id] = extension
        return clamped

    def drop(self, local_id: str) -> bool:
        view = self._views.pop(local_id, None)
        if view is None:
            return False
        if view.first_answer is None and view.chunk is not None and view.instance:
            self._unwait(local_id, view)
        key = (view.engine_id, view.instance, view.name)
        sharing = self._by_remote[key]
        if len(sharing) == 1:
            del self._by_remote[key]
            self.claims.release(key)
            names = self._names[(view.engine_id, view.instance)]
            del names[view.name]
            if not names:
                del self._names[(view.engine_id, view.instance)]
        else:
            sharing.remove(local_id)
        return True

    def terms_margin(self, extension: float, p_interval: float, d_interval: float) -> float:
        """The margin P's terms leave a view: ``margin`` at most, and at most half
        the room between P's extension and D's heartbeat interval plus half P's
        (the wait for P's answer).  The caller applies its floor."""
        room = extension - d_interval - p_interval / 2
        return min(self.margin, room / 2)

    def add_views(
        self,
        new: Mapping[str, ViewTerms],
        chunks: Mapping[str, tuple[int, int]],
        d_interval: float,
        margin_floor: float,
        offsets: Mapping[str, float],
    ) -> tuple[int, list[str]]:
        """A step's updates in one call: ``add`` each of ``new`` (with its chunk
        from ``chunks`` and the margin ``terms_margin`` gives, never below
        ``margin_floor``; P's interval defaults to ``d_interval``), then
        ``move_to_chunk`` each other id of ``chunks`` that is viewed (with its
        engine's offset from ``offsets``).  Returns how many extensions were
        clamped, and the ids whose margin was raised to the floor."""
        clamped = 0
        floored: list[str] = []
        for local_id, view in new.items():
            p_interval = view.interval
            margin = self.terms_margin(
                view.extension, d_interval if p_interval is None else p_interval, d_interval
            )
            if not margin >= margin_floor:
                margin = margin_floor
                floored.append(local_id)
            clamped += self.add(
                local_id,
                view.engine_id,
                view.name,
                view.deadline,
                view.extension,
                view.instance,
                chunks.get(local_id),
                margin,
            )
        if len(chunks) > len(new):  # views whose names were repacked into new chunks
            for local_id, chunk in chunks.items():
                if local_id not in new:
                    engine_id = self.engine_of(local_id)
                    if engine_id is not None:
                        self.move_to_chunk(local_id, chunk, offsets.get(engine_id))
        return clamped, floored

    @staticmethod
    def note_terms(
        new: Mapping[str, ViewTerms],
        versions: MutableMapping[tuple[str, str], int],
        terms: MutableMapping[str, tuple[float, float | None]],
        base_version: int,
        newest_version: int,
    ) -> list[tuple[str, float, float | None]]:
        """What a step's new views say of their P processes, into the caller's
        tables (the ack requester's): ``versions``, the hello version of each
        (engine, instance), ``min(view's, newest_version)`` for a view over
        ``base_version``; ``terms``, each engine's latest (extension, interval).
        A view of a plain P (no instance) changes neither.  Returns (engine,
        extension, interval) for each view whose terms differ from what
        ``terms`` held for its engine just before it, in order: the caller's
        per-engine figures to recompute.  Reads no view this object holds."""
        changed: list[tuple[str, float, float | None]] = []
        for view in new.values():
            instance = view.instance
            if not instance:
                continue
            engine_id = view.engine_id
            if view.hello_version > base_version:
                versions[(engine_id, instance)] = min(view.hello_version, newest_version)
            latest = (view.extension, view.interval)
            if terms.get(engine_id) != latest:
                terms[engine_id] = latest
                changed.append((engine_id, view.extension, view.interval))
        return changed

    def drop_all(self, local_ids: Iterable[str], also: Iterable[MutableMapping[str, Any]] = ()) -> None:
        """``drop`` each of ``local_ids`` (a step's ended views), and pop each
        from every dict of ``also`` (the caller's own per-READ records)."""
        also = tuple(also)
        for local_id in local_ids:
            self.drop(local_id)
            for table in also:
                table.pop(local_id, None)

    def any_name(self, engine_id: str, instance: str) -> str | None:
        """The name of a lease of this P instance that D still views (the newest)."""
        names = self._names.get((engine_id, instance))
        return next(reversed(names)) if names else None

    # -- renewals ------------------------------------------------------------
    def heartbeat_sent(
        self, engine_id: str, remote_ids: Iterable[str], offset: float, started: float, finished: float
    ) -> int:
        """Account one heartbeat to a plain ``engine_id`` sent between ``started``
        and ``finished`` (D's clock); ``offset`` is P's clock minus D's.  Returns
        how many views it renewed."""
        renewed = 0
        for view in self._named(engine_id, "", remote_ids):
            deadline = self._local(view, offset)
            # Judged at the end of the send (latest moment it left), renewed
            # from its start (earliest moment P can have received it).
            if deadline - finished > view.margin:
                view.local_deadline = max(deadline, started + view.extension)
                renewed += 1
        return renewed

    def heartbeat_acked(
        self,
        engine_id: str,
        instance: str,
        remote_ids: Iterable[str],
        offset: float,
        started: float,
        now: float,
    ) -> int:
        """P ``instance`` applied a heartbeat D sent at ``started`` (D's clock) to
        each of ``remote_ids`` while it held their leases: renew them to
        ``started + extension`` (views still alive at ``started`` only).
        Returns how many views it renewed."""
        renewed = 0
        # ``_named`` and ``_local`` inlined: this runs once per name of a whole round.
        by_remote, views = self._by_remote, self._views
        for name in remote_ids:
            sharing = by_remote.get((engine_id, instance, name))
            if sharing is None:
                continue
            for local_id in sharing:
                view = views[local_id]
                deadline = view.local_deadline
                if deadline is None or (view.first_answer is not None and view.chunk is not None):
                    deadline = self._local(view, offset)  # converts, or takes up a chunk's answer
                renewed_to = started + view.extension
                if started < deadline and renewed_to > deadline and renewed_to > now:
                    view.local_deadline = renewed_to
                    renewed += 1
        return renewed

    def chunk_acked(
        self,
        engine_id: str,
        instance: str,
        key: int,
        version: int,
        started: float,
        not_extended: Iterable[str] = (),
        offset: float | None = None,
        now: float = -math.inf,
    ) -> None:
        """P ``instance`` applied the message of chunk ``key`` at ``version``,
        sent at ``started`` (D's clock), to every name in it except
        ``not_extended``, whose views end.  Renews every view that joined that
        chunk at or before ``version`` to ``started + extension``: the views
        waiting for their first answer now, the rest when read (see the module
        docstring).  ``now``: when the answer arrived."""
        ack_key = (engine_id, key)
        for named in self._named(engine_id, instance, not_extended):
            # Only a view that joined this chunk after the message was built was
            # surely not in it; any other view of the name ends (a repack may
            # have moved one that was).
            if named.chunk != key or named.joined <= version:
                named.local_deadline = _ENDED
        if offset is None:
            return  # nothing can be converted: the views stay where they are (conservative)
        waiting = self._first.get(ack_key)
        if waiting:
            still: dict[str, None] = {}
            for local_id in waiting:
                view = self._views.get(local_id)
                if view is None or view.chunk != key:
                    continue
                if view.joined > version:
                    still[local_id] = None
                    continue
                deadline = self._local(view, offset)
                if started < deadline and now < started + view.extension:
                    view.local_deadline = max(deadline, started + view.extension)
                    view.first_answer = started
                else:
                    view.local_deadline = _ENDED  # lapsed before its first answer
            if still:
                self._first[ack_key] = still
            else:
                del self._first[ack_key]
        answers = self._chunk_answers
        prior = answers.get(ack_key)
        if prior is None:
            answers[ack_key] = _ChunkAnswer(version, started, started)
        elif started > prior.started:
            # Messages are built and sent in order: a later send has a version at
            # least as high.  A gap of an extension without an answer breaks the
            # chain: views renewed before it may have lapsed in between.
            gap = started - prior.started
            chain_start = started if gap >= self._extension.get(engine_id, 0.0) else prior.chain_start
            answers[ack_key] = _ChunkAnswer(max(version, prior.version), started, chain_start)
            answers.move_to_end(ack_key)

    def chunk_renewed_until(self, engine_id: str, key: int) -> float | None:
        """The earliest end (D's clock) of the views of chunk ``key`` that its
        latest answer renewed: that answer's send plus the engine's shortest
        extension.  None when some view of it waits for its first answer, or no
        answer is kept: then only an answer can say."""
        if (engine_id, key) in self._first:
            return None
        answer = self._chunk_answers.get((engine_id, key))
        extension = self._extension.get(engine_id)
        return None if answer is None or extension is None else answer.started + extension

    def end(self, engine_id: str, instance: str, names: Iterable[str]) -> int:
        """P ``instance`` said it does not hold these names: end their views.
        Returns how many ended."""
        ended = 0
        for view in self._named(engine_id, instance, names):
            if view.local_deadline != _ENDED:
                view.local_deadline = _ENDED
                ended += 1
        return ended

    def move_to_chunk(self, local_id: str, chunk: tuple[int, int], offset: float | None) -> bool:
        """The view's name now lives in chunk ``(key, version)`` (its engine was
        repacked); what its old chunk proved is kept.  ``offset``: P's clock
        minus D's, None while unknown (then the old chunk's proof is dropped:
        conservative).  Returns False when ``local_id`` is not viewed."""
        view = self._views.get(local_id)
        if view is None:
            return False
        if offset is not None and view.local_deadline is not None:
            # Take up the old chunk's proof first.  A view never converted has
            # none to take up, and must not be converted here: the offset may be
            # an unproven connection's (4.1).
            self._local(view, offset)
        key, version = chunk
        if key == view.chunk:
            view.joined = max(view.joined, version)  # never lower ``joined``
        else:
            self._join(local_id, view, key, version)
        return True

    def instance_proven(self, engine_id: str, instance: str) -> int:
        """P's answers prove ``engine_id`` now runs ``instance``: end every view of
        it with another instance, and every plain view of it.  Returns how many
        views ended."""
        if self._proven.get(engine_id) == instance:
            return 0
        self._proven[engine_id] = instance
        ended = 0
        for view in self._views.values():
            if view.engine_id == engine_id and view.instance != instance and view.local_deadline != _ENDED:
                view.local_deadline = _ENDED
                ended += 1
        return ended

    def prune_chunk_acks(self, sent_before: float) -> int:
        """Forget chunk answers to sends before ``sent_before`` (their renewals
        are over by then; forgetting only ever shortens a view)."""
        answers = self._chunk_answers
        dropped = 0
        while answers:
            key, answer = next(iter(answers.items()))
            if answer.started >= sent_before:
                break
            answers.popitem(last=False)
            dropped += 1
        return dropped

    def forget_engines(self, keep: Iterable[str]) -> int:
        """Forget the per-engine state (proof, shortest extension, chunk answers,
        views waiting for a first answer) of every engine that is not in
        ``keep`` (the engines D is connected or handshaking to) and has no view
        left: vLLM's default engine id is fresh per P start, so without this it
        grows with P restarts.  Forgetting only shortens views: the next answer
        proves the instance again, and a chunk's chain starts anew.  Returns how
        many engines were forgotten."""
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

    def prune_claims(self, now: float) -> int:
        """Forget the read claims whose lease a fresh view would have outlived by
        ``now`` (D's clock); returns how many (``ReadClaims.prune``)."""
        return self.claims.prune(now, self._by_remote)

    def engines_known(self) -> int:
        """Engines this keeps any state for (for bounds tests)."""
        return len(
            self._proven.keys()
            | self._extension.keys()
            | {e for e, _ in self._chunk_answers}
            | {e for e, _ in self._first}
            | {e for e, _ in self._names}
        )

    def _join(self, local_id: str, view: _View, key: int, version: int) -> None:
        self._unwait(local_id, view)
        view.chunk, view.joined, view.first_answer = key, version, None
        if view.instance:
            self._first.setdefault((view.engine_id, key), {})[local_id] = None

    def _unwait(self, local_id: str, view: _View) -> None:
        """Take a view off its chunk's list of views waiting for a first answer."""
        if view.first_answer is None and view.chunk is not None and view.instance:
            waiting = self._first.get((view.engine_id, view.chunk))
            if waiting is not None and local_id in waiting:
                del waiting[local_id]
                if not waiting:
                    del self._first[(view.engine_id, view.chunk)]

    def _named(self, engine_id: str, instance: str, names: Iterable[str]) -> Iterator[_View]:
        """The views of those of ``names`` (of ``engine_id``'s ``instance``) that D views."""
        by_remote, views = self._by_remote, self._views
        for name in names:
            sharing = by_remote.get((engine_id, instance, name))
            if sharing is not None:
                for local_id in sharing:
                    yield views[local_id]

    # -- reads -----------------------------------------------------------------
    def remaining(self, local_id: str, now: float, offset: float) -> float | None:
        """Seconds the view of ``local_id`` has left at ``now`` (D's clock); None if not viewed."""
        view = self._views.get(local_id)
        if view is None:
            return None
        return self._local(view, offset) - now

    def deadline_of(self, local_id: str, offset: float) -> float | None:
        """The view's deadline on D's clock (converted with ``offset`` if it was
        not yet, as ``remaining`` does); None if ``local_id`` is not viewed."""
        view = self._views.get(local_id)
        return None if view is None else self._local(view, offset)

    def left_and_margin(
        self, local_id: str, now: float, offsets: Mapping[str, float]
    ) -> tuple[float, float] | None:
        """``remaining`` and ``margin_of`` in one call, with the offset of the
        view's engine taken from ``offsets``; None if ``local_id`` is not viewed
        or its engine has no offset (then nothing is converted)."""
        view = self._views.get(local_id)
        if view is None:
            return None
        offset = offsets.get(view.engine_id)
        if offset is None:
            return None
        return self._local(view, offset) - now, view.margin

    def may_read(self, local_id: str, now: float, offset: float) -> bool | None:
        """True if a READ may start now, False to fence it, None if ``local_id`` is not viewed."""
        view = self._views.get(local_id)
        if view is None:
            return None
        return self._local(view, offset) - now > view.margin

    def may_wait(self, local_id: str, now: float, offset: float) -> bool | None:
        """``may_read`` for a view whose connection is not proven yet: the same
        test, but a view not converted yet is judged with an estimate that is
        not stored (``offset`` may be another process's, section 4.1).  Only
        for choosing between waiting for the proof and fencing: both are safe
        whatever the estimate.  None if ``local_id`` is not viewed."""
        view = self._views.get(local_id)
        if view is None:
            return None
        if view.local_deadline is None:
            return view.grantor_deadline - offset - now > view.margin
        return self._local(view, offset) - now > view.margin

    def margin_of(self, local_id: str) -> float | None:
        view = self._views.get(local_id)
        return None if view is None else view.margin

    def converted(self, local_id: str) -> bool | None:
        """Is the view on D's clock yet (converted with a proven offset)?  None
        if ``local_id`` is not viewed."""
        view = self._views.get(local_id)
        return None if view is None else view.local_deadline is not None

    def claim_read(
        self, local_id: str, now: float, offset: float | None, unviewed: tuple[str, str] | None = None
    ) -> bool:
        """May ``local_id`` READ its lease: is it the only local request that
        reads it (``read_claims.py``)?  ``offset``: P's clock minus D's (None
        while unknown).  ``unviewed``: ``(engine, P's request id)`` of the READ,
        for a request D does not view (a stock P); without it such a READ may."""
        view = self._views.get(local_id)
        if view is None:
            if unviewed is None:
                return True
            return self.claims.claim_unviewed((unviewed[0], "", unviewed[1]), local_id)
        expiry = -math.inf if offset is None else view.grantor_deadline - offset
        key = (view.engine_id, view.instance, view.name)
        return self.claims.claim(key, local_id, expiry, now, self._by_remote)

    def admit_read(self, local_id: str, now: float, offset: float) -> float | str | None:
        """``may_read``, then ``claim_read``, then ``deadline_of``, in one call (a
        READ's check once its connection is judged): FENCED when the view has
        its margin or less left (nothing claimed), CLAIMED when another local
        request reads the lease, else the view's deadline (D's clock), with the
        READ claimed.  None if ``local_id`` is not viewed."""
        view = self._views.get(local_id)
        if view is None:
            return None
        deadline = self._local(view, offset)
        if not deadline - now > view.margin:
            return FENCED
        key = (view.engine_id, view.instance, view.name)
        expiry = view.grantor_deadline - offset
        if not self.claims.claim(key, local_id, expiry, now, self._by_remote):
            return CLAIMED
        return deadline

    def admit_proven(
        self,
        local_id: str,
        now: float,
        engine_id: str,
        agents: Mapping[str, Mapping[Any, str | bytes]],
        offsets: Mapping[str, float],
        proven: Mapping[str, str],
    ) -> float | str | None:
        """``admit_read`` for a READ from ``engine_id`` of a view of a P instance,
        over a connection proven to reach it: ``agents`` are upstream's agents
        of each engine's connection (names as str or bytes), ``offsets`` its
        clock offsets, ``proven`` the instance each agent's answers carry.  None,
        having changed nothing, unless the view is of an instance, the
        connection has agents and an offset, and every agent answered as that
        instance (the caller then judges the READ the long way)."""
        view = self._views.get(local_id)
        if view is None or not view.instance:
            return None
        connection = agents.get(engine_id)
        offset = offsets.get(engine_id)
        if not connection or offset is None:
            return None
        instance = view.instance
        for agent in connection.values():
            if proven.get(agent.decode() if isinstance(agent, bytes) else agent) != instance:
                return None
        return self.admit_read(local_id, now, offset)

    def late_reads(
        self,
        done: Iterable[str],
        failed: Collection[str],
        posted: MutableMapping[str, float],
        now: float,
        offsets: Mapping[str, float],
    ) -> list[str]:
        """The READs of ``done`` (not ``failed``) seen complete at ``now`` with
        their view's margin or less left (``left_and_margin``), unless ``now`` is
        more than the margin before the deadline ``posted`` holds for them (the
        view's when the READ was posted).  Takes every id of ``done`` and
        ``failed`` out of ``posted``."""
        late = []
        for req_id in done:
            posted_deadline = posted.pop(req_id, -math.inf)
            if req_id in failed:
                continue
            judged = self.left_and_margin(req_id, now, offsets)  # None: not viewed, or no offset
            if judged is None:
                continue
            left, margin = judged
            if left <= margin and now >= posted_deadline - margin:
                late.append(req_id)
        for req_id in failed:
            posted.pop(req_id, None)
        return late

    def answered(self, local_id: str) -> bool:
        """Has an answer to its chunk's heartbeat named the view held on every rank?"""
        view = self._views.get(local_id)
        return view is not None and view.first_answer is not None

    def engine_of(self, local_id: str) -> str | None:
        view = self._views.get(local_id)
        return None if view is None else view.engine_id

    def instance_of(self, local_id: str) -> str | None:
        view = self._views.get(local_id)
        return None if view is None else view.instance

    def _local(self, view: _View, offset: float) -> float:
        deadline = view.local_deadline
        if deadline is None:
            deadline = view.local_deadline = view.grantor_deadline - offset
        elif deadline == _ENDED:
            return deadline
        if view.first_answer is not None and view.chunk is not None:
            answer = self._chunk_answers.get((view.engine_id, view.chunk))
            if (
                answer is not None
                and answer.version >= view.joined
                and answer.chain_start <= view.first_answer
                and answer.started + view.extension > deadline
            ):
                deadline = view.local_deadline = answer.started + view.extension
        return deadline
