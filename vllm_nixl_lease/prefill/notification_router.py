"""P's notification router: one step's NIXL notifications applied to the lease
table (``_notification_router_py.py`` is the reference; the Cython module
behaves identically)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._implementation import choose

if TYPE_CHECKING:
    from ._notification_router_py import NotificationRouter
else:
    NotificationRouter = choose(__package__, "_lease_c", "_notification_router_py").NotificationRouter

__all__ = ["NotificationRouter"]
