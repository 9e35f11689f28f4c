"""A completion without a READ after a P restart, with a colliding request id.

Client-chosen request ids (``X-Request-Id``, vLLM's randomization off) make
P's lease keys the client's: a restarted P can lease the same id again.

1. P grants a lease on ``x`` (a client-chosen id); D queues it (held), as a
   request it will find whole in its prefix cache (``submit(cached=...)``);
2. P is killed; a new P starts under the same engine id and side-channel
   port and grants a lease on ``x`` too (another prompt);
3. D queues the new request (held), reads probe requests of the new P until
   one reads (D is connected to it), then admits the old request: a full
   prefix hit, so upstream only notifies P ``x:1``;
4. then D reads the new ``x``.

Counted: whether the new P freed its ``x`` on that notification (before D
read it: the hole; the new P then prefills another request, which takes the
freed blocks), and whether D read the new ``x`` with the new P's data.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from .fleet import Fleet, wait_for
from .progress import PROGRESS_DELAY_US
from .scenarios import TOKENS, over_ranks

PROBES = 4


def completion_after_restart(fleet: Fleet, stock: bool) -> dict[str, Any]:
    engine_id = f"p-fixed-{uuid.uuid4().hex[:8]}"
    common: dict[str, Any] = {"progress_delay_us": PROGRESS_DELAY_US, "engine_id": engine_id}
    p = fleet.start("P", "p-old", stock=stock, **common)
    port = p.spec.side_channel_port
    d = fleet.start("D", "d", stock=stock, progress_delay_us=PROGRESS_DELAY_US)
    x = f"client-{uuid.uuid4().hex[:8]}"
    old_params = p.prefill([x], tokens=TOKENS)[x]
    d.submit([("d-old", old_params, TOKENS)], hold=True, cached=["d-old"])
    wait_for(lambda: p.report()["reqs"][x].get("hb", 0) >= 2, 30, what="heartbeats on the old P")
    failed_sends = d.report()["hb_sent"]["failed"]
    p.kill()
    # LIFO: a request prefilled after a free takes the freed blocks (overwrites them).
    p2 = fleet.start("P", "p-new", stock=stock, side_channel_port=port, block_reuse="lifo", **common)
    wait_for(
        lambda: d.report()["hb_sent"]["failed"] > failed_sends, 15, poll=0.05, what="D noticing the dead P"
    )
    new_params = p2.prefill([x], tokens=TOKENS)[x]
    d.submit([("d-new", new_params, TOKENS)], hold=True)
    # Connect D to the new P: probe READs until one reads (stock D keeps the dead
    # agent until a READ over it fails; ours handshakes again and proves the new P).
    for i in range(PROBES):
        probe = f"probe-{i}-{uuid.uuid4().hex[:8]}"
        d.submit([(f"d-{probe}", p2.prefill([probe], tokens=TOKENS)[probe], TOKENS)])
        local = f"d-{probe}"
        wait_for(lambda: "read_t" in d.report()["reqs"][local], 30, poll=0.05, what="a probe read")  # noqa: B023
        rec = d.report()["reqs"][local]
        if not rec.get("failed"):
            break
    else:
        raise RuntimeError(f"D never read from the new P in {PROBES} probes")
    d.release(["d-old"])  # admitted: a full prefix hit, upstream only notifies P "x:1"
    wait_for(
        lambda: "read_t" in d.report()["reqs"]["d-old"], 15, poll=0.05, what="D admitting the old request"
    )
    time.sleep(1.0)  # let a notification reach the new P and its step free the lease
    freed_early = "freed_t" in p2.report()["reqs"][x]
    reuse = f"reuse-{uuid.uuid4().hex[:8]}"
    p2.prefill([reuse], tokens=TOKENS)  # overwrites x's blocks if they were freed
    d.release(["d-new"])
    wait_for(lambda: "read_t" in d.report()["reqs"]["d-new"], 30, poll=0.05, what="D reading the new request")
    time.sleep(0.5)
    d_rep, p2_rep = d.report(), p2.report()
    new = d_rep["reqs"]["d-new"]
    read_ok = (
        not new.get("failed") and bool(new.get("digest")) and new["digest"] == p2_rep["reqs"][x].get("digest")
    )
    out = {
        "freed_by_old_completion": freed_early,
        "new_p_freed_reason": p2_rep["reqs"][x].get("freed_reason"),
        "new_read_ok": read_ok,
        "new_failed": bool(new.get("failed")),
        "withheld": over_ranks(d.stats(), "num_completions_withheld"),
        "d_errors": d_rep["errors"],
        "new_p_errors": p2_rep["errors"],
    }
    who = "stock" if stock else "ours"
    print(
        f"\n== P restarted under the same engine id ({who}), client-chosen id {x} leased by both: "
        f"the old request's notify-only completion freed the new lease: {freed_early}; new request read "
        f"correctly: {read_ok} (failed {out['new_failed']}); completions withheld {out['withheld']}"
    )
    return out
