"""`make demo`: real `vllm serve` prefill + decode behind vllm-router, with our lease connector.

Story: serve requests; make D slow so requests queue beyond the lease and watch the leases being
renewed; `kill -9` D and watch P reclaim; start a new D and serve again. Prints a table, writes
`.build/demo/timeline.png` and `.build/demo/summary.json`.
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


def say(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def _progress(sampler: Sampler, until: float, every: float = 3.0) -> None:
    while time.time() < until:
        s = sampler.latest()
        if s:
            say(f"  leased on P: {s.active:3.0f}   renewals: {s.renewed:5.0f}   expired: {s.expired:3.0f}")
        time.sleep(every)


def run(connector: str, lease_s: int, out_dir: Path) -> dict:
    cfg = PDConfig(connector=connector, lease_s=lease_s, d_num_blocks=20, d_max_num_seqs=1,
                   log_dir=out_dir / "logs")  # fmt: skip
    name, env = CONNECTORS[connector]
    how = f"{name} + {env}" if env else name
    say(f"starting P, D and vllm-router (connector {how}, lease {lease_s}s)")
    with PDCluster(cfg) as pd:
        say(f"ready: P {pd.p_url}  D {pd.d_url}  router {pd.r_url}")
        sampler = Sampler(pd.p_url).start()
        t_traffic = time.time()
        eq = scenarios.equality(pd)
        say(f"1. served {len(eq.pairs)} requests via router -> P -> D; NIXL reads on D: {eq.transfers:.0f}; "
            f"greedy output equals P alone: {eq.equal}")  # fmt: skip

        load = scenarios.size_load(pd, queue_s=lease_s * 2.2)
        say(f"2. D runs one request at a time; sending {load.n} x {load.max_tokens} tokens: they queue on D")
        burst = scenarios.Burst(pd.r_url, scenarios.burst_prompts(load.n, "demo"), load.max_tokens, 180)
        ext = scenarios.lease_extension(lease_s)
        settle = lease_s + 3  # queued beyond the lease: only renewals keep these leases alive
        _progress(sampler, burst.t_start + settle)
        scenarios.wait_queued_on_d(pd, burst, settle)
        pre_kill = sampler.latest()

        sampler.mark("D killed (kill -9)")
        t_kill = pd.kill_decode()
        say(f"3. kill -9 of D's process tree with {pre_kill.active if pre_kill else '?'} leases held on P")
        results = burst.results()
        failed = [r for r in results if not r.ok]
        say(f"   router: {len(results) - len(failed)} finished before the crash, {len(failed)} failed fast "
            f"(max {max((r.t_end - t_kill for r in failed), default=0):.1f}s after the kill)")  # fmt: skip
        _wait_reclaim(pd, sampler, t_kill, ext)
        ev = plog.parse(pd.prefill.log_path)  # type: ignore[union-attr]
        last_hb = ev.last_heartbeat_before(t_kill)
        expiries = ev.expiries_after(t_kill - 1)
        t_reclaim = max((t for t, _ in expiries), default=None)
        if t_reclaim:
            sampler.mark("P reclaimed")
        reclaim = (t_reclaim - last_hb) if (t_reclaim and last_hb) else None
        say(f"   P reclaimed {len(expiries)} lease(s) "
            f"{reclaim:.1f}s after D's last heartbeat (extension {ext}s)" if reclaim is not None
            else "   P reclaimed nothing (no queued leases at the kill)")  # fmt: skip

        say("4. starting a new D")
        t_r = time.time()
        pd.restart_decode()
        pd.wait_router_sees_decode(timeout=90)
        sampler.mark("new D ready")
        after = [client.complete(pd.r_url, p, 16, timeout=60) for p in scenarios.PROMPTS]
        n_ok = sum(r.ok for r in after)
        say(f"   new D ready in {time.time() - t_r:.0f}s; {n_ok}/{len(after)} requests served")
        time.sleep(1.5)
        sampler.stop()

    final = sampler.latest()
    summary = {
        "connector": connector,
        "kv_connector": name,
        "lease_s": lease_s,
        "extension_s": ext,
        "requests_sent": len(eq.pairs) * 2 + load.n + len(after) + 1,
        "outputs_equal_p_alone": eq.equal,
        "transfers_phase1": eq.transfers,
        "leases_granted": final.granted if final else None,
        "renewals": final.renewed if final else None,
        "heartbeat_log_lines": len(ev.heartbeats),
        "max_leased": max((s.active for s in sampler.samples), default=0),
        # From the start of the story: a router warm-up request may leave one lease behind before.
        "expired_while_d_alive": sum(1 for t, _ in ev.expiries if t_traffic <= t < t_kill),
        "leases_at_kill": pre_kill.active if pre_kill else None,
        "reclaimed": len(expiries),
        "reclaim_after_last_heartbeat_s": reclaim,
        "inflight_failed_fast": len(failed),
        "served_after_new_d": sum(r.ok for r in after),
        "timeline": [(round(s.t - t_traffic, 2), s.active, s.renewed, s.expired) for s in sampler.samples],
        "events": [(round(t - t_traffic, 2), label) for t, label in sampler.events],
        "wall_s": round(time.time() - T0, 1),
    }
    png = plot(sampler, ev.heartbeats, t_traffic, out_dir / "timeline.png",
               f"P/D lease timeline ({name}, lease {lease_s}s)", lease_s)  # fmt: skip
    summary["png"] = str(png) if png else None
    return summary


def _wait_reclaim(pd: PDCluster, sampler: Sampler, t_kill: float, ext: int) -> None:
    # Our P reclaims at last heartbeat + extension; show the countdown, bounded.
    deadline = t_kill + ext + 15
    while time.time() < deadline:
        s = sampler.latest()
        if s and s.active == 0 and time.time() > t_kill + ext - 2:
            return
        say(f"  leased on P: {s.active if s else '?':>3}   (D dead for {time.time() - t_kill:4.1f}s)")
        time.sleep(2.0)


def table(s: dict) -> str:
    r = s["reclaim_after_last_heartbeat_s"]
    reclaim = f"{r:.1f}s (extension {s['extension_s']}s)" if r is not None else "n/a"
    rows = [
        ("requests sent", s["requests_sent"]),
        ("NIXL transfers (phase 1)", f"{s['transfers_phase1']:.0f}"),
        ("leases granted on P", s["leases_granted"]),
        ("lease renewals (heartbeat ids)", s["renewals"]),
        ("max leased requests on P", f"{s['max_leased']:.0f}"),
        ("expired while D alive", s["expired_while_d_alive"]),
        ("leases held at D crash", s["leases_at_kill"]),
        ("reclaimed after crash", s["reclaimed"]),
        ("reclaim after last heartbeat", reclaim),
        ("in-flight requests failed fast", s["inflight_failed_fast"]),
        ("served after new D", s["served_after_new_d"]),
        ("wall time", f"{s['wall_s']}s"),
    ]  # fmt: skip
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connector", choices=sorted(CONNECTORS), default="lease")
    ap.add_argument("--lease", type=int, default=15)
    ap.add_argument("--out", type=Path, default=BUILD / "demo")
    args = ap.parse_args(argv)
    install_signal_handlers()
    args.out.mkdir(parents=True, exist_ok=True)
    summary = run(args.connector, args.lease, args.out)
    timeline = summary.pop("timeline")
    print("\n" + table(summary))
    (args.out / "summary.json").write_text(json.dumps({**summary, "timeline": timeline}, indent=2))
    print(f"\n  summary: {args.out / 'summary.json'}\n  timeline: {summary['png']}")
    ok = summary["outputs_equal_p_alone"] and not summary["expired_while_d_alive"]
    ok = ok and summary["served_after_new_d"] > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
