"""The wire format D and P exchange as NIXL notifications, and the lease arithmetic
both sides derive from ``kv_lease_duration``.  This is its only home: the core
(twins and Cython modules), the adapter, the tools and the tests all import it.

Messages (byte strings, as upstream vLLM sends them):
- heartbeat, D -> P: ``HB:<id>,<id>,...`` -- extend each named lease;
- completion, D -> P: ``<req_id>:<expected_consumers>`` -- one consumer read the
  blocks; split on the last colon (request ids may contain colons);
- push registration, D -> P (push mode): ``PUSH_REG:...`` -- upstream's own,
  passed through to its code untouched.

Imports nothing from vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable

HEARTBEAT_PREFIX = b"HB:"
HEARTBEAT_SEPARATOR = b","
PUSH_REG_PREFIX = b"PUSH_REG:"
# Largest expected-consumer count accepted (one per D rank; far above any TP).
MAX_EXPECTED_CONSUMERS = 2**31 - 1


# -- heartbeats -----------------------------------------------------------
def is_heartbeat(msg: bytes) -> bool:
    return msg.startswith(HEARTBEAT_PREFIX)


def heartbeat_payload(msg: bytes) -> bytes:
    """The id list of a heartbeat message (the bytes after the prefix)."""
    return msg[len(HEARTBEAT_PREFIX) :]


def heartbeat_message(ids: Iterable[str | bytes]) -> bytes:
    """One unchunked ``HB:`` message naming ``ids`` (the core's ``encode_heartbeats``
    chunks to a size limit; this is for callers that need exactly one message)."""
    return HEARTBEAT_PREFIX + HEARTBEAT_SEPARATOR.join(
        i.encode("utf-8") if isinstance(i, str) else i for i in ids
    )


def heartbeat_ids(msg: bytes) -> list[str]:
    """The ids a heartbeat message names, decoded leniently (for accounting on the
    sender; a receiver must use the core, which rejects undecodable ids)."""
    return heartbeat_payload(msg).decode("utf-8", "replace").split(",")


# -- completions ----------------------------------------------------------
def completion_message(req_id: str, expected_consumers: int) -> bytes:
    return f"{req_id}:{expected_consumers}".encode()


def parse_completion(msg: bytes) -> tuple[str, int] | None:
    """Split ``b"<req_id>:<expected_consumers>"`` on the last colon.

    Returns None when the message is not UTF-8, has no colon, has an empty id,
    or the count is not a positive decimal integer of ASCII digits.
    """
    colon = msg.rfind(b":")
    if colon <= 0:
        return None
    count_bytes = msg[colon + 1 :]
    if not count_bytes or not count_bytes.isdigit() or len(count_bytes) > 10:
        return None
    count = int(count_bytes)
    if not 0 < count <= MAX_EXPECTED_CONSUMERS:
        return None
    try:
        req_id = msg[:colon].decode("utf-8")
    except UnicodeDecodeError:
        return None
    return req_id, count


# -- lease arithmetic (upstream's integer arithmetic, so mixed fleets agree) --
def default_lease_extension(lease_duration: float) -> float:
    """How far a heartbeat moves a lease: ``d * 2 // 3``."""
    return lease_duration * 2 // 3


def default_heartbeat_interval(lease_duration: float) -> float:
    """D's heartbeat period: ``d // 6`` (0, every step, for d < 6)."""
    return lease_duration // 6
