"""The measured process: ``tools.bench_instr`` runs it under callgrind.

    valgrind --tool=callgrind --instr-atstart=no --collect-atstart=no ... \
        python -m tools.instr.measure --lib LIB --out DIR [--cases 0 3 5]

Writes ``DIR/records.json`` (which dump measured what); callgrind writes the dumps.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import harness  # noqa: F401  (sets VLLM_TARGET_DEVICE before vLLM is imported)
from tools.instr.cases import CASES, Engines, quiet_loggers
from tools.instr.probe import Probe


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", required=True, help="the compiled marker library")
    ap.add_argument("--out", required=True, help="where records.json goes")
    ap.add_argument("--cases", type=int, nargs="*", help="indices into CASES (default all)")
    args = ap.parse_args(argv)

    from vllm_nixl_lease import IMPLEMENTATION

    impl = "cython" if IMPLEMENTATION == "cython" else "twin"
    probe = Probe(Path(args.lib), impl)
    if not probe.on_valgrind:
        raise SystemExit(
            "tools.instr.measure counts nothing outside callgrind: run python -m tools.bench_instr"
        )
    quiet_loggers()
    import threading

    print("threads at start:", [t.name for t in threading.enumerate()], flush=True)
    with probe.instrumented():  # what the probe itself costs, subtracted from every row
        probe.measure("calibration", "probe", lambda: None, ops=1, warmup=3, repeats=5)
    worker_sides = ("cython", "stock") if impl == "cython" else ("twin",)
    with tempfile.TemporaryDirectory() as tmp:
        env = SimpleNamespace(engines=Engines(Path(tmp)), worker_sides=worker_sides, case=None)
        for index in args.cases if args.cases is not None else range(len(CASES)):
            case = CASES[index]
            if case.core and impl != "cython":
                continue  # both cores are measured in the Cython process
            env.case = case
            t0 = time.monotonic()
            case.run(probe, env)
            print(f"case took {time.monotonic() - t0:.0f} s: {case.name}", flush=True)
            probe.write(Path(args.out) / "records.json")  # as we go: a crash keeps what was counted
    probe.write(Path(args.out) / "records.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
