"""The connector's own time per step: one sample per step and side, shipped in batches, observed in
`vllm:nixl_lease_connector_step_seconds{side=...}`, for ours and for stock timed the same way."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import prometheus_client
import pytest
from vllm_support import fake_request, make_kv_cache_config, shared_vllm_config

from vllm_nixl_lease.adapter import step_time
from vllm_nixl_lease.adapter.connector import (
    LeaseNixlPullConnector,
    LeaseNixlPushConnector,
    StepTimedNixlConnector,
)
from vllm_nixl_lease.adapter.stats import STEP_TIME_KEYS, STEP_TIME_METRIC, LeaseKVConnectorStats
from vllm_nixl_lease.adapter.step_time import STEP_FLUSH, ConnectorStepTimer

LABELS = {"model_name": "tiny", "engine": "0"}


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _FakeFacade:
    """Stands in for vLLM's facade: each hook costs a known time on the patched clock."""

    def __init__(self, clock: _Clock, worker_stats: Any = None) -> None:
        self.clock = clock
        self.connector_scheduler = None  # worker side
        self.worker_stats = worker_stats

    def start_load_kv(self, _ctx: object) -> None:
        self.clock.now += 3e-6

    def get_transfer_results(self, _finished: set[str]) -> None:
        self.clock.now += 2e-6
        self.get_finished(set())  # a hook calling a hook: timed once

    def get_finished(self, _finished: set[str]) -> None:
        self.clock.now += 1e-6

    def get_kv_connector_stats(self) -> Any:
        self.clock.now += 4e-6
        stats, self.worker_stats = self.worker_stats, None
        return stats


class _Timed(ConnectorStepTimer, _FakeFacade):
    pass


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(step_time, "perf_counter", c)
    return c


def _step(conn: _Timed) -> Any:
    conn.start_load_kv(None)
    conn.get_transfer_results(set())
    return conn.get_kv_connector_stats()


def test_one_sample_per_step_shipped_every_flush(clock: _Clock) -> None:
    conn = _Timed(clock)
    for _ in range(STEP_FLUSH - 1):
        assert _step(conn) is None  # quiet steps: nothing ships
    stats = _step(conn)
    assert isinstance(stats, LeaseKVConnectorStats) and not stats.is_empty()
    samples = stats.data[STEP_TIME_KEYS["worker"]]
    assert samples == pytest.approx([10e-6] * STEP_FLUSH)  # 3 + (2 + 1) + 4 us, the nested hook once
    assert not stats.data[STEP_TIME_KEYS["scheduler"]]
    assert stats.reduce()["Mean connector step, worker (us)"] == 10.0  # the periodic log line
    assert _step(conn) is None  # the batch went out whole


def test_samples_ride_along_with_stock_stats(clock: _Clock) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    stock = NixlKVConnectorStats()
    stock.record_kv_expired_req()
    conn = _Timed(clock)
    assert _step(conn) is None
    conn.worker_stats = stock
    stats = _step(conn)
    assert isinstance(stats, LeaseKVConnectorStats)  # adopted: the scheduler aggregates ours
    assert stats.data["num_kv_expired_reqs"] == [1]
    assert len(stats.data[STEP_TIME_KEYS["worker"]]) == 2


@pytest.mark.parametrize("cls", [LeaseNixlPullConnector, StepTimedNixlConnector])
def test_scheduler_side_of_the_real_facades(cls: type, tmp_path_factory: pytest.TempPathFactory) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    vc = shared_vllm_config(tmp_path_factory.mktemp("cfg"), {"step_time_metric": True}, role="kv_consumer")
    with set_current_vllm_config(vc):
        conn = cls(vc, KVConnectorRole.SCHEDULER, make_kv_cache_config())
    assert isinstance(conn, cls) and isinstance(conn, ConnectorStepTimer)
    for i in range(STEP_FLUSH):
        conn.on_new_request(fake_request(f"r{i}"))
        stats = conn.get_kv_connector_stats()
    assert isinstance(stats, LeaseKVConnectorStats)
    samples = stats.data[STEP_TIME_KEYS["scheduler"]]
    assert len(samples) == STEP_FLUSH and all(s > 0 for s in samples)
    assert not stats.data[STEP_TIME_KEYS["worker"]]
    # The round trip the engine core makes to the metrics process.
    assert not cls.build_kv_connector_stats(data=stats.to_dict()).is_empty()


def test_prometheus_histogram_per_side() -> None:
    registry = prometheus_client.CollectorRegistry()
    types = {
        c: functools.partial(c, registry=registry)
        for c in (prometheus_client.Gauge, prometheus_client.Counter, prometheus_client.Histogram)
    }

    class FakeVllmConfig:
        kv_transfer_config = None

    engines = {0: list(LABELS.values())}
    prom = StepTimedNixlConnector.build_prom_metrics(FakeVllmConfig(), types, list(LABELS), engines)
    stats = LeaseKVConnectorStats()
    stats.data[STEP_TIME_KEYS["scheduler"]].extend([2e-5, 3e-5])
    stats.data[STEP_TIME_KEYS["worker"]].append(1e-3)
    prom.observe(stats.data, 0)
    count, total = f"{STEP_TIME_METRIC}_count", f"{STEP_TIME_METRIC}_sum"
    assert registry.get_sample_value(count, {**LABELS, "side": "scheduler"}) == 2
    assert registry.get_sample_value(total, {**LABELS, "side": "scheduler"}) == pytest.approx(5e-5)
    assert registry.get_sample_value(count, {**LABELS, "side": "worker"}) == 1


@pytest.mark.parametrize("timed", [False, True])
@pytest.mark.parametrize("cls", [LeaseNixlPullConnector, LeaseNixlPushConnector])
def test_our_connectors_time_their_steps_only_when_asked(
    cls: type, timed: bool, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    extra = {"step_time_metric": True} if timed else {}
    vc = shared_vllm_config(tmp_path_factory.mktemp("cfg"), extra, role="kv_consumer")
    with set_current_vllm_config(vc):
        conn = cls(vc, KVConnectorRole.SCHEDULER, make_kv_cache_config())
    assert isinstance(conn, cls)
    assert isinstance(conn, ConnectorStepTimer) is timed
    # Untimed, the hook vLLM calls is vLLM's facade's own: no frame around it.
    assert type(conn).build_connector_meta.__module__.startswith("vllm.") is not timed
    for i in range(STEP_FLUSH):
        conn.on_new_request(fake_request(f"r{i}"))
        conn.build_connector_meta(SimpleNamespace())
        stats = conn.get_kv_connector_stats()
    samples = stats.data.get(STEP_TIME_KEYS["scheduler"], []) if stats is not None else []
    assert len(samples) == (STEP_FLUSH if timed else 0)


def test_a_subclass_of_ours_keeps_its_own_class(tmp_path_factory: pytest.TempPathFactory) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    class Mine(LeaseNixlPullConnector):
        pass

    vc = shared_vllm_config(tmp_path_factory.mktemp("cfg"), {"step_time_metric": True}, role="kv_consumer")
    with set_current_vllm_config(vc):
        conn = Mine(vc, KVConnectorRole.SCHEDULER, make_kv_cache_config())
    assert type(conn) is Mine  # the metric is for our own classes; a subclass adds the timer itself


def test_bound_hooks_call_the_next_facade_in_the_mro(clock: _Clock) -> None:
    class Middle(_FakeFacade):
        def start_load_kv(self, _ctx: object) -> None:
            self.clock.now += 5e-6
            super().start_load_kv(_ctx)

    class Timed(ConnectorStepTimer, Middle):
        pass

    conn = Timed(clock)
    assert Timed.start_load_kv.__name__ == "start_load_kv" and "start_load_kv" in vars(Timed)
    conn.start_load_kv(None)
    conn.get_transfer_results(set())
    conn.get_kv_connector_stats()
    assert conn._step_samples == pytest.approx([(5 + 3 + 2 + 1 + 4) * 1e-6])
