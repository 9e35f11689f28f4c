"""Read fencing through vLLM's real scheduler and worker classes: P reports its
lease deadline, D ships views to its workers, heartbeats renew them and a READ
whose view is about to lapse becomes a failed load instead."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from vllm_support import (
    STOCK_PULL_WORKER,
    Clock,
    WorkerMeta,
    fake_request,
    make_kv_cache_config,
    make_worker,
    remote_prefill_params,
    shared_vllm_config,
)

from vllm_nixl_lease._wire import (
    HEARTBEAT_ACK_PREFIX,
    LEASE_PROTOCOL_BASE,
    PARAM_LEASE_DEADLINE,
    PARAM_LEASE_EXTENSION,
    PARAM_LEASE_INSTANCE,
    PARAM_LEASE_INTERVAL,
    PARAM_LEASE_PROTOCOL,
    PARAM_LEASE_TAG,
    default_heartbeat_interval,
    default_lease_extension,
    heartbeat_message,
    is_instance,
    is_tag,
    parse_heartbeat_ack,
)
from vllm_nixl_lease.adapter.metadata import EngineHeartbeats, LeaseViewUpdates, NewView
from vllm_nixl_lease.adapter.schedulers import LeaseNixlPullConnectorScheduler
from vllm_nixl_lease.adapter.workers import LeaseNixlPullConnectorWorker

LEASE = 12  # extension 8, interval 2, default margin min(8 / 4, (8 - 2) / 2) = 2


@pytest.fixture(scope="module")
def scheduler_factory(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("fence")

    def make(extra: dict | None = None) -> LeaseNixlPullConnectorScheduler:
        from vllm.config import set_current_vllm_config

        vc = shared_vllm_config(root, {"kv_lease_duration": LEASE, **(extra or {})})
        with set_current_vllm_config(vc):
            return LeaseNixlPullConnectorScheduler(vc, "engine-under-test", make_kv_cache_config())

    return make


def _finished_prefill(req_id: str) -> SimpleNamespace:
    from vllm.v1.request import RequestStatus

    return SimpleNamespace(
        request_id=req_id,
        kv_transfer_params={"do_remote_decode": True},
        status=RequestStatus.FINISHED_LENGTH_CAPPED,
        num_computed_tokens=64,
    )


def test_p_reports_its_lease_deadline_and_extension(scheduler_factory, clock: Clock) -> None:
    sched = scheduler_factory()
    delay, params = sched.request_finished(_finished_prefill("p-1"), ([3, 4],))
    assert delay and params["do_remote_prefill"]
    assert params[PARAM_LEASE_DEADLINE] == sched._reqs_need_send["p-1"] == clock.now + LEASE
    assert params[PARAM_LEASE_EXTENSION] == default_lease_extension(LEASE)
    assert params[PARAM_LEASE_INTERVAL] == default_heartbeat_interval(LEASE)
    assert params[PARAM_LEASE_PROTOCOL] == LEASE_PROTOCOL_BASE
    assert params[PARAM_LEASE_INSTANCE] == sched.lease_params.instance.instance
    assert is_instance(params[PARAM_LEASE_INSTANCE]) and is_tag(params[PARAM_LEASE_TAG])
    # Nothing to hold (no blocks): no lease, no deadline.
    delay, params = sched.request_finished(_finished_prefill("p-2"), ([],))
    assert not delay and PARAM_LEASE_DEADLINE not in params


def _d_params(engine: str, remote_id: str, deadline: float | None, extension: float | None = 8.0) -> dict:
    params = remote_prefill_params(engine, remote_id)
    if deadline is not None:
        params[PARAM_LEASE_DEADLINE] = deadline
        params[PARAM_LEASE_EXTENSION] = extension
    return params


def test_d_scheduler_ships_views_and_drops(scheduler_factory, clock: Clock) -> None:
    sched = scheduler_factory()
    sched.on_new_request(fake_request("d1", **_d_params("P", "p1", 5000.0)))
    sched.on_new_request(fake_request("d2", **_d_params("P", "p2", 5001.0)))
    meta = sched.build_connector_meta(None)
    assert meta.lease_views == LeaseViewUpdates(
        {"d1": NewView("P", "", "p1", 5000.0, 8.0, None), "d2": NewView("P", "", "p2", 5001.0, 8.0, None)},
        [],
        {"d1": (1, 1), "d2": (1, 2)},  # one chunk; each joined at its own version
    )
    sched.update_connector_output(SimpleNamespace(finished_recving={"d1"}))  # read done
    sched.on_new_request(fake_request("d3", **_d_params("P", "p3", 5002.0)))
    sched._stop_heartbeat("d3")  # aborted before it was ever shipped: nothing to drop
    sched._stop_heartbeat("d9")  # never seen
    assert sched.build_connector_meta(None).lease_views == LeaseViewUpdates({}, ["d1"])
    assert not hasattr(sched.build_connector_meta(None), "lease_views")  # no news: nothing shipped


def test_d_scheduler_without_deadline_logs_once_per_engine(
    scheduler_factory, clock: Clock, lease_logs: pytest.LogCaptureFixture
) -> None:
    sched = scheduler_factory()
    caplog = lease_logs
    for i in range(3):
        sched.on_new_request(fake_request(f"s{i}", **_d_params("StockP", f"p{i}", None)))
    sched.on_new_request(fake_request("bad1", **_d_params("OurP", "b1", float("nan"))))
    sched.on_new_request(fake_request("bad2", **_d_params("OurP", "b2", 5000.0, "8")))
    sched.on_new_request(fake_request("bad3", **_d_params("OurP", "b3", True)))
    assert not hasattr(sched.build_connector_meta(None), "lease_views")  # no view started
    off = [r for r in caplog.records if "reports no lease deadline" in r.getMessage()]
    assert len(off) == 1 and "StockP" in off[0].getMessage()
    bad = [r for r in caplog.records if "malformed lease fields" in r.getMessage()]
    assert len(bad) == 1 and bad[0].levelno == logging.WARNING  # rate-limited: a peer controls them
    assert len(sched.heartbeats.tracker) == 6  # still heartbeated, as upstream


def test_fencing_can_be_switched_off(scheduler_factory, clock: Clock) -> None:
    sched = scheduler_factory({"lease_fencing": False})
    sched.on_new_request(fake_request("d1", **_d_params("P", "p1", 5000.0)))
    assert not hasattr(sched.build_connector_meta(None), "lease_views")  # no view started


@pytest.fixture
def d_worker(clock: Clock, monkeypatch: pytest.MonkeyPatch):
    """Our pull worker connected to P (clock offset +500 s); stock reads recorded, not issued."""
    worker = make_worker(LeaseNixlPullConnectorWorker, LEASE)
    worker._remote_agents["P"] = {(0, 0): "p-agent-0", (0, 1): "p-agent-1"}
    worker._engine_clock_offset["P"] = 500.0
    worker._invalid_remote_engines = set()
    worker._recv_failures = set()
    worker._failed_remote_engines = set()
    reads: list[str] = []
    monkeypatch.setattr(
        STOCK_PULL_WORKER, "_read_blocks_for_req", lambda self, req_id, meta: reads.append(req_id)
    )
    worker.reads = reads
    return worker


def _recv_meta(engine: str = "P", blocks: tuple = ([1, 2],)) -> SimpleNamespace:
    return SimpleNamespace(local_block_ids=blocks, remote=SimpleNamespace(engine_id=engine))


def _views(worker, **deadlines: float) -> None:
    for local_id, deadline in deadlines.items():
        worker.read_fence.views.add(local_id, "P", "p" + local_id[1:], deadline, 8.0)


def test_read_goes_ahead_while_the_view_has_room(d_worker, clock: Clock) -> None:
    _views(d_worker, d1=clock.now + 500.0 + 10.0)  # 10 s left on P's clock
    clock.advance(7.9)
    d_worker._read_blocks_for_req("d1", _recv_meta())
    assert d_worker.reads == ["d1"] and d_worker._recv_failures == set()


def test_read_is_fenced_when_the_view_is_about_to_lapse(d_worker, clock: Clock) -> None:
    _views(d_worker, d1=clock.now + 500.0 + 10.0)
    clock.advance(8.0)  # exactly the 2 s margin left
    d_worker._read_blocks_for_req("d1", _recv_meta())
    assert d_worker.reads == []
    assert d_worker._recv_failures == {"d1"}  # -> invalid blocks -> kv_load_failure_policy
    assert sum(d_worker.xfer_stats.data["num_reads_fenced"]) == 1
    assert "d1" not in d_worker.read_fence.views


def test_not_fenced_without_view_handshake_or_blocks(d_worker, clock: Clock) -> None:
    _views(d_worker, d2=clock.now + 500.0 + 10.0, d3=clock.now + 500.0 + 1.0)
    d_worker._read_blocks_for_req("d1", _recv_meta())  # no view (stock P): upstream behaviour
    d_worker._read_blocks_for_req("d2", _recv_meta(blocks=([],)))  # nothing to read: P gets notified
    d_worker.read_fence.views.add("d4", "Q", "p4", 0.0, 8.0)
    d_worker._read_blocks_for_req("d4", _recv_meta("Q"))  # not connected: upstream defers it
    assert d_worker.reads == ["d1", "d2", "d4"]
    assert sum(d_worker.xfer_stats.data["num_reads_fenced"]) == 0
    d_worker._read_blocks_for_req("d3", _recv_meta())
    assert d_worker.reads == ["d1", "d2", "d4"] and d_worker._recv_failures == {"d3"}


def test_heartbeat_to_every_p_rank_renews_the_view(d_worker, clock: Clock) -> None:
    _views(d_worker, d1=clock.now + 500.0 + 10.0, d2=clock.now + 500.0 + 10.0)
    clock.advance(5.0)
    hb = EngineHeartbeats("P", [heartbeat_message(["p1"]), heartbeat_message(["p2"])], "127.0.0.1", 5600, 2)
    d_worker.nixl_wrapper.fail_sends = 1  # the first send (p1 to rank 0) fails
    d_worker._send_heartbeats(WorkerMeta(heartbeats={"P": hb}))
    assert d_worker.read_fence.views.remaining("d1", clock.now, 500.0) == pytest.approx(5.0)  # not renewed
    assert d_worker.read_fence.views.remaining("d2", clock.now, 500.0) == pytest.approx(8.0)
    assert sum(d_worker.xfer_stats.data["num_heartbeat_views_renewed"]) == 1
    # The retry next step reaches rank 0 later than rank 1: it never renews.
    d_worker._send_heartbeats(WorkerMeta())
    assert d_worker.read_fence.views.remaining("d1", clock.now, 500.0) == pytest.approx(5.0)
    clock.advance(3.5)
    d_worker._read_blocks_for_req("d1", _recv_meta())
    d_worker._read_blocks_for_req("d2", _recv_meta())
    assert d_worker.reads == ["d2"] and d_worker._recv_failures == {"d1"}


def test_start_load_kv_adds_views_before_reads_and_drops_after(d_worker, clock: Clock, monkeypatch) -> None:
    seen: list[bool] = []
    monkeypatch.setattr(
        STOCK_PULL_WORKER, "start_load_kv", lambda self, meta: seen.append("d1" in self.read_fence.views)
    )
    new = {"d1": NewView("P", "", "p1", clock.now + 510.0, 8.0, None)}
    d_worker.start_load_kv(WorkerMeta(LeaseViewUpdates(new, [])))
    d_worker.start_load_kv(WorkerMeta(LeaseViewUpdates({}, ["d1"])))
    assert seen == [True, True] and "d1" not in d_worker.read_fence.views
    d_worker.start_load_kv(WorkerMeta(None))  # an empty step: upstream would find nothing to do
    assert seen == [True, True]
    stock_meta = WorkerMeta(None)  # metadata from a stock scheduler
    stock_meta.reqs_in_batch = {"p9"}
    d_worker.start_load_kv(stock_meta)
    assert seen == [True, True, False]


def test_acked_views_move_only_on_p_workers_answers(d_worker, clock: Clock) -> None:
    """Our D worker and two of our P workers (real classes, fake NIXL): hello and
    welcome, then LHB out, LACK back, through ``_get_new_notifs`` on both sides."""
    import concurrent.futures

    d_worker.nixl_wrapper.name = "d-agent"
    p_workers = []
    instance, tag_key = "0123456789abcdef", b"k" * 16
    for rank in range(2):
        p = make_worker(LeaseNixlPullConnectorWorker, LEASE)
        p.nixl_wrapper.name = f"p-agent-{rank}"
        p.lease_keeper.adopt_instance(SimpleNamespace(lease_instance=(instance, tag_key)))
        p.lease_keeper.deadlines["p1"] = clock.now + 10.0
        p_workers.append(p)
    d_worker.read_fence.views.add("d1", "P", "p1", clock.now + 500.0 + 10.0, 8.0, instance)

    def carry_to_p(step: int) -> None:
        for p in p_workers:
            for agent, msg in d_worker.nixl_wrapper.sent:
                if agent == p.nixl_wrapper.name:
                    p.nixl_wrapper.deliver("d-agent", msg)
            p._get_new_notifs()
            concurrent.futures.wait([load for load, *_ in p.ack_answerer._loading.values()], timeout=60)
            p._get_new_notifs()  # the hello loaded: the welcome (and answers) go out
        d_worker.nixl_wrapper.sent = []

    hb = EngineHeartbeats("P", [heartbeat_message(["p1"])], "127.0.0.1", 5600, 2, instance=instance)
    d_worker._send_heartbeats(WorkerMeta(heartbeats={"g0": hb}))  # not proven: hellos only
    carry_to_p(0)
    for p in p_workers:
        (welcome,) = p.nixl_wrapper.sent
        assert parse_heartbeat_ack(welcome[1]) == (instance, [], frozenset(), None)
        d_worker.nixl_wrapper.deliver(p.nixl_wrapper.name, welcome[1])
        p.nixl_wrapper.sent = []
    d_worker._get_new_notifs()
    clock.advance(5.0)
    sent_at = clock.now
    d_worker._send_heartbeats(WorkerMeta())  # the heartbeat that waited for the proof
    assert d_worker.read_fence.views.remaining("d1", clock.now, 500.0) == pytest.approx(5.0)
    clock.advance(1.0)
    carry_to_p(1)
    for p in p_workers:
        assert p.lease_keeper.table.deadline("p1") == pytest.approx(clock.now + 8.0)
        # The answer (D's repeated hello, silent past rehello_after_s, got a welcome too).
        (answer,) = [sent for sent in p.nixl_wrapper.sent if parse_heartbeat_ack(sent[1]).seqs]
        assert answer[0] == "d-agent" and answer[1].startswith(HEARTBEAT_ACK_PREFIX)
        d_worker.nixl_wrapper.deliver(p.nixl_wrapper.name, answer[1])
        if p is p_workers[0]:
            d_worker._get_new_notifs()
            assert d_worker.read_fence.views.remaining("d1", clock.now, 500.0) == pytest.approx(4.0)
    d_worker._get_new_notifs()
    assert d_worker.read_fence.views.remaining("d1", clock.now, 500.0) == pytest.approx(
        sent_at + 8.0 - clock.now
    )
    assert sum(d_worker.xfer_stats.data["num_heartbeat_acks_recv"]) == 2


def test_read_seen_complete_after_the_view_ended_is_discarded(d_worker, clock: Clock, monkeypatch) -> None:
    """A READ posted in time but stalled (a partition while it ran) may have read
    blocks P freed and reused: seen complete with its view's margin (2 s) or less
    left, it is a failed load."""
    _views(d_worker, d1=clock.now + 500.0 + 10.0, d2=clock.now + 500.0 + 10.0)
    monkeypatch.setattr(
        STOCK_PULL_WORKER, "_pop_done_transfers", lambda self, transfers: ({"d1", "d2", "x"}, {"d2"})
    )
    d_worker._recving_transfers = {}
    clock.advance(7.9)
    assert d_worker._pop_done_transfers(d_worker._recving_transfers) == ({"d1", "d2", "x"}, {"d2"})
    clock.advance(0.2)
    assert d_worker._pop_done_transfers(d_worker._recving_transfers) == ({"d1", "d2", "x"}, {"d1", "d2"})
    assert sum(d_worker.xfer_stats.data["num_reads_discarded"]) == 1
    # Sending-side polls (other dicts) are not reads: untouched.
    assert d_worker._pop_done_transfers({}) == ({"d1", "d2", "x"}, {"d2"})


def test_read_seen_complete_after_p_said_not_held_is_kept_before_its_posted_deadline(
    d_worker, clock: Clock, monkeypatch
) -> None:
    """P frees the blocks on the completion notification the READ itself carries, and
    its "not held" answer can reach D before D sees that READ complete: the READ read
    held blocks (its view had time left when it was posted), so it is not discarded
    if D saw it complete more than the margin (2 s) before the posted deadline.
    A READ posted after the answer is fenced; one seen complete later is discarded."""
    _views(d_worker, d1=clock.now + 500.0 + 10.0, d2=clock.now + 500.0 + 10.0, d3=clock.now + 500.0 + 10.0)
    d_worker._read_blocks_for_req("d1", _recv_meta())
    d_worker._read_blocks_for_req("d2", _recv_meta())
    assert d_worker.reads == ["d1", "d2"]
    assert d_worker.read_fence.views.end("P", "", ["p1", "p2", "p3"]) == 3  # P: not held
    d_worker._read_blocks_for_req("d3", _recv_meta())
    assert d_worker.reads == ["d1", "d2"] and d_worker._recv_failures == {"d3"}
    done = {"d1"}
    monkeypatch.setattr(STOCK_PULL_WORKER, "_pop_done_transfers", lambda self, transfers: (set(done), set()))
    d_worker._recving_transfers = {}
    clock.advance(7.9)
    assert d_worker._pop_done_transfers(d_worker._recving_transfers) == ({"d1"}, set())
    done.clear()
    done.add("d2")
    clock.advance(0.2)  # past the deadline the view had when d2 was posted, less the margin
    assert d_worker._pop_done_transfers(d_worker._recving_transfers) == ({"d2"}, {"d2"})
    assert sum(d_worker.xfer_stats.data["num_reads_discarded"]) == 1
    assert d_worker.read_fence._posted == {}


def test_heartbeats_go_out_before_the_steps_reads(d_worker, clock: Clock, monkeypatch) -> None:
    """A step posting thousands of READs must not delay heartbeats (a burst would
    starve P of them for the whole step): ours sends them first, and upstream's own
    call after the reads is a no-op."""
    seen: list[int] = []

    def stock_start_load_kv(self, meta) -> None:
        seen.append(len(self.nixl_wrapper.sent))  # the reads would happen here
        self._send_heartbeats(meta)  # as upstream's start_load_kv ends

    monkeypatch.setattr(STOCK_PULL_WORKER, "start_load_kv", stock_start_load_kv)
    hb = EngineHeartbeats("P", [heartbeat_message(["p1"])], "127.0.0.1", 5600, 2)
    d_worker.start_load_kv(WorkerMeta(heartbeats={"P": hb}))
    assert seen == [2]  # both P ranks had their heartbeat before the reads
    assert len(d_worker.nixl_wrapper.sent) == 2  # and no second copy after them


def test_a_second_local_reader_of_one_lease_is_fenced_and_counted(d_worker, clock: Clock) -> None:
    """n > 1 or a duplicate decode on one D: the first READ's completion lets P
    free the blocks, so only the first local request of a lease reads."""
    deadline = clock.now + 500.0 + 10.0
    for local_id in ("d1", "d2"):
        d_worker.read_fence.views.add(local_id, "P", "p1", deadline, 8.0)
    d_worker._read_blocks_for_req("d1", _recv_meta())
    d_worker._read_blocks_for_req("d2", _recv_meta())
    assert d_worker.reads == ["d1"]
    assert d_worker._recv_failures == {"d2"}  # -> kv_load_failure_policy
    assert sum(d_worker.xfer_stats.data["num_reads_fenced_second_reader"]) == 1
    assert sum(d_worker.xfer_stats.data["num_reads_fenced"]) == 0
    assert "d2" not in d_worker.read_fence.views and "d1" in d_worker.read_fence.views


def test_a_second_local_reader_of_a_stock_p_lease_is_fenced(d_worker, clock: Clock) -> None:
    """A stock P reports no deadline, so D views none of its leases; the claim
    goes by P's request id."""
    meta = SimpleNamespace(local_block_ids=([1, 2],), remote=SimpleNamespace(engine_id="P", request_id="p1"))
    d_worker._read_blocks_for_req("d1", meta)
    d_worker._read_blocks_for_req("d2", meta)
    assert d_worker.reads == ["d1"] and d_worker._recv_failures == {"d2"}
    assert sum(d_worker.xfer_stats.data["num_reads_fenced_second_reader"]) == 1
