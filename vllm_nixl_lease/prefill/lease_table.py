"""P's lease table: request id -> deadline (``_lease_table_py.py`` is the
reference; the Cython module behaves identically)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._implementation import choose

if TYPE_CHECKING:
    from ._lease_table_py import LeaseTable
else:
    LeaseTable = choose(__package__, "_lease_c", "_lease_table_py").LeaseTable

__all__ = ["LeaseTable"]
