"""The lease components on their own, against one fake of the upstream interface."""

from __future__ import annotations

import pickle
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from vllm_support import Clock, make_worker, p_meta, p_step

from harness.upstream_fake import FakeUpstreamWorker
from vllm_nixl_lease._wire import completion_message, heartbeat_message, heartbeat_payload
from vllm_nixl_lease.adapter.config import LeaseConfig
from vllm_nixl_lease.adapter.d_worker.heartbeat_sender import HeartbeatSender
from vllm_nixl_lease.adapter.d_worker.read_fence import ReadFence
from vllm_nixl_lease.adapter.metadata import (
    LEASE_HEARTBEATS_ATTR,
    LEASE_INSTANCE_ATTR,
    LEASE_VIEWS_ATTR,
    EngineHeartbeats,
    LeaseConnectorMetadata,
    LeaseViewUpdates,
    NewView,
)
from vllm_nixl_lease.adapter.p_worker.idle_pause import IdlePause
from vllm_nixl_lease.adapter.p_worker.lease_keeper import HeartbeatForm, LeaseKeeper
from vllm_nixl_lease.decode.lease_views import LeaseViews
from vllm_nixl_lease.lease_tags import lease_tag

CONFIG = LeaseConfig.from_extra_config({"kv_lease_duration": 12})  # extension 8, interval 2, margin 2
KEY = b"tag-key-16-bytes"


def test_keeper_grants_extends_releases_and_expires(clock: Clock) -> None:
    up = FakeUpstreamWorker()
    keeper = LeaseKeeper(up, CONFIG)
    keeper.deadlines["a"] = clock.now + 8  # how upstream's start_load_kv grants
    keeper.deadlines["b"] = clock.now + 8
    clock.advance(5)
    done, _ = keeper.route({"d": [heartbeat_message(["a", "zz"]), completion_message("b", 1)]})
    assert done == {"b"} and "b" not in keeper.table
    assert keeper.table.deadline("a") == pytest.approx(clock.now + 8)
    assert (up.count("num_heartbeat_ids_recv"), up.count("num_heartbeat_ids_unknown")) == (2, 1)
    keeper.expire(set())  # nothing due; reports the one lease held
    expired: set[str] = set()
    for _ in range(3):  # P steps on (a longer gap would be P's own stall: see the next test)
        clock.advance(3)
        keeper.expire(expired)
    assert expired == {"a"} and not len(keeper.table)
    assert up.count("num_leases_granted") == 2
    assert [list(x) for x in up.xfer_stats.data["active_leases"]] == [[0, 1], [0, 0]]


def test_keeper_spreads_a_mass_expiry_over_steps(clock: Clock) -> None:
    """A dead D's leases come due at once: each step frees at most
    max_expiries_per_step of them, earliest first, until none is left."""
    up = FakeUpstreamWorker()
    keeper = LeaseKeeper(
        up, LeaseConfig.from_extra_config({"kv_lease_duration": 12, "max_expiries_per_step": 40})
    )
    ids = [f"r{i}" for i in range(100)]
    for i, rid in enumerate(ids):
        keeper.deadlines[rid] = clock.now + 1 + i / 100
    clock.advance(9)
    freed: list[set[str]] = []
    while len(keeper.table):
        freed.append(set())
        keeper.expire(freed[-1])
    assert freed == [set(ids[:40]), set(ids[40:80]), set(ids[80:])]
    assert len(up.xfer_stats.data["num_kv_expired_reqs"]) == 100


def test_keeper_extend_answers_by_heartbeat_form(clock: Clock) -> None:
    """IDS and TAGS (acknowledged heartbeats) return the names to report as
    not held; None when the payload cannot be read."""
    up = FakeUpstreamWorker()
    keeper = LeaseKeeper(up, CONFIG)
    keeper.adopt_instance(SimpleNamespace(lease_instance=("0123456789abcdef", KEY)))
    keeper.deadlines["a"] = clock.now + 8
    clock.advance(5)
    assert keeper.extend(HeartbeatForm.IDS, [b"a,zz"]) == ["zz"]
    assert keeper.table.deadline("a") == pytest.approx(clock.now + 8)
    assert keeper.extend(HeartbeatForm.IDS, [b"a"]) == []
    assert keeper.extend(HeartbeatForm.IDS, [b"a,\xff"]) is None
    clock.advance(1)
    tags = f"{lease_tag('a', KEY)},{lease_tag('b', KEY)}".encode()
    assert keeper.extend(HeartbeatForm.TAGS, [tags]) == [lease_tag("b", KEY)]
    assert keeper.table.deadline("a") == pytest.approx(clock.now + 8)
    assert keeper.extend(HeartbeatForm.TAGS, [b"\xff" + tags]) is None
    assert (up.count("num_heartbeat_msgs_recv"), up.count("num_tagged_heartbeats_recv")) == (5, 2)
    assert (up.count("num_heartbeat_ids_recv"), up.count("num_heartbeat_ids_unknown")) == (9, 5)


@pytest.mark.parametrize("role", ["pull", "push"])
def test_upstreams_handle_heartbeat_extends_by_p_id(role: str, clock: Clock) -> None:
    """Upstream's ``_handle_heartbeat`` entry (our ``_get_new_notifs`` never
    calls it) extends by P's id through ``LeaseKeeper.extend``, counted."""
    from vllm_nixl_lease.adapter.workers import LeaseNixlPullConnectorWorker, LeaseNixlPushConnectorWorker

    cls = LeaseNixlPullConnectorWorker if role == "pull" else LeaseNixlPushConnectorWorker
    worker = make_worker(cls, 12)
    p_step(worker, p_meta(clock, in_batch=("p-1",), to_send={"p-1": 12}))
    clock.advance(6)
    worker._handle_heartbeat("p-1,someone-else")
    assert worker.lease_keeper.table.deadline("p-1") == pytest.approx(clock.now + 8)
    stats = worker.xfer_stats.data
    assert (sum(stats["num_heartbeat_ids_recv"]), sum(stats["num_heartbeat_ids_unknown"])) == (2, 1)


def test_keeper_push_aliases_renew_by_router_id(clock: Clock) -> None:
    up = FakeUpstreamWorker()
    keeper = LeaseKeeper(up, CONFIG, push=True)
    keeper.deadlines["cmpl-1-0badf00d"] = clock.now + 8
    clock.advance(5)
    keeper.extend(HeartbeatForm.PUSH, [heartbeat_payload(heartbeat_message(["cmpl-1"]))])
    assert keeper.table.deadline("cmpl-1-0badf00d") == pytest.approx(clock.now + 8)
    del keeper.deadlines["cmpl-1-0badf00d"]
    assert keeper.aliases is not None and not keeper.aliases


def test_sender_waits_for_handshake_and_retries_failures(clock: Clock) -> None:
    up = FakeUpstreamWorker()
    delivered: list[tuple[str, list[bytes]]] = []
    sender = HeartbeatSender(up, 8192, lambda e, msgs, s, f: delivered.append((e, msgs)))
    hb = EngineHeartbeats("P", [heartbeat_message(["a"])], "127.0.0.1", 5600, 2)
    pending: Future[None] = Future()
    up.handshakes["P"] = pending
    sender.send(SimpleNamespace(**{LEASE_HEARTBEATS_ATTR: {"P": hb}}))
    assert up.nixl_wrapper.sent == [] and "P" in sender.waiting
    up.connect("P", ranks=2)
    pending.set_result(None)
    up.handshakes["P"] = None
    up.nixl_wrapper.fail_sends = 1
    sender.send(SimpleNamespace(**{LEASE_HEARTBEATS_ATTR: {}}))
    assert up.nixl_wrapper.sent == [("P-agent-1", hb.messages[0])]
    assert delivered == []  # not every rank got it
    assert up.count("num_heartbeat_send_failures") == 1
    sender.send(SimpleNamespace(**{LEASE_HEARTBEATS_ATTR: {}}))  # the retry
    assert up.nixl_wrapper.sent[-1] == ("P-agent-0", hb.messages[0]) and not sender.retry


def test_fence_reports_a_lapsing_read_as_failed_load(clock: Clock) -> None:
    up = FakeUpstreamWorker()
    up.connect("P", offset=0.0)
    fence = ReadFence(up, LeaseViews(CONFIG.lease_safety_margin), CONFIG)
    new = {
        "d1": NewView("P", "", "p1", clock.now + 8, 8.0, None),
        "d2": NewView("P", "", "p2", clock.now + 1, 8.0, None),
    }
    views = LeaseViewUpdates(new, [])
    fence.add_views(SimpleNamespace(**{LEASE_VIEWS_ATTR: views}))
    meta = SimpleNamespace(remote=SimpleNamespace(engine_id="P"), local_block_ids=[[1]])
    assert not fence.fenced("d1", meta)
    assert fence.fenced("d2", meta)
    assert up.failed_transfers == [("d2", False)] and up.count("num_reads_fenced") == 1
    fence.heartbeat_delivered("P", [heartbeat_message(["p1"])], clock.now, clock.now)
    assert up.count("num_heartbeat_views_renewed") == 1


def test_idle_pause_only_on_a_quiet_idle_step(clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    sleeps: list[float] = []
    monkeypatch.setattr(time, "sleep", sleeps.append)
    keeper = LeaseKeeper(FakeUpstreamWorker(), CONFIG)
    keeper.deadlines["a"] = clock.now + 8
    pause = IdlePause(0.005, keeper.table)
    results = SimpleNamespace(finished_sending=set(), finished_recving=set())
    pause.begin_step(SimpleNamespace(lease_idle_step=True))
    pause.saw_notifications({"d": [b"x"]})
    pause.end_step(results, 0)
    assert sleeps == []
    pause.begin_step(SimpleNamespace(lease_idle_step=True))
    pause.end_step(results, 0)
    assert sleeps == [pytest.approx(0.005)]


def test_sender_releases_an_engine_whose_connection_is_gone(clock: Clock) -> None:
    """UCX gave the connection up: no retry storm on a dead agent, upstream's
    invalid-engine path releases it and the next tick handshakes again."""

    class nixlRemoteDisconnectError(Exception):  # noqa: N801 (NIXL's name)
        pass

    up = FakeUpstreamWorker()
    up.connect("P", ranks=2)
    up.handshakes["P"] = None
    sender = HeartbeatSender(up, 8192)
    hb = EngineHeartbeats("P", [heartbeat_message(["a"])], "127.0.0.1", 5600, 2)
    up.nixl_wrapper.fail_sends, up.nixl_wrapper.fail_error = 2, nixlRemoteDisconnectError
    sender.send(SimpleNamespace(**{LEASE_HEARTBEATS_ATTR: {"P": hb}}))
    assert up._invalid_remote_engines == {"P"} and not sender.retry
    assert up.count("num_heartbeat_send_failures") == 2


def test_sender_keeps_other_chunks_of_a_paced_engine(clock: Clock) -> None:
    """A paced tick names only some of an engine's chunks: it neither drops
    what waited on the handshake nor a failed send of another chunk."""
    up = FakeUpstreamWorker()
    sender = HeartbeatSender(up, 8192)
    m1, m2, m3 = (heartbeat_message([x]) for x in ("a", "b", "c"))

    def tick(msg: bytes, key: int) -> SimpleNamespace:
        hb = EngineHeartbeats("P", [msg], "127.0.0.1", 5600, 1, chunks=[(key, 1)])
        return SimpleNamespace(**{LEASE_HEARTBEATS_ATTR: {"P": hb}})

    pending: Future[None] = Future()
    up.handshakes["P"] = pending
    sender.send(tick(m1, 1))
    sender.send(tick(m2, 2))  # still handshaking: both chunks wait
    assert up.nixl_wrapper.sent == []
    up.connect("P")
    pending.set_result(None)
    up.handshakes["P"] = None
    up.nixl_wrapper.fail_sends = 2
    sender.send(tick(m3, 3))  # chunks 1 and 2 with it; the first two sends fail
    assert [m for _, m in up.nixl_wrapper.sent] == [m3]
    sender.send(tick(m3, 3))  # a fresh tick of chunk 3 does not drop chunk 1's and 2's retry
    assert sorted(m for _, m in up.nixl_wrapper.sent) == sorted([m3, m3, m1, m2])
    assert not sender.retry and not sender.waiting


def test_sender_takes_the_schedulers_name_counts_and_merges_them() -> None:
    """Name counts the scheduler ships are what the stats count (the sender
    does not scan the messages); a tick merged with one that waited on a
    handshake keeps each message's count beside it, or counts them itself
    when either tick came without."""
    from vllm_nixl_lease.adapter.d_worker.heartbeat_sender import merged

    up = FakeUpstreamWorker()
    up.connect("P")
    up.handshakes["P"] = None
    sender = HeartbeatSender(up, 8192)
    msg = heartbeat_message(["a", "b", "c"])
    hb = EngineHeartbeats("P", [msg], "127.0.0.1", 5600, 1, chunks=[(1, 1)], counts=[3])
    sender.send(SimpleNamespace(**{LEASE_HEARTBEATS_ATTR: {"P": hb}}))
    assert up.count("num_heartbeat_ids_sent") == 3
    older = EngineHeartbeats("P", [b"HB:x", b"HB:y,z"], "h", 1, 1, chunks=[(1, 1), (2, 1)], counts=[1, 2])
    newer = EngineHeartbeats("P", [b"HB:q"], "h", 1, 1, chunks=[(1, 2)], counts=[1])
    both = merged(older, newer)
    assert both.messages == [b"HB:y,z", b"HB:q"] and both.chunks == [(2, 1), (1, 2)] and both.counts == [2, 1]
    uncounted = merged(older, EngineHeartbeats("P", [b"HB:q"], "h", 1, 1, chunks=[(1, 2)]))
    assert uncounted.messages == [b"HB:y,z", b"HB:q"] and uncounted.counts is None
    assert pickle.loads(pickle.dumps(both)) == both


def test_view_updates_pickle_packed_and_come_back_as_new_views() -> None:
    new = {
        "d1": NewView("P0", "0123456789abcdef", "tag1", 1035.5, 20.0, 5.0, 3),
        "d2": NewView("P1", "", "cmpl-2", 7.0, 8.0, None),  # a plain P: no interval, base version
    }
    updates = LeaseViewUpdates(new, ["d0"], {"d1": (4, 9), "d9": (2, 11)})  # d9: repacked
    reducer, (packed,) = updates.__reduce__()
    assert isinstance(packed[0], str) and isinstance(packed[1], bytes)
    back = pickle.loads(pickle.dumps(updates, protocol=pickle.HIGHEST_PROTOCOL))
    assert back.new == new and all(type(v) is NewView for v in back.new.values())
    assert back.new["d2"].interval is None and back.new["d2"].hello_version == new["d2"].hello_version
    assert back.dropped == ["d0"] and back.chunks == {"d1": (4, 9), "d9": (2, 11)}


def test_metadata_with_views_pickles_them_packed_under_one_global() -> None:
    import pickletools

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

    meta = LeaseConnectorMetadata.adopt(NixlConnectorMetadata())
    meta.scheduler_clock = 3.5
    new = {"d1": NewView("P0", "0123456789abcdef", "tag1", 1035.5, 20.0, 5.0, 3)}
    setattr(meta, LEASE_VIEWS_ATTR, LeaseViewUpdates(new, ["d0"], {"d1": (4, 9), "d9": (2, 11)}))
    blob = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
    globals_named = [op.name for op, _, _ in pickletools.genops(blob) if "GLOBAL" in op.name]
    assert len(globals_named) == 1
    back = pickle.loads(blob)
    assert type(back) is LeaseConnectorMetadata and back.scheduler_clock == 3.5
    views = getattr(back, LEASE_VIEWS_ATTR)
    assert type(views) is LeaseViewUpdates and views.new == new and type(views.new["d1"]) is NewView
    assert views.dropped == ["d0"] and views.chunks == {"d1": (4, 9), "d9": (2, 11)}
    assert vars(back).keys() == vars(meta).keys()
    assert back.reqs_to_send == {} and back.reqs_to_send is not meta.reqs_to_send


def test_metadata_pickles_what_it_holds_and_restores_the_empty_fields() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

    meta = LeaseConnectorMetadata.adopt(NixlConnectorMetadata())
    assert type(meta) is LeaseConnectorMetadata
    meta.scheduler_clock = 12.5
    meta.reqs_to_send = {"a": 3.0}
    meta.reqs_in_batch = {"a"}
    setattr(meta, LEASE_INSTANCE_ATTR, ("0123456789abcdef", b"k" * 16))
    back = pickle.loads(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL))
    assert isinstance(back, NixlConnectorMetadata) and vars(back) == vars(meta)
    idle = LeaseConnectorMetadata.adopt(NixlConnectorMetadata())
    blob = pickle.dumps(idle, protocol=pickle.HIGHEST_PROTOCOL)
    assert len(blob) < len(pickle.dumps(NixlConnectorMetadata(), protocol=pickle.HIGHEST_PROTOCOL))
    restored = pickle.loads(blob)
    assert vars(restored) == vars(NixlConnectorMetadata())
    restored.reqs_to_send["b"] = 1.0  # fresh containers, not shared ones
    assert pickle.loads(blob).reqs_to_send == {}
