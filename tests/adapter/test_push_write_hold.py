"""In push mode an expired lease must not free P's blocks
while P's own WRITE of them is still in flight (upstream frees them at once,
so UCX may send another request's KV to D from the reused blocks)."""

from __future__ import annotations

from typing import Any

import pytest
from vllm_support import STOCK_PUSH_WORKER, Clock, make_worker, p_meta

from vllm_nixl_lease.adapter.p_worker.push_write_hold import PushWriteHold
from vllm_nixl_lease.adapter.workers import LeaseNixlPushConnectorWorker

LEASE = 12
P_ID = "cmpl-push-0-1a2b3c4d"
HANDLE = 7


def _worker(cls: type, clock: Clock) -> Any:
    worker = make_worker(cls, LEASE)
    worker.start_load_kv(p_meta(clock, in_batch=(P_ID,), to_send={P_ID: LEASE}))
    return worker


def _write_in_flight(worker: Any, handle: int = HANDLE) -> None:
    # What upstream's writer thread leaves once it posted the WRITE.
    worker._sending_transfers[P_ID].append(handle)
    worker.nixl_wrapper.xfer_states[handle] = "PROC"


def _freed(worker: Any) -> set[str]:
    return set(worker.get_transfer_results().finished_sending)


def _count(worker: Any, key: str) -> int:
    return sum(worker.xfer_stats.data.get(key, []))


@pytest.mark.parametrize(
    "cls",
    [
        pytest.param(
            STOCK_PUSH_WORKER,
            marks=pytest.mark.xfail(strict=True, reason="upstream frees an expired lease's blocks mid-WRITE"),
        ),
        LeaseNixlPushConnectorWorker,
    ],
    ids=["upstream", "ours"],
)
def test_expiry_during_write_frees_nothing_until_the_write_ends(cls: type, clock: Clock) -> None:
    worker = _worker(cls, clock)
    _write_in_flight(worker)
    clock.advance(LEASE + 1)
    assert _freed(worker) == set(), "blocks freed while P's WRITE of them was in flight"
    clock.advance(1)
    assert _freed(worker) == set()
    worker.nixl_wrapper.xfer_states[HANDLE] = "DONE"
    assert _freed(worker) == {P_ID}
    assert _freed(worker) == set(), "freed twice"


@pytest.mark.parametrize("state", ["DONE", "ERR"])
def test_free_follows_the_write_end_and_is_counted(state: str, clock: Clock) -> None:
    worker = _worker(LeaseNixlPushConnectorWorker, clock)
    _write_in_flight(worker)
    clock.advance(LEASE + 1)
    assert _freed(worker) == set()
    assert _count(worker, "num_push_frees_held") == 1
    assert P_ID not in worker.lease_keeper.table, "the expiry itself happened on time"
    worker.nixl_wrapper.xfer_states[HANDLE] = state
    assert _freed(worker) == {P_ID}
    assert not worker.write_hold.held and not worker._sending_transfers
    assert worker._evict_finished_inbox.get_nowait() == P_ID


def test_write_done_before_expiry_is_reported_as_upstream_does(clock: Clock) -> None:
    worker = _worker(LeaseNixlPushConnectorWorker, clock)
    _write_in_flight(worker)
    worker.nixl_wrapper.xfer_states[HANDLE] = "DONE"
    assert _freed(worker) == {P_ID}
    clock.advance(LEASE + 1)
    assert _freed(worker) == set()
    assert _count(worker, "num_push_frees_held") == 0


def test_expiry_with_no_write_frees_at_once(clock: Clock) -> None:
    worker = _worker(LeaseNixlPushConnectorWorker, clock)
    clock.advance(LEASE + 1)
    assert _freed(worker) == {P_ID}


def test_write_that_never_ends_is_cancelled_a_lease_after_expiry(clock: Clock) -> None:
    worker = _worker(LeaseNixlPushConnectorWorker, clock)
    _write_in_flight(worker)
    clock.advance(LEASE + 1)
    assert _freed(worker) == set()
    clock.advance(LEASE - 1)
    assert _freed(worker) == set(), "cancelled before the bound"
    assert worker.nixl_wrapper.released == []
    clock.advance(1)
    assert _freed(worker) == {P_ID}
    assert worker.nixl_wrapper.released == [HANDLE]
    assert _count(worker, "num_push_writes_cancelled") == 1


def test_write_nixl_cannot_cancel_keeps_the_blocks(clock: Clock) -> None:
    worker = _worker(LeaseNixlPushConnectorWorker, clock)
    _write_in_flight(worker)
    worker.nixl_wrapper.refuse_release.add(HANDLE)
    clock.advance(LEASE + 1)
    assert _freed(worker) == set()  # expired: held
    clock.advance(LEASE)
    assert _freed(worker) == set()  # past the bound: the cancel is refused
    assert _freed(worker) == set()
    assert worker._sending_transfers[P_ID] == [HANDLE]
    worker.nixl_wrapper.refuse_release.clear()
    assert _freed(worker) == {P_ID}
    assert _count(worker, "num_push_writes_cancelled") == 1


def test_write_being_posted_at_expiry_holds_the_free(clock: Clock) -> None:
    """The writer thread is inside ``_xfer_blocks_for_req`` (handles not yet
    published) when the lease expires: the free waits for the post to end."""
    worker = _worker(LeaseNixlPushConnectorWorker, clock)
    assert worker.write_hold.begin(P_ID)
    clock.advance(LEASE + 1)
    assert _freed(worker) == set()
    _write_in_flight(worker)
    worker.write_hold.end(P_ID)
    assert _freed(worker) == set()
    worker.nixl_wrapper.xfer_states[HANDLE] = "DONE"
    assert _freed(worker) == {P_ID}


def test_no_write_starts_after_the_lease_freed_the_blocks(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    posted: list[str] = []
    monkeypatch.setattr(
        STOCK_PUSH_WORKER, "_xfer_blocks_for_req", lambda self, req_id, meta: posted.append(req_id)
    )
    worker = _worker(LeaseNixlPushConnectorWorker, clock)
    clock.advance(LEASE + 1)
    assert _freed(worker) == {P_ID}
    worker._xfer_blocks_for_req(P_ID, None)  # a late registration or handshake on the writer thread
    assert posted == []
    _freed(worker)
    assert _count(worker, "num_push_writes_refused") == 1
    worker._xfer_blocks_for_req("another", None)
    assert posted == ["another"]


def test_freed_leases_remembered_are_bounded() -> None:
    hold = PushWriteHold(bound_s=1.0, remembered=2)
    assert hold.hold_expired(["a", "b", "c"], lambda _: False, 0.0) == set()
    assert hold.begin("a"), "the oldest freed lease is forgotten past the bound"
    assert not hold.begin("b") and not hold.begin("c")
    assert hold.take_refused() == 2 and hold.take_refused() == 0
