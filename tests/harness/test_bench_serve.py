"""tools/bench_serve.py's arithmetic and table, without servers."""

from __future__ import annotations

import math
import os

from tools import bench_serve as bs

SCRAPE = """# HELP vllm:nixl_lease_connector_step_seconds ...
vllm:nixl_lease_connector_step_seconds_bucket{engine="0",le="1e-05",model_name="tiny",side="worker"} 1.0
vllm:nixl_lease_connector_step_seconds_sum{engine="0",model_name="tiny",side="worker"} 0.004
vllm:nixl_lease_connector_step_seconds_count{engine="0",model_name="tiny",side="worker"} 100.0
vllm:nixl_lease_connector_step_seconds_sum{engine="0",model_name="tiny",side="scheduler"} 0.002
vllm:nixl_lease_connector_step_seconds_count{engine="0",model_name="tiny",side="scheduler"} 100.0
vllm:nixl_lease_route_time_seconds_sum{engine="0",model_name="tiny"} 9.0
"""


def test_step_times_per_side_and_mean_per_step() -> None:
    before = bs.step_times(SCRAPE)
    assert before == {"worker": (0.004, 100.0), "scheduler": (0.002, 100.0)}
    after_text = SCRAPE.replace("} 0.004", "} 0.010").replace('side="worker"} 100.0', 'side="worker"} 300.0')
    after = bs.step_times(after_text)
    assert math.isclose(bs.per_step_us(before, after, "worker"), 30.0)  # 6 ms over 200 steps
    assert math.isnan(bs.per_step_us(before, after, "scheduler"))  # no step in between
    assert math.isnan(bs.per_step_us({}, bs.step_times(""), "worker"))  # a stock connector without it


def test_spread_leaves_out_missing_values() -> None:
    assert bs.spread([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    assert bs.spread([float("nan"), 4.0]) == (4.0, 4.0, 4.0)
    assert all(math.isnan(v) for v in bs.spread([float("nan")]))


def test_table_side_by_side_with_spread_and_ratio() -> None:
    def run(tput: float, d_cpu: float) -> dict[str, float]:
        return {"output_throughput": tput, "d_cpu_per_1k": d_cpu, "failed": 0.0}

    text = bs.table(
        {"stock": [run(100, 2.0), run(110, 2.2), run(90, 1.8)], "ours": [run(99, 1.0), run(101, 1.2)]}
    )
    lines = text.splitlines()
    assert "stock (n=3)" in lines[0] and "ours (n=2)" in lines[0] and "ours/stock" in lines[0]
    tput = next(line for line in lines if line.startswith("output throughput"))
    assert "100.0 [90.0-110.0]" in tput and "100.0 [99.0-101.0]" in tput and tput.endswith("1.00")
    d_cpu = next(line for line in lines if line.startswith("D CPU"))
    assert d_cpu.endswith("0.55")  # 1.1 / 2.0
    ttft = next(line for line in lines if line.startswith("TTFT p99"))
    assert ttft.split()[-1] == "-"  # no run measured it: no ratio invented
    assert len(lines) == 1 + len(bs.ROWS)


def test_tree_cpu_counts_this_process() -> None:
    t0 = bs.tree_cpu_s(os.getpid())
    end = os.times().user + 0.05
    while os.times().user < end:  # spin 50 ms of user time
        pass
    assert bs.tree_cpu_s(os.getpid()) - t0 >= 0.03


def test_slow_steps_are_those_above_the_bucket_per_side() -> None:
    text = """vllm:nixl_lease_connector_step_seconds_bucket{engine="0",le="0.01",side="worker"} 90.0
vllm:nixl_lease_connector_step_seconds_bucket{engine="0",le="0.05",side="worker"} 97.0
vllm:nixl_lease_connector_step_seconds_bucket{engine="0",le="0.1",side="worker"} 99.0
vllm:nixl_lease_connector_step_seconds_count{engine="0",side="worker"} 100.0
vllm:nixl_lease_connector_step_seconds_bucket{engine="0",le="0.05",side="scheduler"} 100.0
vllm:nixl_lease_connector_step_seconds_count{engine="0",side="scheduler"} 100.0
vllm:nixl_lease_connector_step_seconds_bucket{engine="1",le="0.05",side="worker"} 10.0
vllm:nixl_lease_connector_step_seconds_count{engine="1",side="worker"} 11.0
"""
    assert bs.slow_steps(text) == {"worker": 4.0, "scheduler": 0.0}
    assert bs.slow_steps("") == {}


def test_slow_token_intervals_per_thousand() -> None:
    result = {"itls": [[0.02] * 499 + [0.15], [0.03] * 499 + [0.101]]}
    assert math.isclose(bs.slow_itls_per_1k(result), 2.0)
    assert math.isnan(bs.slow_itls_per_1k({"itls": []}))
    assert math.isnan(bs.slow_itls_per_1k({}))  # a result saved without --save-detailed
