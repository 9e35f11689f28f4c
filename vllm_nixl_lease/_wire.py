"""The wire protocol D and P speak as NIXL notifications, the lease fields P
adds to ``kv_transfer_params``, and the lease arithmetic both sides derive
from ``kv_lease_duration``.  This is its only home (``docs/PROTOCOL.md`` is
its specification, ``spec/protocol.pml`` its spin model): the core, the
adapter, the tools and the tests all import it.

Upstream's messages (byte strings, kept exactly):
- heartbeat, D -> P: ``HB:<id>,<id>,...`` -- extend each named lease;
- completion, D -> P: ``<req_id>:<expected_consumers>`` -- one consumer read the
  blocks; split on the last colon (request ids may contain colons);
- push registration, D -> P (push mode): ``PUSH_REG:...`` -- passed through to
  upstream's code untouched.

Ours (protocol version ``LEASE_PROTOCOL_VERSION``), D -> P, each behind the
escape ``HB:,`` -- a heartbeat whose first id is empty, which no D ever sends,
so a stock P that gets one by mistake parses it as a heartbeat naming no lease
of its own:
- hello: ``HB:,LHELLO:<ver>:<interval_ms>:<metadata>:<key>`` -- D's NIXL
  connection info (base64url, no memory), so P can answer; ``key`` names a
  lease D holds on P (its tag or id), which admits the hello;
- acknowledged heartbeat: ``HB:,LHB:<seq>,<id>,<id>,...``;
- tagged heartbeat: ``HB:,LHBT:<seq>,<tag>,<tag>,...`` (``lease_tags.py``);
- keep-alive, over a connection not yet proven: upstream's ``HB:<id>,...``
  for leases named by id, ``HB:,LHBT:0,<tag>,...`` (``KEEPALIVE_SEQ``) for
  leases named by tag: P extends them as any heartbeat; D records no answer
  to them, so they never renew D's views;
- no answer wanted, over a proven connection: ``HB:,LHB:0,<ids>`` /
  ``HB:,LHBT:0,<tags>`` when the chunk's views need no renewal soon
  (PROTOCOL D3b): P extends them and, since this rule, answers nothing
  (P3b); a version-2 P of before answers seq 0, which D ignores.
P -> D, only to agents whose hello P admitted:
- acknowledgement: ``LACK:<instance>:<seqs>`` (every key those heartbeats named
  was held, unambiguously, and is now extended), ``LACK:<instance>:<seqs>:<keys>``
  (these were not), ``LACK:<instance>:<seqs>:*`` (count none as extended);
  with no seqs, the welcome that answers a hello.  ``instance`` names the P
  process (a fresh one per start), so D can tell a restarted P apart.
  Version 3: to an agent whose hello said 3, the instance field of an answer to
  heartbeats is ``<instance>@<clock_us>``, P's clock when the newest of them
  arrived, from which D refreshes its clock offset (``ack_requester.py``).
  Version 4 (``CLAIM_HELLO_VERSION``, opt-in): the same messages; an
  acknowledged heartbeat of a version-4 agent that names a lease it did not
  hold yet is a **claim**, answered in the step it arrives.

Imports nothing from vLLM.
"""

from __future__ import annotations

import binascii
import math
import secrets
from base64 import urlsafe_b64decode, urlsafe_b64encode
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple, TypeGuard

LEASE_PROTOCOL_VERSION = 3
# The version P advertises in ``remote_lease_protocol``: a version-2 D takes it
# as it is, so P keeps advertising 2 and names the newest hello version it
# accepts in ``remote_lease_protocol_max`` (which a version-2 D ignores).
LEASE_PROTOCOL_BASE = 2
HELLO_VERSIONS = frozenset(range(LEASE_PROTOCOL_BASE, LEASE_PROTOCOL_VERSION + 1))
# Hello versions from which P's answers carry its clock.
CLOCK_HELLO_VERSION = 3
# Version 4, opt-in on both sides (``kv_lease_claim_reads``): version 3 plus read
# claims.  Only a P with the setting advertises it (``remote_lease_protocol_max``
# 4) and accepts such hellos; only a D with the setting says it.  P then keeps
# every agent of version 4 whose acknowledged heartbeat it answered "held" as a
# holder of that lease, frees the lease on a completion only when no other
# holder remains, and answers a heartbeat that made an agent a new holder (a
# claim) in the step it arrives; D reads only once every P rank answered "held".
CLAIM_HELLO_VERSION = 4
HEARTBEAT_PREFIX = b"HB:"
HEARTBEAT_SEPARATOR = b","
# The lease protocol's escape (docs/PROTOCOL.md section 2): a heartbeat whose
# first id is empty, which no D names; our P passes every such message to the
# protocol's components, and a stock P parses it as a harmless heartbeat.
ESCAPE_PREFIX = HEARTBEAT_PREFIX + HEARTBEAT_SEPARATOR
PUSH_REG_PREFIX = b"PUSH_REG:"
HELLO_KIND = b"LHELLO:"
ACKED_HEARTBEAT_KIND = b"LHB:"
TAGGED_HEARTBEAT_KIND = b"LHBT:"
HEARTBEAT_ACK_PREFIX = b"LACK:"
# Messages P's router passes on to the acknowledgement components instead of the core.
ACK_PREFIXES = (ESCAPE_PREFIX, HEARTBEAT_ACK_PREFIX)
# "None of the keys counts as extended" (the answer's list would be too long).
ACK_NONE = b"*"
# Bytes the longest acknowledged header, ``HB:,LHBT:<seq>,`` (seq < 2**64), adds
# over ``HB:``: heartbeats are chunked this much smaller, so every form fits
# ``max_heartbeat_bytes``.
ACKED_HEARTBEAT_OVERHEAD = len(ESCAPE_PREFIX) + len(TAGGED_HEARTBEAT_KIND) + 20 + 1 - len(HEARTBEAT_PREFIX)
# Largest hello accepted (NIXL's connection info over UCX is a few hundred bytes).
MAX_HELLO_BYTES = 4096
INSTANCE_HEX_DIGITS = 16
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


# -- ours: hello, acknowledged heartbeats, answers ------------------------
def new_instance() -> str:
    """A fresh P instance: 64 random bits as 16 lowercase hex digits."""
    return secrets.token_hex(INSTANCE_HEX_DIGITS // 2)


def is_instance(value: object) -> TypeGuard[str]:
    # One C-level pass (a request's params are checked on D's hot path, per request).
    return isinstance(value, str) and len(value) == INSTANCE_HEX_DIGITS and _LOWER_HEX.issuperset(value)


_LOWER_HEX = frozenset("0123456789abcdef")


def is_escape(msg: bytes) -> bool:
    """Is this one of our D -> P messages (behind the ``HB:,`` escape)?"""
    return msg.startswith(ESCAPE_PREFIX)


class Hello(NamedTuple):
    version: int
    interval_s: float
    metadata: bytes  # NIXL's partial agent metadata of the D agent that says hello
    key: str  # a lease it holds on P: its tag or P's request id


def hello_message(
    interval_s: float, metadata: bytes, key: str, version: int = LEASE_PROTOCOL_VERSION
) -> bytes:
    """``HB:,LHELLO:<ver>:<interval_ms>:<metadata>:<key>``."""
    b64 = urlsafe_b64encode(metadata).rstrip(b"=")
    interval_ms = max(0, round(interval_s * 1000))
    return b"%s%s%d:%d:%s:%s" % (ESCAPE_PREFIX, HELLO_KIND, version, interval_ms, b64, key.encode("utf-8"))


def parse_hello(msg: bytes) -> Hello | None:
    """The fields of a hello (``msg`` with its escape); None when malformed or
    longer than ``MAX_HELLO_BYTES``.  A version this side does not speak parses:
    the caller decides."""
    if len(msg) > MAX_HELLO_BYTES or not msg.startswith(ESCAPE_PREFIX + HELLO_KIND):
        return None
    fields = msg[len(ESCAPE_PREFIX) + len(HELLO_KIND) :].split(b":", 3)
    if len(fields) != 4:
        return None
    version, interval_ms = _seq(fields[0]), _seq(fields[1])
    if version is None or interval_ms is None or not fields[2] or not fields[3]:
        return None
    try:
        metadata = urlsafe_b64decode(fields[2] + b"=" * (-len(fields[2]) % 4))
        key = fields[3].decode("utf-8")
    except (binascii.Error, ValueError):
        return None
    if b"," in fields[3]:
        return None
    return Hello(version, interval_ms / 1000, metadata, key)


def acked_heartbeat_message(seq: int, heartbeat: bytes, tagged: bool = False) -> bytes:
    """The acknowledged form of an ``HB:`` message, asking for answer ``seq``:
    ``HB:,LHB:<seq>,<ids>``, or ``HB:,LHBT:<seq>,<tags>`` when it names tags."""
    kind = TAGGED_HEARTBEAT_KIND if tagged else ACKED_HEARTBEAT_KIND
    return b"%s%s%d,%s" % (ESCAPE_PREFIX, kind, seq, heartbeat_payload(heartbeat))


# The sequence number of a keep-alive or of a heartbeat that wants no answer: D
# never opens it (its ledger starts at 1), so an answer to it proves nothing; P
# extends what it names like any heartbeat and does not answer it (P3b).
KEEPALIVE_SEQ = 0


def keepalive_message(heartbeat: bytes, tagged: bool) -> bytes:
    """What D sends for an ``HB:`` message while the connection is not proven
    to reach the P instance whose leases it names: the message itself when it
    names P's request ids (every P extends ``HB:``), ``HB:,LHBT:0,<tags>``
    when it names tags (only our P knows them; a stock P parses it harmlessly)."""
    return acked_heartbeat_message(KEEPALIVE_SEQ, heartbeat, tagged=True) if tagged else heartbeat


def parse_acked_heartbeat(msg: bytes) -> tuple[int, bytes, bool] | None:
    """``(seq, names, tagged)`` of an acknowledged heartbeat (with its escape);
    None when it is none or malformed."""
    if not msg.startswith(ESCAPE_PREFIX):
        return None
    body = msg[len(ESCAPE_PREFIX) :]
    if body.startswith(TAGGED_HEARTBEAT_KIND):
        tagged, body = True, body[len(TAGGED_HEARTBEAT_KIND) :]
    elif body.startswith(ACKED_HEARTBEAT_KIND):
        tagged, body = False, body[len(ACKED_HEARTBEAT_KIND) :]
    else:
        return None
    comma = body.find(b",")
    seq = _seq(body if comma < 0 else body[:comma])
    if seq is None:
        return None
    return seq, b"" if comma < 0 else body[comma + 1 :], tagged


def heartbeat_ack_message(
    instance: str, seqs: Iterable[int], not_extended: bytes = b"", clock: float | None = None
) -> bytes:
    """``LACK:<instance>:<seq>,...[:<keys>]``; ``not_extended`` is a comma-joined
    key list or ``ACK_NONE``, and applies to every listed heartbeat (a key
    missing from one counts as missing from all: conservative).  No seqs: the
    welcome that answers a hello.  ``clock`` (version 3, seconds on P's clock):
    ``LACK:<instance>@<clock_us>:...``, rounded up (a later reading only makes
    D's offset more conservative); left out when not a finite number >= 0."""
    field = instance.encode("ascii")
    if clock is not None and math.isfinite(clock) and 0 <= clock < MAX_CLOCK_S:
        field += b"%s%d" % (_clock_mark, clock_micros(clock))
    head = b"%s%s:%s" % (HEARTBEAT_ACK_PREFIX, field, b",".join(b"%d" % s for s in seqs))
    return head + b":" + not_extended if not_extended else head


def clock_micros(clock: float) -> int:
    """``clock`` in whole microseconds, rounded up so that the receiver's
    ``micros / 1e6`` is never below ``clock`` (the product and the quotient
    each round to the nearest float, which can land a step under it)."""
    micros = math.ceil(clock * 1e6)
    while micros / 1e6 < clock:
        micros += 1
    return micros


_clock_mark = b"@"  # lower case: a separator inside the instance field, not a field of its own
# Clock readings above this are refused (20 digits of microseconds; a
# perf_counter counts from boot, so this is millions of years).
MAX_CLOCK_S = 1e13


class HeartbeatAck(NamedTuple):
    instance: str
    seqs: list[int]  # empty: a welcome
    not_extended: frozenset[str] | None  # None: count none as extended
    clock: float | None = None  # P's clock (seconds) when the newest heartbeat arrived (v3)


def parse_heartbeat_ack(msg: bytes) -> HeartbeatAck | None:
    """The fields of an ``LACK:`` message; None when malformed."""
    if not msg.startswith(HEARTBEAT_ACK_PREFIX):
        return None
    parts = msg[len(HEARTBEAT_ACK_PREFIX) :].split(b":", 2)
    if len(parts) < 2:
        return None
    field, mark, clock_digits = parts[0].partition(_clock_mark)
    clock = None
    if mark:
        micros = _seq(clock_digits)
        if micros is None:
            return None
        clock = micros / 1e6
    try:
        instance = field.decode("ascii")
    except UnicodeDecodeError:
        return None
    if not is_instance(instance):
        return None
    seqs: list[int] = []
    if parts[1]:
        for digits in parts[1].split(b","):
            seq = _seq(digits)
            if seq is None:
                return None
            seqs.append(seq)
    rest = parts[2] if len(parts) == 3 else b""
    if not seqs and rest:
        return None
    if not rest:
        return HeartbeatAck(instance, seqs, frozenset(), clock)
    if rest == ACK_NONE:
        return HeartbeatAck(instance, seqs, None, clock)
    try:
        return HeartbeatAck(instance, seqs, frozenset(rest.decode("utf-8").split(",")), clock)
    except UnicodeDecodeError:
        return HeartbeatAck(instance, seqs, None, clock)  # cannot tell which: none counts


def _seq(digits: bytes) -> int | None:
    """A sequence number (or another small count): 1-20 ASCII digits."""
    if not digits or len(digits) > 20 or not digits.isdigit():
        return None
    return int(digits)


# -- lease fields P adds to kv_transfer_params (pull; stock D ignores them) --
PARAM_LEASE_DEADLINE = "remote_lease_deadline"  # P's deadline, on P's scheduler clock
PARAM_LEASE_EXTENSION = "remote_lease_extension"  # how far one heartbeat moves it (P's)
PARAM_LEASE_INTERVAL = "remote_lease_interval"  # how often P expects heartbeats (P's)
PARAM_LEASE_PROTOCOL = "remote_lease_protocol"  # LEASE_PROTOCOL_BASE: P takes our messages
PARAM_LEASE_PROTOCOL_MAX = "remote_lease_protocol_max"  # the newest hello version P accepts
PARAM_LEASE_INSTANCE = "remote_lease_instance"  # the P process that granted the lease
PARAM_LEASE_TAG = "remote_lease_tag"  # the lease's tag, for ``LHBT:`` (lease_tags.py)


class LeaseTerms(NamedTuple):
    """What one request's ``kv_transfer_params`` say about its lease on P.

    ``instance`` is empty for a *plain* lease: a P that does not speak our
    protocol version (stock, an older or a newer release of ours), which D
    heartbeats with upstream's ``HB:`` only.  Immutable; a tuple, because D
    parses one per arriving request (a frozen dataclass costs a
    ``object.__setattr__`` per field).
    """

    deadline: float
    extension: float
    interval: float | None
    instance: str = ""
    tag: str | None = None
    hello_version: int = LEASE_PROTOCOL_BASE  # the version D's hellos to this P say

    @property
    def acknowledged(self) -> bool:
        return bool(self.instance)


def lease_terms(params: Mapping[str, Any] | None) -> LeaseTerms | None:
    """D side: the lease terms of a request's params; None when they carry no
    lease deadline (a stock P); ValueError when the deadline or extension is
    malformed.  Capabilities come from these params alone, never from what an
    engine id said before."""
    if not params:
        return None
    # Any: checked by hand below, the common float case inline (once per arriving request)
    deadline: Any = params.get(PARAM_LEASE_DEADLINE)
    extension: Any = params.get(PARAM_LEASE_EXTENSION)
    if deadline is None and extension is None:
        return None
    if not (
        (deadline - deadline == 0.0 if type(deadline) is float else _finite(deadline))
        and (extension - extension == 0.0 if type(extension) is float else _finite(extension))
        and extension > 0
    ):
        raise ValueError(
            f"{PARAM_LEASE_DEADLINE}={deadline!r} / {PARAM_LEASE_EXTENSION}={extension!r} "
            "must be finite numbers and the extension > 0"
        )
    interval: Any = params.get(PARAM_LEASE_INTERVAL)
    finite = interval - interval == 0.0 if type(interval) is float else _finite(interval)
    interval = float(interval) if finite and interval >= 0 else None
    instance = params.get(PARAM_LEASE_INSTANCE)
    if params.get(PARAM_LEASE_PROTOCOL) != LEASE_PROTOCOL_BASE or not is_instance(instance):
        plain = (float(deadline), float(extension), interval, "", None, LEASE_PROTOCOL_BASE)
        return _new_terms(LeaseTerms, plain)
    tag = params.get(PARAM_LEASE_TAG)
    newest = params.get(PARAM_LEASE_PROTOCOL_MAX)
    version = LEASE_PROTOCOL_BASE
    if isinstance(newest, int) and not isinstance(newest, bool) and newest > LEASE_PROTOCOL_BASE:
        # the newest both speak (4, claims, only if this D wants them: ``ack_requester.py``)
        version = min(newest, CLAIM_HELLO_VERSION)
    return _new_terms(
        LeaseTerms,
        (float(deadline), float(extension), interval, instance, tag if is_tag(tag) else None, version),
    )


# A NamedTuple's own constructor is a Python-level function (a frame per call);
# every field is given here, so the plain tuple constructor builds the same object.
_new_terms = tuple.__new__


def is_tag(value: object) -> TypeGuard[str]:
    """Exactly 11 characters of unpadded base64url (``lease_tags.TAG_LENGTH``)."""
    return isinstance(value, str) and len(value) == 11 and _B64URL.issuperset(value)


_B64URL = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def _finite(value: object) -> TypeGuard[float]:
    if type(value) is float:  # the common case, without the isinstance checks
        return value - value == 0.0  # inf - inf and nan - nan are nan
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int no double holds: malformed, never a crash
        return False


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
