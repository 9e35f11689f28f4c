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


# -- the common regime: D with churn, P at small fleets ------------------------------------
def regime_step(cpu: float, sched_cpu: float = 0.0, sends: int = 0) -> tuple:
    fields = [0.0] * 17
    fields[7], fields[10], fields[12] = cpu, sched_cpu, sends
    return tuple(fields)


def test_regime_row_gives_the_connector_cpu_per_step_and_the_sending_share() -> None:
    from tools.bench_fleet import regime_row

    steps = [regime_step(100e-6, 20e-6), regime_step(200e-6, 40e-6, sends=2)]
    steps += [regime_step(60e-6, 0.0) for _ in range(2)]
    h = {"steps": steps, "expired": 0, "errors": [], "handed": 40, "read": 38}
    row = regime_row("d_churn", 1000, h, "ours")
    assert row["steps"] == 4 and row["leases"] == 1000
    assert math.isclose(row["cpu_mean_us"], 120.0)  # (120 + 240 + 60 + 60) / 4
    assert math.isclose(row["cpu_p50_us"], 60.0) and math.isclose(row["cpu_p99_us"], 240.0)
    assert row["sending_steps_pct"] == 25.0
    assert (row["handed"], row["read"]) == (40, 38)
    p_row = regime_row("p_common", "10/30s", {"steps": steps, "expired": 0, "errors": []}, "stock")
    assert "handed" not in p_row and p_row["leases"] == "10/30s"


def regime_run(
    run: int, impl: str, scenario: str, key: object, mean: float, p99: float, sending: float
) -> dict:
    return {
        "scenario": scenario,
        "leases": key,
        "impl": impl,
        "run": run,
        "cpu_mean_us": mean,
        "cpu_p50_us": mean,
        "cpu_p99_us": p99,
        "sending_steps_pct": sending,
    }


def test_regime_ratios_are_judged_on_the_median_of_back_to_back_runs() -> None:
    from tools.bench_fleet import regime_ratios

    runs = []
    for run, (ours_mean, ours_p99) in enumerate([(100.0, 400.0), (80.0, 200.0), (120.0, 300.0)]):
        runs.append(regime_run(run, "stock", "p_common", "10/30s", 100.0, 300.0, 0.0))
        runs.append(regime_run(run, "ours", "p_common", "10/30s", ours_mean, ours_p99, 0.5 + run))
    (line,) = regime_ratios(runs)
    assert line.startswith("p_common 10/30s")
    assert "mean 1.00x, 1.25x, 0.83x (median 1.00x >= 1x: met)" in line
    assert "p99 0.75x, 1.50x, 1.00x (median 1.00x >= 1x: met)" in line
    assert "sending steps ours 1.5%, stock 0.0% (ours <= 1%: NOT met)" in line


def test_regime_targets_follow_the_scenario_and_lease() -> None:
    """P's p99 is held to stock only at the 30 s lease; D with churn in mean and p99."""
    from tools.bench_fleet import regime_ratios

    runs = [
        regime_run(0, "stock", "p_common", "100/6s", 100.0, 300.0, 0.0),
        regime_run(0, "ours", "p_common", "100/6s", 110.0, 600.0, 12.0),
        regime_run(0, "stock", "d_churn", 100, 40.0, 90.0, 2.0),
        regime_run(0, "ours", "d_churn", 100, 50.0, 60.0, 4.0),
        regime_run(1, "ours", "d_churn", 100, 50.0, 60.0, 4.0),  # no stock beside it: not a ratio
    ]
    p_line, d_line = regime_ratios(runs)
    assert "p99 0.50x (median 0.50x)" in p_line and "mean 0.91x (median 0.91x >= 1x: NOT met)" in p_line
    assert "ours <=" not in p_line  # the sending share is held at the 30 s lease only
    assert d_line.startswith("d_churn 100") and "p99 1.50x (median 1.50x >= 1x: met)" in d_line
    assert "mean 0.80x (median 0.80x >= 1x: NOT met)" in d_line and "p50 0.80x (median 0.80x)" in d_line


def test_the_common_regime_arguments() -> None:
    import pytest

    from tools.bench_fleet import SCENARIOS, parse_args

    args = parse_args([])
    assert args.d_churn == [100, 1000, 10_000] and args.churn_per_step == 10
    assert args.regime_leases == [10, 100] and args.regime_lease == [6, 30]
    assert {"d_churn", "p_common"} <= set(args.scenarios) <= set(SCENARIOS)
    args = parse_args(["--scenarios", "d_churn", "--d-churn", "100", "--churn-p", "2", "--churn-hold", "3"])
    assert (args.scenarios, args.d_churn, args.churn_p, args.churn_hold) == (["d_churn"], [100], 2, 3.0)
    bad_args = (["--d-churn", "0"], ["--churn-per-step", "0"], ["--regime-lease", "0"], ["--churn-hold", "0"])
    for bad in bad_args:
        with pytest.raises(SystemExit):
            parse_args(bad)
