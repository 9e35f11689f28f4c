"""`make demo`: real `vllm serve` prefill + decode behind vllm-router, with our lease connector.

By default both servers are configured exactly as for stock vLLM (`"kv_connector": "NixlConnector"`)
and `VLLM_NIXL_LEASE=1` makes the import hook load ours: the no-config-change adoption path.

Story: serve a stream of requests; make D slow (a long request occupies D's only slot) so routed
requests queue beyond the lease and watch P's leases being renewed; queue more and `kill -9` D and
watch P reclaim them; start a new D and serve again. Prints a table, writes
`.build/demo/timeline.png` and `.build/demo/summary.json`. Exit status 0 only if the story held.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from tools.pd import client, plog, scenarios  # noqa: E402
from tools.pd.launcher import BUILD, CONNECTORS, PDCluster, PDConfig  # noqa: E402
from tools.pd.procs import install_signal_handlers  # noqa: E402
from tools.pd.timeline import Sampler, plot  # noqa: E402

T0 = time.time()
N_QUEUED = 4


def say(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def _progress(sampler: Sampler, until: float, every: float = 3.0, extra: str = "") -> None:
    time.sleep(1.0)  # let the sampler see the requests just sent
    while time.time() < until:
        s = sampler.latest()
        if s:
            say(f"   leased on P: {s.active:2.0f}   lease renewals so far: {s.renewed:4.0f}   "
                f"expired: {s.expired:2.0f}{extra}")  # fmt: skip
        time.sleep(min(every, max(0.0, until - time.time())))


def run(connector: str, lease_s: int, out_dir: Path) -> dict:
    cfg = PDConfig(connector=connector, lease_s=lease_s, d_max_num_seqs=1, log_dir=out_dir / "logs")
    name, env = CONNECTORS[connector]
    how = f'"{name}" with {" ".join(f"{k}={v}" for k, v in env.items())}' if env else f'"{name}"'
    ext = scenarios.lease_extension(lease_s)
    say(f"starting P (core 0), D (core 1) and vllm-router: kv_connector {how}, lease {lease_s}s, "
        f"heartbeat every {scenarios.lease_interval(lease_s)}s extends it to now + {ext}s")  # fmt: skip
    pd = PDCluster(cfg)
    pd.progress = lambda m: say("   " + m.strip())
    with pd:
        say(f"ready: P {pd.p_url}  D {pd.d_url}  router {pd.r_url}")
        sampler = Sampler(pd.p_url).start()
        t_traffic = time.time()
        exp_start = client.metric(pd.p_url, scenarios.EXPIRED)

        say("1. a stream of requests through router -> P (prefill) -> D (decode, KV read over NIXL)")
        eq = scenarios.equality(pd)
        stream = client.complete_many(pd.r_url, scenarios.burst_prompts(6, "stream"), 16, timeout=60)
        n_ok = sum(r.ok for r in stream) + len(eq.pairs)
        say(f"   {len(eq.pairs) + len(stream)} routed requests, {n_ok} ok; NIXL reads on D: "
            f"{eq.transfers:.0f}+; greedy output equals P alone: {eq.equal}")  # fmt: skip

        hold = lease_s + 8
        say(f"2. D is slow: a long request holds its only slot; {N_QUEUED} routed requests queue behind it "
            f"for {hold}s, longer than the {lease_s}s lease")  # fmt: skip
        sampler.mark("D slow")
        blocker = scenarios.block_decode(pd, max_s=hold + 60)
        try:
            burst = scenarios.queue_behind(pd, N_QUEUED, "slow", 16, 120, blocker)
            _progress(sampler, burst.t_queued + hold)
        finally:
            blocker.release()
        sampler.mark("D free")
        slow = burst.results()
        exp_slow = client.metric(pd.p_url, scenarios.EXPIRED) - exp_start
        say(f"   D free again: {sum(r.ok for r in slow)}/{len(slow)} queued requests served after waiting "
            f"{min(r.elapsed for r in slow):.0f}-{max(r.elapsed for r in slow):.0f}s; leases expired while D "
            f"was alive: {exp_slow:.0f}")  # fmt: skip

        say(f"3. {N_QUEUED} more requests queue behind a slow D, then kill -9 of D's whole process tree")
        exp0 = client.metric(pd.p_url, scenarios.EXPIRED)
        settle = (lease_s - ext) + scenarios.lease_interval(lease_s) + 2.5
        blocker = scenarios.block_decode(pd, max_s=settle + 120)
        sampler.mark("D slow")
        try:
            burst = scenarios.queue_behind(pd, N_QUEUED, "crash", 16, 120, blocker)
            _progress(sampler, burst.t_queued + settle)
            pre_kill = sampler.latest()
            sampler.mark("D killed")
            t_kill = pd.kill_decode()
        finally:
            blocker.release()
        results = burst.results()
        failed = [r for r in results if not r.ok]
        held = pre_kill.active if pre_kill else float("nan")
        say(f"   D killed holding {held:.0f} leases on P; router: {len(failed)} "
            f"in-flight requests failed fast (HTTP {sorted({r.status for r in failed})}, within "
            f"{max((r.t_end - t_kill for r in failed), default=0):.1f}s)")  # fmt: skip
        say("   a new D starts on D's core meanwhile (about a minute); P waits out the dead one's leases")
        t_r = time.time()
        pd.start_decode()
        deadline = t_kill + ext + 12
        while time.time() < deadline:
            s = sampler.latest()
            if client.metric(pd.p_url, scenarios.EXPIRED, timeout=3.0) - exp0 >= N_QUEUED:
                break
            active = s.active if s else float("nan")
            say(f"   leased on P: {active:2.0f}   (D dead for {time.time() - t_kill:4.1f}s)")
            time.sleep(min(2.0, max(0.0, deadline - time.time())))
        reclaimed = client.metric(pd.p_url, scenarios.EXPIRED, timeout=3.0) - exp0
        ev = plog.parse(pd.prefill.log_path)  # type: ignore[union-attr]
        last_hb = ev.last_heartbeat_of_killed(t_kill)
        expiries = ev.expiries_after(t_kill - 1)
        t_reclaim = max((t for t, _ in expiries), default=None)
        if t_reclaim:
            sampler.events.append((t_reclaim, "P reclaimed"))
        reclaim = round(t_reclaim - last_hb, 2) if (t_reclaim and last_hb) else None
        say(f"   P reclaimed {reclaimed:.0f} lease(s) {reclaim}s after D's last heartbeat "
            f"(P's log; extension {ext}s), {t_reclaim - t_kill:.1f}s after the kill"
            if reclaim is not None and t_reclaim else "   P reclaimed nothing")  # fmt: skip

        say("4. waiting for the new D")
        pd.wait_decode()
        pd.wait_router_sees_decode(timeout=90)
        sampler.mark("new D ready")
        after = scenarios.equality(pd)
        say(f"   new D ready in {time.time() - t_r:.0f}s; {len(after.pairs)} requests served through it, "
            f"output equals P alone: {after.equal}")  # fmt: skip
        time.sleep(1.0)
        sampler.stop()
        expired_alive = sum(1 for t, _ in ev.expiries if t_traffic <= t < t_kill)

    final = sampler.latest()
    summary = {
        "connector": connector,
        "kv_connector": name,
        "env": env,
        "lease_s": lease_s,
        "extension_s": ext,
        "requests_routed": 2 * len(eq.pairs) + len(stream) + 2 * N_QUEUED,
        "outputs_equal_p_alone": eq.equal and after.equal,
        "nixl_transfers_on_d": eq.transfers + after.transfers + len(slow),
        "leases_granted": final.granted if final else None,
        "renewals": final.renewed if final else None,
        "max_leased": max((s.active for s in sampler.samples), default=0),
        "queued_beyond_lease_served": sum(r.ok for r in slow),
        "queued_wait_s": [round(r.elapsed, 1) for r in slow],
        "expired_while_d_alive": expired_alive,
        "leases_at_kill": pre_kill.active if pre_kill else None,
        "reclaimed": reclaimed,
        "reclaim_after_last_heartbeat_s": reclaim,
        "reclaim_after_kill_s": round(t_reclaim - t_kill, 2) if t_reclaim else None,
        "inflight_failed_fast": len(failed),
        "new_d_ready_s": round(sampler.events[-1][0] - t_r, 1),
        "served_after_new_d": len(after.pairs),
        "timeline": [(round(s.t - t_traffic, 2), s.active, s.renewed, s.expired) for s in sampler.samples],
        "events": [(round(t - t_traffic, 2), label) for t, label in sorted(sampler.events)],
        "wall_s": round(time.time() - T0, 1),
    }
    png = plot(sampler, ev.heartbeats, t_traffic, out_dir / "timeline.png",
               f"P/D lease timeline: {how}, lease {lease_s}s", lease_s)  # fmt: skip
    summary["png"] = str(png) if png else None
    return summary


def _leased_over_time(timeline: list[tuple[float, float, float, float]]) -> str:
    """`t:leased` at every change of P's lease gauge (seconds since the start of traffic)."""
    out, last = [], None
    for t, active, _r, _e in timeline:
        if active != last:
            out.append(f"{t:.0f}s:{active:.0f}")
            last = active
    return " ".join(out)


def table(s: dict, timeline: list) -> str:
    r = s["reclaim_after_last_heartbeat_s"]
    reclaim = f"{r:.2f}s after D's last heartbeat (extension {s['extension_s']}s)" if r is not None else "n/a"
    rows = [
        ("requests routed", s["requests_routed"]),
        ("greedy output equals P alone", s["outputs_equal_p_alone"]),
        ("NIXL transfers (reads on D)", f"{s['nixl_transfers_on_d']:.0f}"),
        ("leases granted on P", f"{s['leases_granted']:.0f}"),
        ("lease renewals (heartbeat ids)", f"{s['renewals']:.0f}"),
        ("queued past the lease, served", f"{s['queued_beyond_lease_served']} (waited {s['queued_wait_s']})"),
        ("leases expired while D alive", s["expired_while_d_alive"]),
        ("leases held at D crash", f"{s['leases_at_kill']:.0f}"),
        ("reclaimed after crash", f"{s['reclaimed']:.0f}"),
        ("reclaim time", reclaim),
        ("in-flight requests failed fast", s["inflight_failed_fast"]),
        ("served after new D", s["served_after_new_d"]),
        ("leased requests over time", _leased_over_time(timeline)),
        ("wall time", f"{s['wall_s']}s"),
    ]  # fmt: skip
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connector", choices=sorted(CONNECTORS), default="hook")
    ap.add_argument("--lease", type=int, default=15)
    ap.add_argument("--out", type=Path, default=BUILD / "demo")
    args = ap.parse_args(argv)
    install_signal_handlers()
    args.out.mkdir(parents=True, exist_ok=True)
    summary = run(args.connector, args.lease, args.out)
    timeline = summary.pop("timeline")
    print("\n" + table(summary, timeline))
    (args.out / "summary.json").write_text(json.dumps({**summary, "timeline": timeline}, indent=2))
    print(f"\n  summary: {args.out / 'summary.json'}\n  timeline: {summary['png']}")
    ok = (
        summary["outputs_equal_p_alone"]
        and summary["expired_while_d_alive"] == 0
        and summary["queued_beyond_lease_served"] == N_QUEUED
        and summary["reclaimed"] == N_QUEUED
        and summary["served_after_new_d"] > 0
    )
    if not ok:
        print("\n  the story did not hold: see the table above and the logs in", args.out / "logs")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
