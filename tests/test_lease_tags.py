"""Lease tags (``lease_tags.py``): the short names our D heartbeats P's leases by."""

from __future__ import annotations

import string

import pytest

import vllm_nixl_lease.lease_tags as lease_tags
from vllm_nixl_lease._wire import (
    ACKED_HEARTBEAT_OVERHEAD,
    acked_heartbeat_message,
    heartbeat_message,
    is_tagged_heartbeat,
    parse_acked_heartbeat,
)
from vllm_nixl_lease.lease_tags import TAG_LENGTH, LeaseTagIndex, lease_tag

ALPHABET = set(string.ascii_letters + string.digits + "-_")


@pytest.mark.parametrize(
    "req_id", ["a", "cmpl-" + "f" * 32 + "-0-1a2b3c4d", "ünï:cödé,with,commas", "x" * 4000]
)
def test_tag_is_short_fixed_and_wire_safe(req_id: str) -> None:
    tag = lease_tag(req_id)
    assert len(tag) == TAG_LENGTH and set(tag) <= ALPHABET  # no ',' or ':' can appear
    assert tag == lease_tag(req_id.encode("utf-8")) == lease_tag(req_id)


def test_distinct_ids_get_distinct_tags() -> None:
    ids = [f"req-{i}" for i in range(20000)]
    assert len({lease_tag(i) for i in ids}) == len(ids)


def test_index_resolves_held_ids_and_reports_unknown_tags() -> None:
    index = LeaseTagIndex()
    tags = {req_id: index.add(req_id) for req_id in ("p1", "p2", "p3")}
    assert index.add("p1") == tags["p1"] and len(index) == 3  # a second grant: no-op
    index.discard("p2")
    index.discard("never-held")
    payload = ",".join([tags["p1"], tags["p2"], "", lease_tag("p9"), tags["p3"]]).encode()
    assert index.resolve(payload) == ("p1,p3", 4, [tags["p2"], lease_tag("p9")])  # "" is no tag
    assert index.resolve(b"\xff" + payload) is None
    assert index.tag_of("p1") == tags["p1"] and index.tag_of("p2") is None


def test_colliding_tags_renew_every_id_they_name(monkeypatch: pytest.MonkeyPatch) -> None:
    # A collision can only keep a lease longer, never end one early.
    monkeypatch.setattr(lease_tags, "lease_tag", lambda req_id: "same-tag-11")
    index = LeaseTagIndex()
    for req_id in ("a", "b", "c"):
        index.add(req_id)
    assert index.resolve(b"same-tag-11") == ("a,b,c", 1, [])
    index.discard("b")
    assert index.resolve(b"same-tag-11") == ("a,c", 1, [])
    index.discard("a")
    assert index.resolve(b"same-tag-11") == ("c", 1, [])
    index.discard("c")
    assert index.resolve(b"same-tag-11") == ("", 1, ["same-tag-11"]) and len(index) == 0


def test_tagged_heartbeat_wire_form() -> None:
    tags = [lease_tag("p1"), lease_tag("p2")]
    msg = acked_heartbeat_message(7, heartbeat_message(tags), tagged=True)
    assert msg == b"LHBT:7:" + ",".join(tags).encode()
    assert is_tagged_heartbeat(msg) and parse_acked_heartbeat(msg) == (7, ",".join(tags).encode())
    assert not is_tagged_heartbeat(acked_heartbeat_message(7, heartbeat_message(tags)))
    for bad in (b"LHBT:", b"LHBT:7", b"LHBT:x:abc", b"LHBT:" + b"9" * 21 + b":abc"):
        assert parse_acked_heartbeat(bad) is None
    # The longest header still fits the room chunking leaves for it.
    assert len(b"LHBT:%d:" % (2**64 - 1)) - len(b"HB:") == ACKED_HEARTBEAT_OVERHEAD


def test_index_leaves_out_ids_no_tag_may_renew() -> None:
    # The core's payload API splits on ',' and P's ids may be anything a client sent.
    index = LeaseTagIndex()
    assert index.add("a,b") is None and index.add("\ud800lone") is None
    assert len(index) == 0 and index.tag_of("a,b") is None
    assert index.resolve(lease_tag("a,b").encode()) == ("", 1, [lease_tag("a,b")])
    with pytest.raises(TypeError):
        lease_tag(123)  # type: ignore[arg-type]
    with pytest.raises(UnicodeEncodeError):
        lease_tag("\ud800lone")
