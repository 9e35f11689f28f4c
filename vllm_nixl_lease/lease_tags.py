"""Lease tags: short, fixed-length names for P's request ids in heartbeats.

D heartbeats every queued request once an interval, naming it by P's request
id: ~27 bytes in the harness, ~110 bytes for real vLLM ids.  At 100k queued
requests the bytes, and so the number of NIXL ``send_notif`` calls (a fixed
~100-180 us of D's CPU each on a cold step), follow the id length.  A P that
advertises ``remote_lease_tags`` accepts ``LHBT:<seq>:<tag>,<tag>,...``
instead (``_wire.py``): each tag is the 11-character unpadded base64url form
of an 8-byte BLAKE2b digest of the id's UTF-8 bytes, which both sides compute
on their own, so nothing new travels at grant time.

Collisions: P keeps every id under its tag and a tag renews all of them.  Two
ids sharing a tag (about 1 in 2**64 per pair; finding one on purpose takes
~2**32 hashes) can only keep a lease alive longer, never end one early; the
answer's "not extended" list names tags, so D's views stay conservative.

No vLLM imports: ``vllm/lease_keeper.py`` (P) and ``vllm/heartbeat_scheduler.py``
(D) use it.
"""

from __future__ import annotations

from base64 import urlsafe_b64encode
from hashlib import blake2b

TAG_DIGEST_BYTES = 8
TAG_LENGTH = 11  # unpadded base64url of 8 bytes; no ',' or ':' in its alphabet


def lease_tag(req_id: str | bytes) -> str:
    """The tag naming ``req_id`` in an ``LHBT:`` heartbeat.  Raises TypeError
    for anything but str/bytes, UnicodeEncodeError for a str that is not UTF-8."""
    if isinstance(req_id, str):
        raw = req_id.encode("utf-8")
    elif isinstance(req_id, bytes):
        raw = req_id
    else:
        raise TypeError(f"request id must be str or bytes, got {type(req_id).__name__}")
    digest = blake2b(raw, digest_size=TAG_DIGEST_BYTES).digest()
    return urlsafe_b64encode(digest)[:TAG_LENGTH].decode("ascii")


class LeaseTagIndex:
    """P's tag -> request ids, for the leases it holds.

    A tag maps to the comma-joined ids it names (almost always one), so that
    resolving a heartbeat is a C-level ``map`` and ``join`` into the id
    payload the lease core already takes (``LeaseTable.extend_counted``), not a
    Python loop per id.  Indexed ids hold no ',' (see ``add``)."""

    __slots__ = ("_ids", "_tag_of")

    def __init__(self) -> None:
        self._ids: dict[str, str] = {}  # tag -> "id" or "id,id,..." (tags that collide)
        self._tag_of: dict[str, str] = {}  # id -> tag

    def __len__(self) -> int:
        return len(self._tag_of)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._tag_of

    def add(self, req_id: str) -> str | None:
        """Index ``req_id`` (again: no-op); return its tag.  None, unindexed,
        for an id no tag may renew: one with ',' (the core's heartbeat payload
        splits on it; as ``HB:``, such an id cannot be heartbeated either) or
        one that is not UTF-8; a tag naming it is answered "not extended"."""
        tag = self._tag_of.get(req_id)
        if tag is not None:
            return tag
        if "," in req_id:
            return None
        try:
            tag = lease_tag(req_id)
        except UnicodeEncodeError:
            return None
        self._tag_of[req_id] = tag
        held = self._ids.get(tag)
        self._ids[tag] = req_id if held is None else f"{held},{req_id}"
        return tag

    def tag_of(self, req_id: str) -> str | None:
        return self._tag_of.get(req_id)

    def discard(self, req_id: str) -> None:
        tag = self._tag_of.pop(req_id, None)
        if tag is None:
            return
        held = self._ids[tag]
        if held == req_id:
            del self._ids[tag]
            return
        ids = held.split(",")
        ids.remove(req_id)
        self._ids[tag] = ",".join(ids)

    def resolve(self, payload: bytes) -> tuple[str, int, list[str]] | None:
        """An ``LHBT:`` payload (``tag,tag,...``) as ``(the comma-joined ids its
        tags name, how many tags it names, the tags naming no indexed id)``;
        None when it is not ASCII (no tag is)."""
        try:
            tags = payload.decode("ascii").split(",")
        except UnicodeDecodeError:
            return None
        held = list(map(self._ids.get, tags))
        unknown: list[str] = []
        if None in held:
            unknown = [tag for tag, ids in zip(tags, held, strict=True) if ids is None and tag]
            held = [ids for ids in held if ids is not None]
        return ",".join(held), len(tags) - tags.count(""), unknown
