"""Lease tags: short, fixed-length, unguessable names for P's request ids.

D heartbeats every queued request once an interval, naming it by P's request
id, and real vLLM ids are long.  With many requests queued the bytes, and so
the number of NIXL ``send_notif`` calls (each a fixed cost of D's CPU),
follow the id length.  A P that speaks the lease protocol (``docs/PROTOCOL.md``)
accepts ``LHBT:`` heartbeats that name each lease by its tag instead: the
11-character unpadded base64url form of an 8-byte BLAKE2b digest of the id's
UTF-8 bytes, **keyed** with P's secret tag key (``new_tag_key``, one per P
instance).  The key never leaves P: P's scheduler puts each lease's tag in
its ``kv_transfer_params`` and D sends it back as it came.

Why keyed: two leases sharing a tag are renewed together, so a client that
chooses request ids could otherwise grind two ids to one tag offline
(~2**32 hashes) and have P answer "held" for a lease it freed.  Under a
secret key nobody outside P can aim a collision; an accidental one (about 1 in
2**64 per pair) is caught by P's lease table, which answers an ambiguous tag
"not extended" (``LeaseTable`` tombstones and ambiguity).

P's lease table indexes each lease under its tag's 64-bit digest as well as
its id (``LeaseTable.extend_tagged``, both implementations), so a tagged
heartbeat costs P one integer lookup per lease, with no string in between.

No vLLM imports.
"""

from __future__ import annotations

import binascii
import secrets
from base64 import urlsafe_b64decode, urlsafe_b64encode
from hashlib import blake2b

from ._checks import check_tag_key
from ._wire import request_id_bytes

TAG_DIGEST_BYTES = 8
TAG_LENGTH = 11  # unpadded base64url of 8 bytes; no ',' or ':' in its alphabet
TAG_KEY_BYTES = 16  # what new_tag_key draws (BLAKE2b takes keys of up to 64 bytes)


def new_tag_key() -> bytes:
    """A fresh secret tag key (one per P instance, never sent anywhere)."""
    return secrets.token_bytes(TAG_KEY_BYTES)


def _digest(req_id: str | bytes, key: bytes) -> bytes:
    return blake2b(request_id_bytes(req_id), key=check_tag_key(key), digest_size=TAG_DIGEST_BYTES).digest()


def lease_tag(req_id: str | bytes, key: bytes) -> str:
    """The tag naming ``req_id`` under P's tag ``key``.  Raises TypeError for
    an id that is not str/bytes or a key that is not bytes, ValueError for a
    key of the wrong size, UnicodeEncodeError for a str that is not UTF-8."""
    return urlsafe_b64encode(_digest(req_id, key))[:TAG_LENGTH].decode("ascii")


def tag_digest(req_id: str, key: bytes) -> int | None:
    """The 64-bit value P indexes ``req_id`` under (its tag's digest, little
    endian), or None for an id no tag may renew: one with ',' (the heartbeat
    payload splits on it; as ``HB:`` it cannot be heartbeated either) or one
    that is not UTF-8.  A tag naming such an id is answered "not extended"."""
    check_tag_key(key)
    if "," in req_id:
        return None
    try:
        return int.from_bytes(_digest(req_id, key), "little")
    except UnicodeEncodeError:
        return None


def parse_tag(field: str) -> int | None:
    """The digest a tag carries (``tag_digest`` of the id it names, under the
    key it was made with); None unless ``field`` is a tag exactly as
    ``lease_tag`` writes it (11 base64url characters, canonical)."""
    if len(field) != TAG_LENGTH:
        return None
    try:
        raw = urlsafe_b64decode(field + "=")
    except (binascii.Error, ValueError):
        return None
    if urlsafe_b64encode(raw)[:TAG_LENGTH].decode("ascii") != field:
        return None
    return int.from_bytes(raw, "little")
