"""Quiet steps in thread CPU time with cold caches: ours against stock vLLM 0.33.0, in-process.

The instruction table (``make bench-instr``) says what a step executes; this
says what it costs once the caches have been evicted, as they are between two
steps of a real engine.  It runs the instruction cases (``tools/instr/cases.py``:
real schedulers and workers, fake NIXL, the clock held) in this process,
timing each call with ``time.thread_time_ns`` after rewriting a 32 MiB buffer
(``tools/instr/cold.py``).  Each case runs ``--rounds`` times with ours and
stock in alternating order (the sides of one round are built and timed one
after the other, so a round's drift falls on both sides in turn); a row gives
the median over rounds of each round's median, the rounds' spread, and
stock / ours.  A D case that steps through a whole heartbeat interval
(``--cases "D step"``) times each step once and gives the interval's worst
step (stock heartbeats everything in one step) and its mean.

A step ships its metadata pickled (vLLM's multiprocess executor: TP > 1, and
the CPU platform) and, in a second pass, in-process (the uniprocess executor,
one GPU, the default; what the fleet harness does).

    python -m tools.bench_cold                        # the gate's step and ack rows, both hand-overs
    python -m tools.bench_cold --cases "P idle" --rounds 5 --repeats 400
    python -m tools.bench_cold --evict-mib 0          # warm, for comparison
    python -m tools.bench_cold --cases "D step, 10k" --rounds 2

CPU time moves with the machine (frequency, the other core's work, the L3
that other tenants share), so this is a benchmark, not a gate: compare ours
and stock from the same run only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import harness  # noqa: F401  (sets VLLM_TARGET_DEVICE before vLLM is imported)
from tools.instr.cases import CASES, Engines, quiet_loggers
from tools.instr.cold import ColdProbe

ROOT = Path(__file__).resolve().parent.parent
SIDES = ("cython", "stock")


def selected(patterns: list[str] | None) -> list[str]:
    """The engine-level cases (not the core's own classes, not ``parts``) whose name
    contains one of ``patterns``; with none, every such case the instruction gate
    counts (``gate``), so a case added to the gate is timed here too."""
    return [
        c.name
        for c in CASES
        if not c.core
        and c.group != "parts"
        and (any(s in c.name for s in patterns) if patterns is not None else c.gate)
    ]


def run_rounds(
    cases: list[str], rounds: int, repeats: int, evict_bytes: int, pickled: bool, engines: Engines
) -> dict[str, dict[str, list[float]]]:
    """case -> side -> each round's median, in us."""
    out: dict[str, dict[str, list[float]]] = {}
    by_name = {c.name: c for c in CASES}
    for r in range(rounds):
        sides = SIDES if r % 2 == 0 else SIDES[::-1]
        for name in cases:
            probe = ColdProbe(repeats, evict_bytes)
            env = SimpleNamespace(engines=engines, worker_sides=sides, case=by_name[name], pickled=pickled)
            by_name[name].run(probe, env)
            for side in SIDES:
                ns = [rec["ns"] for rec in probe.records if rec["side"] == side]
                if by_name[name].per_step:  # one call per step of an interval: its worst and its mean
                    values = {f"{name}, worst step": max(ns), f"{name}, mean step": statistics.fmean(ns)}
                else:
                    values = {name: statistics.median(ns)}
                for row, value in values.items():
                    out.setdefault(row, {}).setdefault(side, []).append(value / 1e3)
    return out


def summarize(medians: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    rows = {}
    for name, sides in medians.items():
        row: dict[str, Any] = {"rounds": sides}
        for side, values in sides.items():
            row[side] = statistics.median(values)
            row[f"{side}_spread"] = [min(values), max(values)]
        row["ratio"] = row["stock"] / row["cython"] if row["cython"] > 0 else None
        # Rounds in which ours cost no more than stock (each round's two sides ran back to back).
        row["rounds_at_or_below_stock"] = sum(
            o <= s for o, s in zip(sides["cython"], sides["stock"], strict=True)
        )
        rows[name] = row
    return rows


def table(rows: dict[str, Any], title: str) -> str:
    w = max([28, *map(len, rows)])
    lines = [
        title,
        f"  {'case':<{w}} {'ours us':>9} {'(rounds)':>15} {'stock us':>9} {'(rounds)':>15} "
        f"{'stock/ours':>10}  rounds ours <= stock",
    ]
    for name, row in rows.items():
        lo, hi = row["cython_spread"]
        slo, shi = row["stock_spread"]
        lines.append(
            f"  {name:<{w}} {row['cython']:>9.1f} {f'{lo:.1f}-{hi:.1f}':>15} {row['stock']:>9.1f} "
            f"{f'{slo:.1f}-{shi:.1f}':>15} {row['ratio']:>9.2f}x  "
            f"{row['rounds_at_or_below_stock']} of {len(row['rounds']['cython'])}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--cases",
        nargs="*",
        default=None,
        help="cases whose name contains one of these (default: the instruction gate's step and ack cases)",
    )
    ap.add_argument("--rounds", type=int, default=4, help="runs of each case, sides in alternating order")
    ap.add_argument("--repeats", type=int, default=200, help="timed calls per case, side and round")
    ap.add_argument("--evict-mib", type=int, default=32, help="buffer rewritten before each call (0: warm)")
    ap.add_argument(
        "--handover",
        choices=("both", "pickled", "in-process"),
        default="both",
        help="how a step's metadata reaches the worker",
    )
    ap.add_argument("--json", type=Path, default=ROOT / ".build" / "bench-cold.json")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1 or args.evict_mib < 0:
        ap.error("--rounds and --repeats must be >= 1, --evict-mib >= 0")
    from vllm_nixl_lease import IMPLEMENTATION

    if IMPLEMENTATION != "cython":
        raise SystemExit(
            "tools.bench_cold times the Cython core (unset VLLM_NIXL_LEASE_NO_EXTENSIONS, make build)"
        )
    names = selected(args.cases)
    if not names:
        ap.error(f"no step case matches {args.cases}")
    quiet_loggers()
    handovers = {"both": (True, False), "pickled": (True,), "in-process": (False,)}[args.handover]
    result: dict[str, Any] = {
        "evict_mib": args.evict_mib,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "handovers": {},
    }
    print(
        f"thread CPU per call, median of {args.repeats} calls per round, {args.rounds} rounds; "
        f"{args.evict_mib} MiB rewritten before each call",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        engines = Engines(Path(tmp))
        for pickled in handovers:
            t0 = time.monotonic()
            medians = run_rounds(names, args.rounds, args.repeats, args.evict_mib << 20, pickled, engines)
            rows = summarize(medians)
            key = "pickled" if pickled else "in-process"
            result["handovers"][key] = rows
            title = "metadata " + (
                "pickled (multiprocess executor)"
                if pickled
                else "handed over in-process (uniprocess executor)"
            )
            print(table(rows, f"{title}, {time.monotonic() - t0:.0f} s"), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
