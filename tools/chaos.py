"""``make chaos``: a seeded nemesis over a fleet, a history, a checker.

    python -m tools.chaos --seed 1 --minutes 10 --lane harness --impl ours

Writes ``.build/chaos/history.jsonl``, ``summary.json`` and ``timeline.png``
(``--out`` elsewhere); exits 1 on any violation, 2 when the lane cannot run here.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

SHOWN = (
    "requests", "reads", "reads_ok", "reads_failed", "fenced", "discarded", "stale", "expiries",
    "premature_expiries", "leaks", "d_leaks", "aborts", "dups", "second_reads", "stale_second_reader",
    "stale_after_abort", "second_reads_after_free", "recovery_s", "worst_p_step_gain_s", "max_rss_growth",
    "crashes", "faults_by_kind", "late_heals", "latest_heal_s",
)  # fmt: skip
SHOWN_SERVE = (
    "requests", "answers_ok", "stale", "timeouts", "cancelled", "n2", "hedged", "errors", "unanswered",
    "expiries", "leaks",
    "recovery_s", "max_rss_growth", "crashes", "faults_by_kind",
)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the fault phase")
    ap.add_argument("--lane", choices=("harness", "serve"), default="harness")
    ap.add_argument("--impl", choices=("ours", "stock"), default="ours")
    ap.add_argument("--out", type=Path, default=Path(".build/chaos"))
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second (harness lane)")
    ap.add_argument("--burst", type=int, default=1000, help="requests per burst (harness lane)")
    ap.add_argument(
        "--abort-frac", type=float, default=None, help="of stream requests, cancelled by their client"
    )
    ap.add_argument("--dup-frac", type=float, default=None, help="of stream requests, submitted twice")
    ap.add_argument(
        "--dup-other-frac", type=float, default=None, help="of those, on another D (harness lane)"
    )
    ap.add_argument("--n2-frac", type=float, default=None, help="of stream requests, n = 2 (serve lane)")
    ap.add_argument(
        "--no-claim-reads",
        dest="claim_reads",
        action="store_false",
        help="ours without kv_lease_claim_reads: a second reader on another D is then unfenced (A6)",
    )
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # tear the hosts and engines down as Ctrl-C does

    def say(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)

    from harness import netns

    reason = netns.unavailable_reason()
    if reason:
        say(f"chaos: cannot run here: {reason}")
        return 2
    from harness.chaos import nemesis

    kinds, why = nemesis.available_kinds()
    for line in why:
        say(line)
    if args.lane == "serve":
        from harness.chaos import serve_lane

        reason = serve_lane.unavailable_reason()
        if reason:
            say(f"chaos: cannot run the serve lane here: {reason}")
            return 2
        summary = serve_lane.run(
            serve_lane.Options(
                seed=args.seed, minutes=args.minutes, impl=args.impl, workdir=args.out, say=say, kinds=kinds,
                claim_reads=args.claim_reads,
                **_given(args, abort_frac="abort_frac", dup_frac="dup_frac", n2_frac="n2_frac"),
            )
        )  # fmt: skip
    else:
        from harness.chaos import harness_lane

        summary = harness_lane.run(
            harness_lane.Options(
                seed=args.seed,
                minutes=args.minutes,
                impl=args.impl,
                workdir=args.out,
                rate=args.rate,
                burst_size=args.burst,
                say=say,
                kinds=kinds,
                claim_reads=args.claim_reads,
                **_given(args, abort_frac="abort_frac", dup_frac="dup_frac", dup_other_frac="dup_other_frac"),
            )
        )
    fig = summary["figures"]
    say(
        f"chaos {args.lane} {args.impl} seed {args.seed}: "
        + json.dumps({k: fig.get(k) for k in (SHOWN_SERVE if args.lane == "serve" else SHOWN)})
    )
    verdict = "OK" if summary["ok"] else f"VIOLATIONS: {len(summary['violations'])}"
    say(f"{verdict}; history, summary.json and timeline.png in {args.out}")
    return 0 if summary["ok"] else 1


def _given(args: argparse.Namespace, **names: str) -> dict[str, Any]:
    """The workload knobs given on the command line (the lane's defaults for the others)."""
    return {field: getattr(args, arg) for field, arg in names.items() if getattr(args, arg) is not None}


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
