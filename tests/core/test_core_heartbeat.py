"""HeartbeatTracker / encode_heartbeats unit tests, both implementations."""

from __future__ import annotations

import pytest

from vllm_nixl_lease._wire import heartbeat_message, heartbeat_payload, is_heartbeat


def ids_in(messages):
    out = []
    for m in messages:
        assert is_heartbeat(m)
        out.extend(heartbeat_payload(m).split(b","))
    return out


def sent(hb, now=0.0):
    """The messages one ``poll_paced_chunks`` call sends, per engine (every
    chunk, on a tracker with interval 0)."""
    return {engine: [m for _, _, m, _ in items] for engine, items in hb.poll_paced_chunks(now).items()}


def test_encode_packs_greedily(core):
    assert core.encode_heartbeats([], 100) == []
    assert core.encode_heartbeats(["aa", "bb", "cc"], 9) == [
        heartbeat_message(["aa", "bb"]),
        heartbeat_message(["cc"]),
    ]
    assert core.encode_heartbeats(["abcdef"], 9) == [heartbeat_message(["abcdef"])]
    for bad in ("", "a,b", "abcdefg"):
        with pytest.raises(ValueError):
            core.encode_heartbeats([bad], 9)
    with pytest.raises(ValueError):
        core.encode_heartbeats(["a"], 3)


def test_track_and_untrack(core):
    hb = core.HeartbeatTracker(0.0, max_message_bytes=20)
    assert sent(hb) == {}  # nothing tracked: nothing to send
    for i in range(6):
        hb.track(f"loc{i}", "P0" if i % 2 else "P1", f"rem{i}")
    msgs = sent(hb)
    assert sorted(msgs) == ["P0", "P1"]
    assert ids_in(msgs["P0"]) == [b"rem1", b"rem3", b"rem5"]
    assert hb.untrack("loc1") and not hb.untrack("loc1")
    assert ids_in(sent(hb)["P0"]) == [b"rem3", b"rem5"]
    for i in (3, 5):
        hb.untrack(f"loc{i}")
    assert hb.engines() == ["P1"] and sorted(sent(hb)) == ["P1"]
    assert hb.has_engine("P1") and not hb.has_engine("P0")  # the intake's look at one engine


def test_messages_respect_limit_and_dedupe(core):
    hb = core.HeartbeatTracker(0, max_message_bytes=64)
    for i in range(500):
        hb.track(f"l{i}", "E", f"r{i % 300}")  # two local requests per remote id for 200 ids
    msgs = sent(hb)["E"]
    assert all(len(m) <= 64 for m in msgs)
    assert sorted(ids_in(msgs)) == sorted(f"r{i}".encode() for i in range(300))
    for i in range(300):
        hb.untrack(f"l{i}")
    assert sorted(ids_in(sent(hb)["E"])) == sorted(f"r{i}".encode() for i in range(200))


def test_cached_messages_reused_until_change(core):
    hb = core.HeartbeatTracker(0, max_message_bytes=32)
    for i in range(40):
        hb.track(f"l{i}", "E", f"req-{i:03d}")
    first = sent(hb)["E"]
    again = sent(hb)["E"]
    assert all(a is b for a, b in zip(first, again, strict=True))
    hb.untrack("l0")
    after = sent(hb)["E"]
    assert after[0] is not first[0] and all(a is b for a, b in zip(first[1:], after[1:], strict=True))


def test_retrack_moves_engine(core):
    hb = core.HeartbeatTracker(1.0)
    hb.track("l", "A", "r")
    hb.track("l", "B", "r")
    assert hb.engine_of("l") == "B" and hb.engines() == ["B"] and len(hb) == 1
    assert hb.has_engine("B") and not hb.has_engine("A")


def test_repack_after_removals(core):
    hb = core.HeartbeatTracker(0, max_message_bytes=40)
    for i in range(200):
        hb.track(f"l{i}", "E", f"x{i:04d}")
    before = len(sent(hb)["E"])
    for i in range(200):
        if i % 10:
            hb.untrack(f"l{i}")
    msgs = sent(hb)["E"]
    assert len(msgs) == 4 < before  # 20 ids of 6 bytes need 4 messages of 40
    assert len(ids_in(msgs)) == 20


@pytest.mark.parametrize("bad", ["", "a,b", "x" * 8190])
def test_track_rejects_bad_remote_ids(core, bad):
    hb = core.HeartbeatTracker(1.0)
    with pytest.raises(ValueError):
        hb.track("local", "E", bad)
    assert len(hb) == 0


def test_bad_tracker_config(core):
    for interval in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            core.HeartbeatTracker(interval)
    with pytest.raises(ValueError):
        core.HeartbeatTracker(1.0, max_message_bytes=3)
    for phase in (-0.1, 1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            core.HeartbeatTracker(1.0, phase=phase)


def test_paced_sends_new_chunks_at_once_then_spreads_the_round(core):
    """40 chunks created at once go out at the first call (no id waits longer
    than upstream's first tick); then each call sends its share, in due order,
    and every chunk once per interval."""
    hb = core.HeartbeatTracker(1.0, max_message_bytes=12)  # one 8-byte id per chunk
    for i in range(40):
        hb.track(f"l{i}", "P0", f"r{i:07d}")
    first = sent(hb, 0.0)
    assert len(first["P0"]) == 40
    per_call = []
    for step in range(1, 21):  # 20 calls of 0.05 s: one interval
        out = sent(hb, step * 0.05)
        per_call.append(len(out.get("P0", [])))
    assert per_call == [2] * 20  # 40 chunks / 20 calls, early and even
    # the second round follows the first one's order (earliest due first)
    assert ids_in(sent(hb, 1.05)["P0"]) == [b"r0000000", b"r0000001"]


def test_paced_new_chunk_and_appended_ids(core):
    hb = core.HeartbeatTracker(1.0, max_message_bytes=30)
    hb.track("a", "P0", "aaaa")
    assert sent(hb, 0.0) == {"P0": [heartbeat_message(["aaaa"])]}
    hb.track("b", "P0", "bbbb")  # joins the chunk just sent: out by its due time
    for step in range(1, 20):
        assert sent(hb, step * 0.05) == {}
    assert sent(hb, 1.0) == {"P0": [heartbeat_message(["aaaa", "bbbb"])]}
    hb.track("c", "P1", "cccc")  # a new chunk: the next call
    assert sent(hb, 1.01) == {"P1": [heartbeat_message(["cccc"])]}
    hb.untrack("a")
    hb.untrack("b")
    assert sent(hb, 2.0) == {} and hb.engines() == ["P1"]


def test_paced_interval_zero_sends_every_chunk_each_call(core):
    hb = core.HeartbeatTracker(0.0, max_message_bytes=12)
    for i in range(3):
        hb.track(f"l{i}", "P0", f"r{i:07d}")
    for now in (0.0, 0.0, 0.5):
        assert len(sent(hb, now)["P0"]) == 3


def test_paced_phase_offsets_a_new_round_without_sending_more(core):
    """Two D engines given the same 8 chunks at the same moment: at phase 0 and 0.5
    their early sends fall half a share (1/16 s) apart instead of at the same
    polls; the phase adds at most the one send it starts with, and past the first
    interval both send at the same rate.  (Polls every 1/128 s: exact in floats.)"""

    def run(phase: float) -> list[tuple[float, int]]:
        hb = core.HeartbeatTracker(1.0, max_message_bytes=12, phase=phase)
        for i in range(8):
            hb.track(f"l{i}", "P0", f"r{i:07d}")
        sends = []
        for step in range(640):  # 5 s
            n = len(hb.poll_paced_chunks(step / 128).get("P0", []))
            sends += [(step / 128, n)] if n else []
        return sends

    aligned, offset = run(0.0), run(0.5)
    assert aligned[0] == offset[0] == (0.0, 8)  # new chunks: at once, whatever the phase
    assert [t for t, _ in aligned[1:4]] == [0.125, 0.25, 0.375]  # a share is 1/8 s
    assert [t for t, _ in offset[1:4]] == [0.0625, 0.1875, 0.3125]
    assert not {t for t, _ in aligned[1:]} & {t for t, _ in offset[1:]}
    total = sum(n for _, n in aligned)
    assert total <= sum(n for _, n in offset) <= total + 1
    assert sum(n for t, n in aligned if t >= 1) == sum(n for t, n in offset if t >= 1) == 32


def _paced_run(core, seed: int, skip: bool = False, phase: float = 0.0, round_bytes: int = 0):
    """Random tracks/untracks (FIFO-ish and random), random step lengths;
    returns what was sent and checks the promise on the way.  A poll before
    ``next_poll_at`` must send nothing; with ``skip`` it is not made (what
    D's scheduler does)."""
    import random

    rng = random.Random(seed)
    interval = 1.0
    hb = core.HeartbeatTracker(interval, max_message_bytes=40, phase=phase, round_bytes=round_bytes)
    live: dict[str, tuple[str, str]] = {}
    last_sent: dict[tuple[str, str], float] = {}  # (engine, remote id) -> last send
    tracked_at: dict[tuple[str, str], float] = {}
    log = []
    now, n = 0.0, 0
    for _ in range(600):
        for _ in range(rng.randrange(4)):
            engine, rid = f"P{rng.randrange(3)}", f"r{n}"
            hb.track(f"l{n}", engine, rid)
            live[f"l{n}"] = (engine, rid)
            tracked_at[(engine, rid)] = now
            n += 1
        for _ in range(rng.randrange(4)):
            if live:
                local = min(live) if rng.random() < 0.5 else rng.choice(sorted(live))
                key = live.pop(local)
                hb.untrack(local)
                last_sent.pop(key, None)
                tracked_at.pop(key, None)
        early = now < hb.next_poll_at
        if skip and early:
            keyed = {}
        else:
            keyed = hb.poll_paced_chunks(now)
            assert not (early and keyed), (now, keyed)
        log.append((keyed, [hb.chunk_of(local) for local in sorted(live)], hb.repacks))
        out = {engine: [m for _, _, m, _ in items] for engine, items in keyed.items()}
        for engine, msgs in out.items():
            assert all(len(m) <= 40 for m in msgs)
            for rid in ids_in(msgs):
                last_sent[(engine, rid.decode())] = now
        for key in live.values():
            since = last_sent.get(key, tracked_at[key])
            assert now - since <= interval + 1e-9, (key, now, since)
        now += rng.choice((0.01, 0.02, 0.05, 0.3))
    return log


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("phase", [0.0, 0.73])
def test_paced_promise_holds_under_churn(core, seed, phase):
    """Each live id is sent at most ``interval`` after its previous send (or
    after it was tracked), whatever arrives and leaves, at any phase."""
    _paced_run(core, seed, phase=phase)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("round_bytes", [120, 400, 10_000])
def test_a_small_round_keeps_the_promise(core, seed, round_bytes):
    """Rounds that fit ``round_bytes`` go whole, rounds that grow past it are
    paced again: each live id still goes out within ``interval``."""
    _paced_run(core, seed, round_bytes=round_bytes)
    _paced_run(core, seed, skip=True, phase=0.4, round_bytes=round_bytes)


def test_a_round_that_fits_the_step_budget_goes_in_one_step(core):
    """8 chunks of 12 bytes (96 bytes a round): with a budget of 96 bytes every
    round goes out in one poll, once per interval; with 95 it is paced, 8 polls
    an interval as before."""

    def sending_polls(round_bytes: int) -> tuple[list[int], int]:
        hb = core.HeartbeatTracker(1.0, max_message_bytes=12, round_bytes=round_bytes)
        for i in range(8):
            hb.track(f"l{i}", f"P{i % 2}", f"r{i:07d}")
        sizes, made = [], 0
        for step in range(3000):
            now = step * 0.001
            if now < hb.next_poll_at:
                continue
            made += 1
            n = sum(len(v) for v in hb.poll_paced_chunks(now).values())
            if n:
                sizes.append(n)
        return sizes, made

    whole, made = sending_polls(96)
    assert whole == [8, 8, 8]  # at 0, 1 and 2 s
    assert made == 3  # the polls between skipped (next_poll_at)
    paced, _ = sending_polls(95)
    assert paced[0] == 8 and set(paced[1:]) == {1} and len(paced) == 1 + 23
    with pytest.raises(ValueError):
        core.HeartbeatTracker(1.0, round_bytes=-1)
    with pytest.raises(TypeError):
        core.HeartbeatTracker(1.0, round_bytes=1.5)


@pytest.mark.parametrize("seed", range(5))
def test_paced_promise_holds_skipping_early_polls(core, seed):
    """Skipping every poll before ``next_poll_at`` keeps the promise, and
    skips most polls once the round is spread."""
    _paced_run(core, seed, skip=True)
    _paced_run(core, seed, skip=True, phase=0.31)


def test_next_poll_at_skips_most_steps_of_a_spread_round(core):
    """8 chunks over a 1 s interval, polled every 1 ms: one poll in ~125 must
    be made, and a change to the chunks asks for the next one at once."""

    def run(skip: bool) -> tuple[object, list[tuple[float, list[bytes]]], int]:
        hb = core.HeartbeatTracker(1.0, max_message_bytes=12)
        for i in range(8):
            hb.track(f"l{i}", "P0", f"r{i:07d}")
        sends, made = [], 0
        for step in range(3000):
            now = step * 0.001
            if skip and now < hb.next_poll_at:
                continue
            made += 1
            out = hb.poll_paced_chunks(now).get("P0", [])
            sends += [(now, [m for _, _, m, _ in out])] if out else []
        return hb, sends, made

    hb, sends, made = run(skip=True)
    assert sends == run(skip=False)[1]  # the same messages at the same steps
    assert sum(len(msgs) for _, msgs in sends) == 8 + 23  # the first round at once, then 8 a second
    assert made <= 40, made
    assert hb.next_poll_at > 2.999
    hb.track("new", "P0", "r9999999")  # a new chunk: due at the next call
    assert hb.next_poll_at == float("-inf")
    assert hb.poll_paced_chunks(3.0)["P0"][0][2] == heartbeat_message(["r9999999"])
    hb.untrack("new")  # one chunk fewer: the pace changed
    assert hb.next_poll_at == float("-inf")
    assert core.HeartbeatTracker(0.0).next_poll_at == float("-inf")


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("skip", [False, True])
def test_paced_twin_and_cython_agree(seed, skip):
    from core_implementations import load_core

    try:
        cython = load_core("cython")
    except pytest.skip.Exception:
        pytest.skip("no Cython build")
    assert _paced_run(cython, seed, skip) == _paced_run(load_core("python"), seed, skip)
    assert _paced_run(cython, seed, skip, 0.6) == _paced_run(load_core("python"), seed, skip, 0.6)
    assert _paced_run(cython, seed, skip, 0.6, 300) == _paced_run(load_core("python"), seed, skip, 0.6, 300)


def test_chunk_versions_name_who_a_message_covers(core):
    """A message at (key, version) names every id whose chunk_of was (key,
    v <= version); an id tracked (again) after the message was built has a
    higher version."""
    hb = core.HeartbeatTracker(1.0, max_message_bytes=100)
    hb.track("a", "P0", "ra")
    [(key, version, msg, names)] = hb.poll_paced_chunks(0.0)["P0"]
    assert msg == heartbeat_message(["ra"]) and hb.chunk_of("a") == (key, version) and names == 1
    hb.track("b", "P0", "rb")  # joins after the message was built
    b_key, b_joined = hb.chunk_of("b")
    assert b_key == key and b_joined > version
    hb.track("c", "P0", "ra")  # a second request on the same P id: a new joiner
    c_joined = hb.chunk_of("c")[1]
    assert c_joined > b_joined
    hb.track("a", "P0", "ra")  # the same request again: also a new joiner
    assert hb.chunk_of("a")[1] > c_joined
    assert hb.chunk_of("zz") is None and hb.repacks == 0
