"""The instruction gate (``tools/bench_instr.py``): what fails it, on a perturbed baseline.

``make test-instr`` runs the gate itself under callgrind; these check its verdicts
without valgrind, on the committed baseline."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from tools.bench_instr import TARGET, TOLERANCE, check, markdown, mean_verdict, table
from tools.instr.cases import CASES

BASELINE = Path(__file__).resolve().parents[2] / "bench" / "instr-baseline.json"


def summary_of(baseline: dict) -> dict:
    """A run that counted exactly the baseline's instructions, with the floors
    the cases state now (as ``summarize`` takes them)."""
    cases = {c.name: c for c in CASES}
    rows = {}
    for case, row in baseline["rows"].items():
        stock = row["counts"].get("stock")
        ratio = {s: stock / n for s, n in row["counts"].items() if s != "stock" and stock and n}
        rows[case] = {**copy.deepcopy(row), "ratio": ratio, "ops": 1, "unit": "step"}
        if "mean" in row:
            mean_stock = row["mean"].get("stock")
            rows[case]["steps"] = 250
            rows[case]["mean_ratio"] = {
                s: mean_stock / n for s, n in row["mean"].items() if s != "stock" and mean_stock and n
            }
            if case in cases:
                rows[case]["mean_floor"] = dict(cases[case].mean_floor)
    return {"rows": rows}


def per_step_row(summary: dict) -> tuple[str, dict]:
    return next((k, r) for k, r in summary["rows"].items() if r.get("mean_floor", {}).get("cython"))


def test_baseline_covers_every_gate_row() -> None:
    baseline = json.loads(BASELINE.read_text())
    gate = {c.name for c in CASES if c.gate}
    assert gate <= baseline["rows"].keys()
    assert baseline["tolerance"] == TOLERANCE
    for case in gate:
        assert baseline["rows"][case]["counts"].get("cython"), case


def test_the_baseline_itself_passes() -> None:
    baseline = json.loads(BASELINE.read_text())
    summary = summary_of(baseline)
    assert check(summary, baseline) == [], "a row's ratio is below its floor in the baseline itself"


def test_a_slower_row_fails_and_a_slightly_slower_one_passes() -> None:
    baseline = json.loads(BASELINE.read_text())
    case = next(c.name for c in CASES if c.gate)
    summary = summary_of(baseline)
    row = summary["rows"][case]
    row["counts"]["cython"] = round(row["counts"]["cython"] * (TOLERANCE - 0.02))
    assert check(summary, baseline) == []
    row["counts"]["cython"] = round(baseline["rows"][case]["counts"]["cython"] * (TOLERANCE + 0.02))
    failures = check(summary, baseline)
    assert len(failures) == 1 and case in failures[0] and "cython" in failures[0]


def test_a_ratio_below_its_floor_fails() -> None:
    baseline = json.loads(BASELINE.read_text())
    summary = summary_of(baseline)
    case, row = next((k, r) for k, r in summary["rows"].items() if r.get("floor", {}).get("cython"))
    row["ratio"]["cython"] = row["floor"]["cython"] * 0.9
    failures = check(summary, baseline)
    assert failures and "below its floor" in failures[0] and case in failures[0]


def test_a_row_missing_from_the_baseline_fails() -> None:
    baseline = json.loads(BASELINE.read_text())
    summary = summary_of(baseline)
    summary["rows"]["a row nobody measured before"] = {"counts": {"cython": 1}, "ratio": {}}
    assert any("not in the baseline" in f for f in check(summary, baseline))


def test_every_per_step_case_states_a_mean_floor() -> None:
    """A row stepping through an interval is judged on its mean too, not only its worst step."""
    missing = [c.name for c in CASES if c.per_step and not c.mean_floor]
    assert not missing, f"per-step cases without a mean_floor: {missing}"


def test_a_mean_below_its_mean_floor_fails_though_the_worst_step_passes() -> None:
    baseline = json.loads(BASELINE.read_text())
    summary = summary_of(baseline)
    case, row = per_step_row(summary)
    floor = row["mean_floor"]["cython"]
    row["mean_ratio"]["cython"] = floor * 1.01
    assert check(summary, baseline) == []
    row["mean_ratio"]["cython"] = floor * 0.9
    failures = check(summary, baseline)
    assert len(failures) == 1
    assert case in failures[0] and "(mean step)" in failures[0] and "below its mean floor" in failures[0]


def test_a_slower_mean_step_fails_against_the_baseline() -> None:
    baseline = json.loads(BASELINE.read_text())
    summary = summary_of(baseline)
    case, row = per_step_row(summary)
    row["mean"]["cython"] = round(baseline["rows"][case]["mean"]["cython"] * (TOLERANCE + 0.02))
    failures = check(summary, baseline)
    assert len(failures) == 1 and "(mean step)" in failures[0] and "the baseline's" in failures[0]


def test_the_target_is_printed_met_or_short() -> None:
    """The table says plainly which rows do not reach stock's mean yet, beside their floor."""
    short = {"mean": {"cython": 4, "stock": 1}, "mean_ratio": {"cython": 0.25}, "mean_floor": {"cython": 0.2}}
    assert mean_verdict(short, "cython") == f"(floor 0.2x) target {TARGET:g}x: short"
    one_call = {"counts": {"cython": 1, "stock": 3}, "ratio": {"cython": 3.0}}
    assert mean_verdict(one_call, "cython") == f"target {TARGET:g}x: met"
    assert mean_verdict(one_call, "twin") == ""
    baseline = json.loads(BASELINE.read_text())
    summary = summary_of(baseline)
    case, row = per_step_row(summary)
    text, md = table(summary), markdown(summary)
    mean_line = next(line for line in md.splitlines() if line.startswith(f"| {case}, mean of"))
    assert "target 1x: short" in mean_line and f"(floor {row['mean_floor']['cython']:g}x)" in mean_line
    assert "target 1x: short" in text
