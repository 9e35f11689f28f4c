"""A READ posted, then stalled with D's forward loop, while P's clock runs
ahead of what D last measured: the READ runs after P let the lease lapse and
reused the blocks, and D sees it complete while its view of the lease still
has time left (``docs/PROTOCOL.md`` section 4.1, "Completion").

1. D has read one request (connected, and for ours, P's process proven);
   ``n`` requests wait in D's queue and are heartbeated.
2. D admits them and posts their READs; the READs wait in the transport and
   D's engine stalls right after (``read_hold.py``): no heartbeats, no answers.
3. P's clock moves ``skew`` seconds ahead (drift or slewing since D's last
   refresh of the offset, under the margin): P's leases end ``skew`` seconds
   before D's views of them do.  P frees the blocks at its deadline and
   prefills ``n`` other requests into them.
4. The stall ends: the READs run on the reused blocks and complete at once,
   with D's views still alive but within their margin.

A D that keeps every READ seen complete before its view ended returns other
requests' KV (what 5ab44e2 did); ours discards it (failed load).  Stock keeps
it too.
"""

from __future__ import annotations

import os
import time
from typing import Any

from .fleet import EngineProcess, Fleet, wait_for
from .scenarios import (
    EXTENSION,
    TOKENS,
    d_caught_up,
    d_id,
    data_mismatches,
    hand_to_d,
    over_ranks,
    prefill,
    wait_freed,
    wait_loaded,
)

# D's margin, set explicitly; P's clock moves by less (the drift the margin is for).
MARGIN = 1.0
SKEW = 0.8


def _freed(p: EngineProcess, ids: list[str]) -> dict[str, Any] | None:
    rep = p.report()
    return rep if all("freed_t" in rep["reqs"][r] for r in ids) else None


def stalled_read(
    fleet: Fleet, p_stock: bool, d_stock: bool, n: int = 4, skew: float = SKEW
) -> dict[str, Any]:
    blocks = -(-TOKENS // 32)
    # P holds exactly n requests: the prefills after the expiry reuse the freed blocks.
    p = fleet.start("P", "p", stock=p_stock, num_blocks=n * blocks + 1)
    d = fleet.start("D", "d", stock=d_stock, extra={} if d_stock else {"lease_safety_margin": MARGIN})
    warm, params = prefill(p, "warm", 1)
    hand_to_d(d, params, hold=False)
    wait_freed(p, warm, timeout=30)
    d_caught_up(d, warm)
    ids, params = prefill(p, "stall", n)
    hand_to_d(d, params, hold=True)
    wait_for(lambda: all(p.report()["reqs"][r].get("hb", 0) >= 2 for r in ids), 20, what="heartbeats on P")
    stalled = os.path.join(fleet.workdir, "d-stalled")
    release = os.path.join(fleet.workdir, "d-release")
    d.call("hold_reads", stalled=stalled, release=release)
    d.release()
    try:
        wait_for(lambda: os.path.exists(stalled), 10, poll=0.01, what="D stalled with its READs posted")
        t_stall = time.monotonic()
        time.sleep(0.3)  # P's answers to D's last heartbeats left before its clock moves
        p.skew_clock(skew)
        p_freed = wait_for(lambda: _freed(p, ids), EXTENSION + 10, poll=0.02, what="P freeing the leases")
        reuse_ids, _ = prefill(p, "reuse", n)  # overwrites the freed blocks
    finally:
        open(release, "w").close()
    t_release = time.monotonic()
    d_rep = wait_loaded(d, ids, 30)
    time.sleep(0.5)  # let P take in the completions
    p_rep = p.report()
    p_stats, d_stats = p.stats(), d.stats()
    failed = sum(bool(d_rep["reqs"][d_id(r)].get("failed")) for r in ids)
    stale = len(data_mismatches(p_rep, d_rep, ids)) - failed
    freed_t = max(p_freed["reqs"][r]["freed_t"] for r in ids)
    out: dict[str, Any] = {
        "ids": ids,
        "reuse_ids": reuse_ids,
        "p_at_release": p_freed,
        "p": p_rep,
        "d": d_rep,
        "stall_s": t_release - t_stall,
        "release_after_free_s": t_release - freed_t,
        "failed": failed,
        "stale": stale,
        "discarded": over_ranks(d_stats, "num_reads_discarded"),
        "fenced": over_ranks(d_stats, "num_reads_fenced"),
        "after_expiry": over_ranks(p_stats, "num_notifications_after_expiry"),
    }
    who = f"P {'stock' if p_stock else 'ours'}, D {'stock' if d_stock else 'ours'}"
    print(
        f"\n== READs posted, D stalled {out['stall_s']:.2f}s, P's clock +{skew:g}s ({who}): released "
        f"{out['release_after_free_s']:.2f}s after P freed the blocks; stale reads {stale}/{n}, "
        f"discarded {out['discarded']}, fenced {out['fenced']}, failed loads {failed}, "
        f"P completions after expiry {out['after_expiry']}"
    )
    return out
