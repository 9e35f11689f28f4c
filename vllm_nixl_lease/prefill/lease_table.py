"""P's lease table: request id -> deadline (``_lease_table_py.py`` is the
reference; the Cython module behaves identically)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._implementation import choose

if TYPE_CHECKING:
    from ._lease_table_py import LeaseTable
else:
    # The Cython router takes only the Cython table: both, or neither.
    LeaseTable = choose(
        __package__, "_lease_table_c", "_lease_table_py", requires=("_notification_router_c",)
    ).LeaseTable

__all__ = ["LeaseTable"]
