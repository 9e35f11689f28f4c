"""Lease scenarios over real NIXL, shared by the ``test_nixl_*`` modules.

Each function runs one scenario on a ``Fleet`` and returns what the tests
assert on; it also prints the numbers a lease's life is judged by (time from the
last heartbeat P saw to the free, heartbeat messages/bytes D sent).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from vllm_nixl_lease._wire import default_heartbeat_interval, default_lease_extension

from .fleet import EngineProcess, Fleet, wait_for

LEASE = 6
EXTENSION = default_lease_extension(LEASE)  # upstream's derivation; ours uses the same default
INTERVAL = default_heartbeat_interval(LEASE)  # D's heartbeat interval for LEASE
TOKENS = 64  # two 32-token blocks per request
# One P step is 20 ms; the rest absorbs scheduling delays on a busy 2-core box.
STEP_SLACK = 1.5


def new_ids(tag: str, n: int) -> list[str]:
    # vLLM-like ids; distinct per run so a stray notification cannot match.
    run = uuid.uuid4().hex[:8]
    return [f"cmpl-{tag}-{run}-{i}" for i in range(n)]


def over_ranks(stats: list[dict[str, Any]], key: str) -> int:
    """A connector counter summed over an engine's TP ranks (``EngineProcess.stats``: one dict per rank)."""
    return sum(s.get(key, 0) for s in stats)


def d_id(p_id: str) -> str:
    # D's local request id differs from P's, as behind a router.
    return f"d-{p_id}"


def hand_to_d(d: EngineProcess, params: dict[str, Any], hold: bool, tokens: int = TOKENS) -> None:
    d.submit([(d_id(r), p, tokens) for r, p in params.items()], hold=hold)


def wait_freed(p: EngineProcess, ids: list[str], timeout: float) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        rep = p.report()
        return rep if all("freed_t" in rep["reqs"][r] for r in ids) else None

    return wait_for(done, timeout, what=f"P freeing {len(ids)} request(s)")


def data_mismatches(p_rep: dict[str, Any], d_rep: dict[str, Any], ids: list[str]) -> list[str]:
    """Requests whose KV as read by D differs from what P wrote (per head)."""
    bad = []
    for r in ids:
        wrote = p_rep["reqs"][r].get("digest")
        read = d_rep["reqs"][d_id(r)].get("digest")
        if not wrote or wrote != read:
            bad.append(r)
    return bad


def print_summary(title: str, p_rep: dict[str, Any], ids: list[str], d_reps: list[dict[str, Any]]) -> None:
    reqs = [p_rep["reqs"][r] for r in ids]
    reasons: dict[str, int] = {}
    for rec in reqs:
        reasons[rec.get("freed_reason", "held")] = reasons.get(rec.get("freed_reason", "held"), 0) + 1
    hb_to_free = [
        rec["freed_t"] - rec["hb_last_t"] for rec in reqs if "freed_t" in rec and "hb_last_t" in rec
    ]
    renewals = [rec.get("hb", 0) for rec in reqs]
    print(f"\n== {title}: {len(ids)} request(s), freed: {reasons}")
    print(f"   heartbeats naming a request on P: min {min(renewals)} max {max(renewals)}")
    if hb_to_free:
        print(
            f"   last heartbeat -> free: min {min(hb_to_free):.3f}s max {max(hb_to_free):.3f}s "
            f"(extension {EXTENSION}s)"
        )
    for i, d in enumerate(d_reps):
        hb = d["hb_sent"]
        print(
            f"   D{i} sent {hb['msgs']} heartbeat message(s), {hb['bytes']} bytes, largest {hb['max']} B, "
            f"{hb['ids']} ids, {hb['failed']} failed; longest D step {d['max_step_s']:.3f}s"
        )
    print(f"   longest P step {p_rep['max_step_s']:.3f}s over {p_rep['steps']} steps")


def prefill(p: EngineProcess, tag: str, n: int, tokens: int = TOKENS) -> tuple[list[str], dict[str, Any]]:
    ids = new_ids(tag, n)
    return ids, p.prefill(ids, tokens=tokens)


# -- scenarios ---------------------------------------------------------------
def happy_path(fleet: Fleet, p_stock: bool, d_stock: bool, n: int = 4) -> dict[str, Any]:
    p = fleet.start("P", "p", stock=p_stock)
    d = fleet.start("D", "d", stock=d_stock)
    ids, params = prefill(p, "happy", n)
    hand_to_d(d, params, hold=False)
    p_rep = wait_freed(p, ids, timeout=30)
    d_rep = d_caught_up(d, ids)
    print_summary(
        f"happy path (P {'stock' if p_stock else 'ours'}, D {'stock' if d_stock else 'ours'})",
        p_rep,
        ids,
        [d_rep],
    )
    return {"ids": ids, "p": p_rep, "d": d_rep, "p_stats": p.stats()}


def overloaded(fleet: Fleet, p_stock: bool, d_stock: bool, n: int = 4, factor: int = 3) -> dict[str, Any]:
    """Requests wait in D's queue for ``factor`` leases while D keeps stepping."""
    p = fleet.start("P", "p", stock=p_stock)
    d = fleet.start("D", "d", stock=d_stock)
    ids, params = prefill(p, "slow", n)
    hand_to_d(d, params, hold=True)
    time.sleep(factor * LEASE)
    during = p.report()
    d.release()
    p_rep = wait_freed(p, ids, timeout=30)
    d_rep = d_caught_up(d, ids)
    print_summary(
        f"D overloaded {factor}x lease (P {'stock' if p_stock else 'ours'}, "
        f"D {'stock' if d_stock else 'ours'})",
        p_rep,
        ids,
        [d_rep],
    )
    return {"ids": ids, "during": during, "p": p_rep, "d": d_rep, "d_stats": d.stats()}


def wait_heartbeats_decide(
    p: EngineProcess, ids: list[str], lease: float, extension: float, min_heartbeats: int, timeout: float
) -> None:
    """Wait until P's deadline for each of ``ids`` is set by a heartbeat, not by the grant: the last
    heartbeat's ``arrival + extension`` lies past ``grant + lease``.  Judged by time, not by count:
    our D's first tick also goes out as a keep-alive while its hello is answered, so several
    messages can arrive well before that."""

    def decided() -> bool:
        reqs = p.report()["reqs"]
        return all(
            reqs[r].get("hb", 0) >= min_heartbeats
            and reqs[r].get("hb_last_t", 0.0) + extension > reqs[r]["finished_t"] + lease + 0.1
            for r in ids
        )

    wait_for(decided, timeout, what="heartbeats on P")


def d_killed(fleet: Fleet, p_stock: bool, d_stock: bool, n: int = 4) -> dict[str, Any]:
    """SIGKILL a D holding queued requests; P must reclaim, then serve a new D."""
    p = fleet.start("P", "p", stock=p_stock)
    d1 = fleet.start("D", "d1", stock=d_stock)
    ids, params = prefill(p, "orphan", n)
    hand_to_d(d1, params, hold=True)

    # Heartbeats come every second and extend to arrival + 4 s; once one arrives
    # more than 2 s after the grant the free is driven by heartbeats, not by the grant.
    wait_heartbeats_decide(p, ids, LEASE, EXTENSION, min_heartbeats=4, timeout=20)
    d1_rep = d1.report()
    killed_t = d1.kill()
    p_rep = wait_freed(p, ids, timeout=EXTENSION + LEASE + 10)
    # A new D must be served normally by the same P.
    d2 = fleet.start("D", "d2", stock=d_stock)
    ids2, params2 = prefill(p, "after", 2)
    hand_to_d(d2, params2, hold=False)
    p_rep2 = wait_freed(p, ids2, timeout=30)
    d2_rep = d_caught_up(d2, ids2)
    print_summary(
        f"D killed (P {'stock' if p_stock else 'ours'}, D {'stock' if d_stock else 'ours'})",
        p_rep,
        ids,
        [d1_rep],
    )
    print_summary("   ... then a new D", p_rep2, ids2, [d2_rep])
    return {"ids": ids, "p": p_rep, "killed_t": killed_t, "ids2": ids2, "p2": p_rep2, "d2": d2_rep}


def never_handed(fleet: Fleet, p_stock: bool) -> dict[str, Any]:
    p = fleet.start("P", "p", stock=p_stock)
    ids, _ = prefill(p, "lost", 2)
    p_rep = wait_freed(p, ids, timeout=LEASE + 10)
    print_summary(f"never handed to D (P {'stock' if p_stock else 'ours'})", p_rep, ids, [])
    for r in ids:
        rec = p_rep["reqs"][r]
        print(f"   {r}: request_finished -> free {rec['freed_t'] - rec['finished_t']:.3f}s (lease {LEASE}s)")
    return {"ids": ids, "p": p_rep}


def big_heartbeats(fleet: Fleet, n: int, max_bytes: int) -> dict[str, Any]:
    """``n`` queued requests heartbeated in messages of at most ``max_bytes``."""
    extra = {"max_heartbeat_bytes": max_bytes}
    blocks = n + 16  # one 32-token block per request, plus the null block
    p = fleet.start("P", "p", extra=extra, num_blocks=blocks)
    d = fleet.start("D", "d", extra=extra, num_blocks=blocks)
    ids, params = prefill(p, "many", n, tokens=32)
    hand_to_d(d, params, hold=True, tokens=32)
    # Past one lease, so every request needed at least one renewal.
    time.sleep(LEASE + 2)
    during = p.report()
    d.release()
    p_rep = wait_freed(p, ids, timeout=60)
    d_rep = d_caught_up(d, ids)
    print_summary(f"{n} queued requests, max_heartbeat_bytes={max_bytes}", p_rep, ids, [d_rep])
    hb_sizes = [size for _, _, size in during["notif_log"]]
    print(f"   P received {len(hb_sizes)} heartbeat message(s) while D queued, largest {max(hb_sizes)} B")
    return {"ids": ids, "during": during, "p": p_rep, "d": d_rep, "hb_sizes": hb_sizes}


def rogue_during_happy_path(fleet: Fleet, p_stock: bool, n: int = 4) -> dict[str, Any]:
    """A rogue agent floods P with garbage while D holds live requests."""
    from .rogue import finish_rogue, run_rogue

    p = fleet.start("P", "p", stock=p_stock)
    d = fleet.start("D", "d")
    ids, params = prefill(p, "victim", n)
    hand_to_d(d, params, hold=True)
    _, metadata = p.call("agent_metadata")
    proc, conn = run_rogue(fleet.workdir, metadata)
    try:
        sent = finish_rogue(proc, conn)
        time.sleep(1.5)  # let P drain what is in flight (arrival checks need >= 1 s)
        during = p.report()
        stats_during = p.stats()
    finally:
        if proc.is_alive():
            proc.kill()
    d.release()
    try:
        p_rep = wait_freed(p, ids, timeout=20)
        served = True
    except TimeoutError:
        p_rep, served = p.report(), False
    d_rep = d.report()
    print_summary(f"rogue agent vs {'stock' if p_stock else 'our'} P", p_rep, ids, [d_rep])
    print(
        f"   rogue sent {sent['sent']} notification(s) ({sent['bytes']} B), {sent['failed']} send failure(s)"
    )
    errors = during["errors"]
    print(f"   P step errors while flooded: {len(errors)}; live requests served afterwards: {served}")
    for err in errors[:2]:
        print("   first lines of a P step error:", err.strip().splitlines()[-1])
    print(f"   P stats: {stats_during}")
    return {
        "ids": ids,
        "during": during,
        "stats": stats_during,
        "p": p_rep,
        "d": d_rep,
        "served": served,
        "sent": sent,
    }


def hetero_tp(fleet: Fleet, p_stock: bool, d_stock: bool, n: int = 4) -> dict[str, Any]:
    """P with TP 2 (two worker processes, one KV head each) and D with TP 1:
    D reads both halves, heartbeats both P ranks, and each rank frees once."""
    p = fleet.start("P", "p", stock=p_stock, tp_size=2, kv_heads=2)
    d = fleet.start("D", "d", stock=d_stock, kv_heads=2)
    ids, params = prefill(p, "tp", n)
    hand_to_d(d, params, hold=True)
    wait_for(
        lambda: all(p.report()["reqs"][r].get("hb_ranks") == {0, 1} for r in ids),
        15,
        what="heartbeats on both P ranks",
    )
    d.release()
    p_rep = wait_freed(p, ids, timeout=30)
    d_rep = d_caught_up(d, ids)
    print_summary(
        f"P TP2 -> D TP1 (P {'stock' if p_stock else 'ours'}, D {'stock' if d_stock else 'ours'})",
        p_rep,
        ids,
        [d_rep],
    )
    return {"ids": ids, "p": p_rep, "d": d_rep}


def wait_loaded(d: EngineProcess, ids: list[str], timeout: float) -> dict[str, Any]:
    """D's report once every rank of D finished loading (or failing) ``ids``."""

    def done() -> dict[str, Any] | None:
        rep = d.report()
        return rep if all("read_t" in rep["reqs"][d_id(r)] for r in ids) else None

    return wait_for(done, timeout, what=f"D finishing {len(ids)} load(s)")


def d_caught_up(d: EngineProcess, ids: list[str], timeout: float = 10.0) -> dict[str, Any]:
    """D's report once it has seen every load of ``ids`` end, or its last report
    after ``timeout``.  P frees on the completion notification a READ carries,
    which can reach P before D's worker sees that READ complete."""
    deadline = time.monotonic() + timeout
    while True:
        rep = d.report()
        if all("read_t" in rep["reqs"].get(d_id(r), {}) for r in ids) or time.monotonic() > deadline:
            return rep
        time.sleep(0.05)


def wrong_by_rank(
    p_rep: dict[str, Any], d_rep: dict[str, Any], ids: list[str], d_heads: dict[int, list[int]]
) -> dict[int, int]:
    """Per D rank: loads that rank did not fail whose heads differ from what P wrote.

    ``d_heads``: D rank -> the KV heads it holds (rank r of a TP-k D of k heads: [r])."""
    out = {}
    for rank, heads in d_heads.items():
        wrong = 0
        for r in ids:
            rec = d_rep["reqs"][d_id(r)]
            if rank in rec.get("failed_ranks", ()):
                continue
            wrote = p_rep["reqs"][r].get("digest", {})
            read = rec.get("digest", {})
            if any(read.get(h) != wrote.get(h) for h in heads):
                wrong += 1
        out[rank] = wrong
    return out


def hetero_tp_reverse(
    fleet: Fleet, p_stock: bool, d_stock: bool, n: int = 4, hold_s: float = LEASE + 2
) -> dict[str, Any]:
    """P with TP 1 (both KV heads) and D with TP 2 (two worker processes, one
    head each): each D rank reads its head from P rank 0 and heartbeats it
    while the requests wait in D's queue for ``hold_s`` (past one lease); P
    must take two completions per request and free it once."""
    p = fleet.start("P", "p", stock=p_stock, kv_heads=2)
    d = fleet.start("D", "d", stock=d_stock, tp_size=2, kv_heads=2)
    ids, params = prefill(p, "rtp", n)
    t_handed = time.monotonic()
    hand_to_d(d, params, hold=True)
    wait_for(
        lambda: all(len(p.report()["reqs"][r].get("hb_agents", ())) == 2 for r in ids),
        15,
        what="heartbeats from both D ranks on P",
    )
    time.sleep(max(0.0, t_handed + hold_s - time.monotonic()))
    during = p.report()
    d_stats_during = d.stats()
    d.release()
    p_rep = wait_freed(p, ids, timeout=30)
    d_rep = wait_loaded(d, ids, 30)
    held_s = min(d_rep["reqs"][d_id(r)]["admitted_t"] for r in ids) - t_handed
    out = {
        "ids": ids,
        "during": during,
        "held_s": held_s,
        "p": p_rep,
        "d": d_rep,
        "p_stats": p.stats(),
        "d_stats_during": d_stats_during,
        "d_stats": d.stats(),
    }
    print_summary(
        f"P TP1 -> D TP2, held {held_s:.1f}s (P {'stock' if p_stock else 'ours'}, "
        f"D {'stock' if d_stock else 'ours'})",
        p_rep,
        ids,
        [d_rep],
    )
    for rank, st in enumerate(out["d_stats"]):
        print(
            f"   D rank {rank}: heartbeat msgs sent {st.get('num_heartbeat_msgs_sent', 'n/a')}, "
            f"acks received {st.get('num_heartbeat_acks_recv', 'n/a')}, "
            f"views renewed {st.get('num_heartbeat_views_renewed', 'n/a')}, "
            f"fenced {st.get('num_reads_fenced', 0)}"
        )
    comps = [len(p_rep["reqs"][r].get("completions", [])) for r in ids]
    agents = [len(p_rep["reqs"][r].get("hb_agents", ())) for r in ids]
    print(f"   P: completions per request {comps}, D agents heartbeating each {agents}")
    return out


def d_frozen(
    fleet: Fleet, p_stock: bool, d_stock: bool, n: int = 4, p_skew: float = 0.0, d_skew: float = 0.0
) -> dict[str, Any]:
    """D's forward loop stalls (SIGSTOP) with reads pending until P's leases
    lapse and P reuses the blocks for new prefills; then D resumes and is let
    read.  A D that reads now gets someone else's KV (HTTP 200 in real life)."""
    blocks = -(-TOKENS // 32)
    # P holds exactly n requests: the prefills after the expiry reuse the freed blocks.
    p = fleet.start("P", "p", stock=p_stock, num_blocks=n * blocks + 1, clock_skew=p_skew)
    d = fleet.start("D", "d", stock=d_stock, clock_skew=d_skew)
    ids, params = prefill(p, "frozen", n)
    hand_to_d(d, params, hold=True)
    wait_for(lambda: all(p.report()["reqs"][r].get("hb", 0) >= 2 for r in ids), 20, what="heartbeats on P")
    d.freeze()
    try:
        frozen_t = time.monotonic()
        p_expired = wait_freed(p, ids, timeout=LEASE + 10)
        reuse_ids, _ = prefill(p, "reuse", n)  # overwrites the freed blocks
        d.send_only("release", ids=None)
        frozen_s = time.monotonic() - frozen_t
    finally:
        d.thaw()
    d.collect("release")

    d_rep = wait_loaded(d, ids, 30)
    time.sleep(1.0)  # let P take in any late completion notification
    p_rep = p.report()
    out: dict[str, Any] = {
        "ids": ids,
        "reuse_ids": reuse_ids,
        "frozen_s": frozen_s,
        "p_at_thaw": p_expired,
        "p": p_rep,
        "d": d_rep,
        "p_stats": p.stats(),
        "d_stats": d.stats(),
        "d_log": open(d.log, errors="replace").read(),
    }
    failed = sum(bool(d_rep["reqs"][d_id(r)].get("failed")) for r in ids)
    after = sum(s.get("num_notifications_after_expiry", 0) for s in out["p_stats"])
    fenced = sum(s.get("num_reads_fenced", 0) for s in out["d_stats"])
    wrong = len(data_mismatches(p_rep, d_rep, ids)) - failed
    who = f"P {'stock' if p_stock else 'ours'}, D {'stock' if d_stock else 'ours'}"
    print(
        f"\n== D frozen {frozen_s:.1f}s ({who}, "
        f"skew P {p_skew:+g}s D {d_skew:+g}s): loads failed {failed}/{n}, fenced {fenced}, "
        f"P notifications after expiry {after}, reads returning other requests' KV {wrong}"
    )
    return out
