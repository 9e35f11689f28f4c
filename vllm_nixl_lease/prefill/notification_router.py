"""P's notification router: one step's NIXL notifications applied to the lease
table (``_notification_router_py.py`` is the reference; the Cython module
behaves identically)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._implementation import choose

if TYPE_CHECKING:
    from ._notification_router_py import NotificationRouter
else:
    # Importing the Cython router imports the Cython table, so the two
    # choosers agree (see lease_table.py).
    NotificationRouter = choose(
        __package__, "_notification_router_c", "_notification_router_py"
    ).NotificationRouter

__all__ = ["NotificationRouter"]
