"""``make bench-fleet``'s parts: the split of D's CPU per step (``tools/bench_fleet.d_parts``)
and the P fleet's lease."""

from __future__ import annotations

import math

from tools.bench_fleet import d_cpu_ratios, d_parts


def step(worker_cpu: float, sched_cpu: float, sends: int, notifs: int, send_cpu: float) -> tuple:
    """A step-log tuple (``harness/nixl/engine.py``) with only the fields the split reads."""
    fields = [0.0] * 17
    fields[3], fields[7], fields[10], fields[12], fields[16] = notifs, worker_cpu, sched_cpu, sends, send_cpu
    return tuple(fields)


def test_split_by_what_the_step_did() -> None:
    steps = [
        step(300e-6, 80e-6, 1, 0, 150e-6),  # sends
        step(100e-6, 50e-6, 0, 0, 0.0),  # quiet
        step(210e-6, 50e-6, 0, 1, 0.0),  # takes an answer
        step(400e-6, 90e-6, 1, 1, 160e-6),  # sends and takes an answer: only in the sending figures
    ]
    parts = d_parts(steps)
    assert parts["sending_steps_pct"] == 50.0
    # nearest-rank p50 of two values: the lower one
    assert math.isclose(parts["send_cpu_p50_us"], 150.0)
    assert math.isclose(parts["cpu_p50_sending_us"], 380.0)
    assert math.isclose(parts["cpu_p50_not_sending_us"], 150.0)
    assert math.isclose(parts["worker_cpu_p50_no_notif_us"], 100.0)
    assert math.isclose(parts["worker_cpu_p50_one_notif_us"], 210.0)


def test_no_steps_of_a_kind_is_not_a_number() -> None:
    parts = d_parts([step(100e-6, 50e-6, 0, 0, 0.0)])
    assert parts["sending_steps_pct"] == 0.0
    assert math.isnan(parts["send_cpu_p50_us"]) and math.isnan(parts["worker_cpu_p50_one_notif_us"])


def test_the_p_fleet_heartbeats_at_its_own_lease() -> None:
    """`--lease` reaches the P fleet's pacing: D's interval is upstream's d // 6 of that lease."""
    from harness.nixl.pfleet import PFleet

    fleet = PFleet(p=None, ds=[], stock=False)  # type: ignore[arg-type]
    assert fleet.heartbeat_interval == 1
    fleet.lease = 30
    assert fleet.heartbeat_interval == 5


def d_run(run: int, impl: str, cpu_p99_us: float, leases: int = 100_000) -> dict:
    return {"scenario": "d_fleet", "leases": leases, "impl": impl, "run": run, "cpu_p99_us": cpu_p99_us}


def test_d_cpu_ratios_are_judged_on_the_median_of_the_runs() -> None:
    runs = [
        d_run(0, "stock", 11_500.0),
        d_run(0, "ours", 404.0),  # 28.5x
        d_run(1, "stock", 11_100.0),
        d_run(1, "ours", 520.0),  # 21.3x
        d_run(2, "stock", 11_300.0),
        d_run(2, "ours", 615.0),  # 18.4x
        d_run(0, "stock", 150.0, leases=0),  # the floor: not a ratio
        d_run(0, "ours", 130.0, leases=0),
    ]
    (line,) = d_cpu_ratios(runs)
    assert "28.5x, 21.3x, 18.4x by run" in line
    assert "median 21.3x: met" in line and "2 of 3 runs" in line and "--d-repeat" not in line


def test_one_run_below_the_target_is_not_met_and_asks_for_more_runs() -> None:
    (line,) = d_cpu_ratios([d_run(0, "stock", 11_300.0), d_run(0, "ours", 615.0)])
    assert "median 18.4x: NOT met" in line and "0 of 1" in line and "--d-repeat 3" in line
    assert d_cpu_ratios([d_run(0, "ours", 615.0)]) == []  # no stock run: no ratio
