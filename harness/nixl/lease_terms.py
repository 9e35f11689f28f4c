"""Lease terms over real NIXL: P and D configured with different
``kv_lease_duration``, and P's own stall (SIGSTOP) while D heartbeats.

In both, our P and our D hold ``n`` requests queued on D (``hold``) while D
heartbeats them, then D reads them.  Counted: leases P expired while D was
alive and heartbeating, reads D fenced or failed (needless: P still held
every lease), reads that returned other data.
"""

from __future__ import annotations

import time
from typing import Any

from vllm_nixl_lease._wire import default_lease_extension

from .fleet import EngineProcess, Fleet
from .progress import PROGRESS_DELAY_US
from .scenarios import (
    d_id,
    data_mismatches,
    hand_to_d,
    over_ranks,
    prefill,
    wait_freed,
    wait_heartbeats_decide,
    wait_loaded,
)


def _read_back(p: EngineProcess, d: EngineProcess, ids: list[str], during: dict[str, Any]) -> dict[str, Any]:
    d.release()
    p_rep = wait_freed(p, ids, timeout=30)
    d_rep = wait_loaded(d, ids, 30)
    d_stats, p_stats = d.stats(), p.stats()
    loaded = [r for r in ids if not d_rep["reqs"][d_id(r)].get("failed")]
    return {
        "ids": ids,
        "expired_while_held": [r for r in ids if "freed_t" in during["reqs"][r]],
        "freed_by": sorted({p_rep["reqs"][r].get("freed_reason") for r in ids}),
        "failed": sum(bool(d_rep["reqs"][d_id(r)].get("failed")) for r in ids),
        "wrong": len(data_mismatches(p_rep, d_rep, loaded)),  # a failed load holds nothing to check
        "fenced": over_ranks(d_stats, "num_reads_fenced"),
        "discarded": over_ranks(d_stats, "num_reads_discarded"),
        "renewed": over_ranks(d_stats, "num_heartbeat_views_renewed"),
        "stalls_graced": over_ranks(p_stats, "num_stalls_graced"),
        "min_hb": min(p_rep["reqs"][r].get("hb", 0) for r in ids),
        "errors": p_rep["errors"] + d_rep["errors"],
    }


def mismatched_durations(fleet: Fleet, p_lease: int, d_lease: int, n: int = 4) -> dict[str, Any]:
    """P with ``p_lease``, D with ``d_lease``; the requests wait on D past P's
    first deadline (so every lease needs renewals), then D reads them."""
    p = fleet.start("P", "p", extra={"kv_lease_duration": p_lease}, progress_delay_us=PROGRESS_DELAY_US)
    d = fleet.start("D", "d", extra={"kv_lease_duration": d_lease}, progress_delay_us=PROGRESS_DELAY_US)
    ids, params = prefill(p, "terms", n)
    t_handed = time.monotonic()
    hand_to_d(d, params, hold=True)
    time.sleep(max(0.0, t_handed + p_lease + 2 - time.monotonic()))
    out = _read_back(p, d, ids, p.report())
    out.update(p_lease=p_lease, d_lease=d_lease, held_s=time.monotonic() - t_handed)
    print(
        f"\n== P kv_lease_duration {p_lease}s, D {d_lease}s: held {p_lease + 2}s; P expired "
        f"{len(out['expired_while_held'])} while held, freed by {out['freed_by']}; D fenced {out['fenced']}, "
        f"failed {out['failed']}, wrong {out['wrong']}, views renewed {out['renewed']}, "
        f"heartbeats per lease on P >= {out['min_hb']}"
    )
    return out


def p_stalled(fleet: Fleet, lease: int, stop_s: float, n: int = 4) -> dict[str, Any]:
    """SIGSTOP P (and its ranks) for ``stop_s`` while D heartbeats the queued
    requests, SIGCONT, give P a few steps, then let D read."""
    p = fleet.start("P", "p", extra={"kv_lease_duration": lease}, progress_delay_us=PROGRESS_DELAY_US)
    d = fleet.start("D", "d", extra={"kv_lease_duration": lease}, progress_delay_us=PROGRESS_DELAY_US)
    ids, params = prefill(p, "stall", n)
    hand_to_d(d, params, hold=True)
    # Stop P once heartbeats, not the grant, set its deadlines.
    wait_heartbeats_decide(p, ids, lease, default_lease_extension(lease), min_heartbeats=2, timeout=30)
    d_sent0 = d.report()["hb_sent"]["msgs"]
    p.freeze()
    t_stop = time.monotonic()
    try:
        time.sleep(stop_s)
    finally:
        p.thaw()
    stopped_s = time.monotonic() - t_stop
    d_sent_during = d.report()["hb_sent"]["msgs"] - d_sent0
    time.sleep(2.0)  # P drains what D sent meanwhile, sweeps, answers
    out = _read_back(p, d, ids, p.report())
    out.update(stopped_s=stopped_s, d_heartbeats_during_stop=d_sent_during)
    print(
        f"\n== P stopped {stopped_s:.1f}s (lease {lease}s) while D heartbeated ({d_sent_during} messages "
        f"sent meanwhile): P expired {len(out['expired_while_held'])} of {n} live leases, stalls graced "
        f"{out['stalls_graced']}; D fenced {out['fenced']}, failed {out['failed']}, wrong {out['wrong']}"
    )
    return out
