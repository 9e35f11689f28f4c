"""A network partition between P and D with real servers on two hosts: does D
read KV that P has freed and reused?

P and D run on two `harness.netns` hosts (`PDConfig(two_hosts=True)`). Routed requests queue on D
behind a blocker (`scenarios.block_and_queue`); then D's link goes down while they wait. P stays
reachable from the driver (only D's veth is cut). Two shapes:

- long (`partition_decode(pd, n)`): the cut lasts until P has expired the queued requests' leases,
  then P-alone requests churn P's few KV blocks, then the link heals and D is let go. During the
  cut `send_notif` on D still succeeds: UCX queues the heartbeats and delivers them after the heal,
  when P has freed (and reused) the blocks. A D that renewed its view of a lease when a send
  returned reads someone else's KV and answers with HTTP 200 (upstream's D: 8 of 8 wrong); ours renews
  only on P's acknowledgements, so its views have lapsed: it fences the reads and (with
  kv_load_failure_policy=recompute) recomputes, answering exactly as P alone does.
- short (`partition_decode(pd, n, cut_s=...)`, `cut_s` below extension - interval): nothing may
  expire and nothing be fenced; the heartbeats queued during the cut renew P's leases after the
  heal and D is let go only once P's acknowledgements renew its views again.

The cut starts `phase_s` after D's heartbeat counter (D's /metrics) was seen to move, so where it
falls relative to D's heartbeat is chosen, not left to chance; `Partition.cut_after_hb_s` is the
phase measured on P (the cut's time minus the last heartbeat P logged before it).

python -m harness.serve.partition --runs 5                      # ours/ours, a phase sweep
python -m harness.serve.partition --connector stock             # stock/stock
python -m harness.serve.partition --d-connector lease --connector stock   # our D with a stock P
python -m harness.serve.partition --short                       # a cut shorter than extension - interval
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from harness import procs
from harness.serve import client, plog
from harness.serve.fencing import CHURN_PROMPT, FENCED
from harness.serve.launcher import PDCluster
from harness.serve.scenarios import (
    EXPIRED,
    NOTIF_AFTER_EXPIRY,
    Burst,
    block_and_queue,
    burst_prompts,
    lease_extension,
    lease_interval,
    p_alone_references,
    where_requests_are,
)

HB_SENT = "vllm:nixl_lease_heartbeat_messages_sent"  # D (ours only): one per heartbeat message sent
HB_RECV = "vllm:nixl_lease_heartbeat_messages_received"  # P (ours only)
ACKS_RECV = "vllm:nixl_lease_heartbeat_acks_received"  # D: P's answers to acknowledged heartbeats
VIEWS_RENEWED = "vllm:nixl_lease_views_renewed"  # D


@dataclass
class Partition:
    connectors: str  # "P/D"
    phase_s: float  # asked: cut this long after D's heartbeat counter moved (None: no alignment)
    references: list[str]  # P alone, greedy
    results: list[client.Result]  # routed, queued on D across the cut
    cut_s: float  # D's link down
    expired: float  # P's lease expiries during the run
    expired_before_cut: float  # of those, before the cut (a stalled machine, not the partition)
    churned: int  # P-alone requests that reused P's blocks during the cut
    fenced: float  # D's fenced reads
    notifs_after_expiry: float  # P: read completions for leases it had dropped (reads of freed KV)
    # Heartbeats P received during the cut (must be 0: the cut stops NIXL traffic). Long shape: P's
    # counter from 1 s into the cut until the heal; short: P's log from 0.5 s (None: stock P, long).
    p_hb_during_cut: float | None
    hb_resume_after_heal_s: float | None  # first heartbeat P counted after the heal
    cut_after_hb_s: float | None  # the cut's time minus the last heartbeat P applied before it
    finish_after_heal_s: float  # last routed answer after the heal
    d_acks: float  # D: acknowledgements received during the run (ours/ours only)
    marks: dict[str, float] = field(default_factory=dict)  # event -> seconds after the cut
    t_cut: float = 0.0
    t_heal: float = 0.0
    # How long `ip link set down` and `ip link set up` took. The second is part of the cut: a slow
    # one (a starved machine) lengthens it past what was asked.
    cut_cmd_s: float = 0.0
    heal_cmd_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.results)

    @property
    def wrong(self) -> int:
        """HTTP 200 with a text that differs from P alone: served from someone else's KV."""
        return sum(r.ok and r.text != ref for r, ref in zip(self.results, self.references, strict=True))

    @property
    def errors(self) -> int:
        return sum(not r.ok for r in self.results)

    def summary(self) -> dict[str, object]:
        out = {
            k: (round(v, 2) if isinstance(v, float) else v)
            for k, v in asdict(self).items()
            if k not in ("references", "results", "t_cut", "t_heal")
        }
        out.update(n=self.n, wrong=self.wrong, errors=self.errors)
        out["error_samples"] = sorted({r.error[:80] for r in self.results if not r.ok})[:3]
        return out

    def line(self) -> str:
        def f(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}"

        return (
            f"{self.connectors}: phase {f(self.phase_s)}s (on P {f(self.cut_after_hb_s)}s), cut "
            f"{self.cut_s:.1f}s (heal command {self.heal_cmd_s:.2f}s), wrong {self.wrong}/{self.n}, "
            f"errors {self.errors}, fenced "
            f"{self.fenced:.0f}, P expired {self.expired:.0f} (before cut {self.expired_before_cut:.0f}), "
            f"churned {self.churned}, P notifs after expiry {self.notifs_after_expiry:.0f}, P heartbeats "
            f"during cut {f(self.p_hb_during_cut)}, first after heal {f(self.hb_resume_after_heal_s)}s, "
            f"finished {self.finish_after_heal_s:.1f}s after heal"
        )


def _metric(url: str, name: str, attempts: int = 6) -> float:
    """`name` summed from `url`'s /metrics; a scrape that fails is retried, never read as 0."""
    for _ in range(attempts):
        text = client.metrics_text(url, timeout=5.0)
        if text:
            return client.metric_sum(text, name)
        time.sleep(0.5)
    raise AssertionError(f"no /metrics from {url} in {attempts} attempts (reading {name})")


# P's lease counters the not-expired report shows as changes since the set-up.
_P_LEASE_COUNTERS = (
    "vllm:nixl_lease_granted",
    "vllm:nixl_lease_active",
    HB_RECV,
    "vllm:nixl_lease_heartbeat_ids_received",
    "vllm:nixl_lease_heartbeat_ids_unknown",
    "vllm:nixl_lease_heartbeat_acks_sent",
    "vllm:nixl_lease_p_stalls",
)


def _p_lease_counters(p_metrics: str) -> dict[str, float]:
    """``_P_LEASE_COUNTERS`` from one scrape of P's /metrics (empty: no scrape)."""
    return {name: client.metric_sum(p_metrics, name) for name in _P_LEASE_COUNTERS} if p_metrics else {}


def _not_expired_report(
    pd: PDCluster,
    exp0: float,
    p_leases0: dict[str, float],
    t_cut: float,
    t_start: float,
    blocker: client.BlockerChain,
    burst: Burst,
) -> str:
    """What P, D and the requests did when P kept leases past the cut's deadline (once in CI)."""
    assert pd.prefill is not None and pd.decode is not None
    ev = plog.parse(pd.prefill.log_path)
    since = [round(t - t_cut, 2) for t in ev.heartbeats_between(t_start, time.time())]
    text = client.metrics_text(pd.p_url, timeout=5.0)  # one scrape, no retries: a report must not raise
    expired = f"{client.metric_sum(text, EXPIRED) - exp0:.0f}" if text else "? (no /metrics)"
    lines = [
        f"P expired {expired} since the set-up (log: "
        f"{len(ev.expiries_after(t_start))} expiries, {len(ev.expiries_after(t_cut))} after the cut); "
        f"heartbeats P logged, s after the cut: {since[-12:]}",
        "P's lease counters since the set-up: "
        + ", ".join(
            f"{name.removeprefix('vllm:nixl_lease_')} {value - p_leases0.get(name, 0.0):+.0f}"
            for name, value in _p_lease_counters(text).items()
        ),
        f"blocker: finished early {blocker.finished_early}, error {blocker.error!r}; routed requests "
        f"done {sum(f.done() for f in burst.futures)}/{len(burst.futures)}",
        f"where requests are: {where_requests_are(pd)}",
        f"P's processes:\n{procs.snapshot(pd.prefill.pid)}",
        f"D's processes:\n{procs.snapshot(pd.decode.pid)}",
        f"P's log tail:\n{pd.prefill.log_tail(25)}",
    ]
    return "\n".join(lines)


def _wait_heartbeat(pd: PDCluster, timeout: float) -> float | None:
    """Wait for P to apply D's next heartbeat; the wall time it was seen (None: not in `timeout`).

    Read from P's log (both connectors log an applied heartbeat at debug level, ours one line per
    message, stock one per id), polled every 20 ms: D's own heartbeat counter reaches its /metrics
    ~0.25 s late (measured), a quarter of the interval at lease 10 s."""
    assert pd.prefill is not None
    deadline = time.time() + timeout
    with open(pd.prefill.log_path, "rb") as log:
        log.seek(0, 2)
        while time.time() < deadline:
            if b"Heartbeat extended" in log.read():
                return time.time()
            time.sleep(0.02)
    return None


def _poke_until_growth(pd: PDCluster, name: str, base: float, t_from: float, timeout: float) -> float | None:
    """Seconds after `t_from` at which P's counter `name` was first seen above `base`, P kept
    stepping meanwhile by tiny P-alone requests (an idle P engine does not step, so it would not
    read notifications that reached its NIXL agent); None if not within `timeout`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        client.complete(pd.p_url, "poke", max_tokens=1, timeout=10)
        if _metric(pd.p_url, name) > base:
            return time.time() - t_from
        time.sleep(0.1)
    return None


def partition_decode(
    pd: PDCluster,
    n: int = 6,
    phase_s: float | None = 0.5,
    cut_s: float | None = None,
    max_tokens: int = 16,
    churn_cycles: int = 2,
    timeout: float = 240.0,
    tag: str = "partition",
) -> Partition:
    """Queue `n` routed requests on D, cut D's link `phase_s` after a heartbeat, heal, let D serve.

    `cut_s` None: the long shape (cut until P expired all `n`, churn P's blocks, heal, let D go at
    once). A number: the short shape (cut that long, no churn, D let go once its views are renewed
    again); nothing slower than a sleep runs between aligning on the heartbeat and the heal.
    """
    net = pd.net
    assert net is not None and pd.decode is not None and pd.prefill is not None, "needs two_hosts"
    ours_d = pd.d_connector != "stock"
    ours_p = pd.cfg.connector != "stock"
    lease = pd.cfg.lease_s
    interval = max(1, lease_interval(lease))
    notes: list[str] = []
    marks: dict[str, float] = {"start": time.time()}
    pd.wait_router_sees_decode(timeout=60)  # after an earlier cut the router may still mark D down
    prompts = burst_prompts(n, tag)
    references = p_alone_references(pd, prompts, max_tokens)
    exp0 = _metric(pd.p_url, EXPIRED)
    nae0 = _metric(pd.p_url, NOTIF_AFTER_EXPIRY)
    p_leases0 = _p_lease_counters(client.metrics_text(pd.p_url, timeout=5.0))
    fenced0 = _metric(pd.d_url, FENCED)
    acks0 = _metric(pd.d_url, ACKS_RECV)
    blocker, burst = block_and_queue(pd, n, tag, max_tokens, timeout, max_s=timeout)
    t_cut = t_heal = 0.0
    cut_cmd_s = heal_cmd_s = 0.0
    churned = 0
    p_hb_during_cut: float | None = None
    hb_heal = 0.0
    try:
        marks["queued"] = burst.t_queued
        # Past the first deadline (lease - extension after the grant) and two heartbeats: P's leases
        # are heartbeat-driven when the cut starts.
        time.sleep(max(0.0, burst.t_queued + (lease - lease_extension(lease)) + 2 * interval - time.time()))
        if phase_s is not None:
            seen = _wait_heartbeat(pd, timeout=3 * interval + 5)
            if seen is None:
                notes.append("no heartbeat in P's log: the cut is not aligned")
            else:
                time.sleep(max(0.0, seen + phase_s - time.time()))
        t_cmd = time.time()
        net.cut("d")
        t_cut = time.time()
        cut_cmd_s = t_cut - t_cmd
        if cut_s is None:
            hb_cut: float | None = None  # P's heartbeat counter 1 s into the cut
            deadline = t_cut + lease + 30
            while _metric(pd.p_url, EXPIRED) - exp0 < n:
                if hb_cut is None and time.time() >= t_cut + 1.0:
                    hb_cut = _metric(pd.p_url, HB_RECV)
                if time.time() > deadline:
                    raise AssertionError(
                        f"P did not expire the {n} leases of the cut-off D in {lease + 30}s\n"
                        + _not_expired_report(pd, exp0, p_leases0, t_cut, marks["start"], blocker, burst)
                    )
                time.sleep(0.25)
            marks["expired"] = time.time()
            for i in range(churn_cycles * pd.cfg.num_blocks // 10):  # each ~10 of P's blocks
                r = client.complete(pd.p_url, f"{tag} {i} {CHURN_PROMPT}", max_tokens=1, timeout=60)
                if not r.ok:
                    raise AssertionError(f"P-alone churn request failed: {r.error}")
                churned += 1
            marks["churned"] = time.time()
            if hb_cut is None:
                hb_cut = _metric(pd.p_url, HB_RECV)
            hb_heal = _metric(pd.p_url, HB_RECV)
            if ours_p:  # a stock P counts no heartbeats
                p_hb_during_cut = hb_heal - hb_cut
        else:
            time.sleep(max(0.0, t_cut + cut_s - time.time()))
    finally:
        if t_cut:
            t_cmd = time.time()
            net.heal("d")
            t_heal = time.time()
            heal_cmd_s = t_heal - t_cmd
        if cut_s is None or not t_heal:
            blocker.release()  # D aborts it and takes the queued requests
            marks["released"] = time.time()
    hb_resume: float | None = None
    try:
        if cut_s is None:
            if ours_p:
                # When the heartbeats D sent during the cut (queued by UCX) reach P: P has no lease
                # left to extend (nothing logged), so its counter, with P kept stepping.
                hb_resume = _poke_until_growth(pd, HB_RECV, hb_heal, t_heal, timeout=20)
        else:
            # P still holds the leases: the first heartbeat it applies after the heal is logged.
            deadline = time.time() + 20
            while hb_resume is None and time.time() < deadline:
                time.sleep(0.1)
                after = plog.parse(pd.prefill.log_path).heartbeats_between(t_heal, time.time() + 10)
                hb_resume = after[0] - t_heal if after else None
            # Let D go only once P's answers renew its views again (ours), or a few heartbeats.
            if ours_d and ours_p:
                renewed = _metric(pd.d_url, VIEWS_RENEWED)
                deadline = time.time() + 30
                while _metric(pd.d_url, VIEWS_RENEWED) <= renewed:
                    if time.time() > deadline:
                        notes.append("D's views were not renewed within 30 s of the heal")
                        break
                    time.sleep(0.2)
            else:
                time.sleep(3 * interval)
            if blocker.finished_early:
                notes.append("D finished the blocker before it was released")
    finally:
        if "released" not in marks:
            blocker.release()
            marks["released"] = time.time()
    results = burst.results()
    t_done = max(r.t_end for r in results)
    marks.update(heal=t_heal, done=t_done)
    if hb_resume is not None:
        marks["hb_resume"] = t_heal + hb_resume
    # An idle P does not step: one request makes it count D's late completions (if any).
    client.complete(pd.p_url, CHURN_PROMPT, max_tokens=2, timeout=60)
    time.sleep(1.5)  # metrics settle
    ev = plog.parse(pd.prefill.log_path)
    if cut_s is not None:
        # Leases still held during a short cut: any heartbeat that got through is logged.
        p_hb_during_cut = float(len(ev.heartbeats_between(t_cut + 0.5, t_heal)))
    last_hb = ev.last_heartbeat_before(t_cut)
    return Partition(
        connectors=f"{pd.cfg.connector}/{pd.d_connector}",
        phase_s=phase_s if phase_s is not None else float("nan"),
        references=references,
        results=results,
        cut_s=t_heal - t_cut,
        expired=_metric(pd.p_url, EXPIRED) - exp0,
        expired_before_cut=float(len([t for t, _ in ev.expiries if marks["start"] <= t < t_cut])),
        churned=churned,
        fenced=_metric(pd.d_url, FENCED) - fenced0,
        notifs_after_expiry=_metric(pd.p_url, NOTIF_AFTER_EXPIRY) - nae0,
        p_hb_during_cut=p_hb_during_cut,
        hb_resume_after_heal_s=hb_resume,
        cut_after_hb_s=None if last_hb is None else t_cut - last_hb,
        finish_after_heal_s=t_done - t_heal,
        d_acks=_metric(pd.d_url, ACKS_RECV) - acks0,
        marks={k: round(v - t_cut, 2) for k, v in sorted(marks.items(), key=lambda kv: kv[1])},
        t_cut=t_cut,
        t_heal=t_heal,
        cut_cmd_s=cut_cmd_s,
        heal_cmd_s=heal_cmd_s,
        notes=notes,
    )


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    from harness.procs import install_signal_handlers
    from harness.serve.launcher import BUILD, PDConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connector", default="lease", help="P's (and D's unless --d-connector)")
    ap.add_argument("--d-connector")
    ap.add_argument("--lease", type=int, default=10)
    ap.add_argument("--n", type=int, default=6)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--phases", default="0.05,0.3,0.5,0.7,0.95", help="fractions of D's heartbeat interval")
    ap.add_argument("--short", type=float, help="first a cut of this many seconds (no churn)")
    args = ap.parse_args(argv)
    install_signal_handlers()
    cfg = PDConfig(
        connector=args.connector, d_connector=args.d_connector, lease_s=args.lease, num_blocks=80,
        d_max_num_seqs=1, two_hosts=True, kv_transfer={"kv_load_failure_policy": "recompute"},
        log_dir=BUILD / "partition" / f"{args.connector}-{args.d_connector or args.connector}",
    )  # fmt: skip
    phases = [float(x) for x in args.phases.split(",")]
    interval = max(1, lease_interval(args.lease))
    plan: list[tuple[float | None, float]] = [(args.short, 0.05 * interval)] if args.short else []
    plan += [(None, phases[i % len(phases)] * interval) for i in range(args.runs)]
    t0 = time.time()
    out = []
    with PDCluster(cfg) as pd:
        pd.progress = print
        print(f"cluster up in {time.time() - t0:.0f}s")
        for i, (cut_s, phase) in enumerate(plan):
            t1 = time.time()
            p = partition_decode(pd, args.n, phase_s=phase, cut_s=cut_s, tag=f"run{i}")
            print(f"run {i} ({time.time() - t1:.0f}s): {p.line()} {p.notes or ''}")
            print(f"    seconds after the cut: {p.marks}")
            for r, ref in zip(p.results, p.references, strict=True):
                ok = "OK  " if r.text == ref else ("DIFF" if r.ok else "ERR ")
                print(f"    {ok} {r.status} {r.text!r} vs {ref!r} {r.error[:80]}")
            out.append(p.summary())
    (cfg.log_dir / "partition.json").write_text(json.dumps(out, indent=2))
    print(f"total {time.time() - t0:.0f}s; logs {cfg.log_dir}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
