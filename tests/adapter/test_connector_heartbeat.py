"""D side: the scheduler's HeartbeatTracker and the worker that forwards its
pre-encoded messages to every P agent."""

from __future__ import annotations

import threading
import time

import pytest
from vllm_support import (
    Clock,
    fake_request,
    hb_info,
    make_kv_cache_config,
    make_worker,
    remote_prefill_params,
    shared_vllm_config,
)

from vllm_nixl_lease._wire import (
    ESCAPE_PREFIX,
    HELLO_KIND,
    PARAM_LEASE_TAG,
    acked_heartbeat_message,
    heartbeat_ack_message,
    heartbeat_message,
    heartbeat_payload,
    keepalive_message,
)
from vllm_nixl_lease.adapter.d_scheduler.heartbeat_schedule import pace_phase
from vllm_nixl_lease.adapter.metadata import EngineHeartbeats
from vllm_nixl_lease.adapter.schedulers import LeaseNixlPullConnectorScheduler
from vllm_nixl_lease.adapter.workers import LeaseNixlPullConnectorWorker


@pytest.fixture(scope="module")
def scheduler_factory(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("hb")

    def make(extra: dict | None = None, engine_id: str = "d-engine") -> LeaseNixlPullConnectorScheduler:
        from vllm.config import set_current_vllm_config

        vc = shared_vllm_config(root, extra or {"kv_lease_duration": 12})
        with set_current_vllm_config(vc):
            return LeaseNixlPullConnectorScheduler(vc, engine_id, make_kv_cache_config())

    return make


def test_scheduler_tracks_in_core_and_ships_bytes(scheduler_factory, clock: Clock) -> None:
    sched = scheduler_factory({"kv_lease_duration": 12, "heartbeat_step_bytes": 0})  # always paced
    sched.on_new_request(fake_request("d1", **remote_prefill_params("P1", "p-1", tp=2)))
    sched.on_new_request(fake_request("d2", **remote_prefill_params("P1", "p-2", tp=2)))
    sched.on_new_request(fake_request("d3", **remote_prefill_params("P2", "q-1", port=5700)))
    sched.on_new_request(fake_request("d4"))  # not a remote prefill
    assert sched._heartbeat_by_engine == {} and sched._heartbeat_req_engine == {}
    assert len(sched.heartbeats.tracker) == 0  # queued: the step's metadata applies them
    meta = sched.build_connector_meta(None)
    assert len(sched.heartbeats.tracker) == 3
    assert meta.heartbeat_by_engine == {}  # no id sets on the wire
    hb = by_engine(meta.lease_heartbeats)
    p1_chunk = sched.heartbeats.chunk_of("d2")  # the message names every id that joined up to it
    assert hb["P1"] == EngineHeartbeats(
        "P1", [heartbeat_message(["p-1", "p-2"])], "127.0.0.1", 5600, 2, 1, 1, chunks=[p1_chunk], counts=[2]
    )
    assert hb["P2"].messages == [heartbeat_message(["q-1"])] and hb["P2"].port == 5700
    # Paced, interval 12 // 6 = 2 s: the round of two chunks is spread over
    # it, earliest due first; neither waits longer than 2 s.
    clock.advance(0.5)
    assert getattr(sched.build_connector_meta(None), "lease_heartbeats", {}) == {}  # none due
    clock.advance(0.5)
    assert by_engine(sched.build_connector_meta(None).lease_heartbeats).keys() == {"P1"}  # early: the pace
    clock.advance(1.0)
    assert by_engine(sched.build_connector_meta(None).lease_heartbeats).keys() == {"P2"}  # due
    sched.update_connector_output(type("O", (), {"finished_recving": {"d1"}})())
    sched._stop_heartbeat("d3")  # what upstream's request_finished calls
    clock.advance(1.0)
    hb = by_engine(sched.build_connector_meta(None).lease_heartbeats)
    assert hb.keys() == {"P1"} and hb["P1"].messages == [heartbeat_message(["p-2"])]
    assert {g.engine_id for g in sched.heartbeats.groups.values()} == {"P1"}


def test_a_small_round_goes_in_one_step(scheduler_factory, clock: Clock) -> None:
    """Under ``heartbeat_step_bytes`` (default 64 KiB) the whole round goes out
    in one step, once per interval: one sending step, not one per chunk."""
    sched = scheduler_factory()  # interval 12 // 6 = 2 s
    for k in range(8):
        sched.on_new_request(fake_request(f"d{k}", **remote_prefill_params(f"P{k}", f"p-{k}")))
    sending = []
    for step in range(int(6.0 / 0.05)):  # three intervals of 50 ms steps
        sent = getattr(sched.build_connector_meta(None), "lease_heartbeats", {})
        if sent:
            sending.append((step, len(by_engine(sent))))
        clock.advance(0.05)
    assert [n for _, n in sending] == [8, 8, 8]  # every chunk, one step an interval
    steps = [step for step, _ in sending]
    assert steps[0] == 0 and all(b - a in (40, 41) for a, b in zip(steps, steps[1:], strict=False))


def test_d_engines_pace_their_rounds_at_phases_drawn_from_their_ids(scheduler_factory, clock: Clock) -> None:
    """Two D engines handed the same 8 requests (one chunk each) at the same moment
    send the round's early chunks at different steps: each paces at the phase its
    engine id draws (the same on every start of that id)."""
    assert pace_phase("d-a") == pace_phase("d-a") != pace_phase("d-b")
    assert all(0.0 <= pace_phase(f"d{i}") < 1.0 for i in range(100))
    sends: dict[str, list[int]] = {}
    for engine in ("d-a", "d-b"):
        sched = scheduler_factory(
            {"kv_lease_duration": 12, "max_heartbeat_bytes": 256, "heartbeat_step_bytes": 0}, engine
        )
        for i in range(8):
            sched.on_new_request(fake_request(f"d{i}", **remote_prefill_params("P1", f"p-{i:0200d}")))
        steps = []
        for step in range(200):  # 2 s (the interval) of 10 ms steps
            hb = getattr(sched.build_connector_meta(None), "lease_heartbeats", {})
            steps += [step] * sum(len(h.messages) for h in hb.values())
            clock.advance(0.01)
        sends[engine] = steps
    assert sends["d-a"][:8] == sends["d-b"][:8] == [0] * 8  # new chunks: at once
    assert len(sends["d-a"]) == len(sends["d-b"]) and set(sends["d-a"][8:]).isdisjoint(sends["d-b"][8:])


def test_scheduler_chunks_messages(scheduler_factory, clock: Clock) -> None:
    sched = scheduler_factory({"kv_lease_duration": 12, "max_heartbeat_bytes": 256})
    for i in range(100):
        sched.on_new_request(fake_request(f"d{i}", **remote_prefill_params("P1", f"cmpl-{i:040d}")))
    messages = by_engine(sched.build_connector_meta(None).lease_heartbeats)["P1"].messages
    assert len(messages) > 1 and all(len(m) <= 256 for m in messages)
    ids = [i for m in messages for i in heartbeat_payload(m).split(b",")]
    assert len(ids) == 100 and len(set(ids)) == 100


def by_engine(heartbeats: dict[str, EngineHeartbeats]) -> dict[str, EngineHeartbeats]:
    """The metadata keys heartbeats by group; each group is one P engine here."""
    return {hb.engine_id: hb for hb in heartbeats.values()}


def _worker_with_handshake(agents: dict) -> tuple[LeaseNixlPullConnectorWorker, threading.Event]:
    worker = make_worker(LeaseNixlPullConnectorWorker, 12)
    release = threading.Event()

    def fake_handshake(host, port, tp_size, engine_id, *args):
        release.wait(10)
        return dict(agents), 0.0

    worker._nixl_handshake = fake_handshake
    return worker, release


class _Meta:
    def __init__(self, lease_heartbeats: dict | None = None) -> None:
        self.lease_heartbeats = lease_heartbeats or {}


def test_heartbeat_goes_out_on_the_step_after_handshake(clock: Clock) -> None:
    worker, release = _worker_with_handshake({(0, 0): "p-agent-0", (0, 1): "p-agent-1"})
    messages = [heartbeat_message(["a", "b"]), heartbeat_message(["c"])]
    hb = EngineHeartbeats("P1", messages, "127.0.0.1", 5600, 2)
    worker._send_heartbeats(_Meta({"P1": hb}))  # starts the handshake
    assert worker.nixl_wrapper.sent == []
    release.set()
    # Generous bounds: they only wait, and `make test` runs this suite at nice 19 beside others.
    worker.heartbeat_sender.waiting["P1"][1].result(timeout=60)
    deadline = time.monotonic() + 60
    while "P1" not in worker._remote_agents and time.monotonic() < deadline:
        time.sleep(0.01)  # the done-callback runs just after result() returns
    worker._send_heartbeats(_Meta())  # next step, not a heartbeat tick
    # Heterogeneous TP: every P agent gets every chunk.
    assert sorted(worker.nixl_wrapper.sent) == sorted(
        (agent, msg) for agent in ("p-agent-0", "p-agent-1") for msg in hb.messages
    )
    data = worker.xfer_stats.data
    assert sum(data["num_heartbeat_msgs_sent"]) == 4
    assert sum(data["num_heartbeat_ids_sent"]) == 6
    assert sum(data["num_heartbeat_bytes_sent"]) == 2 * (6 + 4)


def test_failed_send_counted_and_retried_next_step(clock: Clock) -> None:
    worker, release = _worker_with_handshake({(0, 0): "p-agent-0"})
    release.set()
    worker._remote_agents["P1"] = {(0, 0): "p-agent-0"}  # already handshaken
    worker.nixl_wrapper.fail_sends = 1
    hb = EngineHeartbeats("P1", [heartbeat_message(["a"])], "127.0.0.1", 5600, 1)
    worker._send_heartbeats(_Meta({"P1": hb}))
    assert worker.nixl_wrapper.sent == []
    assert sum(worker.xfer_stats.data["num_heartbeat_send_failures"]) == 1
    worker._send_heartbeats(_Meta())
    assert worker.nixl_wrapper.sent == [("p-agent-0", heartbeat_message(["a"]))]
    worker._send_heartbeats(_Meta())  # nothing left to retry
    assert len(worker.nixl_wrapper.sent) == 1


def test_ids_sent_count_only_delivered_messages(clock: Clock) -> None:
    """Ids are counted once per message, so a failed send and its retry must
    each be counted as what they are: nothing, then the retried message."""
    worker, release = _worker_with_handshake({(0, 0): "p-agent-0", (0, 1): "p-agent-1"})
    release.set()
    worker._remote_agents["P1"] = {(0, 0): "p-agent-0", (0, 1): "p-agent-1"}
    worker.nixl_wrapper.fail_sends = 1  # the first of four pairs fails
    hb = EngineHeartbeats(
        "P1", [heartbeat_message(["a", "b", "c"]), heartbeat_message(["d"])], "127.0.0.1", 5600, 2
    )
    worker._send_heartbeats(_Meta({"P1": hb}))
    data = worker.xfer_stats.data
    assert len(worker.nixl_wrapper.sent) == 3
    assert sum(data["num_heartbeat_ids_sent"]) == sum(
        msg.count(b",") + 1 for _, msg in worker.nixl_wrapper.sent
    )
    worker._send_heartbeats(_Meta())  # the retry
    assert len(worker.nixl_wrapper.sent) == 4
    assert sum(data["num_heartbeat_ids_sent"]) == 2 * (3 + 1)
    assert sum(data["num_heartbeat_msgs_sent"]) == 4


def test_stock_metadata_still_heartbeats(clock: Clock) -> None:
    """Metadata from a stock scheduler (id sets) is encoded by the worker."""
    worker, _ = _worker_with_handshake({})
    worker._remote_agents["P1"] = {(0, 0): "p-agent-0"}

    class StockMeta:
        heartbeat_by_engine = {"P1": hb_info({"x", "y"})}

    worker._send_heartbeats(StockMeta())
    assert worker.nixl_wrapper.sent == [("p-agent-0", heartbeat_message(["x", "y"]))]


@pytest.mark.parametrize("mode", ["tags", "untagged-lease", "tags-off-on-D"])
def test_acknowledged_chunk_renews_its_views_end_to_end(scheduler_factory, clock: Clock, mode: str) -> None:
    """Real scheduler and worker: P's answer to a chunk's LHB (LHBT: by tag,
    where the lease's params carry one) renews the views of the requests in it
    when the message was built, and no later joiner."""
    from vllm_nixl_lease.adapter.p_scheduler.lease_params import LeaseParams

    # lease 12: extension 8, interval 2, margin 2
    sched = scheduler_factory({"kv_lease_duration": 12, "heartbeat_tags": mode != "tags-off-on-D"})
    worker = make_worker(LeaseNixlPullConnectorWorker, 12)
    worker._remote_agents["P1"] = {(0, 0): "p-agent-0"}
    worker._engine_clock_offset["P1"] = 0.0
    worker._ensure_handshake = lambda *a, **k: None
    p = LeaseParams(sched.lease_config)
    tags: dict[str, str] = {}

    def new(local: str, remote: str) -> None:
        params = remote_prefill_params("P1", remote)
        p.add(params, remote, clock.now + 5)
        tags[remote] = params[PARAM_LEASE_TAG]
        if mode == "untagged-lease":
            del params[PARAM_LEASE_TAG]
        sched.on_new_request(fake_request(local, **params))

    def step() -> list[bytes]:
        meta = sched.build_connector_meta(None)
        worker.read_fence.add_views(meta)
        worker.heartbeat_sender.send(meta)
        sent, worker.nixl_wrapper.sent = worker.nixl_wrapper.sent, []
        return [m for _, m in sent if m.startswith(ESCAPE_PREFIX)]

    new("d1", "p-1")
    new("d2", "p-2")
    # Unproven: the hello, and the tick as a keep-alive (tags behind the escape with
    # seq 0, which D never opens; ids as upstream's plain HB:, not escaped).
    first = step()
    assert first[0].startswith(ESCAPE_PREFIX + HELLO_KIND)
    if mode == "tags":
        keepalive = keepalive_message(heartbeat_message([tags["p-1"], tags["p-2"]]), tagged=True)
        assert first[1:] == [keepalive] and keepalive.startswith(b"HB:,LHBT:0,")
    else:
        assert first[1:] == []
    worker.nixl_wrapper.deliver("p-agent-0", heartbeat_ack_message(p.instance.instance, []))  # welcome
    worker._get_new_notifs()
    started = clock.now
    if mode == "tags":
        named = heartbeat_message([tags["p-1"], tags["p-2"]])
        assert step() == [acked_heartbeat_message(1, named, tagged=True)]
    else:
        assert step() == [acked_heartbeat_message(1, heartbeat_message(["p-1", "p-2"]))]
    new("d3", "p-3")  # joins the chunk after the message was built
    assert step() == []
    clock.advance(1)
    worker.nixl_wrapper.deliver("p-agent-0", heartbeat_ack_message(p.instance.instance, [1]))
    worker._get_new_notifs()
    views = worker.read_fence.views
    assert views.remaining("d1", clock.now, 0.0) == pytest.approx(started + 8 - clock.now)
    assert views.remaining("d2", clock.now, 0.0) == pytest.approx(started + 8 - clock.now)
    assert views.remaining("d3", clock.now, 0.0) == pytest.approx(started + 5 - clock.now)  # not renewed


def test_tagged_engine_with_a_non_string_remote_id_is_skipped_not_raised(
    scheduler_factory, clock: Clock
) -> None:
    """P's kv_transfer_params are P's to write: a request whose remote id is of
    the wrong type costs that request its heartbeats, not the step."""
    from vllm_nixl_lease.adapter.p_scheduler.lease_params import LeaseParams

    sched = scheduler_factory()
    p = LeaseParams(sched.lease_config)
    for local, remote in (("d1", 12345), ("d2", "p-2"), ("d3", None)):
        params = remote_prefill_params("P1", remote)  # type: ignore[arg-type]
        p.add(params, str(remote), clock.now + 5)
        if remote != "p-2":
            del params[PARAM_LEASE_TAG]
        sched.on_new_request(fake_request(local, **params))
    meta = sched.build_connector_meta(None)
    tagged = [hb for hb in meta.lease_heartbeats.values() if hb.tagged]
    assert len(tagged) == 1 and tagged[0].messages == [heartbeat_message([_tag(p, "p-2")])]
    assert "d1" not in sched.heartbeats.tracker and "d3" not in sched.heartbeats.tracker


def _tag(p, req_id: str) -> str:  # type: ignore[no-untyped-def]
    from vllm_nixl_lease.lease_tags import lease_tag

    return lease_tag(req_id, p.instance.tag_key)
