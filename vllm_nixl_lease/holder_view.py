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

No vLLM imports: the vLLM adapter feeds it (``vllm/read_fence.py``).
"""

from __future__ import annotations

import math
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


class HolderLeaseViews:
    """Views of P's leases, keyed by D's request id and by (P engine, P's id)."""

    def __init__(self, margin: float) -> None:
        if not (math.isfinite(margin) and margin >= 0):
            raise ValueError(f"margin must be a finite number >= 0, got {margin!r}")
        self.margin = margin
        self._views: dict[str, _View] = {}
        self._by_remote: dict[tuple[str, str], str] = {}
        # Engines that acknowledge heartbeats (learnt from their views; kept).
        self.acked_engines: set[str] = set()
        self.max_extension = 0.0  # the longest extension any view had

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
    ) -> None:
        """Start viewing a lease P reported; a second add for the same id replaces
        the first.  ``acked``: P answers heartbeats, so only answers renew it."""
        if not (math.isfinite(grantor_deadline) and math.isfinite(extension) and extension > 0):
            raise ValueError(
                f"lease of {local_id!r}: deadline {grantor_deadline!r} / extension {extension!r} "
                "must be finite and the extension > 0"
            )
        self.drop(local_id)
        self._views[local_id] = _View(engine_id, remote_id, float(grantor_deadline), float(extension), acked)
        self._by_remote[(engine_id, remote_id)] = local_id
        if acked:
            self.acked_engines.add(engine_id)
        self.max_extension = max(self.max_extension, float(extension))

    def drop(self, local_id: str) -> bool:
        view = self._views.pop(local_id, None)
        if view is None:
            return False
        key = (view.engine_id, view.remote_id)
        if self._by_remote.get(key) == local_id:
            del self._by_remote[key]
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

    def _named(self, engine_id: str, remote_ids: Iterable[str]) -> Iterator[_View]:
        """The views of those of ``remote_ids`` (P's ids on ``engine_id``) that D views."""
        by_remote, views = self._by_remote, self._views
        for remote_id in remote_ids:
            local_id = by_remote.get((engine_id, remote_id))
            if local_id is not None:
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

    @staticmethod
    def _local(view: _View, offset: float) -> float:
        if view.local_deadline is None:
            view.local_deadline = view.grantor_deadline - offset
        return view.local_deadline
