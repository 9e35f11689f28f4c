"""The lease holder's (D's) conservative view of the leases P granted it.

P frees a request's KV blocks when its lease ends; D must never READ them after
that.  D cannot see P's table, so it keeps a *view* that is never later than
P's real deadline (Gray and Cheriton's rule: the holder lets a lease expire
earlier than the grantor does):

- it starts at the deadline P reported (P's clock), converted with the clock
  offset measured at the NIXL handshake;
- from a P that acknowledges heartbeats (``acked`` views): P's answer to a
  heartbeat D sent at local time ``t`` renews the view to ``t + extension``
  (``heartbeat_acked``; ``ack_ledger.py`` says why that needs no assumption
  about delivery);
- from a P that does not, a heartbeat D sent at ``t`` renews the view to
  ``t + extension`` only if the view still had more than ``margin`` left when
  the send finished (``heartbeat_sent``).  P applies a heartbeat before it
  sweeps in the same step, so a heartbeat that reaches P within ``margin``
  cannot arrive after P's deadline, and P's new deadline is at least its
  arrival time (>= ``t``) plus the extension.  This assumes delivery within
  ``margin``, which a partition breaks (UCX queues the send and delivers it
  after the heal); acknowledged views assume nothing about delivery;
- before D reads, ``remaining`` must exceed ``margin`` (room for the READ itself
  and for the clock-offset estimate), or D fences the read.

Renewed per chunk, not per id.  D's scheduler packs the ids it heartbeats into
chunks, each one message (``HeartbeatTracker``); a chunk has a key and a
version bumped whenever its ids change or one of them is tracked again.  A
view knows its chunk and the version at which it joined (``joined``).  P's
answer to the message of chunk ``key`` at version ``v`` sent at ``started``
(``chunk_acked``) is stored once per chunk, O(1) instead of O(ids); a view
takes it up when read (``_local``), only if ``joined <= v``:
- an id that joined the chunk after the message was built was not in it;
- a view added again (reset) joined at a version above every older message,
  so an answer to one of those cannot renew the new view.
An id P said it did not extend first takes up what the chunk had proven
before, then joins above ``v``.  Answers only ever move views forward.

No vLLM imports: the vLLM adapter feeds it (``vllm/d_worker/read_fence.py``,
``vllm/d_worker/ack_requester.py``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass


@dataclass(slots=True)
class _View:
    engine_id: str
    remote_id: str
    grantor_deadline: float  # as reported by P, on P's clock
    extension: float  # P's heartbeat extension
    acked: bool = False  # P acknowledges heartbeats: renew only on its answers
    local_deadline: float | None = None  # on D's clock, once converted
    chunk: int | None = None  # key of the heartbeat chunk naming it
    joined: int = 0  # that chunk's version when the view joined it


class LeaseViews:
    """Views of P's leases, keyed by D's request id and by (P engine, P's id)."""

    def __init__(self, margin: float) -> None:
        if not (math.isfinite(margin) and margin >= 0):
            raise ValueError(f"margin must be a finite number >= 0, got {margin!r}")
        self.margin = margin
        self._views: dict[str, _View] = {}
        # (P engine, P's id) -> the local ids viewing it (several D requests
        # may wait on one P request; an answer about it renews each)
        self._by_remote: dict[tuple[str, str], list[str]] = {}
        # Engines that acknowledge heartbeats (learnt from their views; kept).
        self.acked_engines: set[str] = set()
        self.max_extension = 0.0  # the longest extension any view had
        # (engine, chunk key) -> (version, started) of the latest acknowledged
        # message of that chunk; oldest first (for pruning).
        self._chunk_acks: OrderedDict[tuple[str, int], tuple[int, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._views)

    def __contains__(self, local_id: object) -> bool:
        return local_id in self._views

    def add(
        self,
        local_id: str,
        engine_id: str,
        remote_id: str,
        grantor_deadline: float,
        extension: float,
        acked: bool = False,
        chunk: tuple[int, int] | None = None,
    ) -> None:
        """Start viewing a lease P reported; a second add for the same id replaces
        the first.  ``acked``: P answers heartbeats, so only answers renew it.
        ``chunk``: ``(key, version)`` of the heartbeat chunk naming it, as
        ``HeartbeatTracker.chunk_of`` returned right after tracking it."""
        if not (math.isfinite(grantor_deadline) and math.isfinite(extension) and extension > 0):
            raise ValueError(
                f"lease of {local_id!r}: deadline {grantor_deadline!r} / extension {extension!r} "
                "must be finite and the extension > 0"
            )
        if local_id in self._views:
            self.drop(local_id)
        extension = float(extension)
        if chunk is None:
            view = _View(engine_id, remote_id, float(grantor_deadline), extension, acked)
        else:
            view = _View(engine_id, remote_id, float(grantor_deadline), extension, acked, None, *chunk)
        self._views[local_id] = view
        key = (engine_id, remote_id)
        sharing = self._by_remote.get(key)
        if sharing is None:
            self._by_remote[key] = [local_id]
        else:
            sharing.append(local_id)
        if acked and engine_id not in self.acked_engines:
            self.acked_engines.add(engine_id)
        if extension > self.max_extension:
            self.max_extension = extension

    def drop(self, local_id: str) -> bool:
        view = self._views.pop(local_id, None)
        if view is None:
            return False
        key = (view.engine_id, view.remote_id)
        sharing = self._by_remote[key]
        if len(sharing) == 1:
            del self._by_remote[key]
        else:
            sharing.remove(local_id)
        return True

    def heartbeat_sent(
        self, engine_id: str, remote_ids: Iterable[str], offset: float, started: float, finished: float
    ) -> int:
        """Account one heartbeat to ``engine_id`` sent between ``started`` and ``finished``
        (D's clock); ``offset`` is P's clock minus D's.  Returns how many views it renewed."""
        renewed = 0
        for view in self._named(engine_id, remote_ids):
            if view.acked:
                continue  # only P's answer renews it
            deadline = self._local(view, offset)
            # Judged at the end of the send (latest moment it left), renewed
            # from its start (earliest moment P can have received it).
            if deadline - finished > self.margin:
                view.local_deadline = max(deadline, started + view.extension)
                renewed += 1
        return renewed

    def heartbeat_acked(
        self, engine_id: str, remote_ids: Iterable[str], offset: float, started: float
    ) -> int:
        """P applied a heartbeat D sent at ``started`` (D's clock) to each of
        ``remote_ids`` while it held their leases: renew them to ``started +
        extension``.  Returns how many views it renewed."""
        renewed = 0
        for view in self._named(engine_id, remote_ids):
            deadline = self._local(view, offset)
            if started + view.extension > deadline:
                view.local_deadline = started + view.extension
                renewed += 1
        return renewed

    def move_to_chunk(self, local_id: str, chunk: tuple[int, int], offset: float | None) -> bool:
        """The view's id now lives in chunk ``(key, version)`` (its engine was
        repacked); what its old chunk proved is kept.  ``offset``: P's clock
        minus D's, None while unknown (then the old chunk's proof is dropped:
        conservative).  Returns False when ``local_id`` is not viewed."""
        view = self._views.get(local_id)
        if view is None:
            return False
        if offset is not None:
            self._local(view, offset)  # take up the old chunk's proof first
        key, version = chunk
        if key == view.chunk:
            # Not moved after all: never lower ``joined`` (an id P disowned
            # joined above the answer that disowned it).
            view.joined = max(view.joined, version)
        else:
            view.chunk, view.joined = key, version
        return True

    def chunk_acked(
        self,
        engine_id: str,
        key: int,
        version: int,
        started: float,
        not_extended: Iterable[str] = (),
        offset: float | None = None,
    ) -> None:
        """P applied the message of chunk ``key`` at ``version``, sent at
        ``started`` (D's clock), to every id in it except ``not_extended``:
        renews each view that joined that chunk at or before ``version`` to
        ``started + extension``, lazily (see the module docstring)."""
        ack_key = (engine_id, key)
        acks = self._chunk_acks
        if not_extended:
            for view in self._named(engine_id, not_extended):
                if view.chunk == key and view.joined <= version:
                    if offset is not None:
                        self._local(view, offset)  # keep what earlier answers proved
                    view.joined = version + 1
        prior = acks.get(ack_key)
        if prior is None or started > prior[1]:
            # Messages are built and sent in order: a later send has a version
            # at least as high, so the latest send is the only one worth keeping.
            acks[ack_key] = (max(version, prior[0]) if prior else version, started)
            acks.move_to_end(ack_key)

    def prune_chunk_acks(self, sent_before: float) -> int:
        """Forget chunk answers to sends before ``sent_before`` (their renewals
        are over by then; forgetting only ever shortens a view)."""
        acks = self._chunk_acks
        dropped = 0
        while acks:
            key, (_, started) = next(iter(acks.items()))
            if started >= sent_before:
                break
            acks.popitem(last=False)
            dropped += 1
        return dropped

    def _named(self, engine_id: str, remote_ids: Iterable[str]) -> Iterator[_View]:
        """The views of those of ``remote_ids`` (P's ids on ``engine_id``) that D views."""
        by_remote, views = self._by_remote, self._views
        for remote_id in remote_ids:
            sharing = by_remote.get((engine_id, remote_id))
            if sharing is not None:
                for local_id in sharing:
                    yield views[local_id]

    def remaining(self, local_id: str, now: float, offset: float) -> float | None:
        """Seconds the view of ``local_id`` has left at ``now`` (D's clock); None if not viewed."""
        view = self._views.get(local_id)
        if view is None:
            return None
        return self._local(view, offset) - now

    def may_read(self, local_id: str, now: float, offset: float) -> bool | None:
        """True if a READ may start now, False to fence it, None if ``local_id`` is not viewed."""
        left = self.remaining(local_id, now, offset)
        return None if left is None else left > self.margin

    def engine_of(self, local_id: str) -> str | None:
        view = self._views.get(local_id)
        return None if view is None else view.engine_id

    def _local(self, view: _View, offset: float) -> float:
        deadline = view.local_deadline
        if deadline is None:
            deadline = view.local_deadline = view.grantor_deadline - offset
        if view.chunk is not None:
            ack = self._chunk_acks.get((view.engine_id, view.chunk))
            if ack is not None and ack[0] >= view.joined and view.acked:
                renewed = ack[1] + view.extension
                if renewed > deadline:
                    deadline = view.local_deadline = renewed
        return deadline
