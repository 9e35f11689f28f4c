"""What the D scheduler hands its workers for heartbeats and read fencing."""

from __future__ import annotations

from dataclasses import dataclass

# Attribute set on upstream's NixlConnectorMetadata: engine id -> EngineHeartbeats.
LEASE_HEARTBEATS_ATTR = "lease_heartbeats"
# Attribute set on upstream's NixlConnectorMetadata: LeaseViewUpdates.
LEASE_VIEWS_ATTR = "lease_views"


@dataclass(slots=True)
class EngineHeartbeats:
    """Pre-encoded ``HB:`` messages for one P engine plus its handshake info.

    Messages are built and chunked once on the scheduler (``max_heartbeat_bytes``
    each), so workers only forward bytes.
    """

    messages: list[bytes]
    host: str
    port: int
    tp_size: int
    dcp_size: int = 1
    pp_size: int = 1


@dataclass(slots=True)
class LeaseViewUpdates:
    """Lease views that start and end this step (see ``holder_view.py``)."""

    # local request id -> (P engine id, P's request id, P's deadline on P's clock,
    # extension, P acknowledges heartbeats)
    new: dict[str, tuple[str, str, float, float, bool]]
    dropped: list[str]


# Attribute set on upstream's NixlConnectorMetadata: the step is idle (idle_pause.py).
LEASE_IDLE_ATTR = "lease_idle_step"
