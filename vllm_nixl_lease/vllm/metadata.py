"""What the D scheduler hands its workers for heartbeats."""

from __future__ import annotations

from dataclasses import dataclass

# Attribute set on upstream's NixlConnectorMetadata: engine id -> EngineHeartbeats.
LEASE_HEARTBEATS_ATTR = "lease_heartbeats"


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
