"""D's heartbeat tracker: the P-side ids D keeps alive, per P engine, as
cached ``HB:`` chunks (``_heartbeat_tracker_py.py`` is the reference; the
Cython module behaves identically)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._implementation import choose

if TYPE_CHECKING:
    from ._heartbeat_tracker_py import HeartbeatTracker, encode_heartbeats
else:
    _chosen = choose(__package__, "_heartbeat_tracker_c", "_heartbeat_tracker_py")
    HeartbeatTracker = _chosen.HeartbeatTracker
    encode_heartbeats = _chosen.encode_heartbeats

__all__ = ["HeartbeatTracker", "encode_heartbeats"]
