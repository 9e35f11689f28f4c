"""Pure-Python twin of D's scheduler intake.

D's scheduler hooks only queue what happened: an arrival
``(local id, kv_transfer_params)`` of a plain remote prefill, or a departure
(the local id alone).  ``apply`` replays the queue in order once per step
(from ``build_connector_meta``), so a step's requests cost one call into the
core instead of several Python-level calls each:

- an arrival's remote fields and lease terms are read (``_wire.lease_terms``);
  a request missing a remote field is not heartbeated (upstream's rule); one
  whose terms need a log line (a stock P, malformed fields) or whose fields
  are not the plain types goes to ``arrive_slow``, the adapter's Python path,
  at its place in the order;
- it is tracked in the heartbeat tracker, in the group of its P engine,
  instance and naming (``track``);
- its lease view goes into ``views`` (the adapter's ``LeaseViewCollector``),
  unless it leaves later in the same queue: the view would be dropped unseen;
- a departure drops the view (shipping the id as dropped when the workers had
  it) and untracks the request (``untrack``).

Everything else happens exactly as if each hook had done its part at once:
the tracker sees the same calls in the same order, so chunks, keys, versions
and messages are the same.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .._wire import lease_terms

# Upstream's rule for heartbeating a remote prefill: each of these present.
_REMOTE_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size")


def heartbeat_target(params: Mapping[str, Any], host: Any, port: Any, tp_size: Any) -> tuple[Any, ...]:
    """A new heartbeat group's target, from its first request's params: where its
    P listens (``host``, ``port``, ``tp_size`` and the params' dcp and pp sizes),
    and the KV registration generation they name (the worker checks its type)."""
    return (
        host,
        port,
        tp_size,
        params.get("dcp_size", 1),
        params.get("pp_size", 1),
        params.get("remote_registration_generation", 0),
    )


class Intake:
    """D's scheduler-side bookkeeping of arriving and departing requests.

    ``tracker``: the ``HeartbeatTracker``; ``new_group(engine id, instance,
    tagged, target)`` makes the record of a new heartbeat group (the adapter's
    ``HeartbeatGroup``); ``untrackable(local id, name, exc)`` is told of a
    request the tracker refused (it logs).  Set before ``apply``: ``views``
    (an object with ``enabled`` and the dicts ``new``, ``chunks``,
    ``shipped`` and the list ``dropped``, or None), ``view_type`` (the tuple
    type of a new view), ``tags`` (name leases by tag where allowed) and
    ``arrive_slow(local id, params)`` (the adapter's path for one arrival).
    """

    __slots__ = (
        "tracker",
        "groups",
        "keys",
        "next_key",
        "repacked",
        "events",
        "views",
        "view_type",
        "tags",
        "arrive_slow",
        "new_group",
        "untrackable",
    )

    def __init__(
        self,
        tracker: Any,
        new_group: Callable[[str, str, bool, tuple[Any, ...]], Any],
        untrackable: Callable[[str, str, Exception], None],
    ) -> None:
        self.tracker = tracker
        self.groups: dict[str, Any] = {}  # tracker key (one per group) -> the group
        self.keys: dict[tuple[str, str, bool], str] = {}  # (engine, instance, tagged) -> tracker key
        self.next_key = 0
        self.repacked: set[str] = set()  # groups whose chunks were repacked since the adapter looked
        # Arrivals ``(local id, params)`` and departures (a local id), in order.
        self.events: list[Any] = []
        self.views: Any = None
        self.view_type: Any = tuple
        self.tags = False
        self.arrive_slow: Callable[[str, Any], None] | None = None
        self.new_group = new_group
        self.untrackable = untrackable

    def apply(self) -> None:
        """Replay the queued events in order, then empty the queue (also when
        a callback raises: no event is replayed twice)."""
        events = self.events
        if not events:
            return
        try:
            # A view whose request leaves later in the queue is never built.
            last_leave: dict[Any, int] = {}
            for i, event in enumerate(events):
                if type(event) is not tuple:
                    last_leave[event] = i
            views = self.views
            fencing = views is not None and views.enabled
            cancelled: set[Any] = set()
            for i, event in enumerate(events):
                if type(event) is tuple:
                    local_id, params = event
                    self._arrive(local_id, params, fencing, last_leave.get(local_id, -1) > i, cancelled)
                else:
                    if views is not None:
                        self._drop_view(views, event, cancelled)
                    self.untrack(event)
        finally:
            del events[:]

    def _arrive(self, local_id: Any, params: Any, fencing: bool, leaves: bool, cancelled: set[Any]) -> None:
        if type(params) is not dict or type(local_id) is not str:
            self._slow(local_id, params)
            return
        engine_id, remote_id, host, port, tp_size = map(params.get, _REMOTE_FIELDS)
        if engine_id is None or remote_id is None or host is None or port is None or tp_size is None:
            return
        if type(engine_id) is not str or type(remote_id) is not str:
            self._slow(local_id, params)
            return
        terms = None
        if fencing:
            try:
                terms = lease_terms(params)
            except ValueError:
                terms = None
            if terms is None:  # malformed, or a stock P: the adapter logs it
                self._slow(local_id, params)
                return
        target = heartbeat_target(params, host, port, tp_size)
        instance = "" if terms is None else terms.instance
        tag = None if terms is None else terms.tag
        tagged = bool(instance) and self.tags and tag is not None
        name = tag if tagged and tag is not None else remote_id
        if not self.track(local_id, engine_id, instance, tagged, name, target) or terms is None:
            return
        if leaves:
            cancelled.add(local_id)  # its departure drops it as it would the view
            return
        views = self.views
        views.new[local_id] = tuple.__new__(
            self.view_type,
            (engine_id, instance, name, terms.deadline, terms.extension, terms.interval, terms.hello_version),
        )
        chunk = self.tracker.chunk_of(local_id)
        if chunk is not None:
            views.chunks[local_id] = chunk

    def _slow(self, local_id: Any, params: Any) -> None:
        slow = self.arrive_slow
        if slow is not None:
            slow(local_id, params)

    @staticmethod
    def _drop_view(views: Any, local_id: Any, cancelled: set[Any]) -> None:
        views.chunks.pop(local_id, None)
        if local_id in cancelled:  # as the view's add then drop would leave it
            cancelled.discard(local_id)
            views.new.pop(local_id, None)
        elif views.new.pop(local_id, None) is None and views.shipped.pop(local_id, None) is not None:
            views.dropped.append(local_id)

    def track(
        self, local_id: str, engine_id: str, instance: str, tagged: bool, name: str, target: tuple[Any, ...]
    ) -> bool:
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

    def untrack(self, local_id: Any) -> None:
        tracker = self.tracker
        key = tracker.engine_of(local_id)
        if key is not None:
            repacks = tracker.repacks
            tracker.untrack(local_id)
            if not tracker.has_engine(key):
                group = self.groups.pop(key)
                del self.keys[(group.engine_id, group.instance, group.tagged)]
            elif tracker.repacks != repacks:
                self.repacked.add(key)
