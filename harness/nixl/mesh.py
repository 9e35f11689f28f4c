"""Fleet scenarios: P and D engines in a full mesh (every D reads from every
P, as in a real P/D fleet), with NIXL progress threads that sleep between
events (``progress.py``) so that a dozen engines fit on two cores.

``mesh`` queues ``per_pair`` requests from each P on each D, keeps them
queued past the lease (D heartbeats each P's share to that P), then lets D
read them all.  What a fleet must show: no lease expires while its D is alive
and heartbeating, every read returns the data P wrote, every lease is freed
by its read.
"""

from __future__ import annotations

import time
from typing import Any

from .fleet import Fleet
from .progress import PROGRESS_DELAY_US
from .scenarios import LEASE, data_mismatches, hand_to_d, prefill, wait_freed, wait_loaded


def mesh(
    fleet: Fleet, n_p: int, n_d: int, per_pair: int, hold_s: float = 1.5 * LEASE, stock: bool = False
) -> dict[str, Any]:
    started = time.monotonic()
    ps = [
        fleet.start(
            "P", f"p{i}", stock=stock, progress_delay_us=PROGRESS_DELAY_US, num_blocks=4 * n_d * per_pair + 8
        )
        for i in range(n_p)
    ]
    ds = [
        fleet.start(
            "D", f"d{j}", stock=stock, progress_delay_us=PROGRESS_DELAY_US, num_blocks=4 * n_p * per_pair + 8
        )
        for j in range(n_d)
    ]
    start_s = time.monotonic() - started
    ids: dict[tuple[int, int], list[str]] = {}
    for i, p in enumerate(ps):
        for j, d in enumerate(ds):
            ids[i, j], params = prefill(p, f"m{i}x{j}", per_pair)
            hand_to_d(d, params, hold=True)
    time.sleep(hold_s)
    during = [p.report() for p in ps]
    for d in ds:
        d.release()
    d_ids = {j: [r for (i, jj), rs in ids.items() if jj == j for r in rs] for j in range(n_d)}
    d_reps = [wait_loaded(d, d_ids[j], timeout=60) for j, d in enumerate(ds)]
    p_reps = [
        wait_freed(p, [r for (i, _), rs in ids.items() if i == ip for r in rs], 60) for ip, p in enumerate(ps)
    ]
    expired_while_held = sum("freed_t" in during[i]["reqs"][r] for (i, _), rs in ids.items() for r in rs)
    freed_by: dict[str, int] = {}
    wrong = 0
    for (i, j), rs in ids.items():
        for r in rs:
            reason = p_reps[i]["reqs"][r].get("freed_reason", "held")
            freed_by[reason] = freed_by.get(reason, 0) + 1
        wrong += len(data_mismatches(p_reps[i], d_reps[j], rs))
    out = {
        "engines": (n_p, n_d),
        "requests": sum(map(len, ids.values())),
        "start_s": round(start_s, 1),
        "expired_while_held": expired_while_held,
        "freed_by": freed_by,
        "wrong": wrong,
        "errors": [e for rep in p_reps + d_reps for e in rep["errors"]],
        "p_max_step_s": max(rep["max_step_s"] for rep in p_reps),
        "d_max_step_s": max(rep["max_step_s"] for rep in d_reps),
        "d_heartbeat_msgs": [rep["hb_sent"]["msgs"] for rep in d_reps],
    }
    print(f"\n== mesh {n_p} P x {n_d} D ({'stock' if stock else 'ours'}): {out}")
    return out
