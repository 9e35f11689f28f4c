"""Idle P: an empty step that only holds unread leases pauses briefly instead of spinning."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from vllm_support import (
    STOCK_PULL_WORKER,
    Clock,
    make_kv_cache_config,
    make_worker,
    p_meta,
    shared_vllm_config,
)

from vllm_nixl_lease._wire import heartbeat_message
from vllm_nixl_lease.adapter.metadata import LEASE_IDLE_ATTR, LeaseConnectorMetadata, executor_pickles
from vllm_nixl_lease.adapter.schedulers import LeaseNixlPullConnectorScheduler
from vllm_nixl_lease.adapter.workers import LeaseNixlPullConnectorWorker

LEASE = 30


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    out: list[float] = []
    monkeypatch.setattr(time, "sleep", out.append)
    return out


def test_scheduler_marks_empty_steps_idle(tmp_path_factory, clock: Clock) -> None:
    from vllm.config import set_current_vllm_config

    root = tmp_path_factory.mktemp("idle")
    vc = shared_vllm_config(root, {"kv_lease_duration": LEASE, "idle_step_sleep_ms": 1})
    with set_current_vllm_config(vc):
        sched = LeaseNixlPullConnectorScheduler(vc, "p-engine", make_kv_cache_config())
    assert getattr(sched.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0)), LEASE_IDLE_ATTR)
    assert not getattr(
        sched.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=5)), LEASE_IDLE_ATTR
    )
    assert not getattr(sched.build_connector_meta(SimpleNamespace()), LEASE_IDLE_ATTR)  # unknown: not idle
    # With the pause off (the default) no step carries the flag: nothing reads it.
    off = shared_vllm_config(root, {"kv_lease_duration": LEASE})
    with set_current_vllm_config(off):
        sched = LeaseNixlPullConnectorScheduler(off, "p-engine", make_kv_cache_config())
    meta = sched.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0))
    assert not hasattr(meta, LEASE_IDLE_ATTR)


def test_metadata_class_is_swapped_only_where_the_executor_pickles_it(
    tmp_path_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compact pickle costs a class swap per step; vLLM's in-process
    executors (uniprocess, external launcher) never pickle the metadata."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

    vc = shared_vllm_config(tmp_path_factory.mktemp("exec"), {"kv_lease_duration": LEASE})
    for backend, pickled in (("mp", True), ("ray", True), ("uni", False), ("external_launcher", False)):
        monkeypatch.setattr(vc.parallel_config, "distributed_executor_backend", backend)
        assert executor_pickles(vc) is pickled
        with set_current_vllm_config(vc):
            sched = LeaseNixlPullConnectorScheduler(vc, "d-engine", make_kv_cache_config())
        meta = sched.build_connector_meta(SimpleNamespace())
        assert type(meta) is (LeaseConnectorMetadata if pickled else NixlConnectorMetadata), backend
    assert executor_pickles(SimpleNamespace()) is True  # unknown: assume it pickles


@pytest.fixture
def p_worker(clock: Clock, monkeypatch: pytest.MonkeyPatch):
    """Our P worker; the stock step body reduced to what the lease path does."""

    def stock_results(self):
        done = self._get_new_notifs()
        self._reap_expired_send_leases(done)
        return SimpleNamespace(finished_sending=done, finished_recving=set(), failed_recving=set())

    monkeypatch.setattr(STOCK_PULL_WORKER, "get_transfer_results", stock_results)
    monkeypatch.setattr(STOCK_PULL_WORKER, "start_load_kv", lambda self, meta: None)

    def make(extra: dict | None = None):
        worker = make_worker(LeaseNixlPullConnectorWorker, LEASE, extra or {"idle_step_sleep_ms": 1})
        worker._reqs_to_process.add("r1")
        worker._reqs_to_send["r1"] = clock.now + LEASE  # an unread lease
        return worker

    return make


def _step(worker, clock: Clock, idle: bool = True):
    meta = p_meta(clock)
    setattr(meta, LEASE_IDLE_ATTR, idle)
    worker.start_load_kv(meta)
    return worker.get_transfer_results()


def test_idle_step_holding_leases_pauses(p_worker, clock: Clock, sleeps: list[float]) -> None:
    worker = p_worker()
    _step(worker, clock)
    assert sleeps == [0.001]
    _step(worker, clock, idle=False)  # tokens scheduled: no pause
    assert sleeps == [0.001]


def test_pause_never_passes_the_next_deadline(p_worker, clock: Clock, sleeps: list[float]) -> None:
    worker = p_worker()
    clock.advance(LEASE - 0.0004)
    _step(worker, clock)
    assert sleeps == [pytest.approx(0.0004)]


def test_no_pause_when_something_happened(p_worker, clock: Clock, sleeps: list[float]) -> None:
    worker = p_worker()
    worker.nixl_wrapper.deliver("d-agent", heartbeat_message(["r1"]))  # a notification this step
    _step(worker, clock)
    worker.nixl_wrapper.deliver("d-agent", b"r1:1")  # the read completes: the lease ends
    res = _step(worker, clock)
    assert res.finished_sending == {"r1"}
    _step(worker, clock)  # nothing held any more: the engine will block on its own
    assert sleeps == []


def test_no_pause_with_a_read_in_flight_or_when_off(p_worker, clock: Clock, sleeps: list[float]) -> None:
    worker = p_worker()
    worker._recving_transfers["d1"].append(7)
    _step(worker, clock)
    off = p_worker({"idle_step_sleep_ms": 0})
    _step(off, clock)
    assert sleeps == []
