"""Stand-ins for upstream's ``_reqs_to_send`` dict and ``_reqs_to_process``
set, backed by the lease core.

Upstream code we do not override (both ``start_load_kv`` variants, the push
worker's ``get_transfer_results``, which ours only wraps, and, in 0.32, its
``_get_new_notifs``) keeps reading and writing those two attributes directly.  Giving it views instead
of copies means the grant path, the deadline rebasing onto the worker clock
and the push completion path stay exactly upstream's code, while every lease
lives in one place: the ``NotificationRouter``/``LeaseTable``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ...prefill.notification_router import NotificationRouter

_MISSING: Any = object()


class ReqsToSendDict(MutableMapping[str, float]):
    """``_reqs_to_send``: request id -> lease deadline, on the worker clock."""

    __slots__ = ("_router", "_on_grant", "_on_release")

    def __init__(
        self,
        router: NotificationRouter,
        on_grant: Callable[[str], None] | None = None,
        on_release: Callable[[str], None] | None = None,
    ) -> None:
        self._router = router
        self._on_grant = on_grant
        self._on_release = on_release

    def __getitem__(self, req_id: str) -> float:
        deadline = self._router.table.deadline(req_id)
        if deadline is None:
            raise KeyError(req_id)
        return deadline

    def __setitem__(self, req_id: str, deadline: float) -> None:
        # Upstream only assigns for requests in a batch; a direct assignment
        # outside one is still a grant (the dict would have accepted it).
        if not self._router.grant(req_id, deadline):
            self._router.table.grant(req_id, deadline)
        if self._on_grant is not None:
            self._on_grant(req_id)

    def __delitem__(self, req_id: str) -> None:
        if not self._router.release(req_id):
            raise KeyError(req_id)
        if self._on_release is not None:
            self._on_release(req_id)

    def pop(self, req_id: str, default: Any = _MISSING) -> Any:
        deadline = self._router.table.deadline(req_id)
        if deadline is None:
            if default is _MISSING:
                raise KeyError(req_id)
            return default
        del self[req_id]
        return deadline

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._router.table

    def __iter__(self) -> Iterator[str]:
        return iter(self._router.table.ids())

    def __len__(self) -> int:
        return len(self._router.table)

    def __repr__(self) -> str:
        return f"<ReqsToSendDict leases={len(self)}>"


class ReqsToProcessSet:
    """``_reqs_to_process``: requests that were part of a batch."""

    __slots__ = ("_router",)

    def __init__(self, router: NotificationRouter) -> None:
        self._router = router

    def add(self, req_id: str) -> None:
        self._router.add_in_batch(req_id)

    def discard(self, req_id: str) -> None:
        self._router.discard_in_batch(req_id)

    def remove(self, req_id: str) -> None:
        if not self._router.is_in_batch(req_id):
            raise KeyError(req_id)
        self._router.discard_in_batch(req_id)

    def __contains__(self, req_id: object) -> bool:
        return isinstance(req_id, str) and self._router.is_in_batch(req_id)

    def __len__(self) -> int:
        return self._router.in_batch_count()

    def __bool__(self) -> bool:
        return self._router.in_batch_count() > 0

    def __repr__(self) -> str:
        return f"<ReqsToProcessSet requests={len(self)}>"
