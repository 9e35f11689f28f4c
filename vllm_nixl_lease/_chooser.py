"""Pick the Cython core or its pure-Python twin, once, at import time.

``VLLM_NIXL_LEASE_NO_EXTENSIONS=1`` forces the twin; a missing or broken
extension falls back to the twin with one warning.
"""

from __future__ import annotations

import os
import warnings

NO_EXTENSIONS_ENV = "VLLM_NIXL_LEASE_NO_EXTENSIONS"


def extensions_disabled() -> bool:
    return os.environ.get(NO_EXTENSIONS_ENV, "").strip().lower() not in ("", "0", "false", "no")


if extensions_disabled():
    from ._heartbeat_py import HeartbeatTracker, encode_heartbeats
    from ._lease_table_py import LeaseTable
    from ._router_py import NotificationRouter

    IMPLEMENTATION = "python"
else:
    try:
        from ._heartbeat_c import HeartbeatTracker, encode_heartbeats  # type: ignore[no-redef]
        from ._lease_c import LeaseTable, NotificationRouter  # type: ignore[no-redef]

        IMPLEMENTATION = "cython"
    except ImportError as exc:  # pragma: no cover - depends on the build
        warnings.warn(
            f"vllm_nixl_lease: Cython extension unavailable ({exc}); using the pure-Python core",
            RuntimeWarning,
            stacklevel=2,
        )
        from ._heartbeat_py import HeartbeatTracker, encode_heartbeats
        from ._lease_table_py import LeaseTable
        from ._router_py import NotificationRouter

        IMPLEMENTATION = "python"

__all__ = ["HeartbeatTracker", "IMPLEMENTATION", "LeaseTable", "NotificationRouter", "encode_heartbeats"]
