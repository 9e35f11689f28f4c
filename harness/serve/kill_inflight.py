"""`kill -9` of D while routed requests are in flight on it, P and D on two hosts: how long the
in-flight requests take to fail, when each of D's processes is gone, when P reclaims the leases,
and whether P's engine stalls meanwhile (stack samples of P's engine process with py-spy).

Historically (loopback) in 4 of 11 e2e runs the in-flight requests took 8.5-12.4 s to fail instead
of 0.35-1.0 s, each time within ~1 s of P expiring the dead D's leases.

python -m harness.serve.kill_inflight --kills 3 [--pyspy /path/to/py-spy]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.procs import descendants
from harness.serve import client, plog
from harness.serve.launcher import PDCluster
from harness.serve.scenarios import EXPIRED, block_and_queue, lease_extension, lease_interval


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _state(pid: int) -> str | None:
    """The process's state letter (R, S, D, Z, ...), None once it is gone (reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()[0]


class _ExitWatch(threading.Thread):
    """When each pid turns zombie (exited) and disappears (reaped)."""

    def __init__(self, pids: dict[int, str]) -> None:
        super().__init__(daemon=True)
        self.pids = pids
        self.exited: dict[int, float] = {}
        self.gone: dict[int, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set() and len(self.gone) < len(self.pids):
            now = time.time()
            for pid in self.pids:
                if pid in self.gone:
                    continue
                st = _state(pid)
                if st is None:
                    self.gone[pid] = now
                    self.exited.setdefault(pid, now)
                elif st in ("Z", "X") and pid not in self.exited:
                    self.exited[pid] = now
            self.stop.wait(0.02)


class _Probe(threading.Thread):
    """Back-to-back one-token P-alone requests: one that takes long means P's engine did not step."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.samples: list[tuple[float, float, bool]] = []  # (start, end, ok)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            r = client.complete(self.url, "probe", max_tokens=1, timeout=60)
            self.samples.append((r.t_start, r.t_end, r.ok))
            self.stop.wait(0.05)


class _Stacks(threading.Thread):
    """`py-spy dump` of P's processes every `every` seconds (timestamped text)."""

    def __init__(self, pyspy: str, pids: dict[int, str], every: float) -> None:
        super().__init__(daemon=True)
        self.pyspy, self.pids, self.every = pyspy, pids, every
        self.dumps: list[tuple[float, int, str]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for pid in self.pids:
                t = time.time()
                try:
                    out = subprocess.run(
                        [self.pyspy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=10
                    )
                    text = out.stdout + out.stderr
                except subprocess.TimeoutExpired:
                    text = "py-spy dump timed out"
                self.dumps.append((t, pid, text))
            self.stop.wait(self.every)


@dataclass
class KillRun:
    kill_ts: float
    fail_after_kill_s: list[float]  # each in-flight request's failure, seconds after the kill
    statuses: list[int]
    d_exit_after_kill_s: dict[str, float]  # D process (pid:comm) -> exited (zombie or gone)
    p_expiries_after_kill_s: list[float]
    p_last_hb_before_kill_s: float | None
    probe_max_s: float  # the slowest one-token P-alone request from the kill to the end
    probe_max_at_s: float  # its start, seconds after the kill
    probe_n: int
    stacks_file: str | None = None
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        d = ", ".join(f"{k} {v:.2f}" for k, v in self.d_exit_after_kill_s.items())
        exp = self.p_expiries_after_kill_s
        return (
            f"in-flight failed after {[round(x, 2) for x in self.fail_after_kill_s]} s "
            f"(HTTP {sorted(set(self.statuses))}); D exited: {d}; P expired "
            f"{len(exp)} lease(s) {min(exp, default=float('nan')):.2f}-{max(exp, default=float('nan')):.2f}s "
            f"after the kill; slowest P probe {self.probe_max_s:.2f}s at +{self.probe_max_at_s:.2f}s "
            f"({self.probe_n} probes)"
        )


def kill_inflight(
    pd: PDCluster, n: int = 4, pyspy: str | None = None, out_dir: Path | None = None, tag: str = "kill"
) -> KillRun:
    assert pd.decode is not None and pd.prefill is not None
    lease = pd.cfg.lease_s
    ext = lease_extension(lease)
    settle = (lease - ext) + lease_interval(lease) + 2.5  # leases heartbeat-driven (test_pd_serve)
    exp0 = client.metric(pd.p_url, EXPIRED)
    blocker, burst = block_and_queue(pd, n, tag, 16, 120, max_s=settle + 120)
    probe = _Probe(pd.p_url)
    stacks = None
    try:
        time.sleep(max(0.0, burst.t_queued + settle - time.time()))
        d_pids = {p: _comm(p) for p in [pd.decode.pid, *descendants(pd.decode.pid)]}
        p_pids = {p: _comm(p) for p in [pd.prefill.pid, *descendants(pd.prefill.pid)]}
        watch = _ExitWatch(d_pids)
        if pyspy:
            # P's API server, engine core and worker (the processes whose names say so).
            chosen = {
                p: c for p, c in p_pids.items() if "Engine" in c or "Worker" in c or p == pd.prefill.pid
            }
            stacks = _Stacks(pyspy, chosen, every=0.3)
            stacks.start()
        probe.start()
        time.sleep(1.0)
        watch.start()
        kill_ts = pd.kill_decode()
        results = burst.results()
        deadline = kill_ts + ext + 15
        while time.time() < deadline and client.metric(pd.p_url, EXPIRED, timeout=3.0) - exp0 < n:
            time.sleep(0.5)
        time.sleep(2.0)
    finally:
        probe.stop.set()
        if stacks is not None:
            stacks.stop.set()
        blocker.release()
    probe.join(70)
    watch.stop.set()
    watch.join(5)
    if stacks is not None:
        stacks.join(30)
    ev = plog.parse(pd.prefill.log_path)
    after = [(s, e) for s, e, _ in probe.samples if e >= kill_ts]
    slow = max(after, key=lambda se: se[1] - se[0]) if after else (kill_ts, kill_ts)
    stacks_file = None
    if stacks is not None and out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{tag}-p-stacks.txt"
        with path.open("w") as fh:
            for t, pid, text in stacks.dumps:
                fh.write(
                    f"=== {t:.3f} (+{t - kill_ts:.2f}s after the kill) pid {pid} {p_pids.get(pid)}\n{text}\n"
                )
        stacks_file = str(path)
    return KillRun(
        kill_ts=kill_ts,
        fail_after_kill_s=sorted(r.t_end - kill_ts for r in results),
        statuses=[r.status for r in results],
        d_exit_after_kill_s={
            f"{p}:{c}": watch.exited.get(p, float("nan")) - kill_ts for p, c in d_pids.items()
        },
        p_expiries_after_kill_s=[t - kill_ts for t, _ in ev.expiries_after(kill_ts - 1)],
        p_last_hb_before_kill_s=(None if (hb := ev.last_heartbeat_before(kill_ts)) is None else kill_ts - hb),
        probe_max_s=slow[1] - slow[0],
        probe_max_at_s=slow[0] - kill_ts,
        probe_n=len(after),
        stacks_file=stacks_file,
    )


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    from dataclasses import asdict

    from harness.procs import install_signal_handlers
    from harness.serve.launcher import BUILD, PDConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connector", default="lease")
    ap.add_argument("--lease", type=int, default=15)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--loopback", action="store_true", help="P and D on loopback instead of two hosts")
    ap.add_argument("--pyspy", default=shutil.which("py-spy") or os.environ.get("PYSPY"))
    args = ap.parse_args(argv)
    install_signal_handlers()
    log_dir = BUILD / "kill-inflight" / f"{args.connector}-{'lo' if args.loopback else 'hosts'}"
    cfg = PDConfig(
        connector=args.connector, lease_s=args.lease, d_max_num_seqs=1, two_hosts=not args.loopback,
        log_dir=log_dir,
    )  # fmt: skip
    t0 = time.time()
    out = []
    with PDCluster(cfg) as pd:
        pd.progress = print
        print(f"cluster up in {time.time() - t0:.0f}s")
        for i in range(args.kills):
            if i:
                t1 = time.time()
                pd.restart_decode()
                pd.wait_router_sees_decode(timeout=60)
                print(f"D restarted in {time.time() - t1:.0f}s")
            k = kill_inflight(pd, args.n, args.pyspy, log_dir, tag=f"kill{i}")
            print(f"kill {i}: {k.line()}  stacks: {k.stacks_file}")
            out.append(asdict(k))
    (log_dir / "kill-inflight.json").write_text(json.dumps(out, indent=2))
    print(f"total {time.time() - t0:.0f}s; logs {log_dir}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
