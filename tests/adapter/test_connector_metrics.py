"""Lease metrics flow through vLLM's connector stats and Prometheus hooks."""

from __future__ import annotations

import functools

import prometheus_client
from vllm_support import Clock, make_worker, p_idle, p_meta, p_step

from vllm_nixl_lease._wire import heartbeat_message
from vllm_nixl_lease.adapter.connector import LeaseNixlPullConnector
from vllm_nixl_lease.adapter.stats import LEASE_COUNTERS, LeaseKVConnectorStats
from vllm_nixl_lease.adapter.workers import LeaseNixlPullConnectorWorker

LABELS = {"model_name": "tiny", "engine": "0"}


def _prom(registry: prometheus_client.CollectorRegistry):
    types = {
        cls: functools.partial(cls, registry=registry)
        for cls in (prometheus_client.Gauge, prometheus_client.Counter, prometheus_client.Histogram)
    }

    class FakeVllmConfig:
        kv_transfer_config = None

    per_engine = {0: list(LABELS.values())}
    return LeaseNixlPullConnector.build_prom_metrics(FakeVllmConfig(), types, list(LABELS), per_engine)


def _one_busy_step(clock: Clock) -> LeaseKVConnectorStats:
    worker = make_worker(LeaseNixlPullConnectorWorker, 12)
    p_step(worker, p_meta(clock, in_batch=("a", "b", "c"), to_send=dict.fromkeys("abc", 12)))
    worker.nixl_wrapper.deliver("d", heartbeat_message(["a", "b", "zz"]), b"c:1", b"junk")
    assert p_step(worker) == {"c"}  # read by D
    # the heartbeat (extension 8) did not outlast the grant
    assert p_idle(worker, clock, 12, step_s=4) == {"a", "b"}  # expired
    stats = worker.get_kv_connector_stats()
    assert stats is not None
    return stats


def test_stats_keep_upstream_keys_and_add_lease_ones(clock: Clock) -> None:
    stats = _one_busy_step(clock)
    assert isinstance(stats, LeaseKVConnectorStats)
    data = stats.data
    assert len(data["num_kv_expired_reqs"]) == 2  # upstream's counter
    assert sum(data["num_leases_granted"]) == 3
    assert sum(data["num_heartbeat_msgs_recv"]) == 1
    assert sum(data["num_heartbeat_ids_recv"]) == 3
    assert sum(data["num_heartbeat_ids_unknown"]) == 1
    assert sum(data["num_malformed_notifs"]) == 1
    assert data["active_leases"][-1] == [0, 0]
    assert data["lease_route_time"] and data["lease_sweep_time"]
    reduced = stats.reduce()
    assert reduced["Num KV expired reqs"] == 2 and reduced["Num leases granted"] == 3
    # Round trip through the connector's stats builder, as the logger does.
    rebuilt = LeaseNixlPullConnector.build_kv_connector_stats(data=stats.to_dict())
    assert not rebuilt.is_empty()


def test_prometheus_metrics_registered_and_observed(clock: Clock) -> None:
    registry = prometheus_client.CollectorRegistry()
    prom = _prom(registry)
    stats = _one_busy_step(clock)
    prom.observe(stats.data, 0)
    assert registry.get_sample_value("vllm:nixl_num_kv_expired_reqs_total", LABELS) == 2
    assert registry.get_sample_value("vllm:nixl_lease_granted_total", LABELS) == 3
    assert registry.get_sample_value("vllm:nixl_lease_heartbeat_ids_unknown_total", LABELS) == 1
    assert registry.get_sample_value("vllm:nixl_lease_malformed_notifications_total", LABELS) == 1
    assert registry.get_sample_value("vllm:nixl_lease_active", LABELS) == 0
    assert registry.get_sample_value("vllm:nixl_lease_sweep_time_seconds_count", LABELS) >= 1
    for name, _ in LEASE_COUNTERS.values():
        assert registry.get_sample_value(name + "_total", LABELS) is not None


def test_prometheus_accepts_stock_worker_stats() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    registry = prometheus_client.CollectorRegistry()
    stock = NixlKVConnectorStats()
    stock.record_kv_expired_req()
    _prom(registry).observe(stock.data, 0)
    assert registry.get_sample_value("vllm:nixl_num_kv_expired_reqs_total", LABELS) == 1


def test_idle_steps_do_not_ship_stats(clock: Clock) -> None:
    worker = make_worker(LeaseNixlPullConnectorWorker, 12)
    p_step(worker, p_meta(clock, in_batch=("a",), to_send={"a": 12}))
    assert worker.get_kv_connector_stats() is not None  # grant + gauge change
    for _ in range(5):
        clock.advance(1)
        p_step(worker)
    assert worker.get_kv_connector_stats() is None  # only sweep timings: ride along later
