"""A burst of READs is spread over steps: each D step posts READs for at most
``read_post_budget_ms``, carries the rest in order, and sends its heartbeats
before any of them (the real-NIXL burst scenario is in test_nixl_burst.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm_support import STOCK_PULL_WORKER, Clock, WorkerMeta, make_worker

from vllm_nixl_lease._wire import heartbeat_message
from vllm_nixl_lease.adapter.d_worker.read_pacer import ReadPacer
from vllm_nixl_lease.adapter.metadata import EngineHeartbeats
from vllm_nixl_lease.adapter.workers import LeaseNixlPullConnectorWorker

LEASE = 12  # extension 8, interval 2, margin 2
READ_COST_S = 0.03  # what posting one READ costs in these tests


def test_pacer_posts_until_the_budget_is_spent_then_queues_in_order(clock: Clock) -> None:
    pacer = ReadPacer(0.1)
    pacer.begin_step()
    posted = []
    for i in range(10):
        if not pacer.defer(f"r{i}", None):
            posted.append(f"r{i}")
            clock.advance(READ_COST_S)
    assert posted == ["r0", "r1", "r2", "r3"]  # the 4th starts at 90 ms, inside the budget
    assert [r for r, _ in pacer.carried] == [f"r{i}" for i in range(4, 10)]
    assert (pacer.newly_carried, len(pacer)) == (6, 6)
    pacer.begin_step()
    assert pacer.defer("new", None)  # never overtakes what waits
    out = []
    for req_id, _ in pacer.carried_over():
        out.append(req_id)
        clock.advance(READ_COST_S)
    assert out == ["r4", "r5", "r6", "r7"] and pacer.newly_carried == 1
    assert [r for r, _ in pacer.carried] == ["r8", "r9", "new"]


def test_pacer_posts_one_read_per_step_however_slow(clock: Clock) -> None:
    pacer = ReadPacer(0.001)
    pacer.begin_step()
    assert [pacer.defer(f"r{i}", None) or clock.advance(1.0) for i in range(3)] == [1001.0, True, True]
    for expected in (["r1"], ["r2"], []):
        pacer.begin_step()
        clock.advance(0.5)  # the heartbeats alone took longer than the budget
        assert [r for r, _ in pacer.carried_over()] == expected


def test_budget_zero_never_carries(clock: Clock) -> None:
    pacer = ReadPacer(0)
    pacer.begin_step()
    clock.advance(3600)
    assert not any(pacer.defer(f"r{i}", None) for i in range(1000)) and len(pacer) == 0


@pytest.fixture
def d_worker(clock: Clock, monkeypatch: pytest.MonkeyPatch):
    """Our pull worker connected to P; each READ "costs" READ_COST_S of the
    fake clock and is recorded, with every heartbeat send, in ``events``."""
    worker = make_worker(LeaseNixlPullConnectorWorker, LEASE, {"read_post_budget_ms": 100})
    worker._remote_agents["P"] = {(0, 0): "p-agent-0"}
    worker._engine_clock_offset["P"] = 0.0
    worker._invalid_remote_engines = set()
    worker._recv_failures = set()
    worker._failed_remote_engines = set()
    events: list[str] = []

    def read(self, req_id: str, meta) -> None:
        events.append(req_id)
        clock.advance(READ_COST_S)

    def start_load_kv(self, metadata) -> None:  # upstream's loop over the step's new READs
        for req_id, meta in metadata.reqs_to_recv.items():
            self._read_blocks_for_req(req_id, meta)

    monkeypatch.setattr(STOCK_PULL_WORKER, "_read_blocks_for_req", read)
    monkeypatch.setattr(STOCK_PULL_WORKER, "start_load_kv", start_load_kv)
    send = worker.nixl_wrapper.send_notif
    worker.nixl_wrapper.send_notif = lambda agent, notif_msg: (events.append("HB"), send(agent, notif_msg))
    worker.events = events
    return worker


def _recv(*ids: str) -> dict:
    return {r: SimpleNamespace(local_block_ids=([1],), remote=SimpleNamespace(engine_id="P")) for r in ids}


def _heartbeat() -> dict:
    return {"P": EngineHeartbeats("P", [heartbeat_message(["p-x"])], "127.0.0.1", 5600, 1)}


def test_burst_is_spread_over_steps_with_heartbeats_first(d_worker, clock: Clock) -> None:
    burst = [f"b{i}" for i in range(10)]
    d_worker.start_load_kv(WorkerMeta(heartbeats=_heartbeat(), reqs_to_recv=_recv(*burst)))
    assert d_worker.events == ["HB", "b0", "b1", "b2", "b3"]
    assert sum(d_worker.xfer_stats.data["num_reads_carried"]) == 6
    d_worker.events.clear()
    # Next step: its heartbeats, then the carried READs, then (budget left) new ones.
    d_worker.start_load_kv(WorkerMeta(heartbeats=_heartbeat(), reqs_to_recv=_recv("n0")))
    assert d_worker.events == ["HB", "b4", "b5", "b6", "b7"]
    d_worker.events.clear()
    d_worker.start_load_kv(WorkerMeta())
    assert d_worker.events == ["b8", "b9", "n0"] and len(d_worker.read_pacer) == 0


def test_a_carried_read_is_fenced_when_its_view_lapsed_meanwhile(d_worker, clock: Clock) -> None:
    for i in range(5):
        d_worker.read_fence.views.add(f"b{i}", "P", f"p{i}", clock.now + 10.0, 8.0)
    d_worker.start_load_kv(WorkerMeta(reqs_to_recv=_recv(*(f"b{i}" for i in range(5)))))
    assert d_worker.events == ["b0", "b1", "b2", "b3"]
    clock.advance(8.0)  # b4's view has the 2 s margin left when its READ comes up
    d_worker.start_load_kv(WorkerMeta())
    assert d_worker.events == ["b0", "b1", "b2", "b3"] and d_worker._recv_failures == {"b4"}
    assert sum(d_worker.xfer_stats.data["num_reads_fenced"]) == 1


def test_carried_reads_keep_an_idle_step_from_pausing(d_worker, clock: Clock, monkeypatch) -> None:
    import vllm_nixl_lease.adapter.p_worker.idle_pause as idle_pause

    pauses: list[float] = []
    monkeypatch.setattr(idle_pause.time, "sleep", pauses.append)
    results = SimpleNamespace(finished_sending=set(), finished_recving=set())
    monkeypatch.setattr(STOCK_PULL_WORKER, "get_transfer_results", lambda self, *a: results)
    d_worker.idle_pause.sleep_s = 0.05
    d_worker.lease_keeper.deadlines["held"] = clock.now + 30  # a lease keeps the engine busy
    d_worker._recving_transfers = {}
    d_worker.start_load_kv(WorkerMeta(reqs_to_recv=_recv(*(f"b{i}" for i in range(6)))))
    d_worker.idle_pause._idle_step = True  # what the scheduler would say of this step
    d_worker.get_transfer_results()
    assert pauses == []  # two READs still wait to be posted
    d_worker.start_load_kv(WorkerMeta())
    d_worker.idle_pause._idle_step = True
    d_worker.get_transfer_results()
    assert pauses == [0.05]
