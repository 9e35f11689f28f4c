"""What the D scheduler hands its workers for heartbeats and read fencing."""

from __future__ import annotations

from dataclasses import dataclass, field

# Attribute set on upstream's NixlConnectorMetadata: engine id -> EngineHeartbeats.
LEASE_HEARTBEATS_ATTR = "lease_heartbeats"
# Attribute set on upstream's NixlConnectorMetadata: LeaseViewUpdates.
LEASE_VIEWS_ATTR = "lease_views"


@dataclass(slots=True)
class EngineHeartbeats:
    """Pre-encoded ``HB:`` messages for one P engine plus its handshake info.

    Messages are built and chunked once on the scheduler (``max_heartbeat_bytes``
    each), so workers only forward bytes.  ``chunks``: for each message, the
    tracker chunk ``(key, version)`` it encodes (None from other sources), so
    P's answer renews that chunk's views at once (``decode/lease_views.py``).
    ``tagged``: the messages name lease tags (``lease_tags.py``), to go out as
    ``LHBT:``.
    """

    messages: list[bytes]
    host: str
    port: int
    tp_size: int
    dcp_size: int = 1
    pp_size: int = 1
    chunks: list[tuple[int, int]] | None = None
    tagged: bool = False

    def __reduce__(self) -> tuple[type, tuple]:
        # The metadata is pickled every step (multiprocess executor): a plain
        # constructor call unpickles faster than dataclass slot state.
        return EngineHeartbeats, (
            self.messages,
            self.host,
            self.port,
            self.tp_size,
            self.dcp_size,
            self.pp_size,
            self.chunks,
            self.tagged,
        )


@dataclass(slots=True)
class LeaseViewUpdates:
    """Lease views that start and end this step (see ``decode/lease_views.py``)."""

    # local request id -> (P engine id, P's request id, P's deadline on P's clock,
    # extension, P acknowledges heartbeats)
    new: dict[str, tuple[str, str, float, float, bool]]
    dropped: list[str]
    # local request id -> (chunk key, version) of the heartbeat chunk naming
    # it: for the new views, and for views whose ids were repacked.
    chunks: dict[str, tuple[int, int]] = field(default_factory=dict)

    def __reduce__(self) -> tuple[type, tuple]:
        return LeaseViewUpdates, (self.new, self.dropped, self.chunks)  # see EngineHeartbeats


# Attribute set on upstream's NixlConnectorMetadata: the step is idle (idle_pause.py).
LEASE_IDLE_ATTR = "lease_idle_step"
