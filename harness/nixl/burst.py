"""Burst scenario: one D step admits ``b`` requests, ``queued`` more wait
behind them for D's KV blocks, all leased on one P over real NIXL (a step that
posts many READs delays D's heartbeats: do P's leases survive it?).

Upstream's D worker posts every READ a step admits before it does anything
else, so the step's length is the burst's: P's next heartbeat comes one
interval plus the burst after the last one.  What the scenario reports:

- ``premature_expiries``: leases P expired although D was alive (D never
  dies here, so every expiry is premature);
- ``wrong_reads``: reads D completed whose data differs from what P wrote;
- ``fenced_live``: reads D refused (failed loads) although P still held the
  lease at that moment (P freed it by the read's completion notification, or
  expired it only after D gave the read up);
- ``max_hb_gap_s``: P's longest wait between two heartbeat messages, from the
  first heartbeat to the moment the last lease was freed, against
  ``extension_s``;
- ``max_lease_gap_s``: the longest any one lease waited for a heartbeat naming
  it (from its first heartbeat until it was freed).  Ours paces a round's
  chunks over the interval, so P hears some heartbeat more often than any one
  lease is renewed: this is the margin a lease really has;
- ``max_first_hb_s``: the longest from P's grant to the first heartbeat naming
  the lease, against the lease itself (the grant's deadline);
- ``max_d_step_s``: D's longest step; ``reads_carried``: READs our D spread
  over later steps (``read_pacer.py``; 0 for stock).
"""

from __future__ import annotations

import time
from typing import Any

from vllm_nixl_lease._wire import default_lease_extension

from .fleet import Fleet, wait_for
from .scenarios import d_id, data_mismatches, hand_to_d, prefill

TOKENS = 32  # one block per request by default
CHUNK = 100  # requests P prefills and hands to D at a time


def burst(
    fleet: Fleet,
    b: int,
    queued: int,
    stock: bool,
    hold_s: float | None = None,
    progress_delay_us: int = 0,
    tokens: int = TOKENS,
) -> dict[str, Any]:
    """``progress_delay_us``: 0 is NIXL's default (each agent's progress thread
    spins a core, so on two cores posting READs is slow, the worst case
    for heartbeats a burst delays); ``progress.PROGRESS_DELAY_US`` lets the engines have the cores."""
    n = b + queued
    common: dict[str, Any] = {"stock": stock, "progress_delay_us": progress_delay_us, "sampled_digest": True}
    blocks = -(-tokens // 32)
    p = fleet.start("P", "p", num_blocks=n * blocks + 8, **common)
    # Room for the burst only: the queued requests wait for its blocks.
    d = fleet.start("D", "d", num_blocks=b * blocks + 8, max_admit=b, **common)
    # P finishes the requests and D receives them CHUNK at a time, as a router
    # hands each one on.  Handing all 5500 over in one piece took up to 1.8 s
    # here between P's grant and D's first heartbeat: most of a 2 s lease gone
    # before the burst began, and the test then measured the harness.
    ids: list[str] = []
    for first in range(0, n, CHUNK):
        chunk, params = prefill(p, f"burst{first}", min(CHUNK, n - first), tokens=tokens)
        hand_to_d(d, params, hold=True, tokens=tokens)
        ids += chunk
    # Queued for a whole lease by default: when the burst comes, every lease
    # lives on heartbeats alone (the grant's deadline has passed).
    time.sleep(fleet.lease if hold_s is None else hold_s)
    released = time.monotonic()
    d.release()

    def all_done() -> bool:
        # Counts only while the burst runs: a full report is work in the engines' loops.
        d_sum = d.summary()
        return p.summary()["live"] == 0 and not any(d_sum[k] for k in ("held", "waiting", "unread"))

    wait_for(all_done, 120 + n / 50, what=f"a burst of {b} (+{queued} queued) read and freed")
    p_rep, d_rep = p.report(), d.report()
    unfinished = [
        r for r in ids if "freed_t" not in p_rep["reqs"][r] or "read_t" not in d_rep["reqs"][d_id(r)]
    ]
    assert not unfinished, f"{len(unfinished)} requests not both read on D and freed on P"
    return summarize(p_rep, d_rep, ids, d.stats(), b, queued, stock, fleet.lease, released)


def summarize(
    p_rep: dict[str, Any],
    d_rep: dict[str, Any],
    ids: list[str],
    d_stats: list[dict[str, Any]],
    b: int,
    queued: int,
    stock: bool,
    lease: float,
    released: float,
) -> dict[str, Any]:
    p_reqs = p_rep["reqs"]
    expired = [r for r in ids if p_reqs[r].get("freed_reason") == "expiry"]
    failed = [r for r in ids if d_rep["reqs"][d_id(r)].get("failed")]
    ok = [r for r in ids if r not in set(failed)]
    # P still held the lease when D gave the read up: P freed it by the read's
    # completion, or expired it only later (D stops heartbeating a failed load).
    fenced_live = [
        r
        for r in failed
        if p_reqs[r].get("freed_reason") != "expiry"
        or p_reqs[r]["freed_t"] > d_rep["reqs"][d_id(r)]["read_t"]
    ]
    last_free = max(p_reqs[r]["freed_t"] for r in ids)
    arrivals = sorted(t for t in p_rep["hb_arrivals"] if t <= last_free)
    marks = arrivals + [last_free]
    gaps = [later - earlier for earlier, later in zip(marks, marks[1:], strict=False)]
    recs = [p_reqs[r] for r in ids]
    lease_gaps = [
        max(rec.get("hb_max_gap", 0.0), rec["freed_t"] - rec["hb_last_t"])
        for rec in recs
        if "hb_last_t" in rec
    ]
    first_hb = [rec["hb_first_t"] - rec["granted_t"] for rec in recs if "hb_first_t" in rec]
    out = {
        "impl": "stock" if stock else "ours",
        "burst": b,
        "queued": queued,
        "lease_s": lease,
        "extension_s": default_lease_extension(lease),
        "premature_expiries": len(expired),
        "wrong_reads": len(data_mismatches(p_rep, d_rep, ok)),
        "fenced_live": len(fenced_live),
        "failed_loads": len(failed),
        "max_hb_gap_s": round(max(gaps), 3) if gaps else None,
        "max_lease_gap_s": round(max(lease_gaps), 3) if lease_gaps else None,
        "max_first_hb_s": round(max(first_hb), 3) if first_hb else None,
        "max_d_step_s": round(d_rep["max_step_s"], 3),
        "reads_carried": sum(s.get("num_reads_carried", 0) for s in d_stats),
        "drain_s": round(last_free - released, 2),
        # D's slowest step, split by phase (engine.py): the connector's calls and the harness's work.
        "d_slowest_step": {
            k: round(v, 3)
            for k, v in max(d_rep["slow_phases"], key=lambda ph: ph["step"], default={}).items()
            if k != "t"
        },
        "errors": p_rep["errors"] + d_rep["errors"],
    }
    print(f"\n== burst {b} (+{queued} queued), {out['impl']}: {out}")
    return out
