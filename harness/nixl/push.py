"""Push mode (P WRITEs into the blocks D registered) across a network cut.

P runs on host "p", D on host "d" (``harness.netns``), both with the push
connector (``EngineSpec.push``).  The scenario holds P's WRITE at the writer
thread's gate (``gate_writes``) until D's link is cut, so the WRITE is posted
into UCX with the peer unreachable; P's leases then lapse, P prefills other
requests into whatever blocks it has freed (most recently freed first), and
the link heals.  What D then receives is judged by per-head digests: P's
data for the request, or another request's.
"""

from __future__ import annotations

import time
from typing import Any

from .fleet import EngineProcess, Fleet, wait_for
from .scenarios import new_ids

HEADS = 8  # 64 KiB per block: a WRITE larger than a fresh TCP send buffer
TOKENS = 4096  # 128 blocks, 8 MiB per request
BLOCKS_PER_REQ = -(-TOKENS // 32)
PUSH_COUNTERS = (
    "num_failed_transfers",
    "num_push_frees_held",
    "num_push_writes_cancelled",
    "num_push_writes_refused",
)


def start_pair(fleet: Fleet, stock: bool, n: int) -> tuple[EngineProcess, EngineProcess]:
    """P with room for the warm-up, ``n`` requests and ``n`` more (reusing the
    most recently freed blocks first); D with room for the warm-up and ``n``."""
    kw: dict[str, Any] = {"push": True, "kv_heads": HEADS}
    p_blocks = (2 * n + 1) * BLOCKS_PER_REQ + 1
    p = fleet.start("P", "p", stock=stock, host="p", num_blocks=p_blocks, block_reuse="lifo", **kw)
    d = fleet.start("D", "d", stock=stock, host="d", num_blocks=(n + 1) * BLOCKS_PER_REQ + 1, **kw)
    return p, d


def prefill(p: EngineProcess, tag: str, n: int) -> tuple[list[str], dict[str, Any]]:
    ids = new_ids(tag, n)
    return ids, p.prefill(ids, tokens=TOKENS)


def hand_to_d(d: EngineProcess, params: dict[str, Any]) -> None:
    # Upstream's push P matches D's registration to its request by id: D uses P's.
    d.submit([(r, prm, TOKENS) for r, prm in params.items()], hold=False)


def loaded(rec: dict[str, Any]) -> bool:
    """D's connector reported the request's KV received (``failed`` says how).
    Not ``read_t`` alone: the push writer thread drains NIXL's notifications,
    so the harness can see P's completion notification a step or more before
    D's connector reports the load, and before D digested the blocks."""
    return "failed" in rec


def wait_received(
    d: EngineProcess, ids: list[str], timeout: float, seen_early: set[str] | None = None
) -> dict[str, Any]:
    """D's report once every one of ``ids`` was loaded; ``seen_early`` gets
    those whose completion notification the harness saw before the load."""

    def done() -> dict[str, Any] | None:
        rep = d.report()
        if seen_early is not None:
            seen_early.update(r for r in ids if "read_t" in rep["reqs"][r] and not loaded(rep["reqs"][r]))
        return rep if all(loaded(rep["reqs"][r]) for r in ids) else None

    return wait_for(done, timeout, what=f"D receiving {len(ids)} push(es)")


def warm_up(p: EngineProcess, d: EngineProcess) -> None:
    """One push end to end: both handshakes made, UCX connected both ways."""
    ids, params = prefill(p, "warm", 1)
    hand_to_d(d, params)
    wait_received(d, ids, 60)
    wait_for(lambda: all("freed_t" in p.report()["reqs"][r] for r in ids), 30, what="P freeing the warm-up")


def write_held_past_lease(
    fleet: Fleet, hosts: Any, stock: bool, n: int = 2, cut_s: float = 0.0, wait_s: float = 90.0
) -> dict[str, Any]:
    """P's WRITEs are posted just after D's link went down and stay queued
    while the leases lapse and P prefills ``n`` other requests; then the link
    heals: at once, or ``cut_s`` after the cut.  D is given ``wait_s`` to
    receive them.  Returns what D received against what P wrote."""
    p, d = start_pair(fleet, stock, n)
    warm_up(p, d)
    p.call("gate_writes", closed=True)
    ids, params = prefill(p, "held", n)
    hand_to_d(d, params)
    # The first WRITE waits at the gate; the writer thread (one) holds the others behind it.
    wait_for(lambda: p.call("gate_writes", closed=True), 30, what="P's first WRITE at the gate")
    hosts.cut("d")
    t_cut = time.monotonic()
    try:
        p.call("gate_writes", closed=False)  # the WRITEs go into UCX behind the cut
        expired = lambda: sum(s.get("num_kv_expired_reqs", 0) for s in p.stats()) >= n  # noqa: E731
        wait_for(expired, fleet.lease + 5, what="P's leases lapsing")  # no heartbeat crosses the cut
        t_expired = time.monotonic()
        at_expiry = p.report()
        reuse_ids, _ = prefill(p, "reuse", n)  # into the blocks P freed last
        t_reused = time.monotonic()
        time.sleep(max(0.0, t_cut + cut_s - time.monotonic()))
    finally:
        hosts.heal("d")
    t_heal = time.monotonic()
    seen_early: set[str] = set()
    try:
        d_rep = wait_received(d, ids, wait_s, seen_early)
    except TimeoutError:
        d_rep = d.report()
    time.sleep(1.0)
    p_rep = p.report()
    wrote = {r: p_rep["reqs"][r].get("digest") for r in ids}
    done = [r for r in ids if loaded(d_rep["reqs"][r])]
    got = {r: d_rep["reqs"][r].get("digest") or {} for r in done if not d_rep["reqs"][r]["failed"]}
    others = {r: rec["digest"] for r, rec in p_rep["reqs"].items() if r not in ids and rec.get("digest")}
    out = {
        "p": p_rep,
        "d": d_rep,
        "received": len(got),
        "failed": len(done) - len(got),
        "notified_before_loaded": len(seen_early),
        "right": sum(got[r] == wrote[r] for r in got),
        "wrong": sum(got[r] != wrote[r] for r in got),
        "freed_in_cut": sum("freed_t" in at_expiry["reqs"][r] for r in ids),
        "freed_after_heal": sum(p_rep["reqs"][r].get("freed_t", 0.0) >= t_heal for r in ids),
        "p_stats": p.stats(),
        "cut_s": t_heal - t_cut,
        # into the cut: when P's leases had lapsed, and when P had prefilled the others
        "expired_s": t_expired - t_cut,
        "reused_s": t_reused - t_cut,
        # when P freed each request, from the heal (s)
        "freed_from_heal": [round(p_rep["reqs"][r].get("freed_t", 0.0) - t_heal, 2) for r in ids],
        # each wrong one: how many heads held P's data, and whose data the others held
        "wrong_heads": {r: _heads_like(got[r], wrote[r] or {}, others) for r in got if got[r] != wrote[r]},
    }
    print(
        f"\n== push WRITEs queued behind a {out['cut_s']:.1f}s cut ({'stock' if stock else 'ours'}): "
        f"P freed {out['freed_in_cut']}/{n} during the cut, {out['freed_after_heal']} after the heal; "
        f"D received {out['received']}/{n} ({out['failed']} failed): {out['right']} as P wrote them, "
        f"{out['wrong']} not "
        f"(P prefilled {len(reuse_ids)} others in the cut, into the blocks it freed last); "
        f"P freed them at {out['freed_from_heal']} s from the heal; "
        f"{out['notified_before_loaded']} seen notified before D reported them loaded"
    )
    push_stats = {k: sum(s.get(k, 0) for s in out["p_stats"]) for k in PUSH_COUNTERS}
    print(
        f"   P: {push_stats}; leases lapsed {out['expired_s']:.1f}s into the cut, "
        f"the others prefilled at {out['reused_s']:.1f}s"
    )
    for r, like in out["wrong_heads"].items():
        print(
            f"   wrong {r}: {like}; D received it {d_rep['reqs'][r]['read_t'] - t_heal:.2f} s from the heal"
        )
    return out


def _heads_like(
    got: dict[Any, str], wrote: dict[Any, str], others: dict[str, dict[Any, str]]
) -> dict[str, int]:
    """Per head of what D received: P's data for it, another request's, or neither."""
    like: dict[str, int] = {}
    for h, digest in got.items():
        owner = (
            "its own"
            if wrote.get(h) == digest
            else next((r for r, heads in others.items() if heads.get(h) == digest), "no request's")
        )
        like[owner] = like.get(owner, 0) + 1
    return like
