"""Differential test: our P worker vs vLLM's, driven with the same calls and
notifications, must report the same requests finished sending at the same
steps and move the same stats counters."""

from __future__ import annotations

import logging
import random

import pytest
from vllm_support import STOCK_PULL_WORKER as NixlPullConnectorWorker
from vllm_support import Clock, make_worker, p_idle, p_meta, p_step

from vllm_nixl_lease._wire import heartbeat_message
from vllm_nixl_lease.adapter.workers import LeaseNixlPullConnectorWorker

LEASE = 12  # extension 8, like upstream's d * 2 // 3


def _counts(worker) -> tuple[int, int]:
    data = worker.xfer_stats.data
    return len(data["num_kv_expired_reqs"]), len(data["num_notifications_after_expiry"])


def _scenario(seed: int, steps: int = 60):
    """Yield (dt, meta kwargs, {agent: [messages]}) per step."""
    rng = random.Random(seed)
    issued: list[str] = []
    consumers: dict[str, int] = {}
    pending_grant: list[str] = []
    aborted_next: list[str] = []
    counter = 0
    for _ in range(steps):
        in_batch, to_send = [], {}
        for req_id in pending_grant:
            to_send[req_id] = LEASE
        pending_grant = []
        not_processed, aborted_next = aborted_next, []
        for _ in range(rng.randint(0, 3)):
            counter += 1
            # Some ids carry ':' (completions split on the last colon).
            req_id = f"cmpl-{seed}-{counter}" + (":x" if rng.random() < 0.2 else "")
            issued.append(req_id)
            consumers[req_id] = rng.choice((1, 1, 2))
            in_batch.append(req_id)
            roll = rng.random()
            if roll < 0.6:
                to_send[req_id] = LEASE
            elif roll < 0.85:
                pending_grant.append(req_id)  # async scheduling: grant a step late
            else:
                aborted_next.append(req_id)  # aborted before any lease
        notifs: dict[str, list[bytes]] = {}
        if issued:
            for agent in ("agent-a", "agent-b"):
                msgs = []
                if rng.random() < 0.6:
                    ids = rng.sample(issued, k=min(len(issued), rng.randint(1, 6)))
                    if rng.random() < 0.3:
                        ids.append(f"ghost-{rng.randint(0, 9)}")
                    msgs.append(heartbeat_message(ids))
                for req_id in rng.sample(issued, k=min(len(issued), rng.randint(0, 2))):
                    msgs.append(f"{req_id}:{consumers[req_id]}".encode())
                if rng.random() < 0.1:
                    msgs.append(b"ghost-late:1")
                rng.shuffle(msgs)
                if msgs:
                    notifs[agent] = msgs
        # P steps within half the extension: a longer gap is P's own stall, after
        # which ours deliberately gives D's heartbeats a grace stock does not
        # (tests/adapter/test_acks.py::test_p_stall_waits_for_the_heartbeats_sent_meanwhile).
        dt = rng.choice((0.0, 0.5, 1.0, 2.5, 3.5))
        offset = rng.uniform(-1e5, 1e5)  # unrelated scheduler clock
        kwargs = dict(
            in_batch=tuple(in_batch),
            to_send=to_send,
            not_processed=tuple(not_processed),
            scheduler_offset=offset,
        )
        yield dt, kwargs, notifs


def _drive(seed: int, clock: Clock) -> None:
    stock = make_worker(NixlPullConnectorWorker, LEASE)
    ours = make_worker(LeaseNixlPullConnectorWorker, LEASE)
    for step, (dt, kwargs, notifs) in enumerate(_scenario(seed)):
        clock.advance(dt)
        for worker in (stock, ours):
            for agent, msgs in notifs.items():
                worker.nixl_wrapper.deliver(agent, *msgs)
        done_stock = p_step(stock, p_meta(clock, **kwargs))
        done_ours = p_step(ours, p_meta(clock, **kwargs))
        where = f"seed {seed} step {step}"
        assert done_ours == done_stock, where
        assert _counts(ours) == _counts(stock), where
        assert dict(ours._reqs_to_send) == stock._reqs_to_send, where
        assert len(ours._reqs_to_process) == len(stock._reqs_to_process), where
        assert all(r in ours._reqs_to_process for r in stock._reqs_to_process), where


@pytest.mark.parametrize("seed", range(40))
def test_same_finished_and_expired_as_upstream(seed: int, clock: Clock) -> None:
    _drive(seed, clock)


def test_scenarios_exercise_every_path(clock: Clock) -> None:
    """Guard against a generator that never expires or completes anything."""
    expired = completed = after_expiry = 0
    for seed in range(10):
        stock = make_worker(NixlPullConnectorWorker, LEASE)
        for dt, kwargs, notifs in _scenario(seed):
            clock.advance(dt)
            for agent, msgs in notifs.items():
                stock.nixl_wrapper.deliver(agent, *msgs)
            before = len(stock.xfer_stats.data["num_kv_expired_reqs"])
            done = p_step(stock, p_meta(clock, **kwargs))
            grew = len(stock.xfer_stats.data["num_kv_expired_reqs"]) - before
            expired += grew
            completed += len(done) - grew
        after_expiry += len(stock.xfer_stats.data["num_notifications_after_expiry"])
    assert expired > 10 and completed > 10 and after_expiry > 10


def test_deadline_rebased_onto_worker_clock(clock: Clock) -> None:
    ours = make_worker(LeaseNixlPullConnectorWorker, LEASE)
    p_step(ours, p_meta(clock, in_batch=("r",), to_send={"r": LEASE}, scheduler_offset=-7e5))
    assert ours.lease_keeper.table.deadline("r") == pytest.approx(clock.now + LEASE)
    assert p_idle(ours, clock, LEASE - 0.5) == set()
    clock.advance(0.5)  # now >= deadline: expired, inclusive like upstream
    assert p_step(ours) == {"r"}


def test_one_warning_per_step_and_debug_lines(clock: Clock, lease_logs: pytest.LogCaptureFixture) -> None:
    ours = make_worker(LeaseNixlPullConnectorWorker, LEASE)
    ids = tuple(f"r{i}" for i in range(8))
    p_step(ours, p_meta(clock, in_batch=ids, to_send=dict.fromkeys(ids, LEASE)))
    caplog = lease_logs
    assert p_idle(ours, clock, LEASE, step_s=LEASE / 3) == set(ids)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    debugs = [
        r for r in caplog.records if r.levelno == logging.DEBUG and "Releasing expired" in r.getMessage()
    ]
    assert len(warnings) == 1 and "Releasing expired KV blocks for 8 request(s)" in warnings[0].getMessage()
    assert len(debugs) == 8
    assert len(ours.xfer_stats.data["num_kv_expired_reqs"]) == 8


def test_malformed_counted_not_raised(clock: Clock) -> None:
    stock = make_worker(NixlPullConnectorWorker, LEASE)
    ours = make_worker(LeaseNixlPullConnectorWorker, LEASE)
    bad = (b"no-colon", b"r:notanumber", b"\xff\xfe:1")
    for worker in (stock, ours):
        p_step(worker, p_meta(clock, in_batch=("r",), to_send={"r": LEASE}))
        worker.nixl_wrapper.deliver("a", *bad, b"r:1")
    with pytest.raises(ValueError):
        p_step(stock)  # upstream loses the whole batch, including r's completion
    assert p_step(ours) == {"r"}
    assert sum(ours.xfer_stats.data["num_malformed_notifs"]) == 3
