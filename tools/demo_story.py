"""The demo's four chapters on one running P/D pair (stock or ours), reusing the e2e scenarios.

Each chapter records its wall-clock window, so the figure and the fired alerts can be read back
from Prometheus for exactly that span. A chapter ends only once Prometheus has scraped the pair
after the chapter's last reading (`scraped`), so the window's last samples hold the state its
numbers describe, even when the servers stop right after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from harness.serve import client, fencing, scenarios
from harness.serve.launcher import PDCluster

N_QUEUED = 4
CHAPTERS = {
    1: "routed through vllm-router = P alone",
    2: "D queued past the lease",
    3: "D frozen past the lease, P reuses the blocks",
    4: "D killed",
}


@dataclass
class Chapter:
    n: int
    t0: float
    t1: float = 0.0
    claims: dict[str, bool] = field(default_factory=dict)  # claim -> held
    numbers: dict[str, object] = field(default_factory=dict)
    events: list[tuple[float, str]] = field(default_factory=list)  # (wall time, label) for the figure

    @property
    def held(self) -> bool:
        return all(self.claims.values())


def _settled(url: str, name: str, quiet_s: float = 2.0, timeout: float = 8.0) -> float:
    """The metric once it has not changed for `quiet_s`: a server reports some counts a step or
    two after the request that caused them has answered."""
    value, since = client.metric(url, name), time.time()
    deadline = since + timeout
    while time.time() < deadline and time.time() - since < quiet_s:
        time.sleep(0.4)
        now = client.metric(url, name)
        if now != value:
            value, since = now, time.time()
    return value


def run_side(
    pd: PDCluster, ours: bool, say: Callable[[str], None], scraped: Callable[[], None] = lambda: None
) -> list[Chapter]:
    """The four chapters in order; `scraped()` returns once Prometheus has scraped this pair after
    the call (a no-op without Prometheus)."""
    lease = pd.cfg.lease_s
    out = []

    def close(ch: Chapter) -> None:
        scraped()
        ch.t1 = time.time()
        out.append(ch)

    scraped()  # the first chapter's window starts from a scrape of the idle pair

    say(f"1. {CHAPTERS[1]}")
    ch = Chapter(1, time.time())
    reads0 = client.metric(pd.d_url, scenarios.XFER_TIME_COUNT)
    eq = scenarios.equality(pd)
    reads = _settled(pd.d_url, scenarios.XFER_TIME_COUNT) - reads0
    ch.numbers = {
        "routed": len(eq.pairs),
        "equal_p_alone": sum(a == b for a, b in eq.pairs),
        "nixl_reads_on_d": reads,
    }
    ch.claims = {
        "routed output equals P alone": eq.equal,
        "D read KV over NIXL": reads >= len(eq.pairs),
    }
    say(
        f"   {ch.numbers['equal_p_alone']}/{len(eq.pairs)} routed completions equal P alone; "
        f"NIXL reads on D: {reads:.0f}"
    )
    close(ch)

    hold = lease + 3
    say(
        f"2. {CHAPTERS[2]}: {N_QUEUED} routed requests wait {hold}s behind a long request on D "
        f"(lease {lease}s)"
    )
    ch = Chapter(2, time.time())
    ov = scenarios.overload(pd, N_QUEUED, hold)
    served = sum(r.ok for r in ov.results)
    ch.numbers = {
        "queued": N_QUEUED,
        "served": served,
        "held_s": round(ov.held_s, 1),
        "expired": ov.expired,
        "heartbeat_log_lines": ov.heartbeats,
        "max_heartbeat_gap_s": round(ov.max_hb_gap_s, 2),
    }
    ch.claims = {"all queued requests served": served == N_QUEUED, "no lease expired": ov.expired == 0}
    say(
        f"   {served}/{N_QUEUED} served after {ov.held_s:.0f}s in D's queue; leases expired on P: "
        f"{ov.expired:.0f}; heartbeats seen in P's log: {ov.heartbeats} (max gap {ov.max_hb_gap_s:.1f}s)"
    )
    close(ch)

    say(f"3. {CHAPTERS[3]}: SIGSTOP D with {N_QUEUED} requests queued, P expires and reuses, SIGCONT")
    ch = Chapter(3, time.time())
    fr = fencing.frozen_decode(pd, n=N_QUEUED)
    ch.events = [(fr.t_freeze, "D frozen"), (fr.t_freeze + fr.frozen_s, "D resumes")]
    wrong_200 = sum(r.ok and r.text != ref for r, ref in zip(fr.results, fr.references, strict=True))
    ok = sum(r.ok for r in fr.results)
    ch.numbers = {
        "requests": N_QUEUED,
        "frozen_s": round(fr.frozen_s, 1),
        "expired": fr.expired,
        "churned": fr.churned,
        "http_200": ok,
        "wrong_with_http_200": wrong_200,
        "fenced_on_d": fr.fenced,
        "reads_after_expiry_on_p": fr.notifs_after_expiry,
    }
    ch.claims = {"P let the frozen D's leases lapse": fr.expired >= N_QUEUED}
    if ours:
        ch.claims |= {
            "0 wrong answers": fr.mismatches == 0,
            "all answered (recomputed)": ok == N_QUEUED,
            "D fenced every stale read": fr.fenced >= N_QUEUED,
        }
    else:  # the chapter proves nothing unless stock really serves wrong answers with HTTP 200
        ch.claims |= {"stock served wrong answers with HTTP 200": wrong_200 > 0}
    say(
        f"   D frozen {fr.frozen_s:.0f}s; P expired {fr.expired:.0f} leases, ran {fr.churned} other prompts; "
        f"answers: {ok}/{N_QUEUED} HTTP 200, {wrong_200} of them differ from P alone; "
        f"fenced on D: {fr.fenced:.0f}; reads after expiry on P: {fr.notifs_after_expiry:.0f}"
    )
    close(ch)

    ext, interval = scenarios.lease_extension(lease), scenarios.lease_interval(lease)
    settle = (lease - ext) + interval + 2.5  # leases heartbeat-driven when D dies
    say(f"4. {CHAPTERS[4]}: {N_QUEUED} requests queued on D, kill -9 of D's tree {settle:.0f}s later")
    ch = Chapter(4, time.time())
    rc = scenarios.kill_and_reclaim(pd, N_QUEUED, settle, ext + 12, restart=False)
    failed = [r for r in rc.results if not r.ok]
    fail_s = max((r.t_end - rc.kill_ts for r in failed), default=None)
    ch.events = [(rc.kill_ts, "D killed")]
    if rc.expiries:
        ch.events.append((max(t for t, _ in rc.expiries), "P reclaimed"))
    # What P holds once the reclaim is counted, read last in the chapter so the window's last scrape
    # of the lease gauge shows it (ours only: stock exports no lease gauge).
    held_after = None
    if ours:
        p_text = client.metrics_text(pd.p_url, timeout=3.0)
        held_after = client.metric_sum(p_text, scenarios.LEASE_ACTIVE) if p_text else None
    ch.numbers = {
        "queued": N_QUEUED,
        "leases_at_kill": rc.leases_at_kill,
        "reclaimed": rc.expired_metric,
        "leases_held_after": held_after,
        "reclaim_after_last_heartbeat_s": rc.reclaim_after_last_hb_s,
        "reclaim_after_kill_s": rc.reclaim_after_kill_s,
        "extension_s": ext,
        "inflight_failed": len(failed),
        "inflight_failed_within_s": round(fail_s, 2) if fail_s else None,
        "p_healthy_after": rc.p_healthy_after,
    }
    ch.claims = {
        "P reclaimed every lease": rc.expired_metric >= N_QUEUED,
        "in-flight requests failed within 15 s": len(failed) == N_QUEUED and (fail_s or 99) < 15,
        "P healthy after": rc.p_healthy_after,
    }
    if ours:
        ch.claims["P holds no lease after the reclaim"] = held_after == 0
    say(
        f"   P reclaimed {rc.expired_metric:.0f}/{N_QUEUED} leases {rc.reclaim_after_last_hb_s}s after "
        f"D's last heartbeat ({rc.reclaim_after_kill_s}s after the kill); {len(failed)} in-flight requests "
        f"failed within {fail_s or 0:.1f}s"
        + (f"; leases still held on P: {held_after:.0f}" if held_after is not None else "")
    )
    close(ch)
    return out
