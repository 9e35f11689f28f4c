"""D's conservative views of the leases P granted it (``_lease_views_py.py`` is
the reference and says how they work; the Cython module behaves identically)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._implementation import choose

if TYPE_CHECKING:
    from ._lease_views_py import CLAIMED, FENCED, LeaseViews
else:
    _chosen = choose(__package__, "_lease_views_c", "_lease_views_py")
    LeaseViews = _chosen.LeaseViews
    FENCED = _chosen.FENCED
    CLAIMED = _chosen.CLAIMED

__all__ = ["CLAIMED", "FENCED", "LeaseViews"]
