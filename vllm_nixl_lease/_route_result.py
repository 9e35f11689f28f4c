"""Result of routing one engine step's notifications (shared by both twins)."""

from __future__ import annotations

from dataclasses import dataclass, field

# How many malformed messages a result keeps verbatim for logging.
MALFORMED_SAMPLE_SIZE = 3
# Each kept sample is cut to this many bytes so a huge rogue message cannot
# bloat logs.
MALFORMED_SAMPLE_BYTES = 64


@dataclass(slots=True)
class RouteResult:
    """What one call to ``NotificationRouter.route`` did.

    ``completed``: requests whose last expected read completion arrived, in
    arrival order; their leases are released.  ``unknown_completions``: read
    completions for requests neither leased nor in a batch (upstream counts
    these as "notifications after expiry").  ``passthrough``: messages with a
    prefix the router does not own (e.g. ``PUSH_REG:``), per agent, untouched.
    """

    completed: list[str] = field(default_factory=list)
    heartbeat_messages: int = 0
    heartbeat_ids: int = 0
    extended: int = 0
    unknown_completions: list[str] = field(default_factory=list)
    malformed: int = 0
    malformed_sample: list[bytes] = field(default_factory=list)
    passthrough: dict[str, list[bytes]] = field(default_factory=dict)

    @property
    def unknown_heartbeat_ids(self) -> int:
        return self.heartbeat_ids - self.extended
