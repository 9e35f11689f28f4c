"""Fast, trustworthy KV-cache lease renewal for vLLM's NIXL connector.

The lease core (``LeaseTable``, ``NotificationRouter``, ``HeartbeatTracker``,
``encode_heartbeats``) imports nothing from vLLM.
"""

from __future__ import annotations

from ._chooser import IMPLEMENTATION, HeartbeatTracker, LeaseTable, NotificationRouter, encode_heartbeats
from ._route_result import RouteResult

__version__ = "0.1.0"

__all__ = [
    "IMPLEMENTATION",
    "HeartbeatTracker",
    "LeaseTable",
    "NotificationRouter",
    "RouteResult",
    "__version__",
    "encode_heartbeats",
]
