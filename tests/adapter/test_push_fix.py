"""vLLM issue 53095: in push mode D heartbeats the router's request id, P
keys the lease by its own (suffixed) id, so upstream never renews it."""

from __future__ import annotations

import pytest
from vllm_support import STOCK_PUSH_WORKER, Clock, make_worker, p_idle, p_meta, p_step

from vllm_nixl_lease._wire import heartbeat_message
from vllm_nixl_lease.adapter.workers import LeaseNixlPushConnectorWorker

LEASE = 12  # extension 8
P_ID = "cmpl-4b1d2c-0-1a2b3c4d"  # P's internal id: router id + "-<8 hex>"
ROUTER_ID = "cmpl-4b1d2c-0"  # what D puts in its heartbeats


def _heartbeat(worker, payload: str) -> None:
    # The push writer thread forwards non-PUSH_REG notifications to this queue.
    worker._pending_completion_notifs.put(heartbeat_message([payload]))


@pytest.mark.parametrize(
    "cls",
    [
        pytest.param(STOCK_PUSH_WORKER, marks=pytest.mark.xfail(strict=True, reason="vLLM issue 53095")),
        LeaseNixlPushConnectorWorker,
    ],
    ids=["upstream", "ours"],
)
@pytest.mark.parametrize("hb_id", [ROUTER_ID, ROUTER_ID + "-0badf00d"], ids=["router-id", "d-suffixed-id"])
def test_router_id_heartbeat_renews_p_lease(cls: type, hb_id: str, clock: Clock) -> None:
    worker = make_worker(cls, LEASE)
    assert p_step(worker, p_meta(clock, in_batch=(P_ID,), to_send={P_ID: LEASE})) == set()
    # Heartbeats every 2 s (upstream's interval for d=12) for 3 lease lengths.
    for _ in range(3 * LEASE // 2):
        clock.advance(2)
        _heartbeat(worker, hb_id)
        assert p_step(worker) == set(), "lease expired although D kept heartbeating"


def test_exact_id_still_works_and_unknown_ids_counted(clock: Clock) -> None:
    worker = make_worker(LeaseNixlPushConnectorWorker, LEASE)
    p_step(worker, p_meta(clock, in_batch=(P_ID,), to_send={P_ID: LEASE}))
    clock.advance(6)
    _heartbeat(worker, f"{P_ID},someone-else")
    p_step(worker)
    assert worker.lease_keeper.table.deadline(P_ID) == pytest.approx(clock.now + 8)
    assert sum(worker.xfer_stats.data["num_heartbeat_ids_recv"]) == 2
    assert sum(worker.xfer_stats.data["num_heartbeat_ids_unknown"]) == 1


def test_alias_dropped_when_lease_ends(clock: Clock) -> None:
    worker = make_worker(LeaseNixlPushConnectorWorker, LEASE)
    p_step(worker, p_meta(clock, in_batch=(P_ID,), to_send={P_ID: LEASE}))
    assert p_idle(worker, clock, LEASE) == {P_ID}  # expired
    assert not worker.lease_keeper.aliases
    _heartbeat(worker, ROUTER_ID)
    p_step(worker)
    assert P_ID not in worker.lease_keeper.table  # a heartbeat never creates a lease


def test_completions_still_handled_by_upstream_path(clock: Clock) -> None:
    """Non-heartbeat notifications go back to upstream's push handling."""
    worker = make_worker(LeaseNixlPushConnectorWorker, LEASE)
    p_step(worker, p_meta(clock, in_batch=(P_ID,), to_send={P_ID: LEASE}))
    worker._pending_completion_notifs.put(b"unknown-d-req:1")
    p_step(worker)
    assert len(worker.xfer_stats.data["num_notifications_after_expiry"]) == 1
    assert P_ID in worker.lease_keeper.table
