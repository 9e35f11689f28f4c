"""Instructions, not time: ours against stock vLLM 0.33.0's real methods, counted by callgrind.

A given binary on a given input executes the same instructions however loaded
the machine is, so these counts can gate ``make test`` where wall-clock
benchmarks cannot.  Each case (``tools/instr/cases.py``) counts one call per
side: our Cython core, our pure-Python twin, and stock; the measured process
runs under ``valgrind --tool=callgrind`` with instrumentation on only while a
case measures and collection on only around the measured call
(``tools/instr/probe.py`` says why and how).  Worker rows for the twin come
from a second process that imports the twin.

    python -m tools.bench_instr                      # every case, both processes
    python -m tools.bench_instr --gate --check bench/instr-baseline.json
    python -m tools.bench_instr --update bench/instr-baseline.json
    python -m tools.bench_instr --twice              # run twice, report the largest difference

Counts depend on the interpreter build, glibc and the CPU features its
string functions pick: a baseline holds for the machine that wrote it (update
it deliberately, ``make bench-instr-update``, and review its diff).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tools.instr.cases import CASES, Case
from tools.instr.probe import build_marker

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 1.10  # a row fails the gate above this multiple of its baseline
TARGET = 1.0  # stock/ours every row is to reach in its mean step (printed, not enforced: the floors are)
OURS = ("cython", "twin")


def run_process(impl: str, cases: list[int], lib: Path, workdir: Path) -> list[dict[str, Any]]:
    """One measured process under callgrind; returns its records with their counts."""
    out = workdir / impl
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONHASHSEED="0", VLLM_TARGET_DEVICE="cpu")
    env.pop("VLLM_NIXL_LEASE_NO_EXTENSIONS", None)
    if impl == "twin":
        env["VLLM_NIXL_LEASE_NO_EXTENSIONS"] = "1"
    else:
        env["VLLM_NIXL_LEASE_REQUIRE_EXTENSIONS"] = "1"
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--collect-atstart=no",
        "--dump-line=no",
        # Counts per thread: only the main thread's are read, so a library's
        # background thread taking the GIL mid-measurement cannot add to a row.
        "--separate-threads=yes",
        f"--callgrind-out-file={out / 'callgrind.out'}",
        f"--log-file={out / 'valgrind.log'}",
        sys.executable,
        "-m",
        "tools.instr.measure",
        "--lib",
        str(lib),
        "--out",
        str(out),
        "--cases",
        *map(str, cases),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the {impl} process failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    for line in proc.stdout.splitlines():
        if line.startswith(("threads at start:", "case took", "case note:")):
            print(f"  [{impl} process] {line}")
    counts = read_dumps(out)
    records = json.loads((out / "records.json").read_text())["records"]
    for rec in records:
        rec["count"] = counts[rec["label"]]
    return records


def read_dumps(out: Path) -> dict[str, int]:
    """label -> instructions, from callgrind's dumps (``desc: Trigger: Client Request: <label>``)."""
    counts: dict[str, int] = {}
    prefix = "desc: Trigger: Client Request: "
    for path in out.glob("callgrind.out.*-01"):  # thread 1: the main thread
        label = total = None
        with path.open() as f:
            for line in f:
                if line.startswith(prefix):
                    label = line[len(prefix) :].strip()
                elif line.startswith("summary:"):
                    total = int(line.split()[1])
                    break
        if label is not None and total is not None:
            counts[label] = total
    return counts


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per case and side: the median count of its repeats, less the probe's own cost."""
    calibration = [r["count"] for r in records if r["case"] == "calibration"]
    overhead = statistics.median(calibration) if calibration else 0
    by: dict[tuple[str, str], list[float]] = {}
    for r in records:
        if r["case"] == "calibration":
            continue
        by.setdefault((r["case"], r["side"]), []).append(r["count"] - overhead * r["stretches"])
    rows: dict[str, Any] = {}
    meta = {c.name: c for c in CASES}
    for (case, side), values in by.items():
        c = meta.get(case) or Case(case, "parts", "call", 1, lambda probe, env: None)
        row = rows.setdefault(
            case,
            {"group": c.group, "unit": c.unit, "ops": c.ops, "floor": c.floor, "counts": {}, "spread": {}},
        )
        if c.per_step:  # one value per step of an interval: the worst step, and the mean beside it
            row["mean_floor"] = c.mean_floor
            row["counts"][side] = round(max(values))
            row.setdefault("mean", {})[side] = round(statistics.fmean(values))
            row["steps"] = len(values)
        else:
            row["counts"][side] = round(statistics.median(values))
            row["spread"][side] = (max(values) - min(values)) / max(1.0, statistics.median(values))
    for row in rows.values():
        stock = row["counts"].get("stock")
        row["ratio"] = {
            side: stock / n for side, n in row["counts"].items() if side in OURS and stock and n > 0
        }
        if "mean" in row and row["mean"].get("stock"):
            row["mean_ratio"] = {
                side: row["mean"]["stock"] / n for side, n in row["mean"].items() if side in OURS and n > 0
            }
    return {"overhead": overhead, "rows": rows}


def table(summary: dict[str, Any]) -> str:
    lines = [
        f"{'case':<48} {'side':<7} {'instr/call':>14} {'instr/op':>12}  {'op':<6} {'stock/ours':>10}",
    ]
    for case, row in summary["rows"].items():
        for side in ("cython", "twin", "stock"):
            n = row["counts"].get(side)
            if n is None:
                continue
            ratio = row["ratio"].get(side)
            floor = f" (floor {row['floor'][side]:g}x)" if ratio is not None and side in row["floor"] else ""
            label = case if "mean" not in row else f"{case}, worst step"
            lines.append(
                f"{label:<48} {side:<7} {n:>14,} {n / row['ops']:>12,.1f}  {row['unit']:<6} "
                + (f"{ratio:>9.2f}x{floor}" if ratio is not None else "")
                + (f" {mean_verdict(row, side)}" if ratio is not None and "mean" not in row else "")
            )
            if "mean" in row:
                mean_ratio = row.get("mean_ratio", {}).get(side)
                lines.append(
                    f"{'  mean of ' + str(row['steps']) + ' steps':<48} {side:<7} "
                    f"{row['mean'][side]:>14,} {row['mean'][side]:>12,.1f}  {row['unit']:<6} "
                    + (f"{mean_ratio:>9.2f}x {mean_verdict(row, side)}" if mean_ratio is not None else "")
                )
    return "\n".join(lines)


def mean_verdict(row: dict[str, Any], side: str) -> str:
    """Beside a row's mean stock/ours: its floor (what the gate enforces) and
    the target, met or short.  A row with one call per count (no ``mean``) is
    its own mean: its ratio is judged."""
    ratios: dict[str, float] = row.get("mean_ratio", {}) if "mean" in row else row.get("ratio", {})
    ratio = ratios.get(side)
    if ratio is None:
        return ""
    floor = (row.get("mean_floor") or {}).get(side) if "mean" in row else None
    met = "met" if ratio >= TARGET else "short"
    return (f"(floor {floor:g}x) " if floor is not None else "") + f"target {TARGET:g}x: {met}"


def markdown(summary: dict[str, Any]) -> str:
    """The table as docs/BENCHMARKS.md shows it: instructions per call (per op), and stock/ours."""
    lines = [
        "| case | op | cython | twin | stock | stock / cython | stock / twin | "
        f"mean: floor, target {TARGET:g}x |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def cell(row: dict[str, Any], key: str, side: str) -> str:
        n = row.get(key, {}).get(side)
        if n is None:
            return ""
        per = f" ({n / row['ops']:,.0f}/{row['unit']})" if row["ops"] > 1 else ""
        return f"{n:,}{per}"

    for case, row in summary["rows"].items():
        counts_label = case if "mean" not in row else f"{case}, worst step"
        keys: tuple[tuple[str, str], ...] = (("counts", counts_label),)
        if "mean" in row:
            keys += (("mean", f"{case}, mean of {row['steps']} steps"),)
        for key, label in keys:
            ratios = row["ratio"] if key == "counts" else row.get("mean_ratio", {})
            # The mean's verdict on the mean line, or on the only line of a one-call row.
            judged = key == "mean" or "mean" not in row
            verdicts = [f"{s}: {mean_verdict(row, s)}" for s in OURS if judged and mean_verdict(row, s)]
            lines.append(
                f"| {label} | {row['unit']} | {cell(row, key, 'cython')} | {cell(row, key, 'twin')} | "
                f"{cell(row, key, 'stock')} | "
                + " | ".join(f"{ratios[s]:.2f}x" if s in ratios else "" for s in OURS)
                + f" | {'; '.join(verdicts)} |"
            )
    return "\n".join(lines)


def check(summary: dict[str, Any], baseline: dict[str, Any], tolerance: float = TOLERANCE) -> list[str]:
    """What fails the gate: a row of ours above ``tolerance`` x its baseline, a
    ratio to stock below the row's stated floor (worst step, or a one-call
    row's only count), a mean step's ratio below the row's mean floor, a row
    the baseline lacks."""
    failures = []
    base_rows = baseline.get("rows", {})
    for case, row in summary["rows"].items():
        base = base_rows.get(case)
        if base is None:
            failures.append(f"{case}: not in the baseline (make bench-instr-update)")
            continue
        for key, what in (("counts", ""), ("mean", " (mean step)")):
            for side in OURS:
                now, then = row.get(key, {}).get(side), base.get(key, {}).get(side)
                if now is not None and then is not None and now > then * tolerance:
                    failures.append(
                        f"{case} [{side}]{what}: {now:,} instructions, {now / then:.2f}x the baseline's "
                        f"{then:,} (limit {tolerance:g}x)"
                    )
        floors = row.get("floor") or {}
        for side, ratio in row["ratio"].items():
            if side in floors and ratio < floors[side]:
                failures.append(f"{case} [{side}]: {ratio:.2f}x stock, below its floor {floors[side]:g}x")
        mean_floors = row.get("mean_floor") or {}
        for side, ratio in row.get("mean_ratio", {}).items():
            if side in mean_floors and ratio < mean_floors[side]:
                failures.append(
                    f"{case} [{side}] (mean step): {ratio:.2f}x stock, below its mean floor "
                    f"{mean_floors[side]:g}x"
                )
    return failures


def measure(cases: list[int], impls: tuple[str, ...], keep: Path | None = None) -> dict[str, Any]:
    lib = build_marker(ROOT / ".build" / "instr")
    records: list[dict[str, Any]] = []
    workdir = Path(tempfile.mkdtemp(prefix="bench-instr-"))
    try:
        for impl in impls:
            t0 = time.monotonic()
            records += run_process(impl, cases, lib, workdir)
            print(f"  [{impl} process: {time.monotonic() - t0:.0f} s under callgrind]", flush=True)
    finally:
        if keep is not None:
            shutil.copytree(workdir, keep, dirs_exist_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)
    return summarize(records)


def largest_difference(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, str]:
    worst, where = 0.0, ""
    for case, row in a["rows"].items():
        for side, n in row["counts"].items():
            m = b["rows"].get(case, {}).get("counts", {}).get(side)
            if m is None or max(n, m) == 0:
                continue
            diff = abs(n - m) / max(n, m)
            if diff > worst:
                worst, where = diff, f"{case} [{side}]: {n:,} vs {m:,}"
    return worst, where


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gate", action="store_true", help="only the cases make test runs (Cython process only)")
    ap.add_argument("--no-twin", action="store_true", help="skip the twin's process (its core rows stay)")
    ap.add_argument("--cases", nargs="*", default=None, help="only cases whose name contains one of these")
    ap.add_argument("--check", type=Path, help="fail (exit 1) against this baseline")
    ap.add_argument("--update", type=Path, help="write this run as the baseline")
    ap.add_argument("--twice", action="store_true", help="run twice and report the largest difference")
    ap.add_argument("--json", type=Path, default=ROOT / ".build" / "bench-instr.json")
    ap.add_argument("--markdown", type=Path, help="print this result file (--json's) as a Markdown table")
    ap.add_argument("--keep", type=Path, help="keep callgrind's dumps here (callgrind_annotate reads them)")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        return 0
    if shutil.which("valgrind") is None:
        raise SystemExit(
            "valgrind is not installed: `make system-deps` as root, or `sudo apt-get install -y valgrind`"
        )

    selected = [
        i
        for i, c in enumerate(CASES)
        if (not args.gate or c.gate)
        and (args.cases is None or any(s in c.name for s in args.cases))
        and (c.group != "parts" or any("parts" in s for s in args.cases or ()))
    ]
    impls = ("cython",) if args.gate or args.no_twin else ("cython", "twin")
    print(f"counting instructions for {len(selected)} cases ({', '.join(impls)}) under callgrind", flush=True)
    summary = measure(selected, impls, args.keep)
    print(table(summary))
    result: dict[str, Any] = {"cases": [CASES[i].name for i in selected], **summary}
    if args.twice:
        again = measure(selected, impls)
        worst, where = largest_difference(summary, again)
        result["second_run_largest_difference"] = worst
        print(f"second run: largest difference {worst:.4%} ({where or 'none'})")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    status = 0
    if args.update:
        keep = json.loads(args.update.read_text())["rows"] if args.update.exists() else {}
        keep.update(
            {
                case: {key: row[key] for key in ("counts", "mean", "floor", "mean_floor") if key in row}
                for case, row in summary["rows"].items()
            }
        )
        args.update.write_text(
            json.dumps({"tolerance": TOLERANCE, "rows": dict(sorted(keep.items()))}, indent=1) + "\n"
        )
        print(f"baseline written: {args.update}")
    if args.check:
        failures = check(summary, json.loads(args.check.read_text()))
        for f in failures:
            print("FAIL", f)
        print("instruction gate:", "FAILED" if failures else f"passed ({len(summary['rows'])} rows)")
        status = 1 if failures else 0
    return status


if __name__ == "__main__":
    raise SystemExit(main())
