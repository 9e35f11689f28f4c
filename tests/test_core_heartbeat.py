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


def test_track_untrack_and_throttle(core):
    hb = core.HeartbeatTracker(5.0, max_message_bytes=20)
    assert hb.poll(0.0) == {}  # nothing tracked: nothing to send
    for i in range(6):
        hb.track(f"loc{i}", "P0" if i % 2 else "P1", f"rem{i}")
    assert hb.due(0.0)
    msgs = hb.poll(0.0)
    assert sorted(msgs) == ["P0", "P1"]
    assert ids_in(msgs["P0"]) == [b"rem1", b"rem3", b"rem5"]
    assert hb.poll(4.9) == {} and not hb.due(4.9) and hb.due(5.0)
    assert hb.untrack("loc1") and not hb.untrack("loc1")
    assert ids_in(hb.messages_for("P0")) == [b"rem3", b"rem5"]
    for i in (3, 5):
        hb.untrack(f"loc{i}")
    assert hb.engines() == ["P1"] and hb.messages_for("P0") == []


def test_messages_respect_limit_and_dedupe(core):
    hb = core.HeartbeatTracker(0, max_message_bytes=64)
    for i in range(500):
        hb.track(f"l{i}", "E", f"r{i % 300}")  # two local requests per remote id for 200 ids
    msgs = hb.messages_for("E")
    assert all(len(m) <= 64 for m in msgs)
    assert sorted(ids_in(msgs)) == sorted(f"r{i}".encode() for i in range(300))
    for i in range(300):
        hb.untrack(f"l{i}")
    assert sorted(ids_in(hb.messages_for("E"))) == sorted(f"r{i}".encode() for i in range(200))


def test_cached_messages_reused_until_change(core):
    hb = core.HeartbeatTracker(0, max_message_bytes=32)
    for i in range(40):
        hb.track(f"l{i}", "E", f"req-{i:03d}")
    first = hb.messages_for("E")
    again = hb.messages_for("E")
    assert all(a is b for a, b in zip(first, again, strict=True))
    hb.untrack("l0")
    after = hb.messages_for("E")
    assert after[0] is not first[0] and all(a is b for a, b in zip(first[1:], after[1:], strict=True))


def test_retrack_moves_engine(core):
    hb = core.HeartbeatTracker(1.0)
    hb.track("l", "A", "r")
    hb.track("l", "B", "r")
    assert hb.engine_of("l") == "B" and hb.engines() == ["B"] and len(hb) == 1


def test_repack_after_removals(core):
    hb = core.HeartbeatTracker(0, max_message_bytes=40)
    for i in range(200):
        hb.track(f"l{i}", "E", f"x{i:04d}")
    before = len(hb.messages_for("E"))
    for i in range(200):
        if i % 10:
            hb.untrack(f"l{i}")
    msgs = hb.messages_for("E")
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
