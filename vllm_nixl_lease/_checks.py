"""Argument checks of the lease core, shared by each concept's pure-Python
twin and Cython module, so that both refuse the same input with the same
error, before changing anything.

The Cython modules call these at the edges; where they check a value in C on
a hot path instead (a request id as it is hashed), they raise what these do.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable

from ._wire import ESCAPE_PREFIX, HEARTBEAT_PREFIX, request_id_bytes

# What an agent's messages may come as in a notification batch; anything else
# counts as one malformed entry.
MESSAGES_TYPES = (list, tuple)

# Free events a lease table remembers at most, by default (``max_tombstones``).
DEFAULT_MAX_TOMBSTONES = 1_000_000

# Default size cap of one heartbeat message: fits every NIXL backend (some cap
# a notification there).
DEFAULT_MAX_MESSAGE_BYTES = 8192


# -- P: lease table and router ----------------------------------------------
def check_extension(extension: float) -> float:
    """A lease extension: a finite number of seconds > 0 (ValueError otherwise)."""
    extension = float(extension)
    if not (math.isfinite(extension) and extension > 0):
        raise ValueError(f"lease extension must be a finite number > 0, got {extension!r}")
    return extension


def check_req_id(req_id: object) -> str:
    """A request id to grant: a str (TypeError) encodable as UTF-8 (ValueError)."""
    if not isinstance(req_id, str):
        raise TypeError(f"request id must be str, got {type(req_id).__name__}")
    try:
        req_id.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"request id {req_id!r} is not encodable as UTF-8") from exc
    return req_id


def check_tag_key(key: object) -> bytes:
    """P's secret tag key: bytes (TypeError) of 16 to 64 bytes (ValueError):
    shorter is guessable, longer is more than BLAKE2b takes as a key."""
    if not isinstance(key, bytes):
        raise TypeError(f"tag key must be bytes, got {type(key).__name__}")
    if not 16 <= len(key) <= 64:
        raise ValueError(f"tag key must be 16 to 64 bytes, got {len(key)}")
    return key


def check_tombstone_s(tombstone_s: float | None, extension: float) -> float:
    """How long a freed lease's keys are remembered: ``2 * extension`` for
    None, else a finite number of seconds >= 0 (ValueError otherwise)."""
    if tombstone_s is None:
        return 2.0 * extension
    value = float(tombstone_s)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"tombstone_s must be a finite number >= 0, got {tombstone_s!r}")
    return value


def check_tag_bits(tag_bits: int) -> int:
    """Low bits of each tag digest a table keeps (a test knob): an int in 1..64."""
    if isinstance(tag_bits, bool) or not isinstance(tag_bits, int):
        raise TypeError(f"tag_bits must be an int, got {type(tag_bits).__name__}")
    if not 1 <= tag_bits <= 64:
        raise ValueError(f"tag_bits must be in 1..64, got {tag_bits}")
    return tag_bits


def check_max_tombstones(max_tombstones: int) -> int:
    """The cap on remembered free events: an int >= 1 that fits a C ssize_t."""
    if isinstance(max_tombstones, bool) or not isinstance(max_tombstones, int):
        raise TypeError(f"max_tombstones must be an int, got {type(max_tombstones).__name__}")
    if not 1 <= max_tombstones <= sys.maxsize:
        raise ValueError(f"max_tombstones must be >= 1, got {max_tombstones}")
    return max_tombstones


def check_passthrough_prefixes(prefixes: Iterable[bytes]) -> tuple[bytes, ...]:
    """The prefixes a router passes through, ``ESCAPE_PREFIX`` always among
    them; ValueError for an empty one, or one that would take plain ``HB:``
    heartbeats (a prefix may start with ``HB:`` only if it starts with the escape)."""
    out = tuple(bytes(p) for p in prefixes)
    for p in out:
        if not p or (p.startswith(HEARTBEAT_PREFIX) and not p.startswith(ESCAPE_PREFIX)):
            raise ValueError(
                f"passthrough prefixes must be non-empty and not start with {HEARTBEAT_PREFIX.decode()} "
                f"unless they start with {ESCAPE_PREFIX.decode()}, got {p!r}"
            )
    return out if ESCAPE_PREFIX in out else (*out, ESCAPE_PREFIX)


def check_deadline(deadline: float) -> float:
    """A lease deadline as a float; ValueError if it is NaN (infinities are allowed)."""
    deadline = float(deadline)
    if math.isnan(deadline):
        raise ValueError("lease deadline must not be NaN")
    return deadline


def check_now(now: object) -> float:
    """``now`` as a float; TypeError if it is no real number, ValueError if it
    is NaN, infinite or too large for a float (before any state changes)."""
    if isinstance(now, (str, bytes, bytearray)):
        raise TypeError(f"now must be a real number, got {type(now).__name__}")
    try:
        # Any object: float() itself decides what converts, and says so with TypeError.
        value = float(now)  # type: ignore[arg-type]
    except OverflowError:
        if isinstance(now, int):
            raise ValueError(f"now must be a finite time, got an int of {now.bit_length()} bits") from None
        # Not only ints overflow: a huge Fraction does too.
        name = type(now).__name__
        raise ValueError(f"now must be a finite time, got a {name} too large for a float") from None
    except (TypeError, ValueError):
        raise TypeError(f"now must be a real number, got {type(now).__name__}") from None
    if not math.isfinite(value):
        raise ValueError(f"now must be a finite time, got {value!r}")
    return value


def check_limit(limit: int | None) -> int:
    """How many leases a sweep may pop: -1 for all (``None``), else an int >= 0
    (TypeError/ValueError before any state changes)."""
    if limit is None:
        return -1
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"limit must be None or an int, got {type(limit).__name__}")
    if not 0 <= limit <= sys.maxsize:
        raise ValueError(f"limit must be >= 0 (and fit a C ssize_t), got {limit}")
    return limit


# -- D: heartbeat tracker and encoder -----------------------------------------
def check_interval(interval: float) -> float:
    """A heartbeat interval: a finite number of seconds >= 0 (0: every step)."""
    interval = float(interval)
    if not (math.isfinite(interval) and interval >= 0):
        raise ValueError(f"heartbeat interval must be a finite number >= 0, got {interval!r}")
    return interval


def check_pace_phase(phase: float) -> float:
    """A paced round's phase: a fraction of one send's share of the interval, in [0, 1)."""
    phase = float(phase)
    if not (0.0 <= phase < 1.0):
        raise ValueError(f"pace phase must be a number in [0, 1), got {phase!r}")
    return phase


def check_round_bytes(round_bytes: int) -> int:
    """The bytes of a heartbeat round small enough to go in one step: an int >= 0 (0: always paced)."""
    if isinstance(round_bytes, bool) or not isinstance(round_bytes, int):
        raise TypeError("round_bytes must be an int")
    if round_bytes < 0:
        raise ValueError(f"round_bytes must be >= 0, got {round_bytes!r}")
    return round_bytes


def check_max_message_bytes(max_message_bytes: int) -> int:
    """A heartbeat message size cap: an int with room for the prefix and an id."""
    if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int):
        raise TypeError("max_message_bytes must be an int")
    if max_message_bytes <= len(HEARTBEAT_PREFIX):
        raise ValueError(f"max_message_bytes must exceed {len(HEARTBEAT_PREFIX)}, got {max_message_bytes}")
    return max_message_bytes


def check_remote_id(remote_req_id: object, max_message_bytes: int) -> bytes:
    """Encode a P-side request id for a heartbeat, or raise ValueError."""
    raw = request_id_bytes(remote_req_id)
    if not raw:
        raise ValueError("empty request id cannot be heartbeated")
    if b"," in raw:
        raise ValueError(f"request id {remote_req_id!r} contains ',' (the heartbeat separator)")
    if len(HEARTBEAT_PREFIX) + len(raw) > max_message_bytes:
        raise ValueError(
            f"request id of {len(raw)} bytes does not fit a heartbeat message "
            f"of at most {max_message_bytes} bytes"
        )
    return raw
