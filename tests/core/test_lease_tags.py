"""Lease tags (``lease_tags.py``): the short, keyed names our D heartbeats P's leases by."""

from __future__ import annotations

import hashlib
import string

import pytest

from vllm_nixl_lease._wire import (
    ACKED_HEARTBEAT_OVERHEAD,
    acked_heartbeat_message,
    heartbeat_message,
    parse_acked_heartbeat,
)
from vllm_nixl_lease.lease_tags import (
    TAG_KEY_BYTES,
    TAG_LENGTH,
    lease_tag,
    new_tag_key,
    parse_tag,
    tag_digest,
)

ALPHABET_ORDER = string.ascii_uppercase + string.ascii_lowercase + string.digits + "-_"
ALPHABET = set(ALPHABET_ORDER)
KEY = bytes(range(16))
OTHER_KEY = bytes(range(100, 132))


def keyed_table(core, extension: float, **options):
    t = core.LeaseTable(extension, **options)
    t.set_tag_key(KEY)
    return t


@pytest.mark.parametrize(
    "req_id", ["a", "cmpl-" + "f" * 32 + "-0-1a2b3c4d", "ünï:cödé,with,commas", "x" * 4000]
)
def test_tag_is_short_fixed_and_wire_safe(req_id: str) -> None:
    tag = lease_tag(req_id, KEY)
    assert len(tag) == TAG_LENGTH and set(tag) <= ALPHABET  # no ',' or ':' can appear
    assert tag == lease_tag(req_id.encode("utf-8"), KEY) == lease_tag(req_id, KEY)


def test_distinct_ids_get_distinct_tags() -> None:
    ids = [f"req-{i}" for i in range(20000)]
    assert len({lease_tag(i, KEY) for i in ids}) == len(ids)


def test_tags_are_keyed() -> None:
    """The same id has unrelated tags under two keys, and every function agrees
    on one key: ``parse_tag`` of ``lease_tag`` is ``tag_digest``, which is the
    keyed BLAKE2b itself (not, say, the unkeyed one)."""
    ids = [f"req-{i}" for i in range(2000)] + ["", "ü" * 50, "x" * 300]
    under = {key: [lease_tag(i, key) for i in ids] for key in (KEY, OTHER_KEY)}
    assert all(a != b for a, b in zip(under[KEY], under[OTHER_KEY], strict=True))
    for key in (KEY, OTHER_KEY):
        for req_id, tag in zip(ids, under[key], strict=True):
            assert parse_tag(tag) == tag_digest(req_id, key)
    keyed = hashlib.blake2b(b"req-7", key=KEY, digest_size=8).digest()
    assert tag_digest("req-7", KEY) == int.from_bytes(keyed, "little")
    assert tag_digest("req-7", KEY) != int.from_bytes(
        hashlib.blake2b(b"req-7", digest_size=8).digest(), "little"
    )


def test_tag_keys_are_fresh_and_checked() -> None:
    keys = {new_tag_key() for _ in range(100)}
    assert len(keys) == 100 and all(len(k) == TAG_KEY_BYTES for k in keys)
    for bad, exc in (
        (b"short", ValueError),
        (b"k" * 65, ValueError),
        ("k" * 16, TypeError),
        (None, TypeError),
    ):
        with pytest.raises(exc):
            lease_tag("a", bad)
        with pytest.raises(exc):
            tag_digest("a", bad)


def test_tag_digest_is_keyed_blake2b(core) -> None:
    """Both tables index a lease under hashlib's keyed BLAKE2b of its id (8 bytes,
    little endian), the value ``lease_tag`` names it by in D's params."""
    t = core.LeaseTable(10.0)
    t.set_tag_key(KEY)
    t.grant("req-7", 100.0)
    want = int.from_bytes(hashlib.blake2b(b"req-7", key=KEY, digest_size=8).digest(), "little")
    assert tag_digest("req-7", KEY) == want and parse_tag(lease_tag("req-7", KEY)) == want
    assert t.extend_tagged(lease_tag("req-7", KEY).encode(), 1.0) == (1, 1, [])


def test_no_tags_before_the_key(core) -> None:
    """Until ``set_tag_key`` the table indexes no tag; the first key indexes
    the leases already held; the same key again is a no-op; another key is
    refused while leases are held and taken once none are."""
    t = core.LeaseTable(20.0)
    t.grant("p1", 10.0)
    tag = lease_tag("p1", KEY)
    assert t.extend_tagged(tag.encode(), 1.0) == (0, 1, [tag])
    t.set_tag_key(KEY)
    t.grant("p2", 10.0)
    both = f"{tag},{lease_tag('p2', KEY)}".encode()
    assert t.extend_tagged(both, 1.0) == (2, 2, [])
    t.set_tag_key(KEY)
    assert t.extend_tagged(both, 1.5) == (2, 2, [])
    with pytest.raises(ValueError):
        t.set_tag_key(OTHER_KEY)
    assert t.extend_tagged(both, 2.0) == (2, 2, [])  # the refused key changed nothing
    with pytest.raises(TypeError):
        t.set_tag_key("not bytes")
    t.release("p1")
    t.release("p2")
    t.set_tag_key(OTHER_KEY)
    t.grant("p3", 10.0)
    assert t.extend_tagged(lease_tag("p3", OTHER_KEY).encode(), 3.0) == (1, 1, [])
    assert t.extend_tagged(lease_tag("p3", KEY).encode(), 3.0) == (0, 1, [lease_tag("p3", KEY)])


def test_table_extends_by_tag_and_reports_unknown_tags(core) -> None:
    t = keyed_table(core, 20.0)
    for req_id in ("p1", "p2", "p3"):
        t.grant(req_id, 10.0)
    t.grant("p1", 11.0)  # a second grant keeps one tag entry
    t.release("p2")
    tags = {req_id: lease_tag(req_id, KEY) for req_id in ("p1", "p2", "p3", "p9")}
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
    t.set_tag_key(KEY)
    for req_id in ("p1", "p2"):
        t.grant(req_id, 10.0)
    payload = f"{lease_tag('p1', KEY)},{lease_tag('p2', KEY)}".encode()
    assert t.extend_tagged(payload, 1.0) == (0, 2, [lease_tag("p1", KEY), lease_tag("p2", KEY)])
    assert t.deadline("p1") == 10.0
    assert t.extend(b"p1,p2", 1.0) == 2 and t.deadline("p1") == 21.0
    assert t.pop_expired(30.0) == ["p1", "p2"]


def test_expiry_and_compaction_keep_the_tag_index(core) -> None:
    t = keyed_table(core, 5.0)
    ids = [f"req-{i}" for i in range(2000)]
    for i, req_id in enumerate(ids):
        t.grant(req_id, float(i))
    assert t.pop_expired(1899.0) == ids[:1900]  # past a quarter: the Cython table compacts
    payload = ",".join(lease_tag(i, KEY) for i in ids[1890:1910]).encode()
    extended, named, unknown = t.extend_tagged(payload, 3000.0)
    assert (extended, named) == (10, 20) and unknown == [lease_tag(i, KEY) for i in ids[1890:1900]]
    assert all(t.deadline(i) == 3005.0 for i in ids[1900:1910])
    assert t.deadline(ids[1910]) == 1910.0


def test_ids_no_tag_may_renew_are_left_out(core) -> None:
    # The heartbeat payload splits on ',', and P's ids are whatever a client sent.
    t = keyed_table(core, 5.0)
    t.grant("a,b", 1.0)
    assert t.extend_tagged(lease_tag("a,b", KEY).encode(), 2.0) == (0, 1, [lease_tag("a,b", KEY)])
    assert t.deadline("a,b") == 1.0
    assert tag_digest("a,b", KEY) is None and tag_digest("\ud800lone", KEY) is None
    with pytest.raises(TypeError):
        lease_tag(123, KEY)  # type: ignore[arg-type]


def tag_group(req_id: str, bits: int) -> int:
    """The low ``bits`` of an id's tag digest: its tag in a table with ``tag_bits=bits``."""
    return tag_digest(req_id, KEY) & (2**bits - 1)


def colliding(n: int, bits: int = 2, prefix: str = "id") -> list[str]:
    """``n`` ids whose tags collide in a table with ``tag_bits=bits``."""
    first = tag_group(f"{prefix}-0", bits)
    return [r for r in (f"{prefix}-{i}" for i in range(1000)) if tag_group(r, bits) == first][:n]


def test_colliding_tags_renew_every_id_they_name(core) -> None:
    """A tag renews every lease it names.  Once one of them is freed, the tag
    no longer names exactly what D meant: the others are ambiguous, still
    renewed, but the tag is answered "not held"."""
    a, b, c = colliding(3)
    t = keyed_table(core, 5.0, tag_bits=2)
    for req_id in (a, b, c):
        t.grant(req_id, 1.0)
    tag = lease_tag(a, KEY).encode()
    assert t.extend_tagged(tag, 2.0) == (3, 1, [])
    t.release(b)
    assert t.is_ambiguous(a) and t.is_ambiguous(c) and not t.is_ambiguous(b)
    assert t.extend_tagged(tag, 3.0) == (2, 1, [tag.decode()])
    assert [t.deadline(i) for i in (a, b, c)] == [8.0, None, 8.0]
    assert t.pop_expired(8.0) == [a, c]
    assert t.extend_tagged(tag, 4.0) == (0, 1, [tag.decode()])


def test_tag_chains_survive_compaction(core) -> None:
    """Chains of colliding tags through a compaction: the Cython table renumbers
    every chain link, which unique tags (chains of one) never exercise."""
    t = keyed_table(core, 5.0, tag_bits=2, tombstone_s=0.0)  # tags of 2 bits: 4 chains
    ids = [f"req-{i}" for i in range(2000)]
    for i, req_id in enumerate(ids):
        t.grant(req_id, float(i))
    assert t.pop_expired(1899.0) == ids[:1900]  # past a quarter: the Cython table compacts
    live = ids[1900:]
    group = {k: [r for r in live if tag_group(r, 2) == k] for k in range(4)}
    tag_of = {k: lease_tag(group[k][0], KEY) for k in range(4)}
    # Every chain lost members to the expiry: every tag is ambiguous now.
    assert all(t.is_ambiguous(r) for r in live)
    assert t.extend_tagged(tag_of[0].encode(), 3000.0) == (len(group[0]), 1, [tag_of[0]])
    assert all(t.deadline(r) == 3005.0 for r in group[0])
    assert all(t.deadline(r) < 3000.0 for r in group[1] + group[2] + group[3])
    for r in group[1][::2]:  # unlink from the middle and the ends of a renumbered chain
        assert t.release(r)
    assert t.extend_tagged(tag_of[1].encode(), 3001.0) == (len(group[1][1::2]), 1, [tag_of[1]])
    # By deadline: groups 2 and 3 never renewed, group 0 at 3005, what is left of group 1 at 3006.
    rest = sorted(group[2] + group[3], key=ids.index)
    assert t.pop_expired(3010.0) == rest + group[0] + group[1][1::2]
    assert t.extend_tagged(tag_of[2].encode(), 3002.0) == (0, 1, [tag_of[2]])


def test_parse_tag_takes_only_canonical_tags() -> None:
    tag = lease_tag("p1", KEY)
    assert parse_tag(tag) == tag_digest("p1", KEY)
    last = ALPHABET_ORDER.index(tag[-1])
    bent = tag[:-1] + ALPHABET_ORDER[last | 1]  # a non-zero padding bit
    assert parse_tag(bent) is None and parse_tag(tag + "A") is None and parse_tag("!" * 11) is None


def test_tagged_heartbeat_wire_form() -> None:
    tags = [lease_tag("p1", KEY), lease_tag("p2", KEY)]
    msg = acked_heartbeat_message(7, heartbeat_message(tags), tagged=True)
    assert msg == b"HB:,LHBT:7," + ",".join(tags).encode()
    assert parse_acked_heartbeat(msg) == (7, ",".join(tags).encode(), True)
    assert parse_acked_heartbeat(acked_heartbeat_message(7, heartbeat_message(tags)))[2] is False  # type: ignore[index]
    for bad in (b"HB:,LHBT:", b"HB:,LHBT:x,abc", b"HB:,LHBT:" + b"9" * 21 + b",abc", b"LHBT:7:abc"):
        assert parse_acked_heartbeat(bad) is None
    # The longest header still fits the room chunking leaves for it.
    assert len(b"HB:,LHBT:%d," % (2**64 - 1)) - len(b"HB:") == ACKED_HEARTBEAT_OVERHEAD
