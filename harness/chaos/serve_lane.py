"""The serve lane: 1 P and 2 D real `vllm serve` processes on three
network-namespace hosts on one bridge (NIXL over UCX's TCP transport), behind
`vllm-router` in the root namespace, under the nemesis, then healed, probed
and checked (``serve_checker``).

Phases, each marked in the history: ``warm`` (P alone's references, routed
requests until both Ds have served, then the quiet sizes), ``faults`` (the
workload and the nemesis for the horizon), ``recovery`` (after ``heal_all``:
routed probes until every D has answered as P alone), ``quiet`` (a lease and
more for the last leases to end) and ``end`` (sizes again).

The servers run at the driver's priority (no ``raise_own_priority``): started
under ``nice``, the whole fleet stays below other work on a shared machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import netns
from harness.serve import client, plog
from harness.serve.launcher import VENV_CPU, VENV_ROUTER, PDConfig
from vllm_nixl_lease._wire import default_heartbeat_interval, default_lease_extension

from . import report, schedule, serve_checker, serve_workload
from .history import History
from .nemesis import Nemesis
from .progress import ServeTally
from .serve_nodes import CrashWatch, Router, ServeNode

LEASE = 10  # scaled down from vLLM's 30 s: a partition or stall past it fits in a short run
EXTENSION = default_lease_extension(LEASE)
INTERVAL = default_heartbeat_interval(LEASE)
ENGINES = {"p0": ("P", "p", 0), "d0": ("D", "d", 1), "d1": ("D", "e", 0)}  # name: role, host, CPU
# A `vllm serve` restart takes tens of seconds to minutes here; P is killed in longer runs only.
PACE = schedule.Pace(mean_gap_s=8.0, restart_allowance_s=150.0, spare=(("P", 0), ("D", 1)), kill_roles=("D",))
PACE_LONG = schedule.Pace(mean_gap_s=8.0, restart_allowance_s=150.0, spare=(("P", 0), ("D", 1)))
LONG_MINUTES = 10.0
RATE = 0.7  # routed requests per second, besides bursts
BURST = 12
PROGRESS_EVERY_S = 10.0
SIZES_EVERY_S = 10.0
START_TIMEOUT_S = 900.0  # three servers starting at once on a busy 2-core machine


@dataclass
class Options:
    seed: int
    minutes: float
    impl: str = "ours"  # or "stock"
    workdir: Path = Path(".build/chaos")
    say: Callable[[str], None] = print
    kinds: tuple[str, ...] = schedule.KINDS
    abort_frac: float = serve_workload.ABORT_FRAC  # of stream requests, cancelled by their client
    n2_frac: float = serve_workload.N2_FRAC  # of stream requests, n = 2
    dup_frac: float = serve_workload.DUP_FRAC  # of stream requests, the decode step sent twice
    # Ours only: each D claims a lease before it reads (``kv_lease_claim_reads``, docs/PROTOCOL.md
    # P14 and D11). A decode step hedged to both Ds is safe only with claims (assumption A6).
    claim_reads: bool = True


def unavailable_reason() -> str | None:
    """Why `vllm serve` and `vllm-router` cannot start here (the venvs they run from), or None."""
    for exe, make in (
        (VENV_CPU / "bin" / "python", "venv-cpu"),
        (VENV_ROUTER / "bin" / "vllm-router", "venv-router"),
    ):
        if not exe.exists():
            return f"{exe} missing: `make {make}` (or PD_VENV_CPU / PD_VENV_ROUTER pointing at one)"
    return None


def layout() -> schedule.Layout:
    return schedule.Layout({n: (r, h) for n, (r, h, _) in ENGINES.items()})


def _quiet_sizes(nodes: list[ServeNode], phase: str) -> None:
    """Sizes of every up server; P stepped first by two tiny P-alone requests, so
    its gauges reflect every lease that has ended (an idle engine does not step)."""
    for n in nodes:
        if n.role == "P" and n.state == "up":
            for _ in range(2):
                client.complete(n.url, "poke", max_tokens=1, timeout=30)
    time.sleep(1.0)
    for n in nodes:
        n.sizes(phase)


def _p_expiries(hist: History, p: ServeNode) -> None:
    """P's lease expiries, from its logs (both connectors log each), as ``freed`` events."""
    wall_minus_mono = time.time() - time.monotonic()
    for log in sorted(p.cfg.log_dir.glob(f"{p.name}-g*.log")):
        for wall, rid in plog.parse(log).expiries:
            t = hist.rel(wall - wall_minus_mono)
            hist.add("freed", t=t, id=rid, p=p.name, reason="expiry", hb_last=None)


def run(opts: Options) -> dict[str, Any]:
    say = opts.say
    workdir = opts.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    horizon = opts.minutes * 60.0
    pace = PACE_LONG if opts.minutes >= LONG_MINUTES else PACE
    plan = schedule.plan(opts.seed, horizon, layout(), opts.kinds, pace)
    hist = History(workdir / "history.jsonl")
    tally = ServeTally()
    hist.observers.append(tally)
    claims = opts.claim_reads and opts.impl == "ours"
    cfg = PDConfig(
        connector="lease" if opts.impl == "ours" else "stock",
        lease_s=LEASE,
        log_dir=workdir / "servers",
        kv_transfer={"kv_load_failure_policy": "recompute"},
        startup_timeout_s=START_TIMEOUT_S,
        kv_extra={"kv_lease_claim_reads": True} if claims else {},
    )
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    for old in cfg.log_dir.glob("*.log"):  # expiries are read from these: no earlier run's lines
        old.unlink()
    hist.add(
        "run", seed=opts.seed, impl=opts.impl, lane="serve", lease=LEASE, extension=EXTENSION,
        interval=INTERVAL, minutes=opts.minutes, bounds=serve_checker.SERVE_BOUNDS, rate=RATE,
        burst_size=BURST, abort_frac=opts.abort_frac, n2_frac=opts.n2_frac, dup_frac=opts.dup_frac,
        claim_reads=claims,
        engines={n: {"role": r, "host": h} for n, (r, h, _) in ENGINES.items()},
        plan=len(plan),
    )  # fmt: skip
    netns.sweep_stale()
    started = time.monotonic()
    nem: Nemesis | None = None
    router: Router | None = None
    nodes: dict[str, ServeNode] = {}
    wl: serve_workload.ServeWorkload | None = None
    watch = CrashWatch(nodes, hist)
    with netns.TwoHosts(names=tuple(layout().hosts)) as hosts:
        try:
            for name, (role, host, cpu) in ENGINES.items():
                nodes[name] = ServeNode(hosts, hist, cfg, name, role, host, cpu, cfg.connector)
            say(f"starting {len(nodes)} `vllm serve` ({opts.impl}) on hosts {', '.join(layout().hosts)}")
            for n in nodes.values():
                n.launch()
            for n in nodes.values():
                n.wait_up(START_TIMEOUT_S)
                say(f"{n.name} up at {n.url} ({time.monotonic() - started:.0f}s since start)")
            router = Router(list(nodes.values()), cfg.log_dir)
            router.wait_up(60)
            p = nodes["p0"]
            ds = {n.name: n.url for n in nodes.values() if n.role == "D"}
            hist.add("phase", name="warm")
            texts = serve_workload.prompts(opts.seed)
            refs = serve_workload.references(p.url, texts)
            wl = serve_workload.ServeWorkload(
                hist, router.url, texts, refs, opts.seed, RATE, (p.url, ds),
                (opts.abort_frac, opts.n2_frac, opts.dup_frac),
            )  # fmt: skip
            served = wl.probe(ds, limit_s=180)
            say(f"warm-up: {len(served)}/{len(ds)} Ds served a routed request as P alone")
            time.sleep(LEASE + EXTENSION)
            _quiet_sizes(list(nodes.values()), "warm")
            nem = Nemesis(hosts, nodes, hist, plan, lambda m: say(f"[{hist.now():7.1f}s] {m}"))
            hist.add("phase", name="faults")
            bursts = [horizon * x for x in (0.25, 0.6, 0.85)]
            say(f"faults: {len(plan)} planned over {horizon:.0f}s (seed {opts.seed}); bursts of {BURST}")
            wl.start(bursts, BURST)
            nem.start()
            t_faults = last_sizes = time.monotonic()
            while time.monotonic() - t_faults < horizon:
                time.sleep(min(PROGRESS_EVERY_S, max(0.1, horizon - (time.monotonic() - t_faults))))
                say(f"[{hist.now():7.1f}s] now: {nem.running_line()} | {tally.line()}")
                watch.check()
                if time.monotonic() - last_sizes >= SIZES_EVERY_S:
                    last_sizes = time.monotonic()
                    for n in nodes.values():
                        n.sizes("run")
            wl.stop()
            nem.join()
            nem.heal_all()
            watch.check()
            watch.join(START_TIMEOUT_S)
            say(f"[{hist.now():7.1f}s] healed everything; probing every D through the router")
            hist.add("phase", name="recovery")
            bound = serve_checker.SERVE_BOUNDS["recovery_s"]
            served = wl.probe({d: u for d, u in ds.items() if nodes[d].state == "up"}, limit_s=bound + 30)
            say(f"[{hist.now():7.1f}s] recovery: " + ", ".join(f"{d} {s:.1f}s" for d, s in served.items()))
            hist.add("phase", name="quiet")
            time.sleep(LEASE + EXTENSION + 5)
            watch.check()
            _quiet_sizes(list(nodes.values()), "end")
            hist.add("phase", name="end")
            _p_expiries(hist, p)
        finally:
            if wl is not None:
                wl.stop(wait_s=0.0)
            if nem is not None:
                nem.stop()
                for n in nodes.values():
                    n.thaw()
            if router is not None:
                router.proc.stop(grace=3.0)
            for n in nodes.values():
                if n.eng is not None:
                    n.eng.stop(grace=5.0)
    hist.close()
    head = {
        "seed": opts.seed, "impl": opts.impl, "lane": "serve", "minutes": opts.minutes,
        "bounds": serve_checker.SERVE_BOUNDS, "lease": LEASE, "extension": EXTENSION,
        "skipped_sends": wl.skipped,
    }  # fmt: skip
    failed = list(nem.failed)  # wl and nem are set: the try above raises on any path that leaves them None
    return report.finish(say, workdir, head, serve_checker.check, failed, time.monotonic() - started)
