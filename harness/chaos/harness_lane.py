"""The harness lane: 2 P and 3 D NIXL engines (UCX over TCP), each on its own
network-namespace host on one bridge, every D reading from every P, under the
nemesis, then healed, probed and checked.

Phases, each marked in the history: ``warm`` (one request per P-D pair, so
every pair has handshaken; then the structure sizes and RSS baselines),
``faults`` (workload and nemesis for the horizon), ``recovery`` (after
``heal_all``: every pair of live engines must serve a probe), ``quiet`` (every
lease ended, every queue empty) and ``end`` (sizes again).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import netns
from harness.nixl.fleet import Fleet
from harness.nixl.progress import PROGRESS_DELAY_US
from vllm_nixl_lease._wire import default_heartbeat_interval, default_lease_extension

from . import checker, report, schedule
from .history import History
from .nemesis import Nemesis, available_kinds  # noqa: F401 - the lane's entry point
from .nodes import Node
from .progress import Reads, Tally
from .workload import ABORT_FRAC, DUP_FRAC, DUP_OTHER_FRAC, Workload

LEASE = 6  # scaled down from vLLM's 30 s: a partition or stall past it fits in seconds
EXTENSION = default_lease_extension(LEASE)
INTERVAL = default_heartbeat_interval(LEASE)
P_HOSTS = {"p0": "p", "p1": "q"}
D_HOSTS = {"d0": "d", "d1": "e", "d2": "f"}
P_BLOCKS = 2048
D_BLOCKS = 2048
PROGRESS_EVERY_S = 10.0
# State that is time-bounded by design (upstream's invalid-engine backoff memory,
# 60 s after the backoff, which doubles from 1 s; D's re-handshake memory, 60 s; a dead
# engine's state, ENGINE_TTL_S; swept every 10 s) has ended this long after recovery:
# the end sizes are taken no earlier.  From recovery, not the heal: a connection that
# recovers late is released and handshaken again during recovery, and its memory starts then.
QUIET_AFTER_RECOVERY_S = 80.0
# Upstream's idle-engine eviction (3600 s by default), scaled down with the lease so
# that a dead engine's state on D must be gone by the end (ours and stock alike).
ENGINE_TTL_S = 30.0
BOUNDS = dict(checker.DEFAULT_BOUNDS)  # the checker's stated bounds, one place


@dataclass
class Options:
    seed: int
    minutes: float
    impl: str = "ours"  # or "stock"
    workdir: Path = Path(".build/chaos")
    rate: float = 4.0  # requests per second, all P together
    burst_size: int = 1000
    abort_frac: float = ABORT_FRAC  # of stream requests, cancelled by their client
    dup_frac: float = DUP_FRAC  # of stream requests, submitted twice with the same P params
    dup_other_frac: float = DUP_OTHER_FRAC  # of those, the second on another D
    # Ours only: each D claims a lease before it reads (``kv_lease_claim_reads``, docs/PROTOCOL.md
    # P14 and D11). A second reader on another D is safe only with claims (assumption A6).
    claim_reads: bool = True
    say: Callable[[str], None] = print
    kinds: tuple[str, ...] = schedule.KINDS
    extra: dict[str, Any] = field(default_factory=dict)


def layout() -> schedule.Layout:
    return schedule.Layout(
        {**{n: ("P", h) for n, h in P_HOSTS.items()}, **{n: ("D", h) for n, h in D_HOSTS.items()}}
    )


def _on_node_thread(nodes: list[Node], phase: str, timeout: float) -> None:
    """Drain every up engine once more, recording sizes as ``phase`` (on each node's own thread)."""
    done = []
    for node in nodes:
        if node.state != "up":
            continue
        ev = threading.Event()

        def job(eng: Any, node: Node = node, ev: threading.Event = ev) -> None:
            try:
                node.drain(eng, phase=phase)
            finally:
                ev.set()

        node.enqueue(job)
        done.append(ev)
    for ev in done:
        ev.wait(timeout)


def _wait_idle(nodes: list[Node], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(n.state != "up" or (n.idle.is_set() and n.jobs.empty()) for n in nodes):
            return True
        time.sleep(0.5)
    return False


class ProbeWatch:
    """After the final heal: which P-D pairs have served a probe correctly (history observer)."""

    def __init__(self) -> None:
        self.pair_of: dict[str, tuple[str, str]] = {}
        self.ok: dict[tuple[str, str], float] = {}
        self.failed: dict[tuple[str, str], int] = {}
        self.reads = Reads(self._verdict)

    def __call__(self, e: dict[str, Any]) -> None:
        if e["ev"] == "request" and e.get("probe"):
            self.pair_of[e["id"]] = (e["p"], e["d"])
        if e.get("id") in self.pair_of:
            self.reads(e)

    def _verdict(self, read: dict[str, Any], verdict: str) -> None:
        pair = self.pair_of[read["id"]]
        if verdict == "ok":
            self.ok.setdefault(pair, read["t"])
        else:
            self.failed[pair] = self.failed.get(pair, 0) + 1


def run(opts: Options) -> dict[str, Any]:
    """One run; returns the summary (also written to summary.json beside the history)."""
    say = opts.say
    workdir = opts.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "engines").mkdir(exist_ok=True)
    stock = opts.impl == "stock"
    claims = opts.claim_reads and not stock
    horizon = opts.minutes * 60.0
    lay = layout()
    plan = schedule.plan(opts.seed, horizon, lay, opts.kinds)
    hist = History(workdir / "history.jsonl")
    tally = Tally()
    probes = ProbeWatch()
    hist.observers += [tally, probes]
    hist.add(
        "run",
        seed=opts.seed,
        impl=opts.impl,
        lane="harness",
        lease=LEASE,
        extension=EXTENSION,
        interval=INTERVAL,
        minutes=opts.minutes,
        bounds=BOUNDS,
        rate=opts.rate,
        burst_size=opts.burst_size,
        abort_frac=opts.abort_frac,
        dup_frac=opts.dup_frac,
        dup_other_frac=opts.dup_other_frac,
        claim_reads=claims,
        engines={n: {"role": r, "host": h} for n, (r, h) in lay.engines.items()},
        plan=len(plan),
    )
    netns.sweep_stale()
    started = time.monotonic()
    common = {
        "progress_delay_us": PROGRESS_DELAY_US,
        "sampled_digest": True,
        "written_log": True,
        "block_reuse": "lifo",
        "max_lifetime_s": horizon + 1200.0,
        "extra": {
            "engine_ttl": ENGINE_TTL_S,
            **({"kv_lease_claim_reads": True} if claims else {}),
            **opts.extra,
        },
    }
    nodes: dict[str, Node] = {}
    with (
        netns.TwoHosts(names=tuple(lay.hosts)) as hosts,
        Fleet(str(workdir / "engines"), lease=LEASE, hosts=hosts) as fleet,
    ):
        specs = []
        for name, (role, host) in lay.engines.items():
            spec = {**common, "num_blocks": P_BLOCKS if role == "P" else D_BLOCKS, "engine_id": name}
            nodes[name] = Node(fleet, hist, name, role, host, stock, spec)
            specs.append((role, name, {**spec, "host": host}))
        say(f"starting {len(specs)} engines ({opts.impl}) on hosts {', '.join(lay.hosts)}")
        for node, eng in zip(
            nodes.values(), fleet.start_many(specs, stock=stock, start_timeout=300.0), strict=True
        ):
            node.adopt(eng)
            node.start_thread()
        ps = [n for n in nodes.values() if n.role == "P"]
        ds = [n for n in nodes.values() if n.role == "D"]
        all_nodes = ps + ds
        bursts = [horizon * x for x in (0.3, 0.65)] if horizon >= 240 else [horizon * 0.4]
        wl = Workload(
            hist, ps, ds, opts.seed, LEASE, opts.rate, opts.burst_size, bursts,
            opts.abort_frac, opts.dup_frac, opts.dup_other_frac,
        )  # fmt: skip
        nem: Nemesis | None = None
        try:
            hist.add("phase", name="warm")
            say(f"warm-up: one request per P-D pair ({time.monotonic() - started:.0f}s since start)")
            for p in ps:
                for d in ds:
                    wl.one(p=p, d=d, wait=0.0)
            time.sleep(2.0)
            if not _wait_idle(all_nodes, 120):
                say("warm-up: not every request finished in 120 s")
            time.sleep(2 * EXTENSION)  # let heartbeat and acknowledgement state settle
            _on_node_thread(all_nodes, "warm", 60)
            nem = Nemesis(hosts, nodes, hist, plan, lambda m: say(f"[{hist.now():7.1f}s] {m}"))
            hist.add("phase", name="faults")
            say(
                f"faults: {len(plan)} planned over {horizon:.0f}s (seed {opts.seed}); bursts of "
                f"{opts.burst_size} at {', '.join(f'{b:.0f}s' for b in bursts)}"
            )
            wl.start()
            nem.start()
            t_faults = time.monotonic()
            while time.monotonic() - t_faults < horizon:
                time.sleep(min(PROGRESS_EVERY_S, max(0.1, horizon - (time.monotonic() - t_faults))))
                say(f"[{hist.now():7.1f}s] now: {nem.running_line()} | {tally.line()}")
            wl.stop()
            nem.join()
            nem.heal_all()
            t_heal = time.monotonic()
            tcp = TcpWatch(hosts, nodes, hist, t_heal, workdir / "tcp_after_heal.txt")
            say(f"[{hist.now():7.1f}s] healed everything; probing every P-D pair")
            hist.add("phase", name="recovery")
            for n in ds:
                n.release_all_holds()
            _probe(wl, ps, ds, probes, BOUNDS["recovery_s"] + 15.0, tcp)
            tcp.record()
            worst = max((t - hist.rel(t_heal) for t in probes.ok.values()), default=0.0)
            say(
                f"[{hist.now():7.1f}s] recovery: {len(probes.ok)}/{len(ps) * len(ds)} pairs served a probe "
                f"(worst {worst:.1f}s after the heal; TCP's retransmissions were due until "
                f"{tcp.longest():.1f}s after it)"
            )
            hist.add("phase", name="quiet")
            t_recovered = time.monotonic()
            if not _wait_idle(all_nodes, 3 * LEASE + 30):
                say("quiet: some engine still holds leases or queued requests")
            time.sleep(max(2 * EXTENSION, t_recovered + QUIET_AFTER_RECOVERY_S - time.monotonic()))
            _on_node_thread(all_nodes, "end", 60)
            hist.add("phase", name="end")
        finally:
            wl.stop()
            if nem is not None:
                nem.stop()
            for n in all_nodes:
                n.stop_thread()
    nem_failed = list(nem.failed)  # set: the try above raises on any path that leaves it None
    hist.close()
    head = {
        "seed": opts.seed,
        "impl": opts.impl,
        "lane": "harness",
        "minutes": opts.minutes,
        "bounds": BOUNDS,
        "lease": LEASE,
        "extension": EXTENSION,
    }
    return report.finish(say, workdir, head, checker.check, nem_failed, time.monotonic() - started)


class TcpWatch:
    """Per P-D pair, until when after the final heal its engines' TCP connections (either way)
    still waited for a backed-off retransmission.  A cut backs a connection's timer off,
    doubling per lost retransmission, and nothing UCX queued on it moves before the timer
    fires: up to about as long after the heal as the cut lasted, longer when the first
    retransmission after the heal is lost too (the link just came up).  So the pair's
    connections are looked at every ``POLL_S`` until the pair has served, and the latest
    moment a retransmission was due (a look's time plus its timer) is the pair's wait.  D owes
    service from then on: the recovery rule adds the wait to its bound (``tcp_wait`` events)."""

    POLL_S = 1.0

    def __init__(
        self, hosts: netns.TwoHosts, nodes: dict[str, Node], hist: History, t_heal: float, log: Path
    ) -> None:
        self._hosts = hosts
        self._log = log  # each look's backed-off sockets, as ``ss`` shows them
        self._nodes = nodes
        self._hist = hist
        self._t_heal = t_heal
        self._next = 0.0
        self.waits: dict[tuple[str, str], tuple[int, float]] = {}  # pair -> (backoffs, s after heal)

    def longest(self) -> float:
        return max((w for _, w in self.waits.values()), default=0.0)

    def poll(self, pairs: list[tuple[str, str]]) -> None:
        """Look at ``pairs`` (those not served yet) if a look is due."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.POLL_S
        for p, d in pairs:
            ph, dh = P_HOSTS[p], D_HOSTS[d]
            pids = [*self._nodes[p].pids(), *self._nodes[d].pids()]
            seen: list[str] = []
            try:
                waits = [self._hosts.tcp_wait(a, b, pids, seen) for a, b in ((dh, ph), (ph, dh))]
            except Exception as exc:  # noqa: BLE001 - evidence for the checker, not the run
                self._hist.add("error", engine=d, text=f"ss for {p}->{d} after the heal: {exc}")
                continue
            if seen:
                with self._log.open("a") as f:
                    f.write(f"{now - self._t_heal:.2f}s after the heal, {p}->{d}:\n" + "\n".join(seen) + "\n")
            backoffs, wait = max(waits, key=lambda w: w[1])
            if wait > 0:
                due = now + wait - self._t_heal
                if due > self.waits.get((p, d), (0, 0.0))[1]:
                    self.waits[(p, d)] = (backoffs, due)

    def record(self) -> None:
        for (p, d), (backoffs, due) in sorted(self.waits.items()):
            self._hist.add("tcp_wait", pair=f"{p}->{d}", backoffs=backoffs, wait_s=round(due, 3))


def _probe(
    wl: Workload, ps: list[Node], ds: list[Node], probes: ProbeWatch, limit_s: float, tcp: TcpWatch
) -> None:
    """One probe per pair of up engines; another for a pair whose probe failed or is slow.
    Gives up ``limit_s`` after the start plus the longest wait TCP has shown so far."""
    start = time.monotonic()
    sent: dict[tuple[str, str], float] = {}
    while time.monotonic() < start + limit_s + tcp.longest():
        todo = [
            (p, d) for p in ps for d in ds if (p.name, d.name) not in probes.ok and p.state == d.state == "up"
        ]
        if not todo:
            return
        tcp.poll([(p.name, d.name) for p, d in todo])
        for p, d in todo:
            key = (p.name, d.name)
            last = sent.get(key)
            if last is None or time.monotonic() - last > 6.0 or probes.failed.get(key, 0):
                probes.failed.pop(key, None)
                sent[key] = time.monotonic()
                wl.one(probe=True, p=p, d=d, wait=0.0)
        time.sleep(0.5)
