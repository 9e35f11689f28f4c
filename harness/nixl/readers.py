"""Several readers of one lease over real NIXL.

``same_d``: one P, one D; every P request is queued twice on D (two local
requests carrying the same ``kv_transfer_params``: n > 1, a retried or
duplicate decode).  The first copies are read; P frees their leases on the
completions and at once prefills new requests into the freed blocks; the
second copies are admitted ``gap_s`` later.  A second copy that reads, and is
not reported failed, gets the new requests' KV: a stale read.
"""

from __future__ import annotations

import time
from typing import Any

from .fleet import EngineProcess, Fleet, wait_for
from .scenarios import TOKENS, d_id, over_ranks, prefill, wait_freed


def dup_id(p_id: str) -> str:
    """D's local id of a request's second copy (``d_id`` names the first)."""
    return f"d2-{p_id}"


def _loaded(d: EngineProcess, local_ids: list[str], timeout: float) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        rep = d.report()
        return rep if all("read_t" in rep["reqs"][i] for i in local_ids) else None

    return wait_for(done, timeout, what=f"D finishing {len(local_ids)} load(s)")


def copies(p_rep: dict[str, Any], d_rep: dict[str, Any], ids: list[str], local: Any) -> dict[str, int]:
    """Of the copies ``local(p_id)`` of ``ids`` on D: loads that read P's KV
    (``ok``), failed (``failed``), or read something else without failing (``stale``)."""
    out = {"ok": 0, "failed": 0, "stale": 0}
    for r in ids:
        rec = d_rep["reqs"][local(r)]
        if rec.get("failed"):
            out["failed"] += 1
        elif rec.get("digest") and rec["digest"] == p_rep["reqs"][r].get("digest"):
            out["ok"] += 1
        else:
            out["stale"] += 1
    return out


def same_d(fleet: Fleet, p_stock: bool, d_stock: bool, n: int = 8, gap_s: float = 0.2) -> dict[str, Any]:
    blocks = -(-TOKENS // 32)
    # P holds exactly n requests: the prefills after the reads reuse the freed blocks.
    p = fleet.start("P", "p", stock=p_stock, num_blocks=n * blocks + 1)
    d = fleet.start("D", "d", stock=d_stock)
    ids, params = prefill(p, "dup", n)
    d.submit([(d_id(r), params[r], TOKENS) for r in ids], hold=False)
    d.submit([(dup_id(r), params[r], TOKENS) for r in ids], hold=True)
    wait_freed(p, ids, timeout=30)  # on the first copies' completions
    first_rep = _loaded(d, [d_id(r) for r in ids], 30)
    reuse_ids, _ = prefill(p, "reuse", n)  # overwrites the freed blocks
    time.sleep(gap_s)
    d.release([dup_id(r) for r in ids])
    d_rep = _loaded(d, [dup_id(r) for r in ids], 30)
    time.sleep(0.5)  # let P take in the second copies' completions
    p_rep = p.report()
    d_stats, p_stats = d.stats(), p.stats()
    out: dict[str, Any] = {
        "n": n,
        "first": copies(p_rep, first_rep, ids, d_id),
        "second": copies(p_rep, d_rep, ids, dup_id),
        "fenced_second_reader": over_ranks(d_stats, "num_reads_fenced_second_reader"),
        "fenced": over_ranks(d_stats, "num_reads_fenced"),
        "discarded": over_ranks(d_stats, "num_reads_discarded"),
        "p_unknown_completions": over_ranks(p_stats, "num_notifications_after_expiry"),
        "reused": all(p_rep["reqs"][r].get("delay_free") for r in reuse_ids),
        "errors": p_rep["errors"] + d_rep["errors"],
    }
    who = f"P {'stock' if p_stock else 'ours'}, D {'stock' if d_stock else 'ours'}"
    print(
        f"\n== each request queued twice on one D ({who}), second admitted {gap_s}s after P reused "
        f"the blocks: first {out['first']}, second {out['second']}, fenced as second reader "
        f"{out['fenced_second_reader']}, fenced {out['fenced']}, discarded {out['discarded']}, "
        f"P completions for no lease {out['p_unknown_completions']}"
    )
    return out


def two_d(
    fleet: Fleet,
    p_stock: bool,
    d_stock: bool,
    claims: bool,
    n: int = 8,
    gap_s: float = 0.2,
    p_tp: int = 1,
    d_tp: int = 1,
) -> dict[str, Any]:
    """One P, two Ds, each P request queued on both (a router hedging or
    retrying the decode on another D).  D1 reads every request at once.  D2
    holds the first half (``early``) from before D1 reads them, and gets the
    second half (``late``) only once P freed them on D1's completions.  P then
    prefills ``n`` new requests, taking the blocks freed last first (``lifo``:
    what D1's completions freed is overwritten at once), and ``gap_s`` later D2
    reads its copies.  A copy of D2 that reads, and is not reported failed,
    gets other KV: a stale read.

    ``claims``: ``kv_lease_claim_reads`` on P and both Ds (docs/PROTOCOL.md P14,
    D11): D2's early copies are claimed before D1 finishes, so P keeps their
    blocks until D2 read them; its late copies are claimed after the free, so P
    answers "not held" and D2 fences them.

    ``p_tp``, ``d_tp``: TP sizes (two KV heads, one per rank, when either is 2).
    With P at TP 2 every claim needs "held" from both P ranks, and each rank keeps
    its own holders; with the Ds at TP 2 each D rank is a holder of its own."""
    blocks = -(-TOKENS // 32)
    extra = {"kv_lease_claim_reads": True} if claims else {}
    heads = 2 if max(p_tp, d_tp) > 1 else 1  # KV heads: one per rank at TP 2
    p = fleet.start(
        "P",
        "p",
        stock=p_stock,
        num_blocks=(2 * n + 2) * blocks + 1,
        block_reuse="lifo",
        extra=extra,
        tp_size=p_tp,
        kv_heads=heads,
    )
    d_extra = {} if d_stock else extra
    d1 = fleet.start("D", "d1", stock=d_stock, extra=d_extra, tp_size=d_tp, kv_heads=heads)
    d2 = fleet.start("D", "d2", stock=d_stock, extra=d_extra, tp_size=d_tp, kv_heads=heads)
    # One request each first: both Ds connected and proven, so the loads timed below are warm.
    warm, warm_params = prefill(p, "warm", 2)
    for d, r in ((d1, warm[0]), (d2, warm[1])):
        d.submit([(d_id(r), warm_params[r], TOKENS)], hold=False)
        _loaded(d, [d_id(r)], 30)
    ids, params = prefill(p, "two", n)
    early, late = ids[: n // 2], ids[n // 2 :]
    d2.submit([(dup_id(r), params[r], TOKENS) for r in early], hold=True)
    time.sleep(1.0)  # D2 connects, proves P and (claims on) claims the early leases
    d1.submit([(d_id(r), params[r], TOKENS) for r in ids], hold=False)
    first_rep = _loaded(d1, [d_id(r) for r in ids], 30)
    wait_freed(p, late, timeout=30)  # on D1's completions: D2 never named them
    d2.submit([(dup_id(r), params[r], TOKENS) for r in late], hold=True)
    reuse_ids, _ = prefill(p, "reuse", n)  # into the blocks freed last
    time.sleep(gap_s)
    d2.release([dup_id(r) for r in ids])
    d2_rep = _loaded(d2, [dup_id(r) for r in ids], 30)
    p_rep = wait_freed(p, ids, timeout=30)  # the early ones on D2's completions (claims on)
    p_stats, d1_stats, d2_stats = p.stats(), d1.stats(), d2.stats()
    out: dict[str, Any] = {
        "n": n,
        "first": copies(p_rep, first_rep, ids, d_id),
        "second_early": copies(p_rep, d2_rep, early, dup_id),
        "second_late": copies(p_rep, d2_rep, late, dup_id),
        "early_freed_by": sorted({p_rep["reqs"][r].get("freed_reason", "held") for r in early}),
        "fenced": over_ranks(d2_stats, "num_reads_fenced"),
        "fenced_not_claimed": over_ranks(d2_stats, "num_reads_fenced_not_claimed"),
        "waited_claim": over_ranks(d1_stats, "num_reads_waiting_claim")
        + over_ranks(d2_stats, "num_reads_waiting_claim"),
        "discarded": over_ranks(d2_stats, "num_reads_discarded"),
        "p_claimed_freed": over_ranks(p_stats, "num_claimed_leases_freed"),
        "p_ignored": over_ranks(p_stats, "num_completions_ignored_held"),
        "reused": all(p_rep["reqs"][r].get("delay_free") for r in reuse_ids),
        "errors": p_rep["errors"] + first_rep["errors"] + d2_rep["errors"],
    }
    out["second_stale"] = out["second_early"]["stale"] + out["second_late"]["stale"]
    # What a claim costs the first D (warm): its READs' time from submission to loaded (median).
    waits = sorted(
        first_rep["reqs"][d_id(r)]["read_t"] - first_rep["reqs"][d_id(r)]["submitted_t"] for r in ids
    )
    out["first_load_s"] = waits[len(waits) // 2]
    side = {True: "stock", False: "ours"}
    who = f"P {side[p_stock]} TP {p_tp}, Ds {side[d_stock]} TP {d_tp}, claims {'on' if claims else 'off'}"
    print(
        f"\n== each request queued on two Ds ({who}): first D {out['first']}; second D, claimed before "
        f"the first read {out['second_early']}, handed over after P freed {out['second_late']}; fenced "
        f"{out['fenced']} (not claimed {out['fenced_not_claimed']}), discarded {out['discarded']}; "
        f"READs that waited for a claim {out['waited_claim']}; P freed {out['p_claimed_freed']} lease(s) "
        f"on the last holder, ignored {out['p_ignored']} completion(s); first D's median load "
        f"{out['first_load_s'] * 1000:.0f} ms"
    )
    return out
