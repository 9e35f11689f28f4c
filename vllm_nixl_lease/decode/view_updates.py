"""D's lease view updates packed for the scheduler-to-worker trip
(``_view_updates_py.py`` is the reference and gives the layout; the Cython
module packs identically)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._implementation import choose

if TYPE_CHECKING:
    from ._view_updates_py import pack_views, unpack_views
else:
    _chosen = choose(__package__, "_view_updates_c", "_view_updates_py")
    pack_views = _chosen.pack_views
    unpack_views = _chosen.unpack_views

__all__ = ["pack_views", "unpack_views"]
