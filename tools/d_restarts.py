"""D's state under many P restarts with fresh engine ids, over real NIXL.

One D and ``--n`` P processes one after the other (vLLM's default engine id: a new uuid per
start), each granting one lease that D reads, then killed (``harness/nixl/churn.py``,
``restarts``; ``make test`` runs it 20 times in ``tests/nixl/test_nixl_d_state.py``).  D's
connector structures and RSS are sampled after the first quarter and again once D's engine
reaper has released the dead engines.  Exits 1 if a read failed, a structure grew, or a dict
still names a dead engine.

    .venv/bin/python -m tools.d_restarts [--n 1000] [--json .build/d-restarts.json] [--workdir DIR] [--stock]

Not part of ``make test`` (about 2 s per restart here; a tool for docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from harness.nixl import Fleet, churn
from harness.nixl import scenarios as sc


def _say(line: str) -> None:
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1000, help="P restarts")
    ap.add_argument("--json", type=Path, default=Path(".build/d-restarts.json"))
    ap.add_argument("--stock", action="store_true", help="stock vLLM's connector on both sides")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the engines' logs here")
    args = ap.parse_args(argv)
    if args.n < 4:
        ap.error("--n must be at least 4 (the first sample is taken after a quarter)")
    with tempfile.TemporaryDirectory(prefix="d-restarts-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        with Fleet(str(workdir), lease=sc.LEASE) as fleet:
            try:
                out = churn.restarts(fleet, args.n, say=_say, stock=args.stock)
            except Exception:
                for eng in fleet.engines:
                    if eng.spec.role == "D":
                        print(f"D's exit code: {eng.proc.exitcode}; log: {eng.log}", flush=True)
                raise
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1, default=str))
    ok = out["read"] == args.n and not out["grown"] and not out["holding_engine_ids"] and not out["d_errors"]
    print(f"{'OK' if ok else 'FAILED'}: {args.n} restarts; written to {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
