"""Lease tags: short, fixed-length names for P's request ids in heartbeats.

D heartbeats every queued request once an interval, naming it by P's request
id, and real vLLM ids are long.  With many requests queued the bytes, and so
the number of NIXL ``send_notif`` calls (each a fixed cost of D's CPU),
follow the id length.  A P that advertises ``remote_lease_tags`` accepts
``LHBT:<seq>:<tag>,<tag>,...`` instead (``_wire.py``): each tag is the
11-character unpadded base64url form of an 8-byte BLAKE2b digest of the id's
UTF-8 bytes, which both sides compute on their own, so nothing new travels at
grant time.

P's lease table indexes each lease under its tag's 64-bit digest as well as
its id (``LeaseTable.extend_tagged``, both implementations), so a tagged
heartbeat costs P one integer lookup per lease, with no string in between.

Collisions: P keeps every id under its tag and a tag renews all of them.  Two
ids sharing a tag (about 1 in 2**64 per pair; finding one on purpose takes
~2**32 hashes) can only keep a lease alive longer, never end one early; the
answer's "not extended" list names tags, so D's views stay conservative.

No vLLM imports: the lease tables (P) and
``vllm/d_scheduler/heartbeat_schedule.py`` (D) use it.
"""

from __future__ import annotations

import binascii
from base64 import urlsafe_b64decode, urlsafe_b64encode
from hashlib import blake2b

from ._wire import request_id_bytes

TAG_DIGEST_BYTES = 8
TAG_LENGTH = 11  # unpadded base64url of 8 bytes; no ',' or ':' in its alphabet


def _digest(req_id: str | bytes) -> bytes:
    return blake2b(request_id_bytes(req_id), digest_size=TAG_DIGEST_BYTES).digest()


def lease_tag(req_id: str | bytes) -> str:
    """The tag naming ``req_id`` in an ``LHBT:`` heartbeat.  Raises TypeError
    for anything but str/bytes, UnicodeEncodeError for a str that is not UTF-8."""
    return urlsafe_b64encode(_digest(req_id))[:TAG_LENGTH].decode("ascii")


def tag_digest(req_id: str) -> int | None:
    """The 64-bit value P indexes ``req_id`` under (its tag's digest, little
    endian), or None for an id no tag may renew: one with ',' (the heartbeat
    payload splits on it; as ``HB:`` it cannot be heartbeated either) or one
    that is not UTF-8.  A tag naming such an id is answered "not extended"."""
    if "," in req_id:
        return None
    try:
        return int.from_bytes(_digest(req_id), "little")
    except UnicodeEncodeError:
        return None


def parse_tag(field: str) -> int | None:
    """``tag_digest`` of the id a tag names; None unless ``field`` is a tag
    exactly as ``lease_tag`` writes it (11 base64url characters, canonical)."""
    if len(field) != TAG_LENGTH:
        return None
    try:
        raw = urlsafe_b64decode(field + "=")
    except (binascii.Error, ValueError):
        return None
    if urlsafe_b64encode(raw)[:TAG_LENGTH].decode("ascii") != field:
        return None
    return int.from_bytes(raw, "little")
