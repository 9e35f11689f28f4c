"""D releases upstream's state of P engines that are gone (``d_worker/engine_reaper.py``),
against vLLM's real pull worker: its own TTL eviction and engine clean-up run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm_support import Clock

from harness.upstream_fake import FakeUpstreamWorker, make_upstream_worker, stock_worker_class
from vllm_nixl_lease.adapter.d_worker.engine_reaper import (
    INVALID_BACKOFF_MEMORY_S,
    STEPS_PER_CLOCK_READ,
    EngineReaper,
)

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
