"""`make demo` (python -m tools.demo): why switch, stock vLLM and ours side by side in one run.

Two real P/D pairs (`vllm serve` prefill + decode behind vllm-router, one core each), stock
NixlConnector first, then ours loaded through the import hook under the same name
(VLLM_NIXL_LEASE=1: no config change). Both use kv_load_failure_policy=recompute. A real
Prometheus (Debian's package) scrapes P, D and the router of both and evaluates the shipped alert
rules (monitoring/alerts.yml). Chapters, each on both pairs:

  1. requests routed through vllm-router answer exactly as P alone;
  2. D queued past the lease: leases renew, nothing expires;
  3. D frozen past the lease while P reuses the blocks: stock answers wrong with HTTP 200, ours
     fences the stale reads and recomputes: 0 wrong answers;
  4. D killed: P reclaims its leases; in-flight requests fail fast;
  5. P's connector time per step at scale, when .build/bench-fleet.json exists.

Writes .build/demo/summary.json (every number), .build/demo/series.json (every series the figure
draws, as Prometheus scraped it) and .build/demo/timeline.png (wrong answers, stock against ours, on
top; then one row per chapter, stock and ours side by side). Exits 1 if any claim does not hold,
including "the figure's series end at the summary's numbers". `--replot` redraws the figure from
the saved summary and series, without servers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from harness.procs import install_signal_handlers
from harness.serve import client, prom
from harness.serve.launcher import BUILD, PDCluster, PDConfig
from tools import demo_story as story
from tools import demo_timeline as timeline

T0 = time.time()
SIDES = {"stock": "stock", "ours": "hook"}  # side -> harness.serve.launcher connector
FLEET = BUILD / "bench-fleet.json"


def say(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def _await_scrape(server: prom.Prometheus, side: str, timeout: float = 10.0) -> None:
    """Return once Prometheus has scraped every target of `side` after this call (the scrape of a
    dead or frozen target counts: it records `up` 0), so the state read so far is in its data."""
    after = time.time()
    deadline = after + timeout
    jobs = {f"{side}-P", f"{side}-D", f"{side}-router"}
    while time.time() < deadline:
        res = server.query(f'timestamp(up{{job=~"{side}-.*"}})')
        if jobs <= {r["metric"]["job"] for r in res if float(r["value"][1]) > after}:
            return
        time.sleep(0.2)
    say(f"   Prometheus did not scrape {sorted(jobs)} within {timeout:.0f}s: the figure may lag")


def _metric_check(pd: PDCluster) -> list[str]:
    """Names the shipped rules and dashboard query that P and D do not expose (must be none)."""
    scrapes = [client.metrics_text(pd.p_url), client.metrics_text(pd.d_url)]
    return sorted(prom.metric_names() - prom.exposed_names(scrapes))


def _fleet() -> tuple[list[dict] | None, str]:
    """Chapter 5's rows {"leases", "stock_us", "ours_us"} (p99 per P step) from
    `make bench-fleet`, or why not."""
    if not FLEET.exists():
        return None, f"skipped: {FLEET.relative_to(BUILD.parent)} not found (made by the fleet benchmark)"
    try:
        rows = json.loads(FLEET.read_text())["rows"]
        # `make bench-fleet`'s stock/ours rows of the P fleet: the p99 per P step.
        fleet = [
            {"leases": float(r["leases"]), "stock_us": r["stock_p99_us"], "ours_us": r["ours_p99_us"]}
            for r in rows
            # leases 0 is the floor (no lease, no message), not a fleet size
            if r.get("scenario") == "p_fleet" and r.get("impl") == "stock/ours" and r.get("leases")
        ]
        if not fleet:
            raise KeyError("no p_fleet stock/ours rows")
        return sorted(fleet, key=lambda r: r["leases"]), ""
    except (ValueError, KeyError, TypeError) as e:
        return None, f"skipped: {FLEET} has no P-fleet rows ({type(e).__name__}: {e})"


def _alerts(server: prom.Prometheus | None, sides: dict[str, list[story.Chapter]]) -> dict[str, dict]:
    """side -> chapter -> ["AlertName (job)", ...]: alerts that went to firing during the chapter
    (or within 10 s after the side's last chapter, while its servers stop)."""
    out: dict[str, dict[int, list]] = {s: {ch.n: [] for ch in chs} for s, chs in sides.items()}
    if server is None:
        return out
    t_end = max(ch.t1 for chs in sides.values() for ch in chs) + 10
    for t, labels in server.alert_onsets(T0, t_end):
        side = labels.get("job", "").split("-")[0]
        for i, ch in enumerate(sides.get(side, [])):
            nxt = sides[side][i + 1].t0 if i + 1 < len(sides[side]) else ch.t1 + 10
            if ch.t0 <= t < nxt:
                out[side][ch.n].append(f"{labels['alertname']} ({labels.get('job')})")
    return out


def _table(sides: dict[str, list[story.Chapter]], alerts: dict, startup: dict[str, float]) -> str:
    def num(side: str, n: int, key: str) -> object:
        return next(ch.numbers.get(key) for ch in sides[side] if ch.n == n) if side in sides else None

    def row(label: str, fn: Callable[[str], object]) -> tuple[str, ...]:
        return (label, *(str(fn(s)) for s in sides))

    rows = [
        ("", *sides),
        row("pair start-up (P+D+router)", lambda s: f"{startup[s]:.0f}s"),
        row("1. routed = P alone", lambda s: f"{num(s, 1, 'equal_p_alone')}/{num(s, 1, 'routed')}"),
        row("2. queued past lease, served", lambda s: f"{num(s, 2, 'served')}/{story.N_QUEUED} after "
            f"{num(s, 2, 'held_s')}s"),
        row("2. leases expired, D alive", lambda s: f"{num(s, 2, 'expired'):.0f}"),
        row("3. wrong answers, HTTP 200", lambda s: f"{num(s, 3, 'wrong_with_http_200')}/{story.N_QUEUED}"),
        row("3. reads fenced on D", lambda s: f"{num(s, 3, 'fenced_on_d'):.0f}"),
        row("3. reads after expiry (P)", lambda s: f"{num(s, 3, 'reads_after_expiry_on_p'):.0f}"),
        row("4. leases reclaimed, held after", lambda s: f"{num(s, 4, 'reclaimed'):.0f}/{story.N_QUEUED}, "
            f"{timeline._f(num(s, 4, 'leases_held_after'))}"),
        row("4. reclaim after last HB", lambda s: f"{num(s, 4, 'reclaim_after_last_heartbeat_s')}s "
            f"(ext {num(s, 4, 'extension_s')}s)"),
        row("4. in-flight failed within", lambda s: f"{num(s, 4, 'inflight_failed_within_s')}s"),
    ]  # fmt: skip
    for n in story.CHAPTERS:

        def fired(s: str, n: object = n) -> str:
            return ", ".join(alerts[s].get(n, [])) or "none"

        rows.append(row(f"alerts fired in {n}", fired))
    rows.append(row("claims held", lambda s: "all" if all(ch.held for ch in sides[s]) else "NO"))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows)


def _check_series(sides: dict[str, list[story.Chapter]], series: dict) -> dict[str, dict[int, list[str]]]:
    """Adds the claim "the figure's series end at these numbers" to every chapter; returns the
    mismatches, side -> chapter -> [what disagrees]."""
    out: dict[str, dict[int, list[str]]] = {}
    for s, chs in sides.items():
        for ch in chs:
            found = timeline.disagreements(ch.n, ch.numbers, series.get(s, {}).get(str(ch.n), {}))
            ch.claims["the figure's series end at these numbers"] = not found
            if found:
                out.setdefault(s, {})[ch.n] = found
    return out


def _summary_chapters(sides: dict[str, list[story.Chapter]], alerts: dict) -> dict[str, list[dict]]:
    return {s: [{"n": ch.n, "title": story.CHAPTERS[ch.n], "t0": ch.t0, "t1": ch.t1,
                 "seconds": round(ch.t1 - ch.t0, 1), "numbers": ch.numbers, "claims": ch.claims,
                 "alerts": alerts[s][ch.n], "events": ch.events}
                for ch in chs] for s, chs in sides.items()}  # fmt: skip


def replot(out: Path) -> int:
    """Redraw the figure from the summary and series a previous run saved in `out`."""
    summary = json.loads((out / "summary.json").read_text())
    series_path = out / "series.json"
    series = json.loads(series_path.read_text()) if series_path.exists() else None
    png = timeline.plot(summary, series, out / "timeline.png")
    print(f"  figure:  {png}")
    return 0 if png else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lease", type=int, default=15)
    ap.add_argument("--out", type=Path, default=BUILD / "demo")
    ap.add_argument("--sides", default="stock,ours", help="comma list of stock,ours (default both)")
    ap.add_argument(
        "--replot",
        action="store_true",
        help="redraw timeline.png from OUT's summary.json and series.json, start nothing",
    )
    args = ap.parse_args(argv)
    if args.replot:
        return replot(args.out)
    install_signal_handlers()
    args.out.mkdir(parents=True, exist_ok=True)
    names = [s for s in args.sides.split(",") if s]
    pairs = {
        s: PDCluster(PDConfig(connector=SIDES[s], lease_s=args.lease, num_blocks=80, d_max_num_seqs=1,
                              kv_transfer={"kv_load_failure_policy": "recompute"},
                              log_dir=args.out / "logs" / s))
        for s in names
    }  # fmt: skip
    server = None
    if prom.binary() is None:
        say(f"Prometheus: not installed, running without it (no series in the figure, no alerts): "
            f"{prom.INSTALL_HINT}")  # fmt: skip
    else:
        targets: dict[str, list[str]] = {}
        for s, pd in pairs.items():
            targets |= {f"{s}-P": [f"127.0.0.1:{pd.p_port}"], f"{s}-D": [f"127.0.0.1:{pd.d_port}"],
                        f"{s}-router": [f"127.0.0.1:{pd.r_prom}"]}  # fmt: skip
        server = prom.Prometheus(targets, args.out / "logs")
        server.wait_ready()
        say(f"Prometheus {server.url} (pid {server.proc.pid}) scrapes {len(targets)} targets every 1s, "
            f"evaluates {prom.RULES.relative_to(prom.ROOT)} every 1s")  # fmt: skip
    sides: dict[str, list[story.Chapter]] = {}
    startup: dict[str, float] = {}
    missing: list[str] = []
    try:
        for s, pd in pairs.items():
            conn = "stock NixlConnector" if s == "stock" else "ours, via the import hook (same config)"
            say(f"== {s}: starting P (core 0), D (core 1), vllm-router: {conn}, lease {args.lease}s")
            pd.progress = lambda m: say("   " + m.strip())
            t = time.time()
            with pd:
                startup[s] = time.time() - t
                say(f"   ready in {startup[s]:.0f}s")
                if s == "ours":
                    missing = _metric_check(pd)
                    say(f"   metric names in monitoring/ missing from P/D scrapes: {missing or 'none'}")

                def scraped(side: str = s) -> None:
                    if server is not None:  # without Prometheus there is no scrape to wait for
                        _await_scrape(server, side)

                sides[s] = story.run_side(pd, ours=s == "ours", say=say, scraped=scraped)
            say(f"== {s}: stopped")
        time.sleep(3)  # the last evaluations
        fleet, why = _fleet()
        say(f"5. P's connector time per step at scale: {why or f'{len(fleet or [])} rows from {FLEET}'}")
        alerts = _alerts(server, sides)
        series = timeline.collect(server, sides) if server is not None else None
    finally:
        if server is not None:
            server.close()
    disagree = _check_series(sides, series) if series is not None else {}
    if "ours" in sides:
        fenced_alert = any(a.startswith("NixlLeaseReadsFenced") for a in alerts["ours"][3])
        quiet = not (alerts["ours"][1] or alerts["ours"][2])
        sides["ours"][2].claims["alert NixlLeaseReadsFenced fired"] = fenced_alert or server is None
        sides["ours"][1].claims["no alert in chapters 1-2"] = quiet
        sides["ours"][0].claims["every metric in monitoring/ is exposed"] = not missing
    table = _table(sides, alerts, startup)
    wall = time.time() - T0
    print("\n" + table + f"\n\n  wall time: {wall:.0f}s")
    failed = [f"{s} {ch.n}: {claim}" for s, chs in sides.items() for ch in chs
              for claim, ok in ch.claims.items() if not ok]  # fmt: skip
    summary = {
        "wall_s": round(wall, 1),
        "lease_s": args.lease,
        "startup_s": {s: round(v, 1) for s, v in startup.items()},
        "chapters": _summary_chapters(sides, alerts),
        "fleet": fleet,
        "fleet_skipped": why,
        "prometheus": server is not None,
        "series_disagree": disagree,
        "claims_failed": failed,
    }
    if series is not None:
        (args.out / "series.json").write_text(json.dumps(series))
    else:
        (args.out / "series.json").unlink(missing_ok=True)
    png = timeline.plot(summary, series, args.out / "timeline.png")
    summary["png"] = str(png) if png else None
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"  summary: {args.out / 'summary.json'}\n  series:  {args.out / 'series.json'}\n  figure:  {png}")
    if failed:
        print("\n  claims that did not hold:\n    " + "\n    ".join(failed))
        print(f"  logs: {args.out / 'logs'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
