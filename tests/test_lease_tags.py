"""Lease tags (``lease_tags.py``): the short names our D heartbeats P's leases by."""

from __future__ import annotations

import string

import pytest

from vllm_nixl_lease._wire import (
    ACKED_HEARTBEAT_OVERHEAD,
    acked_heartbeat_message,
    heartbeat_message,
    is_tagged_heartbeat,
    parse_acked_heartbeat,
)
from vllm_nixl_lease.lease_tags import TAG_LENGTH, lease_tag, parse_tag, tag_digest

ALPHABET_ORDER = string.ascii_uppercase + string.ascii_lowercase + string.digits + "-_"
ALPHABET = set(ALPHABET_ORDER)


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


def test_table_extends_by_tag_and_reports_unknown_tags(core) -> None:
    t = core.LeaseTable(20.0)
    for req_id in ("p1", "p2", "p3"):
        t.grant(req_id, 10.0)
    t.grant("p1", 11.0)  # a second grant keeps one tag entry
    t.release("p2")
    tags = {req_id: lease_tag(req_id) for req_id in ("p1", "p2", "p3", "p9")}
    payload = ",".join([tags["p1"], tags["p2"], "", tags["p9"], tags["p3"], "short", "x" * 11]).encode()
    assert t.extend_tagged(payload, 1.0) == (2, 6, [tags["p2"], tags["p9"], "short", "x" * 11])
    assert t.deadline("p1") == t.deadline("p3") == 21.0
    assert t.extend_tagged(tags["p1"].encode(), 1.5) == (1, 1, [])
    assert t.deadline("p1") == 21.5 and t.deadline("p3") == 21.0  # max(old, now + extension)
    assert t.extend_tagged(tags["p1"].encode(), 0.5) == (1, 1, []) and t.deadline("p1") == 21.5
    assert t.extend_tagged(b"", 1.0) == (0, 0, [])
    assert t.extend_tagged(b"\xff" + payload, 2.0) == (0, 6, None)  # not ASCII: nothing applied
    assert t.deadline("p1") == 21.5


def test_table_without_tags_extends_by_id_only(core) -> None:
    """Push mode's table (``tags=False``): a tag names nothing, ids work as ever."""
    t = core.LeaseTable(20.0, tags=False)
    for req_id in ("p1", "p2"):
        t.grant(req_id, 10.0)
    payload = f"{lease_tag('p1')},{lease_tag('p2')}".encode()
    assert t.extend_tagged(payload, 1.0) == (0, 2, [lease_tag("p1"), lease_tag("p2")])
    assert t.deadline("p1") == 10.0
    assert t.extend(b"p1,p2", 1.0) == 2 and t.deadline("p1") == 21.0
    assert t.pop_expired(30.0) == ["p1", "p2"]


def test_expiry_and_compaction_keep_the_tag_index(core) -> None:
    t = core.LeaseTable(5.0)
    ids = [f"req-{i}" for i in range(2000)]
    for i, req_id in enumerate(ids):
        t.grant(req_id, float(i))
    assert t.pop_expired(1899.0) == ids[:1900]  # past a quarter: the Cython table compacts
    payload = ",".join(lease_tag(i) for i in ids[1890:1910]).encode()
    extended, named, unknown = t.extend_tagged(payload, 3000.0)
    assert (extended, named) == (10, 20) and unknown == [lease_tag(i) for i in ids[1890:1900]]
    assert all(t.deadline(i) == 3005.0 for i in ids[1900:1910])
    assert t.deadline(ids[1910]) == 1910.0


def test_ids_no_tag_may_renew_are_left_out(core) -> None:
    # The heartbeat payload splits on ',', and P's ids are whatever a client sent.
    t = core.LeaseTable(5.0)
    t.grant("a,b", 1.0)
    assert t.extend_tagged(lease_tag("a,b").encode(), 2.0) == (0, 1, [lease_tag("a,b")])
    assert t.deadline("a,b") == 1.0
    assert tag_digest("a,b") is None and tag_digest("\ud800lone") is None
    with pytest.raises(TypeError):
        lease_tag(123)  # type: ignore[arg-type]


def test_colliding_tags_renew_every_id_they_name(core, monkeypatch: pytest.MonkeyPatch) -> None:
    # A collision can only keep a lease longer, never end one early.
    import vllm_nixl_lease.prefill._lease_table_py as twin

    same = tag_digest("a")
    monkeypatch.setattr(twin, "tag_digest", lambda req_id: same)
    if core.name == "cython":
        import vllm_nixl_lease.prefill._lease_table_c as cy

        monkeypatch.setattr(cy, "_tag_digest", lambda req_id: same)
    t = core.LeaseTable(5.0)
    for req_id in ("a", "b", "c"):
        t.grant(req_id, 1.0)
    tag = lease_tag("a").encode()
    assert t.extend_tagged(tag, 2.0) == (3, 1, [])
    t.release("b")
    assert t.extend_tagged(tag, 3.0) == (2, 1, [])
    assert [t.deadline(i) for i in "abc"] == [8.0, None, 8.0]
    assert t.pop_expired(8.0) == ["a", "c"]
    assert t.extend_tagged(tag, 4.0) == (0, 1, [tag.decode()])


def test_tag_chains_survive_compaction(core, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chains of colliding tags through a compaction: the Cython table renumbers
    every chain link, which unique tags (chains of one) never exercise."""
    import vllm_nixl_lease.prefill._lease_table_py as twin

    def three_tags(req_id: str) -> int:  # every id collides with a third of the others
        return tag_digest(f"g{int(req_id.split('-')[1]) % 3}")

    monkeypatch.setattr(twin, "tag_digest", three_tags)
    if core.name == "cython":
        import vllm_nixl_lease.prefill._lease_table_c as cy

        monkeypatch.setattr(cy, "_tag_digest", three_tags)
    t = core.LeaseTable(5.0)
    ids = [f"req-{i}" for i in range(2000)]
    for i, req_id in enumerate(ids):
        t.grant(req_id, float(i))
    assert t.pop_expired(1899.0) == ids[:1900]  # past a quarter: the Cython table compacts
    live = ids[1900:]
    group = {k: [r for r in live if int(r.split("-")[1]) % 3 == k] for k in range(3)}
    assert t.extend_tagged(lease_tag("g0").encode(), 3000.0) == (len(group[0]), 1, [])
    assert all(t.deadline(r) == 3005.0 for r in group[0])
    assert all(t.deadline(r) < 3000.0 for r in group[1] + group[2])
    for r in group[1][::2]:  # unlink from the middle and the ends of a renumbered chain
        assert t.release(r)
    assert t.extend_tagged(lease_tag("g1").encode(), 3001.0) == (len(group[1][1::2]), 1, [])
    # By deadline: group 2 never renewed, group 0 at 3005, what is left of group 1 at 3006.
    assert t.pop_expired(3010.0) == group[2] + group[0] + group[1][1::2]
    assert t.extend_tagged(lease_tag("g2").encode(), 3002.0) == (0, 1, [lease_tag("g2")])


def test_parse_tag_takes_only_canonical_tags() -> None:
    tag = lease_tag("p1")
    assert parse_tag(tag) == tag_digest("p1")
    last = ALPHABET_ORDER.index(tag[-1])
    bent = tag[:-1] + ALPHABET_ORDER[last | 1]  # a non-zero padding bit
    assert parse_tag(bent) is None and parse_tag(tag + "A") is None and parse_tag("!" * 11) is None


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
