"""The instruction gate (``tools/bench_instr.py``): what fails it, on a perturbed baseline.

``make test-instr`` runs the gate itself under callgrind; these check its verdicts
without valgrind, on the committed baseline."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from tools.bench_instr import TOLERANCE, check
from tools.instr.cases import CASES

BASELINE = Path(__file__).resolve().parents[2] / "bench" / "instr-baseline.json"


def summary_of(baseline: dict) -> dict:
    """A run that counted exactly the baseline's instructions."""
    rows = {}
    for case, row in baseline["rows"].items():
        stock = row["counts"].get("stock")
        ratio = {s: stock / n for s, n in row["counts"].items() if s != "stock" and stock and n}
        rows[case] = {**copy.deepcopy(row), "ratio": ratio}
    return {"rows": rows}


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
