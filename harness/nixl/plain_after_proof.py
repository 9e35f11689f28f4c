"""A plain lease reaching D after D proved another process under its engine id
(plain views after a proof: PROTOCOL D5, D5b), over real NIXL on loopback.

1. An old P (a version-1 P of ours: its params carry the lease deadline and
   terms but no instance, so our D keeps a plain view; or stock) grants ``n``
   leases; the router holds the params.
2. The old P dies (``kill -9``); a new P of ours starts under the same engine
   id and side-channel port and grants ``n`` other leases on the same block ids.
3. D reads the new requests: it connects to the new P and proves its instance.
4. The router hands D the old requests, their leases still running by the old
   P's clock.

The old requests' blocks now hold the new P's data.  A plain view added after
the proof, bound to the connection it is first read over, reads the new
process's memory (5ab44e2: ``instance_proven`` ended only the plain views that
existed at the proof).  Ours fences it: the connection has answered as one of
our P processes, and whoever granted a plain lease does not speak our protocol
(``docs/PROTOCOL.md`` 4.2).  A stock P's lease (``old_stock``) has no view on D
at all; over a connection that answered as ours it is fenced for the same reason.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from .fleet import Fleet
from .progress import PROGRESS_DELAY_US
from .restart import _outcome
from .scenarios import hand_to_d, over_ranks, prefill, wait_loaded


def plain_after_proof(
    fleet: Fleet, old_stock: bool, new_stock: bool, d_stock: bool, n: int = 4
) -> dict[str, Any]:
    engine_id = f"p-fixed-{uuid.uuid4().hex[:8]}"
    common: dict[str, Any] = {"progress_delay_us": PROGRESS_DELAY_US, "engine_id": engine_id}
    d = fleet.start("D", "d", stock=d_stock, progress_delay_us=PROGRESS_DELAY_US)
    p_old = fleet.start("P", "p-old", stock=old_stock, plain_params=not old_stock, **common)
    old_ids, old_params = prefill(p_old, "old", n)
    t_granted = time.monotonic()
    old_rep = p_old.report()
    p_old.kill()
    p_new = fleet.start(
        "P", "p-new", stock=new_stock, side_channel_port=p_old.spec.side_channel_port, **common
    )
    new_ids, new_params = prefill(p_new, "new", n)
    same_blocks = sorted(b for r in old_ids for b in old_rep["reqs"][r]["blocks"]) == sorted(
        b for r in new_ids for b in p_new.report()["reqs"][r]["blocks"]
    )
    hand_to_d(d, new_params, hold=False)
    wait_loaded(d, new_ids, 30)
    d_stats_before = d.stats()
    t_handed = time.monotonic()
    hand_to_d(d, old_params, hold=False)
    d_rep = wait_loaded(d, old_ids, 30)
    time.sleep(0.5)
    d_stats = d.stats()
    new_rep = p_new.report()
    out: dict[str, Any] = {
        "n": n,
        "same_blocks": same_blocks,
        "old_plain": all("remote_lease_deadline" in p for p in old_params.values()) and not old_stock,
        "old_handed_after_grant_s": t_handed - t_granted,
        "old": _outcome(old_rep, d_rep, old_ids),
        "new": _outcome(new_rep, d_rep, new_ids),
        "fenced": over_ranks(d_stats, "num_reads_fenced") - over_ranks(d_stats_before, "num_reads_fenced"),
        "d_errors": d_rep["errors"],
    }
    who = (
        f"old P {'stock' if old_stock else 'ours v1 (plain)'} -> new P {'stock' if new_stock else 'ours'}, "
        f"D {'stock' if d_stock else 'ours'}"
    )
    old, new = out["old"], out["new"]
    print(
        f"\n== plain leases reaching D after the new process was proven ({who}), same block ids "
        f"{same_blocks}, handed {out['old_handed_after_grant_s']:.1f}s after their grant: "
        f"old: failed {old['failed']}/{n}, read correct {old['read_ok']}, WRONG {old['wrong']}; "
        f"new: read correct {new['read_ok']}/{n}, WRONG {new['wrong']}; D fenced {out['fenced']}"
    )
    return out
