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
    assert t.scheduled_entries() <= 2 * 50 + 64 + 2


def test_extensions_do_not_grow_heap(core):
    t = core.LeaseTable(10.0)
    for i in range(100):
        t.grant(f"r{i}", 0.0)
    payload = ",".join(f"r{i}" for i in range(100)).encode()
    for step in range(1000):
        t.extend(payload, float(step))
        assert t.pop_expired(float(step)) == []
    assert t.scheduled_entries() == 100


def test_seq_renumbering_keeps_tie_order():
    """Cython grant seqs are 31-bit; running out renumbers live leases in order."""
    from core_implementations import load_core

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
    """Unique ids granted and freed forever must not grow the table: the
    tombstones of the freed ones age out as the clock moves on."""
    t = core.LeaseTable(10.0)  # tombstones live 20 s
    for i in range(1000):
        t.grant(f"live{i}", 1e9)
    sizes = []
    for rnd in range(6):
        now = 1e6 + 100.0 * rnd
        for i in range(20_000):
            rid = f"gone{rnd}-{i}"
            t.grant(rid, float(i))
            if i % 2:
                t.release(rid)
        t.pop_expired(now)
        assert t.tombstones() == 10_000  # this round's expiries; its releases are older than 20 s
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
            t.pop_expired(2.0, 0)  # the frees are dated 2.0
            for rid in ids[:-100]:
                t.release(rid)
        else:
            assert len(t.pop_expired(2.0)) == len(ids) - 100
        assert t.tombstones() == len(ids) - 100
        t.pop_expired(2.0 + 20.0 + 0.5, 0)  # past the tombstones' 20 s
        assert t.tombstones() == 0
        assert len(t) == 100 and sorted(t.ids()) == keep
        assert t.nbytes() <= 2 * fresh.nbytes() < peak
        assert t.scheduled_entries() <= 2 * len(t) + 64
        assert t.extend(",".join(keep), 3.0) == 100 and t.pop_expired(1e8) == []


def test_limited_sweeps_pop_in_the_twins_order():
    """A dead D's leases, spread over many wheel buckets and some extended
    (their wheel entries left behind in earlier buckets), popped ``limit`` at a
    time while heartbeats, releases and new grants land between the sweeps
    (the Cython table keeps the due leases a sweep left in a backlog heap):
    the same leases come out in the twin's earliest-first order."""
    from core_implementations import load_core

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
    assert len(fast) == 0 and fast.scheduled_entries() == 0


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


# -- tombstones and ambiguity (docs/PROTOCOL.md P3, P4 and section 5) -------
KEY = bytes(range(16))


def same_tag(n: int, bits: int) -> list[str]:
    """``n`` ids whose tags collide in a table with ``tag_bits=bits``."""
    from vllm_nixl_lease.lease_tags import tag_digest

    def group(req_id: str) -> int:
        return tag_digest(req_id, KEY) & (2**bits - 1)

    first = group("x-0")
    return [r for r in (f"x-{i}" for i in range(1000)) if group(r) == first][:n]


def tagged_table(core, bits: int, **options):
    t = core.LeaseTable(4.0, tag_bits=bits, **options)  # tombstones live 8 s by default
    t.set_tag_key(KEY)
    t.pop_expired(100.0, 0)  # the table's clock: frees are dated 100
    return t


@pytest.mark.parametrize("bits", [1, 2])
def test_freed_while_a_tag_mate_lives(core, bits):
    """(a) X freed while Y shares its tag: Y is ambiguous for its life, so its
    tag is answered not held (and still extended), whatever else renews Y."""
    from vllm_nixl_lease.lease_tags import lease_tag

    x, y = same_tag(2, bits)
    t = tagged_table(core, bits)
    t.grant(x, 200.0)
    t.grant(y, 200.0)
    tag = lease_tag(y, KEY)
    assert t.extend_tagged(tag.encode(), 100.0) == (2, 1, [])  # both held: exactly what it names
    assert t.release(x)
    assert t.is_ambiguous(y) and not t.is_ambiguous(x)
    assert t.extend_tagged(tag.encode(), 150.0) == (1, 1, [tag])
    assert t.deadline(y) == 200.0  # max(old, 154)
    assert t.extend_tagged(tag.encode(), 199.0) == (1, 1, [tag]) and t.deadline(y) == 203.0
    assert t.extend_acked(y.encode(), 199.5) == (1, 1, [y])  # by id too: the lease is ambiguous
    t.grant(y, 300.0)  # granted again: still the same lease, still ambiguous
    assert t.is_ambiguous(y)


@pytest.mark.parametrize("bits", [1, 2])
def test_granted_on_a_tombstoned_tag(core, bits):
    """(b) X freed, then Y granted on X's tag within ``tombstone_s``: Y is
    ambiguous.  (c) Granted after the tombstone aged out: it is not."""
    from vllm_nixl_lease.lease_tags import lease_tag

    x, y, z = same_tag(3, bits)
    t = tagged_table(core, bits)
    t.grant(x, 200.0)
    assert t.release(x)  # dated 100: its keys are tombstones until 108
    assert t.tombstones() == 2  # x's id and its tag
    t.pop_expired(108.0, 0)  # exactly tombstone_s later: still live (inclusive)
    t.grant(y, 200.0)
    assert t.is_ambiguous(y)
    assert t.extend_tagged(lease_tag(y, KEY).encode(), 108.0) == (1, 1, [lease_tag(y, KEY)])
    t.pop_expired(108.001, 0)
    assert t.tombstones() == 0
    t.grant(z, 200.0)
    assert not t.is_ambiguous(z) and t.is_ambiguous(y)
    assert t.release(y)  # dated 108.001: z shared the tag, so z is ambiguous now
    assert t.is_ambiguous(z)


def test_tombstones_agree_with_the_twin_across_resizes():
    """The Cython core's tombstone map resizes a little per operation (the
    old and new tables both live meanwhile) and maps its successor ahead of
    time once large: with 30k leases freed in bursts (60k keys, tags cut to 18
    bits so unrelated ids share them), then aged out, it grows through every
    size to 2**17 cells and shrinks back, and after every step it says what
    the twin says: how many tombstones live, and which grants are ambiguous
    (ids freed in the window, ids freed long ago, fresh ids)."""
    import random

    from core_implementations import load_core

    fast, twin = (tagged_table(load_core(name), 18) for name in ("cython", "python"))
    rng = random.Random(7)
    freed: list[str] = []
    serial = peak = 0
    now = 100.0
    for step in range(400):
        now += 0.05
        if step < 150:  # a burst: grant, release some, let some expire
            batch = [f"b{serial + i}" for i in range(400)]
            serial += len(batch)
            for t in (fast, twin):
                for rid in batch:
                    t.grant(rid, now + 0.2)
                for rid in batch[::3]:
                    t.release(rid)
            freed += batch[::3]
        expired = fast.pop_expired(now, 300)
        assert twin.pop_expired(now, 300) == expired
        freed += expired
        probes = rng.sample(freed, min(20, len(freed))) + [f"fresh{step}-{i}" for i in range(5)]
        for t in (fast, twin):
            for rid in probes:
                t.grant(rid, now + 1e6)
        assert [fast.is_ambiguous(r) for r in probes] == [twin.is_ambiguous(r) for r in probes]
        for t in (fast, twin):
            for rid in probes:
                t.release(rid)
        assert fast.tombstones() == twin.tombstones(), step
        peak = max(peak, fast.tombstones())
    assert peak > 2**15  # past half of 2**16 cells: grown to 2**17
    for t in (fast, twin):
        t.pop_expired(now + 8.5, 0)  # past the window of the last frees
    assert fast.tombstones() == twin.tombstones() == 0 and len(fast) == len(twin) == 0


def test_tombstone_window_is_a_constructor_option(core):
    t = core.LeaseTable(4.0, tombstone_s=1.0)
    t.pop_expired(10.0, 0)
    t.grant("x", 100.0)
    t.release("x")
    t.pop_expired(11.5, 0)
    t.grant("x", 100.0)
    assert not t.is_ambiguous("x")
    for bad in (-1.0, math.nan, math.inf, "x"):
        with pytest.raises((ValueError, TypeError)):
            core.LeaseTable(4.0, tombstone_s=bad)
    for bad, exc in ((0, ValueError), (65, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(exc):
            core.LeaseTable(4.0, tag_bits=bad)
    for bad, exc in ((0, ValueError), (-3, ValueError), (2.0, TypeError)):
        with pytest.raises(exc):
            core.LeaseTable(4.0, max_tombstones=bad)


def test_id_reused_within_the_window(core):
    """(d) An id freed and granted again within ``tombstone_s``: an ``LHB:``
    naming it may be D's about the old lease, so the answer lists it (and the
    lease is extended all the same); an id never freed is answered held."""
    t = core.LeaseTable(4.0)
    t.grant("old", 10.0)
    t.grant("fresh", 10.0)
    t.extend(b"", 1.0)
    assert t.pop_expired(10.0) == ["old", "fresh"]  # freed at 10: tombstones until 18
    t.grant("old", 30.0)
    t.grant("other", 30.0)
    assert t.extend_acked(b"old,other,gone", 12.0) == (2, 3, ["old", "gone"])
    assert t.deadline("old") == 30.0  # extended: max(30, 16)
    assert t.extend_acked(b"old,other", 27.0) == (2, 2, ["old"]) and t.deadline("old") == 31.0
    t.release("old")
    t.pop_expired(40.0, 0)  # 27 + 8 < 40: the window has passed
    t.grant("old", 50.0)
    assert t.extend_acked(b"old", 41.0) == (1, 1, [])


def test_extend_acked_payloads(core):
    t = core.LeaseTable(4.0)
    t.grant("a", 10.0)
    t.grant("réq", 10.0)
    assert t.extend_acked(b"", 1.0) == (0, 0, [])
    assert t.extend_acked(b",a,,zz,", 1.0) == (1, 2, ["zz"])  # empty names name nothing
    assert t.extend_acked("réq,a".encode(), 7.0) == (2, 2, [])
    assert t.deadline("a") == t.deadline("réq") == 11.0
    # Not UTF-8: the answer counts none as extended, but the held ids were.
    assert t.extend_acked(b"a,\xff,zz", 8.0) == (1, 3, None) and t.deadline("a") == 12.0
    assert t.extend_acked("a,\ud800", 9.0) == (1, 2, None) and t.deadline("a") == 13.0
    assert t.extend_acked(bytearray(b"a,zz"), 10.0) == (1, 2, ["zz"])
    assert t.extend_acked(memoryview(b"a"), 11.0) == (1, 1, [])
    assert t.extend_acked("a,zz", 11.0) == (1, 2, ["zz"]) and t.deadline("a") == 15.0


def test_release_dates_tombstones_with_the_latest_now(core):
    """``release`` takes no time: it uses the largest ``now`` any call gave
    (here a router's ``route`` and an ``extend``), never one that went back."""
    table = core.LeaseTable(4.0)
    router = core.NotificationRouter(table)
    router.route({}, 50.0)
    table.extend(b"", 20.0)  # earlier than 50: the clock stays at 50
    table.grant("x", 100.0)
    table.release("x")  # dated 50: a tombstone until 58
    table.pop_expired(58.0, 0)
    table.grant("x", 100.0)
    assert table.is_ambiguous("x")
    router.add_in_batch("y")
    router.grant("y", 100.0)
    assert router.route({"d": [b"y:1"]}, 70.0).completed == ["y"]  # a completion: dated 70
    table.pop_expired(78.0, 0)
    table.grant("y", 100.0)
    assert table.is_ambiguous("y")
    table.release("y")
    table.pop_expired(86.5, 0)
    table.grant("y", 100.0)
    assert not table.is_ambiguous("y")


def test_over_the_cap_every_grant_is_ambiguous_until_the_lost_tombstone_ages_out(core):
    """Past ``max_tombstones`` free events the oldest goes; the table cannot
    tell any more whether a new lease reuses its key, so every lease granted
    until it would have aged out is ambiguous, and the loss is counted."""
    t = core.LeaseTable(4.0, max_tombstones=3)  # no tag key: one event per free
    t.pop_expired(100.0, 0)
    for i, now in enumerate((100.0, 101.0, 102.0)):
        t.pop_expired(now, 0)
        t.grant(f"f{i}", 1000.0)
        t.release(f"f{i}")
    assert (t.tombstones(), t.tombstone_overflows) == (3, 0)
    t.grant("before", 1000.0)
    assert not t.is_ambiguous("before")
    t.pop_expired(103.0, 0)
    t.grant("f3", 1000.0)
    t.release("f3")  # the 4th event: f0's (freed at 100) is dropped while live
    assert (t.tombstones(), t.tombstone_overflows) == (3, 1)
    t.grant("new", 1000.0)
    assert t.is_ambiguous("new")  # f0's tombstone would have lived until 108
    t.pop_expired(108.0, 0)
    t.grant("new2", 1000.0)
    assert t.is_ambiguous("new2")
    t.pop_expired(108.5, 0)
    t.grant("new3", 1000.0)
    assert not t.is_ambiguous("new3") and t.is_ambiguous("new")
    # An id freed twice in the window is one tombstone with two events: the
    # older event leaving at the cap drops nothing live.
    t2 = core.LeaseTable(4.0, max_tombstones=2)
    t2.pop_expired(0.0, 0)
    for _ in range(3):
        t2.grant("same", 1000.0)
        t2.release("same")
    assert (t2.tombstones(), t2.tombstone_overflows) == (1, 0)


def test_tombstones_are_bounded_by_the_cap_and_the_window(core):
    """At most ``max_tombstones`` free events (two per tagged lease: id and
    tag), and once the clock passes the window the memory they took is given back."""
    t = core.LeaseTable(4.0, max_tombstones=1000)
    t.set_tag_key(KEY)
    peak = 0
    for step in range(50):
        t.pop_expired(float(step), 0)
        for i in range(100):
            t.grant(f"s{step}-{i}", 1e9)
            t.release(f"s{step}-{i}")
        assert t.tombstones() <= 1000
        peak = max(peak, t.nbytes())
    assert t.tombstone_overflows > 0
    t.pop_expired(100.0, 0)
    assert t.tombstones() == 0 and t.nbytes() * 10 < peak
