"""Read-fence rules (parked aborts, no conversion before proof, plain views, one
lock, margins), through our real pull worker with
upstream's state faked (``vllm_support``): a parked READ whose request ended is
reported once; an unproven connection's offset is never stored in a view; a
plain view, or a lease with no view, is fenced over a connection that reached
one of our P processes;
the verdict and upstream's look at the connection are one step under the
handshake lock; margins apply to completions and have a floor."""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import pytest
from vllm_support import STOCK_PULL_WORKER, Clock, WorkerMeta, make_worker

from vllm_nixl_lease.adapter.d_worker.read_fence import MARGIN_FLOOR_SHARE, ReadFence
from vllm_nixl_lease.adapter.metadata import LEASE_VIEWS_ATTR, LeaseViewUpdates, NewView
from vllm_nixl_lease.adapter.workers import LeaseNixlPullConnectorWorker

LEASE = 12  # extension 8, interval 2, margin 2
INSTANCE = "0123456789abcdef"
OFFSET = 500.0


@pytest.fixture
def d_worker(clock: Clock, monkeypatch: pytest.MonkeyPatch):
    """Our pull worker connected to P (clock offset +500 s); stock reads recorded, not issued."""
    worker = make_worker(LeaseNixlPullConnectorWorker, LEASE)
    worker._remote_agents["P"] = {(0, 0): "p-agent-0"}
    worker._engine_clock_offset["P"] = OFFSET
    worker._invalid_remote_engines = set()
    worker._failed_remote_engines = set()
    worker._invalid_block_ids = queue.Queue()  # upstream's failure path puts a failed load's blocks here
    reads: list[str] = []
    monkeypatch.setattr(
        STOCK_PULL_WORKER, "_read_blocks_for_req", lambda self, req_id, meta: reads.append(req_id)
    )
    monkeypatch.setattr(STOCK_PULL_WORKER, "start_load_kv", lambda self, meta: None)
    worker.reads = reads
    return worker


def _meta(engine: str = "P") -> SimpleNamespace:
    return SimpleNamespace(
        local_block_ids=([1, 2],), remote=SimpleNamespace(engine_id=engine), local_physical_block_ids=[[1, 2]]
    )


def _stat(worker, key: str) -> int:
    return sum(worker.xfer_stats.data[key])


def _prove(worker, instance: str = INSTANCE) -> None:
    worker.ack_requester._proven["p-agent-0"] = instance


# -- a parked READ whose request ended -----------------------------------
def test_parked_read_of_an_aborted_request_is_reported_once(d_worker, clock: Clock) -> None:
    """The connection is not proven yet: the READ parks.  The client aborts: the
    scheduler drops the view; the READ is reported as a failed load in that step
    (vLLM frees the blocks only on that report) and never again."""
    d_worker.read_fence.views.add("d1", "P", "p1", clock.now + OFFSET + 10.0, 8.0, INSTANCE)
    d_worker._recving_metadata["d1"] = _meta()
    d_worker._read_blocks_for_req("d1", _meta())
    assert "d1" in d_worker.read_fence.parked and d_worker.reads == []
    d_worker.start_load_kv(WorkerMeta(LeaseViewUpdates({}, ["d1"])))  # aborted: its view dropped
    assert d_worker.read_fence.parked == {} and d_worker._recv_failures == {"d1"}
    assert _stat(d_worker, "num_reads_parked_dropped") == 1
    results = d_worker.get_transfer_results()  # upstream's own failure path
    assert results.finished_recving == {"d1"} and "d1" in results.failed_recving
    assert d_worker._recving_metadata == {} and d_worker._recv_failures == set()
    d_worker.start_load_kv(WorkerMeta(LeaseViewUpdates({}, ["d1"])))  # dropped twice: nothing more
    assert d_worker.read_fence.take_parked() == []
    assert _stat(d_worker, "num_reads_parked_dropped") == 1 and d_worker._recv_failures == set()
    assert d_worker.reads == []


def test_parked_read_whose_view_went_another_way_is_reported_when_taken(d_worker, clock: Clock) -> None:
    fence = d_worker.read_fence
    fence.views.add("d1", "P", "p1", clock.now + OFFSET + 10.0, 8.0, INSTANCE)
    fence.views.add("d2", "P", "p2", clock.now + OFFSET + 10.0, 8.0, INSTANCE)
    d_worker._read_blocks_for_req("d1", _meta())
    d_worker._read_blocks_for_req("d2", _meta())
    fence.views.drop("d1")
    assert [req_id for req_id, _ in fence.take_parked()] == ["d2"]
    assert d_worker._recv_failures == {"d1"} and _stat(d_worker, "num_reads_parked_dropped") == 1


# -- no conversion with an unproven connection's offset ------------------
def test_parked_view_is_not_converted_with_the_unproven_offset(d_worker, clock: Clock) -> None:
    """Two processes under one engine id: the unproven connection's offset (here
    another process's, 20 s off) decides only to wait; once the connection is
    proven, the view is converted with the offset of the connection proven."""
    fence = d_worker.read_fence
    fence.views.add("d1", "P", "p1", clock.now + OFFSET + 10.0, 8.0, INSTANCE)
    d_worker._engine_clock_offset["P"] = OFFSET - 20.0  # the unproven connection's
    d_worker._read_blocks_for_req("d1", _meta())
    assert "d1" in fence.parked and fence.views.converted("d1") is False
    # The connection is released and handshaken again; the new one reaches the grantor.
    d_worker._engine_clock_offset["P"] = OFFSET
    _prove(d_worker)
    clock.advance(7.9)  # 2.1 s left by the grantor's clock
    for req_id, meta in fence.take_parked():
        d_worker._post_read(req_id, meta)
    assert d_worker.reads == ["d1"]
    assert fence.views.remaining("d1", clock.now, 0.0) == pytest.approx(2.1)


def test_parked_view_is_fenced_when_even_the_estimate_has_no_room(d_worker, clock: Clock) -> None:
    d_worker.read_fence.views.add("d1", "P", "p1", clock.now + OFFSET + 2.0, 8.0, INSTANCE)
    d_worker._recving_metadata["d1"] = _meta()
    d_worker._read_blocks_for_req("d1", _meta())
    assert d_worker.reads == [] and d_worker._recv_failures == {"d1"}
    assert _stat(d_worker, "num_reads_fenced") == 1


# -- plain views over a connection that reached our P -----------------
def test_plain_view_is_fenced_over_a_connection_that_answered_as_our_p(d_worker, clock: Clock) -> None:
    """A plain view's grantor does not speak our protocol, so it is not the
    process whose agents answered as instance J: added after that proof, it
    ends at its first read (the connection is not the one it was granted over)."""
    fence = d_worker.read_fence
    fence.views.add("d1", "P", "p1", clock.now + OFFSET + 10.0, 8.0)
    d_worker._read_blocks_for_req("d1", _meta())  # no proof on this connection: bound and read
    _prove(d_worker)
    fence.views.add("d2", "P", "p2", clock.now + OFFSET + 10.0, 8.0)
    assert fence.views.instance_proven("P", INSTANCE) == 2  # the plain views so far end (D4)
    fence.views.add("d3", "P", "p3", clock.now + OFFSET + 10.0, 8.0)  # after the first proof
    assert fence.views.instance_proven("P", INSTANCE) == 0  # proven once: d3 is not ended here
    d_worker._read_blocks_for_req("d3", _meta())
    assert d_worker.reads == ["d1"] and d_worker._recv_failures == {"d3"}


def test_plain_view_is_read_over_a_new_connection_to_a_stock_p(d_worker, clock: Clock) -> None:
    """A downgrade: our P (proven) replaced by a stock P under the same engine id;
    the new connection's agents have answered nothing: its plain views are read."""
    _prove(d_worker)
    d_worker._remote_agents["P"] = {(0, 0): "stock-agent-0"}
    d_worker.read_fence.views.add("d1", "P", "p1", clock.now + OFFSET + 10.0, 8.0)
    d_worker._read_blocks_for_req("d1", _meta())
    assert d_worker.reads == ["d1"]


def test_unviewed_lease_is_fenced_over_a_connection_that_answered_as_our_p(d_worker, clock: Clock) -> None:
    """A stock P's lease has no view: read as upstream until the connection has
    answered as one of our P processes (a stock P replaced by ours under the same
    engine id); then its READ is fenced. A notify-only completion with no view still goes
    as upstream sends it (an aborted request of ours has lost its view by its cleanup)."""
    d_worker._read_blocks_for_req("d1", _meta())
    _prove(d_worker)
    d_worker._read_blocks_for_req("d2", _meta())
    cached = SimpleNamespace(local_block_ids=([],), remote=SimpleNamespace(engine_id="P"))
    d_worker._read_blocks_for_req("d3", cached)
    assert d_worker.reads == ["d1", "d3"] and d_worker._recv_failures == {"d2"}
    assert _stat(d_worker, "num_reads_fenced") == 1
    assert _stat(d_worker, "num_completions_withheld") == 0


# -- the verdict and upstream's look at the connection ------------------
class _ConnectsAfterGet(dict):
    """``_remote_agents`` whose ``get`` lets the handshake's done-callback run on
    another thread right after it answered (the worst moment): the callback
    writes the agents and the offset under the handshake lock, as upstream's does."""

    def __init__(self, worker, engine_id: str) -> None:
        super().__init__(worker._remote_agents)
        self.worker, self.engine_id = worker, engine_id
        self.callback: threading.Thread | None = None

    def get(self, key, default=None):
        value = super().get(key, default)
        if key == self.engine_id and self.callback is None:

            def done_callback() -> None:
                with self.worker._handshake_lock:
                    self[key] = {(0, 0): "q-agent-0"}
                    self.worker._engine_clock_offset[key] = OFFSET

            self.callback = threading.Thread(target=done_callback)
            self.callback.start()
            self.callback.join(0.2)  # unlocked, it would finish here
        return value


def test_verdict_and_upstreams_check_see_one_connection_state(d_worker, clock: Clock, monkeypatch) -> None:
    seen: list[bool] = []
    monkeypatch.setattr(
        STOCK_PULL_WORKER,
        "_read_blocks_for_req",
        lambda self, req_id, meta: seen.append(meta.remote.engine_id in self._remote_agents),
    )
    racing = _ConnectsAfterGet(d_worker, "Q")
    d_worker._remote_agents = racing
    d_worker.read_fence.views.add("d1", "Q", "q1", clock.now + OFFSET + 10.0, 8.0, INSTANCE)
    d_worker._read_blocks_for_req("d1", _meta("Q"))
    # The fence saw "not connected" and let upstream defer it: upstream saw the same.
    assert seen == [False]
    assert racing.callback is not None
    racing.callback.join(5)
    assert "Q" in racing and not racing.callback.is_alive()


def test_half_written_connection_is_not_ready(d_worker, clock: Clock) -> None:
    d_worker._remote_agents["Q"] = {(0, 0): "q-agent-0"}  # agents, no offset yet
    d_worker.read_fence.views.add("d1", "Q", "q1", clock.now + OFFSET + 10.0, 8.0)
    d_worker._read_blocks_for_req("d1", _meta("Q"))
    assert d_worker.reads == [] and "d1" in d_worker.read_fence.parked
    d_worker._engine_clock_offset["Q"] = OFFSET
    for req_id, meta in d_worker.read_fence.take_parked():
        d_worker._post_read(req_id, meta)
    assert d_worker.reads == ["d1"]


# -- margins -------------------------------------------------------------
def test_stalled_completion_under_a_skewed_clock_is_discarded(d_worker, clock: Clock, monkeypatch) -> None:
    """D's offset estimate is 1.5 s off (P's clock really 1.5 s further ahead:
    P's lease ends 1.5 s before D's view says).  A READ posted with 10 s left
    stalls; D sees it complete with 1.5 s left on its view, i.e. at P's deadline:
    within the margin (2 s), so it is discarded, not kept."""
    d_worker.read_fence.views.add("d1", "P", "p1", clock.now + OFFSET + 10.0, 8.0)
    d_worker._read_blocks_for_req("d1", _meta())
    assert d_worker.reads == ["d1"]
    monkeypatch.setattr(STOCK_PULL_WORKER, "_pop_done_transfers", lambda self, transfers: ({"d1"}, set()))
    d_worker._recving_transfers = {}
    clock.advance(8.5)
    assert d_worker._pop_done_transfers(d_worker._recving_transfers) == ({"d1"}, {"d1"})
    assert _stat(d_worker, "num_reads_discarded") == 1


def test_margin_has_a_floor_and_short_terms_are_logged_once_per_engine(
    d_worker, lease_logs: pytest.LogCaptureFixture
) -> None:
    fence = d_worker.read_fence
    floor = fence.views.margin * MARGIN_FLOOR_SHARE
    assert floor > 0
    own = NewView("P", "", "p1", 0.0, 8.0, 2.0)  # our own terms
    assert _added_margin(fence, "p1", own) == pytest.approx(2.0)
    # P's extension (3 s) barely outlasts D's interval (2 s): room 0.5 s, half of it below the floor.
    for name in ("p1", "p2"):
        short = NewView("Q", "", name, 0.0, 3.0, 1.0)
        assert _added_margin(fence, f"q-{name}", short) == pytest.approx(floor)
    no_room = NewView("R", "", "r1", 0.0, 1.0, 1.0)  # no room at all
    assert _added_margin(fence, "r1", no_room) == pytest.approx(floor)
    assert _stat(d_worker, "num_views_margin_floored") == 3
    logged = [r.getMessage() for r in lease_logs.records if "too short for this D's" in r.getMessage()]
    assert len(logged) == 1 and "Q" in logged[0]  # the next engine's line is rate-limited


def _added_margin(fence: ReadFence, local_id: str, view: NewView) -> float:
    """The margin the fence gives a view shipped to it (``ReadFence.add_views``)."""
    fence.add_views(SimpleNamespace(**{LEASE_VIEWS_ATTR: LeaseViewUpdates({local_id: view}, [])}))
    margin = fence.views.margin_of(local_id)
    assert margin is not None
    return margin
