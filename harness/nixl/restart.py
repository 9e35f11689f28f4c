"""P restarted under the same engine id and side-channel port, over real NIXL.

Deployments that set ``kv_transfer_config.engine_id`` (or derive it from a pod
name) keep it across restarts.  The scenario:

1. P (ours or stock) grants ``n`` leases; D queues the requests (``hold``) and
   heartbeats them;
2. P is killed with ``kill -9``;
3. a new P (ours or stock: a downgrade) starts under the same engine id and
   side-channel port and prefills ``n`` other requests: a fresh process
   allocates the same block ids, so the old requests' blocks now hold other
   data (each request's KV is seeded by its id);
4. once D has seen a heartbeat to the dead P fail (a real engine restarts
   far slower than one heartbeat interval), D is handed the new requests and
   let read everything.

Counted per old and new request on D: read with the data its P wrote, read
with other data (wrong), failed load.  The new P's step exceptions are
counted too (a stock P's ``_get_new_notifs`` must never raise on our
messages).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from .fleet import EngineProcess, Fleet, wait_for
from .progress import PROGRESS_DELAY_US
from .scenarios import d_id, hand_to_d, over_ranks, prefill

SAMPLE_S = 0.25


def _outcome(p_rep: dict[str, Any], d_rep: dict[str, Any], ids: list[str]) -> dict[str, Any]:
    """Per request on D: ended, failed, read with P's data, read with other data."""
    read_ok, wrong, failed, ended = [], [], [], []
    for r in ids:
        rec = d_rep["reqs"][d_id(r)]
        if "read_t" not in rec:
            continue
        ended.append(r)
        if rec.get("failed"):
            failed.append(r)
        elif rec.get("digest") and rec["digest"] == p_rep["reqs"][r].get("digest"):
            read_ok.append(r)
        else:
            wrong.append(r)
    return {"ended": len(ended), "failed": len(failed), "read_ok": len(read_ok), "wrong": len(wrong)}


def p_restarted(
    fleet: Fleet,
    p_stock: bool,
    d_stock: bool,
    new_p_stock: bool,
    n: int = 8,
    watch_s: float = 45.0,
) -> dict[str, Any]:
    """Run the scenario; return the counts the tests assert on (and print them)."""
    engine_id = f"p-fixed-{uuid.uuid4().hex[:8]}"
    common: dict[str, Any] = {"progress_delay_us": PROGRESS_DELAY_US, "engine_id": engine_id}
    p = fleet.start("P", "p-old", stock=p_stock, **common)
    port = p.spec.side_channel_port
    d = fleet.start("D", "d", stock=d_stock, progress_delay_us=PROGRESS_DELAY_US)
    old_ids, old_params = prefill(p, "old", n)
    hand_to_d(d, old_params, hold=True)
    wait_for(
        lambda: all(p.report()["reqs"][r].get("hb", 0) >= 2 for r in old_ids), 30, what="heartbeats on P"
    )
    p_old = p.report()
    d_stats_before = d.stats()
    failed_sends = d.report()["hb_sent"]["failed"]
    t_kill = p.kill()
    p2: EngineProcess = fleet.start("P", "p-new", stock=new_p_stock, side_channel_port=port, **common)
    t_up = time.monotonic()
    # A real engine takes far longer than one heartbeat interval to restart:
    # D has seen its heartbeat to the dead P fail before the new P serves a
    # request.  Without this wait a fast restart races D's next send.
    wait_for(
        lambda: d.report()["hb_sent"]["failed"] > failed_sends, 15, poll=0.05, what="D noticing the dead P"
    )
    t_noticed = time.monotonic()
    new_ids, new_params = prefill(p2, "new", n)
    p_new_at_grant = p2.report()
    same_blocks = sorted(b for r in old_ids for b in p_old["reqs"][r]["blocks"]) == sorted(
        b for r in new_ids for b in p_new_at_grant["reqs"][r]["blocks"]
    )
    t_handed = time.monotonic()
    hand_to_d(d, new_params, hold=False)
    d.release()  # the old requests may read now too
    all_ids = old_ids + new_ids
    new_done_t = None
    deadline = t_handed + watch_s
    while time.monotonic() < deadline:
        rep = d.report()
        if new_done_t is None and all("read_t" in rep["reqs"][d_id(r)] for r in new_ids):
            new_done_t = max(rep["reqs"][d_id(r)]["read_t"] for r in new_ids)
        if all("read_t" in rep["reqs"][d_id(r)] for r in all_ids):
            break
        time.sleep(SAMPLE_S)
    time.sleep(1.0)  # let the new P take in the completions
    d_rep = d.report()
    p_new = p2.report()
    d_stats = d.stats()
    p_new_stats = p2.stats()
    old_ends = [d_rep["reqs"][d_id(r)]["read_t"] for r in old_ids if "read_t" in d_rep["reqs"][d_id(r)]]
    old = _outcome(p_old, d_rep, old_ids)
    new = _outcome(p_new, d_rep, new_ids)
    # An old request read with the new P's data is wrong data (it was checked
    # against the old P's); one read with the old P's own data would have been
    # read from a dead process, which cannot happen.
    out = {
        "n": n,
        "old": old,
        "new": new,
        "same_blocks": same_blocks,
        "restart_s": t_up - t_kill,
        "noticed_s": t_noticed - t_kill,
        "old_ended_after_kill_s": (max(old_ends) - t_kill) if old_ends else None,
        "new_read_s": (new_done_t - t_handed) if new_done_t is not None else None,
        "new_read_after_kill_s": (new_done_t - t_kill) if new_done_t is not None else None,
        "new_p_errors": p_new["errors"],
        "new_p_hellos": p_new["hellos_recv"],
        "d_errors": d_rep["errors"],
        "d_acks_not_extended": [(round(t - t_kill, 3), a, m) for t, a, m in d_rep["acks_not_extended"]],
        "new_tags": {new_params[r].get("remote_lease_tag"): r for r in new_ids},
        "fenced": over_ranks(d_stats, "num_reads_fenced") - over_ranks(d_stats_before, "num_reads_fenced"),
        "views_ended": over_ranks(d_stats, "num_views_ended") - over_ranks(d_stats_before, "num_views_ended"),
        "waiting_proof": over_ranks(d_stats, "num_reads_waiting_proof")
        - over_ranks(d_stats_before, "num_reads_waiting_proof"),
        "failed_transfers": over_ranks(d_stats, "num_failed_transfers")
        - over_ranks(d_stats_before, "num_failed_transfers"),
        "new_p_malformed": over_ranks(p_new_stats, "num_malformed_notifs"),
        "new_p_unknown_completions": over_ranks(p_new_stats, "num_unknown_completions"),
        "new_p_freed_by": {
            reason: sum(p_new["reqs"][r].get("freed_reason") == reason for r in new_ids)
            for reason in ("read", "expiry")
        },
        "new_p_log": p2.log,
        "d_log": d.log,
    }
    who = (
        f"P {'stock' if p_stock else 'ours'} -> restarted {'stock' if new_p_stock else 'ours'}, "
        f"D {'stock' if d_stock else 'ours'}"
    )
    new_read = "never" if out["new_read_s"] is None else f"{out['new_read_s']:.2f}s"
    print(
        f"\n== P restarted under the same engine id ({who}), {n} old + {n} new requests, "
        f"same block ids {same_blocks}, new P up {out['restart_s']:.1f}s after the kill, "
        f"D saw a heartbeat fail {out['noticed_s']:.1f}s after it"
    )
    print(
        f"   old: ended {old['ended']}/{n}, failed {old['failed']}, read correct {old['read_ok']}, "
        f"WRONG {old['wrong']} (last ended {out['old_ended_after_kill_s'] or 0:.2f}s after the kill); "
        f"new: ended {new['ended']}/{n}, failed {new['failed']}, "
        f"read correct {new['read_ok']}, WRONG {new['wrong']}, all new read {new_read} after hand-over"
        + (f" ({out['new_read_after_kill_s']:.2f}s after the kill)" if new_done_t is not None else "")
    )
    print(
        f"   D: fenced {out['fenced']}, views ended {out['views_ended']}, reads waiting proof "
        f"{out['waiting_proof']}, failed READs {out['failed_transfers']}; new P: hellos received "
        f"{out['new_p_hellos']}, step errors {len(out['new_p_errors'])}, freed {out['new_p_freed_by']}"
    )
    for err in out["new_p_errors"][:1]:
        print("   new P step error:", err.strip().splitlines()[-1])
    return out
