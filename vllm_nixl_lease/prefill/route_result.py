"""Result of routing one engine step's notifications (shared by both twins)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

# How many malformed messages a result keeps verbatim for logging.
MALFORMED_SAMPLE_SIZE = 3
# Each kept sample is cut to this many bytes so a huge rogue message cannot
# bloat logs.
MALFORMED_SAMPLE_BYTES = 64
# Same for read completions of unknown requests: a few ids, each cut short.
UNKNOWN_SAMPLE_SIZE = 3
UNKNOWN_ID_CHARS = 64


def malformed_sample(msg: object) -> bytes:
    """What a result keeps of a malformed message: its first bytes, or the
    type name of something that is not bytes at all."""
    if isinstance(msg, bytes):
        return bytes(msg[:MALFORMED_SAMPLE_BYTES])
    return f"<{type(msg).__name__}>".encode()[:MALFORMED_SAMPLE_BYTES]


def unknown_sample_id(req_id: str) -> str:
    """An unknown request id as kept for logging: at most UNKNOWN_ID_CHARS + 3."""
    return req_id if len(req_id) <= UNKNOWN_ID_CHARS else req_id[:UNKNOWN_ID_CHARS] + "..."


@dataclass(slots=True)
class RouteResult:
    """What one call to ``NotificationRouter.route`` did.

    ``completed``: requests whose last expected read completion arrived, in
    arrival order; their leases are released.  ``unknown``: how many read
    completions named requests neither leased nor in a batch (upstream's
    "notifications after expiry"); ``unknown_sample``: the first few of their
    ids, cut to ``UNKNOWN_ID_CHARS``, so a flood of them costs a count, not a
    list or a log line each.  ``malformed``: messages that are not bytes, or
    neither ``HB:...`` nor ``id:count``, with a short sample likewise.
    ``passthrough``: messages with a prefix the router does not own (e.g.
    ``PUSH_REG:``), per agent, untouched.
    """

    completed: list[str] = field(default_factory=list)
    heartbeat_messages: int = 0
    heartbeat_ids: int = 0
    extended: int = 0
    unknown: int = 0
    unknown_sample: list[str] = field(default_factory=list)
    malformed: int = 0
    malformed_sample: list[bytes] = field(default_factory=list)
    passthrough: dict[str, list[bytes]] = field(default_factory=dict)

    @property
    def unknown_heartbeat_ids(self) -> int:
        return self.heartbeat_ids - self.extended


class Expiry(NamedTuple):
    """What one call to ``NotificationRouter.expire`` removed.

    ``ids``: the expired requests, earliest deadline first.  ``reads``: read
    completions seen, for those of them some consumer had read (most have
    none, so a sweep builds no per-request object).
    """

    ids: list[str]
    reads: dict[str, int]
