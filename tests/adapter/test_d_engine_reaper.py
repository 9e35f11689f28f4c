"""D releases upstream's state of P engines that are gone (``d_worker/engine_reaper.py``),
against vLLM's real pull worker: its own TTL eviction and engine clean-up run."""

from __future__ import annotations

import os
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from vllm_support import Clock, make_worker

from harness.upstream_fake import FakeUpstreamWorker, make_upstream_worker, stock_worker_class
from vllm_nixl_lease._wire import heartbeat_ack_message, heartbeat_message, new_instance
from vllm_nixl_lease.adapter.d_worker.engine_reaper import (
    INVALID_BACKOFF_MEMORY_S,
    STEPS_PER_CLOCK_READ,
    EngineReaper,
)
from vllm_nixl_lease.adapter.metadata import (
    LEASE_HEARTBEATS_ATTR,
    LEASE_VIEWS_ATTR,
    EngineHeartbeats,
    LeaseViewUpdates,
    NewView,
)
from vllm_nixl_lease.adapter.workers import LeaseNixlPullConnectorWorker

TTL = 30.0
SWEEP = 10.0


def connected_worker(engines: dict[str, float]) -> object:
    """An upstream pull worker connected to each engine, last active at the given time."""
    w = make_upstream_worker(stock_worker_class())
    w._engine_ttl = TTL
    for engine_id, last_active in engines.items():
        w._remote_agents[engine_id] = {(0, 0): f"{engine_id}-agent"}
        w._engine_last_active[engine_id] = last_active
        w._engine_clock_offset[engine_id] = 0.0
        w.kv_caches_base_addr[engine_id] = {0: [0]}
        w._remote_registration_generations[engine_id] = 1
    return w


def run_steps(reaper: EngineReaper, n: int) -> None:
    for _ in range(n):
        reaper.step()


def test_an_engine_silent_past_the_ttl_is_released_without_a_new_handshake(clock: Clock) -> None:
    # p-dead died (or restarted under a new id and port) with nothing queued for it on D:
    # nothing fails, no engine replaces it by address; upstream checks its TTL only when
    # another engine handshakes, so a settled fleet kept its state for ever.
    w = connected_worker({"p-dead": clock.now, "p-live": clock.now})
    reaper = EngineReaper(w, SWEEP)
    clock.advance(TTL - 5)
    w._engine_last_active["p-live"] = clock.now  # a read or heartbeat
    clock.advance(10)
    run_steps(reaper, STEPS_PER_CLOCK_READ)
    assert reaper.sweeps == 1
    assert "p-dead" not in w._remote_agents and "p-dead" not in w.kv_caches_base_addr
    assert "p-dead" not in w._engine_clock_offset and "p-dead" not in w._engine_last_active
    assert "p-dead" not in w._remote_registration_generations
    assert "p-live" in w._remote_agents and w._remote_registration_generations["p-live"] == 1


def test_an_engine_with_a_read_in_flight_or_a_handshake_pending_is_kept(clock: Clock) -> None:
    w = connected_worker({"p-reading": clock.now})
    w._recving_metadata["r1"] = SimpleNamespace(remote=SimpleNamespace(engine_id="p-reading"))
    w._recving_transfers["r1"].append(object())
    w._remote_registration_generations["p-connecting"] = 2
    w._handshake_futures["p-connecting"] = object()
    reaper = EngineReaper(w, SWEEP)
    clock.advance(TTL + 1)
    reaper.sweep(clock.now)
    assert "p-reading" in w._remote_agents  # upstream's own rule: reads in flight keep it
    assert w._remote_registration_generations == {"p-reading": 1, "p-connecting": 2}


def test_the_clock_is_read_once_per_steps_and_sweeps_are_spaced(clock: Clock) -> None:
    w = connected_worker({"p": clock.now})
    reaper = EngineReaper(w, SWEEP)
    run_steps(reaper, STEPS_PER_CLOCK_READ - 1)
    assert reaper.sweeps == 0
    run_steps(reaper, 1)
    assert reaper.sweeps == 1
    run_steps(reaper, 3 * STEPS_PER_CLOCK_READ)  # the clock has not moved: not due again
    assert reaper.sweeps == 1
    clock.advance(SWEEP)
    run_steps(reaper, STEPS_PER_CLOCK_READ)
    assert reaper.sweeps == 2


@pytest.mark.parametrize(
    "age, kept", [(INVALID_BACKOFF_MEMORY_S - 1, True), (INVALID_BACKOFF_MEMORY_S + 1, False)]
)
def test_invalid_engine_backoffs_that_are_over_are_forgotten(clock: Clock, age: float, kept: bool) -> None:
    # Upstream forgets a backoff only when it invalidates another engine: a fleet whose
    # P engines restart under new ids kept one entry per engine id ever invalidated.
    up = FakeUpstreamWorker()
    up._invalid_engine_backoff["p-old"] = (0.0, clock.now - age)
    EngineReaper(up, SWEEP).sweep(clock.now)
    assert ("p-old" in up._invalid_engine_backoff) is kept
    assert up.evictions == 0  # nothing connected: no eviction to run


# -- our own per-engine state, pruned with upstream's ------------------
RESTARTS = 1000


def _sizes(obj: object, prefix: str, out: dict[str, int], depth: int = 1) -> dict[str, int]:
    """``len`` of every collection one level into our components (as harness/nixl's ``structure_sizes``)."""
    for name, value in vars(obj).items():
        path = f"{prefix}.{name}"
        if name == "xfer_stats":
            continue  # counters by name, not per engine
        if isinstance(value, (dict, set, list)):
            out[path] = len(value)
        elif (type(value).__module__ or "").startswith("vllm_nixl_lease") and depth > 0:
            if hasattr(value, "__len__"):
                out[path] = len(value)
            if hasattr(value, "__dict__"):
                _sizes(value, path, out, depth - 1)
            elif hasattr(value, "__slots__"):
                for slot in value.__slots__:
                    inner = getattr(value, slot, None)
                    if isinstance(inner, (dict, set, list)):
                        out[f"{path}.{slot}"] = len(inner)
    return out


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


def _p_start(w: Any, clock: Clock, i: int, answer: bool, extension: float) -> None:
    """One P start under a fresh engine id (vLLM's default): D connects, views one
    request, says hello and keeps it alive; ``answer``: P welcomes D and D's
    acknowledged heartbeat is answered (else the group ends unproven); the
    request then ends."""
    engine, instance, agent = f"P-{uuid.uuid4()}", new_instance(), f"agent-{uuid.uuid4()}"
    w._remote_agents[engine] = {(0, 0): agent.encode()}
    w._engine_clock_offset[engine] = 0.0
    w._engine_last_active[engine] = clock.now
    w.kv_caches_base_addr[engine] = {0: [0]}
    w._remote_registration_generations[engine] = 1
    local, name = f"d-{i}", f"p-{i}"
    view = NewView(engine, instance, name, clock.now + 12, extension, 2.0)
    hb = EngineHeartbeats(engine, [heartbeat_message([name])], "10.0.0.1", 5600, 1, instance=instance)
    meta = SimpleNamespace(
        **{
            LEASE_VIEWS_ATTR: LeaseViewUpdates({local: view}, []),
            LEASE_HEARTBEATS_ATTR: {f"{engine}/{instance}": hb},
        }
    )
    w.read_fence.add_views(meta)
    w.heartbeat_sender.send(meta)  # unproven: a hello and a keep-alive
    if answer:
        w.ack_requester.received({agent: [heartbeat_ack_message(instance, [])]})  # the welcome
        clock.advance(0.01)
        w.heartbeat_sender.send(SimpleNamespace(**{LEASE_HEARTBEATS_ATTR: {}}))  # the LHB: that waited
        seq = w.ack_requester.ledger._next - 1
        w.ack_requester.received({agent: [heartbeat_ack_message(instance, [seq])]})
    w.read_fence.drop_views(SimpleNamespace(**{LEASE_VIEWS_ATTR: LeaseViewUpdates({}, [local])}))
    w.nixl_wrapper.sent = []
    clock.advance(0.05)
    w.heartbeat_sender.send(SimpleNamespace(**{LEASE_HEARTBEATS_ATTR: {}}))  # a step after it ended


def test_a_thousand_p_restarts_with_fresh_engine_ids_leave_d_bounded(clock: Clock) -> None:
    """Each start's engine id is new; D's views, proofs, hello state, heartbeats
    waiting for proof and ack ledger must be released with the engine, not kept
    per id ever seen.  One start in three ends unproven (the hello never
    answered); one in seven advertises an absurd extension (clamped)."""
    w = make_worker(LeaseNixlPullConnectorWorker, lease_duration=12, extra={"engine_ttl": TTL})
    w._engine_ttl = TTL
    if os.environ.get("REAPER_NO_FORGET"):  # to see the growth this test guards against
        w.engine_reaper._forget = ()
    samples: dict[int, tuple[dict[str, int], int]] = {}
    for i in range(RESTARTS):
        _p_start(w, clock, i, answer=i % 3 != 0, extension=1e9 if i % 7 == 0 else 8.0)
        if i % 50 == 49:
            clock.advance(1.0)
            w.engine_reaper.sweep(clock.now)  # the reaper's due sweep (its step() reads the clock)
        if i + 1 in (RESTARTS // 5, RESTARTS):
            clock.advance(TTL + 1)  # ... and every engine of the last TTL is idle
            w.engine_reaper.sweep(clock.now)
            w.ack_requester.received({})
            samples[i + 1] = (_sizes(w, "worker", {}, depth=2), _rss_kib())
    early, late = samples[RESTARTS // 5], samples[RESTARTS]
    grown = {k: (early[0].get(k), v) for k, v in late[0].items() if v > max(early[0].get(k, 0), 0)}
    print(
        f"\n{RESTARTS} P restarts: largest structures {sorted(late[0].items(), key=lambda kv: -kv[1])[:5]}; "
        f"RSS {early[1]} KiB after {RESTARTS // 5}, {late[1]} KiB after {RESTARTS}"
    )
    assert grown == {}, f"structures that grew with P restarts: {grown}"
    assert max(late[0].values()) <= 1, late[0]  # everything released: nothing is queued or connected
    assert w.read_fence.views.engines_known() == 0 and w.ack_requester.agents_known() == 0
    assert w.heartbeat_sender.awaiting_proof == {} and len(w.ack_requester.ledger) == 0
    assert w.read_fence.views.max_extension <= w.lease_config.max_view_extension
    assert w.xfer_stats.data.get("num_lease_terms_clamped") == [1] * len(range(0, RESTARTS, 7))
    # Loose on purpose (RSS moves with the allocator): a leak of ~1 KiB per restart shows.
    assert late[1] - early[1] < 1024, f"RSS grew {late[1] - early[1]} KiB over {RESTARTS * 4 // 5} restarts"


def test_a_group_that_ends_unproven_is_dropped_and_stops_keeping_the_engine_active(clock: Clock) -> None:
    w = make_worker(LeaseNixlPullConnectorWorker, lease_duration=12, extra={"engine_ttl": TTL})
    w._engine_ttl = TTL
    _p_start(w, clock, 0, answer=False, extension=8.0)
    assert w.heartbeat_sender.awaiting_proof == {}  # its view is gone: not repeated every step
    active = dict(w._engine_last_active)
    clock.advance(TTL + 1)
    w.heartbeat_sender.send(SimpleNamespace(**{LEASE_HEARTBEATS_ATTR: {}}))
    assert w._engine_last_active == active  # nothing stamps the engine active any more
    w.engine_reaper.sweep(clock.now)
    assert w._remote_agents == {} and w.read_fence.views.engines_known() == 0
