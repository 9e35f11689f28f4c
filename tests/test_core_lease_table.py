"""LeaseTable unit tests, run against the Cython core and its Python twin."""

from __future__ import annotations

import math

import pytest


def test_grant_extend_release(core):
    t = core.LeaseTable(20.0)
    t.grant("a", 10.0)
    t.grant("b", 12.0)
    assert len(t) == 2 and "a" in t and "zz" not in t
    assert t.extend(b"a,zz,b", 1.0) == 2  # max(old, 21)
    assert t.deadline("a") == 21.0 and t.deadline("b") == 21.0
    assert t.extend("a", 0.5) == 1
    assert t.deadline("a") == 21.0  # never lowers a deadline
    assert t.release("a") is True and t.release("a") is False
    assert t.deadline("a") is None and len(t) == 1


def test_pop_expired_is_inclusive_and_ordered(core):
    t = core.LeaseTable(5.0)
    for i, d in enumerate([3.0, 1.0, 2.0, 2.0, 9.0]):
        t.grant(f"r{i}", d)
    assert t.pop_expired(0.5) == []
    assert t.pop_expired(2.0) == ["r1", "r2", "r3"]  # ties: earlier grant first
    assert t.next_deadline() == 3.0
    assert t.pop_expired(100.0) == ["r0", "r4"]
    assert t.next_deadline() is None and len(t) == 0


def test_extension_moves_lease_behind_others(core):
    t = core.LeaseTable(10.0)
    t.grant("head", 1.0)
    t.grant("tail", 2.0)
    t.extend(b"head", 0.0)  # head now 10.0
    assert t.pop_expired(5.0) == ["tail"]  # the renewed head does not strand tail
    assert t.next_deadline() == 10.0
    assert t.pop_expired(10.0) == ["head"]


def test_regrant_overwrites_even_earlier(core):
    t = core.LeaseTable(10.0)
    t.grant("a", 50.0)
    t.grant("a", 5.0)
    assert len(t) == 1 and t.deadline("a") == 5.0
    assert t.pop_expired(5.0) == ["a"]
    assert t.pop_expired(100.0) == []


def test_heartbeat_never_creates_lease_and_skips_junk(core):
    t = core.LeaseTable(10.0)
    t.grant("ok", 1.0)
    assert t.extend_counted(b",,\xff\xfe,ok,,unknown,", 0.0) == (1, 3)
    assert len(t) == 1
    assert t.extend(b"", 0.0) == 0
    assert t.extend("\ud800,ok", 1.0) == 1  # lone surrogate ignored, not raised
    assert t.extend(bytearray(b"ok"), 2.0) == 1
    assert t.extend(memoryview(b"ok"), 3.0) == 1
    assert t.deadline("ok") == 13.0


def test_utf8_ids(core):
    t = core.LeaseTable(10.0)
    t.grant("réq-✓", 1.0)
    assert t.extend("réq-✓".encode(), 0.0) == 1
    assert t.extend("réq-✓", 5.0) == 1
    assert t.deadline("réq-✓") == 15.0


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "x"])
def test_bad_extension(core, bad):
    with pytest.raises((ValueError, TypeError)):
        core.LeaseTable(bad)


def test_bad_grants(core):
    t = core.LeaseTable(1.0)
    with pytest.raises(TypeError):
        t.grant(b"bytes-id", 1.0)
    with pytest.raises(ValueError):
        t.grant("\ud800", 1.0)
    with pytest.raises(ValueError):
        t.grant("a", math.nan)
    assert len(t) == 0 and "\ud800" not in t and t.release(123) is False


def test_forced_hash_collisions(core):
    t = core.LeaseTable(3.0, _hash_bits=1)  # Cython: every id shares two buckets
    ids = [f"id-{i}" for i in range(300)]
    for i, rid in enumerate(ids):
        t.grant(rid, float(i))
    for rid in ids[::2]:
        assert t.release(rid)
    assert t.extend(",".join(ids), 0.0) == 150
    assert sorted(t.ids()) == sorted(ids[1::2])
    assert t.pop_expired(3.0) == ids[1:4:2]


def test_stale_heap_entries_are_bounded(core):
    t = core.LeaseTable(10.0)
    for i in range(50):
        t.grant(f"live{i}", 1e9)
    for i in range(20_000):  # churn: grant + release never pops
        t.grant(f"tmp{i}", float(i))
        t.release(f"tmp{i}")
        t.grant(f"live{i % 50}", 1e9 + i)  # overwrite orphans an entry too
    assert len(t) == 50
    assert t.heap_size() <= 2 * 50 + 64 + 2


def test_extensions_do_not_grow_heap(core):
    t = core.LeaseTable(10.0)
    for i in range(100):
        t.grant(f"r{i}", 0.0)
    payload = ",".join(f"r{i}" for i in range(100)).encode()
    for step in range(1000):
        t.extend(payload, float(step))
        assert t.pop_expired(float(step)) == []
    assert t.heap_size() == 100


def test_seq_renumbering_keeps_tie_order():
    """Cython grant seqs are 31-bit; running out renumbers live leases in order."""
    from conftest import load_core

    fast, twin = load_core("cython").LeaseTable(5.0), load_core("python").LeaseTable(5.0)
    fast._debug_set_seq(2**31 - 40)
    for t in (fast, twin):
        for i in range(100):  # crosses the wrap with equal deadlines everywhere
            t.grant(f"r{i % 60}", float(i % 3))
        t.release("r7")
        t.extend(b"r1,r2", 0.0)
    assert fast.pop_expired(2.0) == twin.pop_expired(2.0)
    assert fast.pop_expired(10.0) == twin.pop_expired(10.0) and len(fast) == 0


def test_memory_bounded_under_unique_id_churn(core):
    """Unique ids granted and released forever must not grow the table."""
    t = core.LeaseTable(10.0)
    for i in range(1000):
        t.grant(f"live{i}", 1e9)
    sizes = []
    for rnd in range(6):
        for i in range(20_000):
            rid = f"gone{rnd}-{i}"
            t.grant(rid, float(i))
            if i % 2:
                t.release(rid)
        t.pop_expired(1e6)
        sizes.append(t.nbytes())
    assert len(t) == 1000
    assert max(sizes[2:]) <= sizes[1] * 1.25


def test_memory_follows_live_count_after_burst(core):
    """After a burst drains to 100 leases, the table is as small as a fresh
    one holding the same 100 (within 2x), for both drains: release and expiry."""
    ids = [f"burst-{i:08d}" for i in range(50_000)]
    keep = ids[-100:]
    fresh = core.LeaseTable(10.0)
    for rid in keep:
        fresh.grant(rid, 1e9)
    for drain in ("release", "expiry"):
        t = core.LeaseTable(10.0)
        for rid in ids[:-100]:
            t.grant(rid, 1.0)
        for rid in keep:
            t.grant(rid, 1e9)
        peak = t.nbytes()
        if drain == "release":
            for rid in ids[:-100]:
                t.release(rid)
        else:
            assert len(t.pop_expired(2.0)) == len(ids) - 100
        assert len(t) == 100 and sorted(t.ids()) == keep
        assert t.nbytes() <= 2 * fresh.nbytes() < peak
        assert t.heap_size() <= 2 * len(t) + 64
        assert t.extend(",".join(keep), 3.0) == 100 and t.pop_expired(1e8) == []


def test_limited_sweeps_pop_in_the_twins_order():
    """A dead D's leases, spread over many wheel buckets and some extended
    (their wheel entries left behind in earlier buckets), popped ``limit`` at a
    time while heartbeats, releases and new grants land between the sweeps
    (the Cython table keeps the due leases a sweep left in a backlog heap):
    the same leases come out in the twin's earliest-first order."""
    from conftest import load_core

    fast, twin = load_core("cython").LeaseTable(16.0), load_core("python").LeaseTable(16.0)
    ids = [f"d{i}" for i in range(5000)]
    got: dict[int, list] = {id(fast): [], id(twin): []}
    for t in (fast, twin):
        for i, rid in enumerate(ids):
            t.grant(rid, (i * 7919 % 5000) / 250.0)  # deadlines 0..20 s, shuffled
        t.extend(",".join(ids[::3]).encode(), 2.0)  # to 18 s, from early buckets
        for step, limit in enumerate((0, 1, 37, 500, 2000, 300, 4000, 5000)):
            got[id(t)].append(t.pop_expired(25.0 + step, limit))
            t.extend(",".join(ids[step::7]).encode(), 10.0 + step)  # some still due, some not
            got[id(t)].append([t.release(rid) for rid in ids[step * 11 :: 97]])
            t.grant(f"new{step}", 20.0 + step)
            got[id(t)].append(t.next_deadline())
        got[id(t)].append(t.pop_expired(1e9))
    assert got[id(fast)] == got[id(twin)]
    assert len(fast) == 0 and fast.heap_size() == 0


def test_limit_contract(core):
    t = core.LeaseTable(5.0)
    for bad, exc in (
        (-1, ValueError),
        (2**70, ValueError),
        (1.0, TypeError),
        (True, TypeError),
        ("3", TypeError),
    ):
        with pytest.raises(exc):
            t.pop_expired(1.0, bad)
