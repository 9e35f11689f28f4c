"""P's clock moves after the handshake measured the offset (drift over days,
or chrony slewing, compressed into one jump), then requests reach D late: a
router held them until P had let their leases lapse and reused the blocks.

D's view of each late request is never renewed before D reads it: it ends at
``remote_lease_deadline - offset``.  With the handshake's offset, stale by the
jump, it ends ``jump`` seconds after P's lease did, and D reads other
requests' KV.  With the offset refreshed from P's answers (protocol version
3: a request D keeps queued keeps answers flowing), it ends with P's lease,
and D fences the read (``docs/PROTOCOL.md`` section 4.3).
"""

from __future__ import annotations

from typing import Any

from .fleet import Fleet, wait_for
from .scenarios import (
    LEASE,
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


def clock_jump(
    fleet: Fleet, p_stock: bool, d_stock: bool, refresh: bool = True, n: int = 4, jump: float = 4.0
) -> dict[str, Any]:
    """``refresh``: P advertises version 3 (False: its params say version 2
    only, so D gets no clock and keeps the handshake's offset)."""
    blocks = -(-TOKENS // 32)
    # The kept request and n late ones; the reuse takes exactly the late ones' blocks.
    p = fleet.start("P", "p", stock=p_stock, num_blocks=(n + 1) * blocks + 1, lease_protocol_max=refresh)
    d = fleet.start("D", "d", stock=d_stock)
    # Connect (and for ours, prove the P process) with one request read at once.
    warm, params = prefill(p, "warm", 1)
    hand_to_d(d, params, hold=False)
    wait_freed(p, warm, timeout=30)
    d_caught_up(d, warm)
    p.skew_clock(jump)  # P's clock now runs `jump` seconds ahead of what D measured
    keep, params = prefill(p, "keep", 1)  # reuses warm's blocks
    hand_to_d(d, params, hold=True)
    wait_for(lambda: p.report()["reqs"][keep[0]].get("hb", 0) >= 3, 20, what="heartbeats of the kept request")
    ids, params = prefill(p, "late", n)
    p_freed = wait_freed(p, ids, timeout=LEASE + 10)
    reuse_ids, _ = prefill(p, "reuse", n)  # overwrites the freed blocks
    hand_to_d(d, params, hold=False)  # the router hands them on only now
    d_rep = wait_loaded(d, ids, 30)
    p_rep = p.report()
    p_stats, d_stats = p.stats(), d.stats()
    failed = sum(bool(d_rep["reqs"][d_id(r)].get("failed")) for r in ids)
    stale = len(data_mismatches(p_rep, d_rep, ids)) - failed
    out: dict[str, Any] = {
        "ids": ids,
        "reuse_ids": reuse_ids,
        "p_at_hand": p_freed,
        "p": p_rep,
        "d": d_rep,
        "failed": failed,
        "stale": stale,
        "fenced": over_ranks(d_stats, "num_reads_fenced"),
        "refreshes": over_ranks(d_stats, "num_clock_offset_refreshes"),
        "after_expiry": over_ranks(p_stats, "num_notifications_after_expiry"),
    }
    p_kind = "stock" if p_stock else "ours" if refresh else "ours, v2 params"
    who = f"P {p_kind}, D {'stock' if d_stock else 'ours'}"
    print(
        f"\n== P's clock +{jump:g}s after the handshake, requests reach D after P freed them ({who}): "
        f"stale reads {stale}/{n}, fenced {out['fenced']}, failed loads {failed}, "
        f"offset refreshes on D {out['refreshes']}, P completions after expiry {out['after_expiry']}"
    )
    return out
