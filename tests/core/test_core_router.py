"""NotificationRouter unit tests, run against both implementations."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from vllm_nixl_lease._wire import heartbeat_message


def make(core, extension=10.0):
    table = core.LeaseTable(extension)
    return table, core.NotificationRouter(table)


def test_completion_releases_after_expected_count(core):
    table, router = make(core)
    router.add_in_batch("r1")
    assert router.grant("r1", 5.0)
    res = router.route({"d0": [b"r1:2"]}, 0.0)
    assert res.completed == [] and router.received("r1") == 1 and "r1" in table
    res = router.route({"d1": [b"r1:2"]}, 0.0)
    assert res.completed == ["r1"] and "r1" not in table and not router.is_in_batch("r1")


def test_completion_before_lease_is_counted(core):
    table, router = make(core)
    router.add_in_batch("early")  # in a batch, no deadline yet (async scheduling)
    res = router.route({"d": [b"early:1"]}, 0.0)
    assert res.completed == ["early"] and res.unknown == 0 and res.unknown_sample == []
    assert router.grant("early", 9.0) is False  # no lease once read


def test_ids_with_colons_split_on_last(core):
    table, router = make(core)
    router.add_in_batch("cmpl:abc:0")
    router.grant("cmpl:abc:0", 5.0)
    assert router.route({"a": [b"cmpl:abc:0:1"]}, 0.0).completed == ["cmpl:abc:0"]


def test_unknown_and_malformed_do_not_stop_the_batch(core):
    table, router = make(core)
    for rid in ("a", "b"):
        router.add_in_batch(rid)
        router.grant(rid, 1.0)
    junk = [b"nocolon", b"x:y", b"a:0", b"a:-1", b"a:+1", b"a: 1", b":1", b"\xff\xfe:1"]
    junk += [b"a:99999999999", b""]
    res = router.route(
        {"rogue": junk, "d": [b"gone:1", heartbeat_message(["a", "b", "zz"]), b"a:1", b"PUSH_REG:\x00"]}, 2.0
    )
    assert res.malformed == len(junk)
    assert len(res.malformed_sample) == 3 and res.malformed_sample[0] == b"nocolon"
    assert res.unknown == 1 and res.unknown_sample == ["gone"]
    assert res.completed == ["a"]
    hb = (res.heartbeat_messages, res.heartbeat_ids, res.extended, res.unknown_heartbeat_ids)
    assert hb == (1, 3, 2, 1)
    assert res.passthrough == {"d": [b"PUSH_REG:\x00"]}
    assert table.deadline("b") == 12.0


def test_malformed_sample_is_truncated(core):
    _, router = make(core)
    res = router.route({"x": [b"z" * 100_000]}, 0.0)
    assert res.malformed == 1 and len(res.malformed_sample[0]) == 64


def test_expire_reports_reads_seen(core):
    table, router = make(core)
    for rid, d in (("a", 1.0), ("b", 2.0)):
        router.add_in_batch(rid)
        router.grant(rid, d)
    router.route({"d": [b"b:2"]}, 0.0)
    assert router.expire(0.5) == ([], {})
    assert router.expire(2.0) == (["a", "b"], {"b": 1})
    assert router.in_batch_count() == 0 and len(table) == 0
    # a late completion after expiry is unknown, as upstream counts it
    res = router.route({"d": [b"b:2"]}, 3.0)
    assert (res.unknown, res.unknown_sample) == (1, ["b"])


def test_heartbeat_after_completion_does_nothing(core):
    table, router = make(core)
    router.add_in_batch("a")
    router.grant("a", 1.0)
    router.route({"d": [b"a:1"]}, 0.0)
    res = router.route({"d": [heartbeat_message(["a"])]}, 0.0)
    assert res.extended == 0 and len(table) == 0


def test_in_batch_membership(core):
    _, router = make(core)
    for rid in ("a", "b", "c"):
        router.add_in_batch(rid)
    router.discard_in_batch("b")
    assert [router.is_in_batch(r) for r in "abc"] == [True, False, True] and router.in_batch_count() == 2


def test_unknown_completions_are_counted_not_listed(core):
    """A flood of completions for unknown ids costs a count and a short sample."""
    _, router = make(core)
    flood = [f"k{i}:1".encode() for i in range(5000)] + [b"j" * 1_000_000 + b":1"]
    res = router.route({"rogue": flood}, 0.0)
    assert res.unknown == 5001 and res.malformed == 0
    assert res.unknown_sample == ["k0", "k1", "k2"]
    res = router.route({"rogue": [b"j" * 1_000_000 + b":1"]}, 0.0)
    assert res.unknown_sample == ["j" * 64 + "..."]


def test_edges_same_contract(core):
    _, router = make(core)
    router.add_in_batch("a")
    router.grant("a", 5.0)
    for bad in (None, "1", math.nan, math.inf, 10**400, Fraction(10**400)):
        with pytest.raises((TypeError, ValueError)):
            router.route({"d": [b"a:1"]}, bad)
    assert "a" in router.table  # nothing applied
    res = router.route({"d": ["a:1", None, memoryview(b"a:1"), 3], "e": None, "f": b"a:1"}, 0.0)
    assert res.malformed == 6 and res.completed == []
    assert res.malformed_sample == [b"<str>", b"<NoneType>", b"<memoryview>"]


def test_read_count_does_not_outlive_lease_or_batch(core):
    table, router = make(core)
    router.add_in_batch("a")
    router.grant("a", 5.0)
    router.route({"d": [b"a:2"]}, 0.0)
    router.discard_in_batch("a")
    assert router.received("a") == 1  # still leased: the count stands
    assert router.release("a") is True
    assert router.received("a") == 0  # neither leased nor in a batch: gone
    router.add_in_batch("a")
    router.grant("a", 5.0)
    assert router.route({"d": [b"a:2"]}, 0.0).completed == []  # 1 of 2, not carried over
    router.add_in_batch("b")
    router.route({"d": [b"b:3"]}, 0.0)
    router.discard_in_batch("b")
    assert router.received("b") == 0


def test_one_router_per_table(core):
    """The Cython router keeps batch membership in its table's slots, so a
    table serves one router; both twins refuse a second."""
    table = core.LeaseTable(5.0)
    core.NotificationRouter(table)
    with pytest.raises(ValueError, match="already belongs"):
        core.NotificationRouter(table)


def test_batch_membership_survives_direct_table_calls(core):
    """A leased id in a batch stays in it when the lease ends through the
    table itself (release, pop_expired), and leaves it through the router."""
    table = core.LeaseTable(5.0)
    router = core.NotificationRouter(table)
    for rid in ("a", "b", "c"):
        router.add_in_batch(rid)
        assert router.grant(rid, 1.0)
    assert router.in_batch_count() == 3
    assert table.release("a") and router.is_in_batch("a")
    assert table.pop_expired(2.0) == ["b", "c"] and router.is_in_batch("b")
    router.add_in_batch("d")
    router.grant("d", 1.0)
    assert router.expire(2.0) == (["d"], {}) and not router.is_in_batch("d")
    assert router.in_batch_count() == 3 and all(router.is_in_batch(r) for r in "abc")


def test_escape_is_passed_through_not_heartbeated(core):
    """``HB:,`` (the lease protocol's escape) goes to ``passthrough``, per
    agent in arrival order, whatever follows it and whichever prefixes the
    router was given; every other ``HB:`` message is a heartbeat as ever."""
    from vllm_nixl_lease._wire import ESCAPE_PREFIX, PUSH_REG_PREFIX

    for prefixes in (
        (),
        (PUSH_REG_PREFIX,),
        (PUSH_REG_PREFIX, ESCAPE_PREFIX),
        (ESCAPE_PREFIX + b"LHB:",),
    ):
        table = core.LeaseTable(10.0)
        router = core.NotificationRouter(table, prefixes)
        router.add_in_batch("a")
        router.grant("a", 1.0)
        ours = [
            ESCAPE_PREFIX + b"LHB:7,a",
            ESCAPE_PREFIX,
            ESCAPE_PREFIX + b"\xff",
            ESCAPE_PREFIX + b"a:1",
        ]
        res = router.route(
            {"d0": [ours[0], b"HB:a", ours[1]], "d1": [ours[2], b"HB:", b"HB:zz,", ours[3]]}, 5.0
        )
        assert res.passthrough == {"d0": [ours[0], ours[1]], "d1": [ours[2], ours[3]]}
        assert (res.heartbeat_messages, res.heartbeat_ids, res.extended, res.malformed) == (3, 2, 1, 0)
        assert table.deadline("a") == 15.0 and res.completed == []  # only the plain HB: extended it


def test_passthrough_prefixes_may_not_take_heartbeats(core):
    from vllm_nixl_lease._wire import ESCAPE_PREFIX

    for bad in (b"HB:", b"HB:x", b"HB:LHB:", b""):
        with pytest.raises(ValueError):
            core.NotificationRouter(core.LeaseTable(1.0), (bad,))
    core.NotificationRouter(core.LeaseTable(1.0), (ESCAPE_PREFIX,))
