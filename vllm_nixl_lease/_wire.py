"""The wire format D and P exchange as NIXL notifications, and the lease arithmetic
both sides derive from ``kv_lease_duration``.  This is its only home: the core
(twins and Cython modules), the adapter, the tools and the tests all import it.

Messages (byte strings, as upstream vLLM sends them):
- heartbeat, D -> P: ``HB:<id>,<id>,...`` -- extend each named lease;
- completion, D -> P: ``<req_id>:<expected_consumers>`` -- one consumer read the
  blocks; split on the last colon (request ids may contain colons);
- push registration, D -> P (push mode): ``PUSH_REG:...`` -- upstream's own,
  passed through to its code untouched.

Ours only, sent only to a peer that advertised it (a stock P never sees them;
see ``vllm/d_worker/ack_requester.py``):
- acknowledged heartbeat, D -> P: ``LHB:<seq>:<id>,<id>,...`` -- a heartbeat
  (same id list as ``HB:``) that P answers with an acknowledgement;
- tagged heartbeat, D -> P: ``LHBT:<seq>:<tag>,<tag>,...`` -- the same, naming
  each lease by its 11-byte tag (``lease_tags.py``) instead of its id; only to
  a P that advertised tags; P's answer names the tags it did not extend;
- acknowledgement, P -> D: ``LACK:<seq>,<seq>,...`` (every id those
  heartbeats named was leased and is now extended) or
  ``LACK:<seqs>:<id>,<id>,...`` (these ids were not leased, the rest were) or
  ``LACK:<seqs>:*`` (treat none as extended); one per D agent per P step;
- hello, D -> P: ``LHELLO:<NIXL agent metadata>`` -- D's connection info
  (no memory), so P can send acknowledgements back.

Imports nothing from vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

HEARTBEAT_PREFIX = b"HB:"
HEARTBEAT_SEPARATOR = b","
# The lease protocol's escape (docs/PROTOCOL.md section 2): a heartbeat whose
# first id is empty, which no D names; our P passes every such message to the
# protocol's components, and a stock P parses it as a harmless heartbeat.
EXTENSION_PREFIX = HEARTBEAT_PREFIX + HEARTBEAT_SEPARATOR
PUSH_REG_PREFIX = b"PUSH_REG:"
ACKED_HEARTBEAT_PREFIX = b"LHB:"
TAGGED_HEARTBEAT_PREFIX = b"LHBT:"
HEARTBEAT_ACK_PREFIX = b"LACK:"
ACK_HELLO_PREFIX = b"LHELLO:"
# Messages P or D route to the ack components instead of the lease core.
ACK_PREFIXES = (ACKED_HEARTBEAT_PREFIX, TAGGED_HEARTBEAT_PREFIX, HEARTBEAT_ACK_PREFIX, ACK_HELLO_PREFIX)
# "None of the ids counts as extended" (the ack's id list would be too long).
ACK_NONE = b"*"
# Bytes the longest acknowledged header, ``LHBT:<seq>:`` (seq < 2**64), adds
# over ``HB:``: heartbeats are chunked this much smaller, so every form fits
# ``max_heartbeat_bytes``.
ACKED_HEARTBEAT_OVERHEAD = len(TAGGED_HEARTBEAT_PREFIX) + 20 + 1 - 3
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


def request_id_bytes(req_id: object) -> bytes:
    """A request id as it goes on the wire: a str's UTF-8 bytes, bytes as
    they are; TypeError for anything else (UnicodeEncodeError for a str
    that is not UTF-8)."""
    if isinstance(req_id, str):
        return req_id.encode("utf-8")
    if isinstance(req_id, bytes):
        return req_id
    raise TypeError(f"request id must be str or bytes, got {type(req_id).__name__}")


# -- acknowledged heartbeats (ours only) ----------------------------------
def acked_heartbeat_message(seq: int, heartbeat: bytes, tagged: bool = False) -> bytes:
    """The ``LHB:`` form of an ``HB:`` message, asking for acknowledgement
    ``seq``; ``LHBT:`` when its payload names tags instead of ids."""
    prefix = TAGGED_HEARTBEAT_PREFIX if tagged else ACKED_HEARTBEAT_PREFIX
    return b"%s%d:%s" % (prefix, seq, heartbeat_payload(heartbeat))


def parse_acked_heartbeat(msg: bytes) -> tuple[int, bytes] | None:
    """``(seq, payload)`` of an ``LHB:`` or ``LHBT:`` message; None when malformed."""
    prefix = TAGGED_HEARTBEAT_PREFIX if msg.startswith(TAGGED_HEARTBEAT_PREFIX) else ACKED_HEARTBEAT_PREFIX
    head, rest = _split_head(msg, prefix)
    seq = _seq(head)
    return None if seq is None or rest is None else (seq, rest)


def is_tagged_heartbeat(msg: bytes) -> bool:
    return msg.startswith(TAGGED_HEARTBEAT_PREFIX)


def heartbeat_ack_message(seqs: Iterable[int], not_extended: bytes = b"") -> bytes:
    """``LACK:<seq>,...[:<ids>]``; ``not_extended`` is a comma-joined id list or
    ``ACK_NONE``, and applies to every listed heartbeat (an id missing from one
    counts as missing from all: conservative)."""
    head = HEARTBEAT_ACK_PREFIX + b",".join(b"%d" % seq for seq in seqs)
    return head + b":" + not_extended if not_extended else head


def parse_heartbeat_ack(msg: bytes) -> tuple[list[int], frozenset[str] | None] | None:
    """``(seqs, ids P did not extend)`` of an ``LACK:`` message, the set None for
    "none extended"; None when malformed."""
    seq_list, rest = _split_head(msg, HEARTBEAT_ACK_PREFIX)
    seqs = [_seq(digits) for digits in seq_list.split(b",")]
    if None in seqs:
        return None
    rest = rest or b""
    if not rest:
        return seqs, frozenset()
    if rest == ACK_NONE:
        return seqs, None
    try:
        return seqs, frozenset(rest.decode("utf-8").split(","))
    except UnicodeDecodeError:
        return seqs, None  # cannot tell which: none counts


def _split_head(msg: bytes, prefix: bytes) -> tuple[bytes, bytes | None]:
    # b"<prefix><head>" -> (head, None); b"<prefix><head>:<rest>" -> (head, rest)
    body = msg[len(prefix) :]
    colon = body.find(b":")
    return (body, None) if colon < 0 else (body[:colon], body[colon + 1 :])


def _seq(digits: bytes) -> int | None:
    """A sequence number: 1-20 ASCII digits."""
    if not digits or len(digits) > 20 or not digits.isdigit():
        return None
    return int(digits)


# -- lease fields P adds to kv_transfer_params (pull; stock D ignores them) --
PARAM_LEASE_DEADLINE = "remote_lease_deadline"  # P's deadline, on P's scheduler clock
PARAM_LEASE_EXTENSION = "remote_lease_extension"  # how far one heartbeat moves it
# P answers acknowledged heartbeats (``LHB:``): D renews its views on answers.
PARAM_LEASE_ACKS = "remote_lease_acks"
# P also takes acknowledged heartbeats that name lease tags (``LHBT:``).
PARAM_LEASE_TAGS = "remote_lease_tags"


def takes_tags(params: Mapping[str, Any] | None) -> bool:
    """D side: do these params come from a P that takes ``LHBT:`` heartbeats?"""
    return bool(params) and params.get(PARAM_LEASE_ACKS) is True and params.get(PARAM_LEASE_TAGS) is True


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
