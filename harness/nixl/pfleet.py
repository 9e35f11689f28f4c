"""One P against N D engines holding L leases over real NIXL (the P side of
the fleet benchmark, ``tools/bench_fleet.py``).

P prefills requests of one 32-token block each and hands them round-robin to
the D engines, which keep them queued (``hold=True``) and heartbeat their
share to P at the configured interval.  The steps of a run:

- ``start``: P and the D engines, started side by side;
- ``grow``: P prefills up to ``leases`` requests in batches, each batch handed
  to the D engines at once (a lease runs from its grant: a batch handed late
  would expire before its D first heartbeats it);
- ``hold``: the leases stay queued for a while; per P step the harness
  records the connector's time and the whole step, and per heartbeat message
  when D sent it and when P drained it;
- ``release_and_check`` (correctness) or ``crash`` (mass expiry): D reads
  everything, or every D is SIGKILLed and P's leases lapse together.

Engines run with ``observe_ids=False`` at scale: counts, step timings and one
record per heartbeat message, no per-request heartbeat bookkeeping.
"""

from __future__ import annotations

import bisect
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_nixl_lease._wire import default_heartbeat_interval, default_lease_extension

from .fleet import EngineProcess, Fleet, wait_for
from .progress import PROGRESS_DELAY_US
from .scenarios import data_mismatches, hand_to_d, prefill, wait_loaded

TOKENS = 32  # one 32-token KV block per request
BATCH = 5000  # requests one P prefill step takes (and P's pipe answers within its timeout)
WARM_IDS_PER_D = 4  # the first requests, heartbeated before the bulk arrives (handshakes done)


@dataclass
class PFleet:
    p: EngineProcess
    ds: list[EngineProcess]
    stock: bool
    # P's request ids, per D.
    ids: list[list[str]] = field(default_factory=list)
    start_s: float = 0.0
    say: Callable[[str], None] = print
    lease: int = 6  # the fleet's kv_lease_duration

    @property
    def heartbeat_interval(self) -> float:
        """D's heartbeat interval (upstream's d // 6)."""
        return default_heartbeat_interval(self.lease)

    @property
    def leases(self) -> int:
        return sum(map(len, self.ids))

    @property
    def impl(self) -> str:
        return "stock" if self.stock else "ours"


def start(
    fleet: Fleet,
    n_d: int,
    max_leases: int,
    stock: bool,
    observe_ids: bool = False,
    d_step_s: float = 0.02,
    d_num_blocks: int = 1032,
    extra: dict[str, Any] | None = None,
    say: Callable[[str], None] = print,
) -> PFleet:
    """P with room for ``max_leases`` one-block requests, and ``n_d`` D engines."""
    common = {"progress_delay_us": PROGRESS_DELAY_US, "observe_ids": observe_ids, "extra": dict(extra or {})}
    engines = [("P", "p", {**common, "num_blocks": max_leases + 64})]
    engines += [
        ("D", f"d{j}", {**common, "num_blocks": d_num_blocks, "step_s": d_step_s}) for j in range(n_d)
    ]
    t0 = time.monotonic()
    p, *ds = fleet.start_many(engines, stock=stock)
    took = time.monotonic() - t0
    pf = PFleet(p=p, ds=ds, stock=stock, ids=[[] for _ in ds], start_s=took, say=say, lease=fleet.lease)
    say(f"  {pf.impl}: 1 P + {n_d} D engines started in {pf.start_s:.1f}s")
    return pf


def _hand_out(pf: PFleet, n: int, tag: str, stagger_s: float = 0.0) -> None:
    ids, params = prefill(pf.p, tag, n, tokens=TOKENS)
    for j, d in enumerate(pf.ds):
        if j and stagger_s:
            time.sleep(stagger_s)
        share = ids[j :: len(pf.ds)]
        hand_to_d(d, {r: params[r] for r in share}, hold=True, tokens=TOKENS)
        pf.ids[j].extend(share)


def grow(pf: PFleet, leases: int, batch: int = BATCH, spread_phases: bool = False) -> dict[str, Any]:
    """Prefill and hand out requests until P holds ``leases`` leases.

    ``spread_phases``: the first requests reach the D engines one heartbeat
    interval apart in all, so their heartbeat rounds (each D sends its
    whole share every interval, timed from its first request) are spread
    over the interval, as in a fleet whose engines did not start together;
    False (default): every D's round lands on P at about the same moment."""
    t0 = time.monotonic()
    if not pf.leases:
        # A few first, heartbeated by every D before the bulk: the handshakes
        # a first heartbeat starts are then done when thousands of grants run.
        stagger = pf.heartbeat_interval / len(pf.ds) if spread_phases else 0.0
        _hand_out(pf, min(leases, WARM_IDS_PER_D * len(pf.ds)), "warm", stagger)
        agents = {d.info["agent"] for d in pf.ds}
        wait_for(lambda: agents <= set(pf.p.summary()["hb_agents"]), 60, what="heartbeats from every D on P")
    n_batches = 0
    while pf.leases < leases:
        _hand_out(pf, min(batch, leases - pf.leases), f"L{leases}")
        n_batches += 1
    took = time.monotonic() - t0
    pf.say(f"  {pf.impl}: P holds {pf.leases} leases ({n_batches} prefill batches, {took:.1f}s)")
    return {"leases": pf.leases, "grow_s": took}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def hb_latencies(
    p_recv: list[tuple[float, str, int]], d_sent: dict[str, list[tuple[float, int, int]]]
) -> tuple[list[float], int]:
    """Seconds from D's ``send_notif`` to P draining that message, per message
    (same machine: both monotonic clocks are one clock).  A message is known
    by its sender and crc32; D may send the same bytes every interval, so the
    latest send at or before the receipt is the one.  Also returns the count
    of receipts without a send in the window (sent before it began)."""
    sends: dict[tuple[str, int], list[float]] = {}
    for agent, msgs in d_sent.items():
        for t, crc, _ in msgs:
            sends.setdefault((agent, crc), []).append(t)
    for times in sends.values():
        times.sort()
    out, unmatched = [], 0
    for t, agent, crc in p_recv:
        times = sends.get((agent, crc), [])
        i = bisect.bisect_right(times, t)
        if i == 0:
            unmatched += 1
            continue
        out.append(t - times[i - 1])
    return out, unmatched


def hold(pf: PFleet, seconds: float) -> dict[str, Any]:
    """Keep every lease queued for ``seconds``; return P's steps in that time
    (start, step s, connector s, notifications, expiries), heartbeat latencies,
    expiries on P (all premature: every D is alive and heartbeating) and CPU use."""
    pf.p.timings()
    # D's sends so far are kept: a message P drains in the window may have left D before it.
    d_t = {d.info["agent"]: d.timings()["hb_sent"] for d in pf.ds}
    before = pf.p.summary()
    pids = [pf.p.pid] + [d.pid for d in pf.ds]
    cpu0 = [cpu_seconds(pid) for pid in pids]
    t0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    cpu = [(cpu_seconds(pid) - c) / wall for pid, c in zip(pids, cpu0, strict=True)]
    p_t = pf.p.timings()
    sent_in_window = {d.info["agent"]: d.timings()["hb_sent"] for d in pf.ds}
    after = pf.p.summary()
    lat, unmatched = hb_latencies(p_t["hb_recv"], {a: d_t[a] + sent_in_window[a] for a in d_t})
    agents_heard = {a for _, a, _ in p_t["hb_recv"]}
    out = {
        "leases": pf.leases,
        "hold_s": wall,
        "steps": p_t["steps"],
        "hb_latency_s": lat,
        "hb_unmatched": unmatched,
        "hb_msgs": len(p_t["hb_recv"]),
        "hb_ids_sent": sum(n for msgs in sent_in_window.values() for _, _, n in msgs),
        "d_silent": sum(d.info["agent"] not in agents_heard for d in pf.ds),
        "expired": after["freed_by"].get("expiry", 0) - before["freed_by"].get("expiry", 0),
        "live": after["live"],
        "errors": after["errors"],
        "cpu_p": cpu[0],
        "cpu_d": cpu[1:],
        "rss_p_mib": rss_mib(pf.p.pid),
        "rss_d_mib": [rss_mib(d.pid) for d in pf.ds],
    }
    pf.say(
        f"  {pf.impl}: held {pf.leases} leases {wall:.1f}s: {len(out['steps'])} P steps, "
        f"{out['hb_msgs']} heartbeat messages, {out['expired']} expired while D heartbeated, "
        f"CPU P {cpu[0]:.2f} D {sum(cpu[1:]) / max(1, len(cpu) - 1):.2f} core each"
    )
    return out


def release_and_check(pf: PFleet, timeout: float = 120.0) -> dict[str, Any]:
    """Let every D read its share; return how P freed them and, with
    ``observe_ids``, how many reads returned data other than P's."""
    for d in pf.ds:
        d.release()
    wait_for(lambda: pf.p.summary()["live"] == 0, timeout, poll=0.5, what=f"P freeing {pf.leases} lease(s)")
    summary = pf.p.summary()
    out: dict[str, Any] = {"freed_by": summary["freed_by"], "errors": list(summary["errors"]), "wrong": None}
    if pf.p.spec.observe_ids:
        p_rep = pf.p.report()
        wrong = 0
        for d, ids in zip(pf.ds, pf.ids, strict=True):
            d_rep = wait_loaded(d, ids, timeout)
            wrong += len(data_mismatches(p_rep, d_rep, ids))
            out["errors"] += d_rep["errors"]
        out["wrong"] = wrong
    pf.say(f"  {pf.impl}: released: P freed {out['freed_by']}, wrong reads {out['wrong']}")
    return out


def crash(pf: PFleet, timeout: float | None = None, settle_s: float = 0.3) -> dict[str, Any]:
    """SIGKILL every D at once: all of P's leases lapse together.  Returns P's
    steps from the kill until the last lease is freed, and how late the frees
    came against the deadlines P held ``settle_s`` after the kill (heartbeats
    already in flight land first)."""
    pf.p.timings()
    t_kill = time.monotonic()
    for d in pf.ds:
        d.send_signal(signal.SIGKILL)
    for d in pf.ds:
        d.proc.join(10)
    time.sleep(settle_s)
    snap = pf.p.snapshot_deadlines()
    if timeout is None:
        timeout = default_lease_extension(pf.lease) + 60.0
    wait_for(lambda: pf.p.summary()["live"] == 0, timeout, poll=0.25, what=f"P expiring {pf.leases} lease(s)")
    summary = pf.p.summary()
    steps = pf.p.timings()["steps"]
    late = summary["late"]
    out = {
        "leases": pf.leases,
        "killed_t": t_kill,
        "deadlines": snap,
        "steps": [s for s in steps if s[0] >= t_kill],
        "freed_by": summary["freed_by"],
        "expired_measured": late["n"],
        "max_late_s": late["max_s"],
        "last_free_late_s": late["last_late_s"],
        # From the earliest deadline to the last free: how long the drain took.
        "drain_s": late["last_t"] - snap["first"] if snap.get("n") else None,
        "deadline_spread_s": snap["last"] - snap["first"] if snap.get("n") else None,
        "errors": summary["errors"],
    }
    pf.say(
        f"  {pf.impl}: all {len(pf.ds)} D killed with {pf.leases} leases held: freed {summary['freed_by']}, "
        f"last free {out['last_free_late_s']:.3f}s after its deadline (max {out['max_late_s']:.3f}s)"
    )
    return out
