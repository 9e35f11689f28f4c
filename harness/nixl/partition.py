"""Network partitions between a P and a D on two hosts (``harness.netns``).

P runs on host "p", D on host "d"; UCX talks TCP over their veths only, so
``hosts.cut("d")`` really stops heartbeats, completions and READs (the driver
still reaches both engines over their pipes).  Each scenario returns what the
tests assert on and prints the numbers (wrong reads, fenced reads, expiries)
plus what UCX did: heartbeats ``send_notif`` accepted during the cut, and how
long after the heal P got them.

Times are ``time.monotonic()``, which every process on the machine shares.
"""

from __future__ import annotations

import time
from typing import Any

from .fleet import EngineProcess, Fleet, wait_for
from .scenarios import (
    EXTENSION,
    INTERVAL,
    LEASE,
    TOKENS,
    d_id,
    data_mismatches,
    hand_to_d,
    over_ranks,
    prefill,
    wait_freed,
    wait_loaded,
    wrong_by_rank,
)

BLOCKS_PER_REQ = -(-TOKENS // 32)


def who(p_stock: bool, d_stock: bool) -> str:
    return f"P {'stock' if p_stock else 'ours'}, D {'stock' if d_stock else 'ours'}"


def start_pair(
    fleet: Fleet,
    p_stock: bool,
    d_stock: bool,
    p_blocks: int = 256,
    env: dict[str, str] | None = None,
    d_tp: int = 1,
) -> tuple[EngineProcess, EngineProcess]:
    """P (TP 1) on host "p", D on host "d"; with ``d_tp`` > 1, D runs that many
    TP ranks (all on host "d") and the model has ``d_tp`` KV heads, one per D rank."""
    heads = {"kv_heads": d_tp} if d_tp > 1 else {}
    p = fleet.start("P", "p", stock=p_stock, host="p", num_blocks=p_blocks, env=dict(env or {}), **heads)
    d = fleet.start("D", "d", stock=d_stock, host="d", env=dict(env or {}), tp_size=d_tp, **heads)
    return p, d


def warm_up(p: EngineProcess, d: EngineProcess) -> float:
    """One request end to end, as a P/D pair that has served before.

    D's first read from an engine that it only handshook for heartbeats
    re-handshakes (upstream 0.33: the handshake made for heartbeats does not
    record P's registration generation, so the read path drops the agent and
    handshakes again).  After this, reads go over the UCX connection that
    heartbeats use.  Returns how long it took.
    """
    t = time.monotonic()
    ids, params = prefill(p, "warm", 1)
    hand_to_d(d, params, hold=False)
    wait_freed(p, ids, timeout=30)
    return time.monotonic() - t


def queue_on_d(p: EngineProcess, d: EngineProcess, tag: str, n: int) -> tuple[list[str], dict[str, Any]]:
    """Prefill ``n`` requests on P and hold them in D's queue until P has seen
    two heartbeats for each; return their ids and D's report at that point."""
    ids, params = prefill(p, tag, n)
    hand_to_d(d, params, hold=True)
    wait_for(lambda: all(p.report()["reqs"][r].get("hb", 0) >= 2 for r in ids), 20, what="heartbeats on P")
    return ids, d.report()


def last_heartbeat_on_p(p: EngineProcess, ids: list[str]) -> float:
    rep = p.report()
    return max(rep["reqs"][r].get("hb_last_t", 0.0) for r in ids)


def cut_after_heartbeat(
    hosts: Any, host: str, p: EngineProcess, ids: list[str], offset: float
) -> tuple[float, float]:
    """Cut ``host`` ``offset`` seconds after P takes in a heartbeat naming ``ids``.

    Returns (when P took in that heartbeat, when the cut happened); the actual
    offset can be a few tens of ms late (polling, one P step).
    """
    before = last_heartbeat_on_p(p, ids)

    def newer() -> float | None:
        t = last_heartbeat_on_p(p, ids)
        return t if t > before else None

    t_hb = wait_for(newer, 5 * INTERVAL + 5, poll=0.02, what="a heartbeat on P")
    delay = t_hb + offset - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    hosts.cut(host)
    return t_hb, time.monotonic()


def notifs_between(p_rep: dict[str, Any], start: float, end: float = float("inf")) -> list[float]:
    return [t for t, _, _ in p_rep["notif_log"] if start <= t < end]


def _sum(stats: list[dict[str, Any]], key: str) -> int:
    return sum(s.get(key, 0) for s in stats)


def _counts(
    p: EngineProcess, d: EngineProcess, p_rep: dict[str, Any], d_rep: dict[str, Any], ids: list[str]
) -> dict[str, Any]:
    p_stats, d_stats = p.stats(), d.stats()
    failed = sum(bool(d_rep["reqs"][d_id(r)].get("failed")) for r in ids)
    accepted = [r for r in ids if not d_rep["reqs"][d_id(r)].get("failed")]
    ranks = range(len(d_stats))
    return {
        "failed": failed,
        # Among the loads D accepted (a failed READ may still have landed P's bytes).
        "wrong": len(data_mismatches(p_rep, d_rep, accepted)),
        "fenced": _sum(d_stats, "num_reads_fenced"),
        # Per D rank (D with TP > 1: rank r holds KV head r).
        "fenced_by_rank": [s.get("num_reads_fenced", 0) for s in d_stats],
        "discarded_by_rank": [s.get("num_reads_discarded", 0) for s in d_stats],
        "failed_by_rank": [
            sum(rank in d_rep["reqs"][d_id(r)].get("failed_ranks", ()) for r in ids) for rank in ranks
        ],
        "wrong_by_rank": wrong_by_rank(p_rep, d_rep, ids, {rank: [rank] for rank in ranks}),
        "expired": sum(p_rep["reqs"][r].get("freed_reason") == "expiry" for r in ids),
        "p_expired_total": _sum(p_stats, "num_kv_expired_reqs"),
        "after_expiry": _sum(p_stats, "num_notifications_after_expiry"),
        "p_stats": p_stats,
        "d_stats": d_stats,
    }


# -- (a) a short partition -----------------------------------------------------
def short_partition(
    fleet: Fleet,
    hosts: Any,
    p_stock: bool,
    d_stock: bool,
    cut_s: float = 2.0,
    offset: float = 0.5,
    n: int = 4,
) -> dict[str, Any]:
    """D holds queued requests; its link is down for ``cut_s`` (< extension -
    interval); then D is let read.  Nothing should expire or be fenced."""
    p, d = start_pair(fleet, p_stock, d_stock)
    warm_up(p, d)
    ids, d_before = queue_on_d(p, d, "short", n)
    t_hb, t_cut = cut_after_heartbeat(hosts, "d", p, ids, offset)
    try:
        time.sleep(cut_s)
        d_at_heal = d.report()
    finally:
        hosts.heal("d")
    t_heal = time.monotonic()
    time.sleep(EXTENSION)  # past every deadline the cut could have cost
    during = p.report()
    d.release()
    p_rep = wait_freed(p, ids, timeout=30)
    time.sleep(0.5)
    d_rep = wait_loaded(d, ids, 30)
    out = {
        "ids": ids,
        "during": during,
        "p": p_rep,
        "d": d_rep,
        "t_hb": t_hb,
        "t_cut": t_cut,
        "t_heal": t_heal,
        **_ucx_facts(d_before, d_at_heal, during, t_cut, t_heal),
        **_counts(p, d, p_rep, d_rep, ids),
    }
    print(
        f"\n== short partition {t_heal - t_cut:.1f}s, cut {t_cut - t_hb:.2f}s after a heartbeat "
        f"({who(p_stock, d_stock)}): expired {out['expired']}/{n}, fenced {out['fenced']}, "
        f"failed loads {out['failed']}, wrong reads {out['wrong']}"
    )
    _print_ucx(out)
    return out


def _ucx_facts(
    d_before: dict[str, Any], d_at_heal: dict[str, Any], p_after: dict[str, Any], t_cut: float, t_heal: float
) -> dict[str, Any]:
    hb0, hb1 = d_before["hb_sent"], d_at_heal["hb_sent"]
    late = notifs_between(p_after, t_heal)
    return {
        "hb_sent_in_cut": hb1["msgs"] - hb0["msgs"],
        "hb_failed_in_cut": hb1["failed"] - hb0["failed"],
        "p_notifs_in_cut": len(notifs_between(p_after, t_cut + 0.05, t_heal)),
        "first_notif_after_heal": (late[0] - t_heal) if late else None,
    }


def _print_ucx(out: dict[str, Any]) -> None:
    first = out["first_notif_after_heal"]
    print(
        f"   UCX during the cut: D's send_notif accepted {out['hb_sent_in_cut']} heartbeat(s), "
        f"{out['hb_failed_in_cut']} raised; P got {out['p_notifs_in_cut']} notification(s); "
        f"first one after the heal: {'none' if first is None else f'+{first:.2f}s'}"
    )


# -- (b) a partition longer than the lease ---------------------------------------
def partition_past_lease(
    fleet: Fleet, hosts: Any, p_stock: bool, d_stock: bool, offset: float, n: int = 4, d_tp: int = 1
) -> dict[str, Any]:
    """D's link goes down ``offset`` s after P takes in a heartbeat and stays
    down until P's leases lapse and P reuses the blocks; then the link heals
    and D is let read.  A D that reads now gets other requests' KV.  With
    ``d_tp`` > 1, D's ranks each read their KV head from P (TP 1)."""
    # P holds exactly n requests: the prefills after the expiry reuse the freed blocks.
    p, d = start_pair(fleet, p_stock, d_stock, p_blocks=n * BLOCKS_PER_REQ + 1, d_tp=d_tp)
    warm_up(p, d)
    ids, d_before = queue_on_d(p, d, "part", n)
    t_hb, t_cut = cut_after_heartbeat(hosts, "d", p, ids, offset)
    try:
        p_expired = wait_freed(p, ids, timeout=LEASE + 10)
        reuse_ids, _ = prefill(p, "reuse", n)  # overwrites the freed blocks
        d_at_heal = d.report()
    finally:
        hosts.heal("d")
    t_heal = time.monotonic()
    d.release()
    d_rep = wait_loaded(d, ids, 40)
    time.sleep(1.0)  # let P take in late completions and heartbeats
    p_rep = p.report()
    out = {
        "ids": ids,
        "reuse_ids": reuse_ids,
        "p_at_heal": p_expired,
        "p": p_rep,
        "d": d_rep,
        "t_hb": t_hb,
        "t_cut": t_cut,
        "t_heal": t_heal,
        "offset": t_cut - t_hb,
        "d_log": open(d.log, errors="replace").read(),
        **_ucx_facts(d_before, d_at_heal, p_rep, t_cut, t_heal),
        **_counts(p, d, p_rep, d_rep, ids),
    }
    freed = [p_expired["reqs"][r]["freed_t"] for r in ids]
    print(
        f"\n== partition {t_heal - t_cut:.1f}s past the lease, cut {out['offset']:.2f}s after a heartbeat "
        f"({who(p_stock, d_stock)}): P expired {out['expired']}/{n} at +{min(freed) - t_cut:.2f}s.."
        f"+{max(freed) - t_cut:.2f}s; D: failed loads {out['failed']}, fenced {out['fenced']}, "
        f"reads returning other requests' KV {out['wrong']}; P completions after expiry {out['after_expiry']}"
    )
    if d_tp > 1:
        print(
            f"   D TP {d_tp}, per rank: fenced {out['fenced_by_rank']}, "
            f"discarded {out['discarded_by_rank']}, failed loads {out['failed_by_rank']}, "
            f"wrong reads {out['wrong_by_rank']}"
        )
    _print_ucx(out)
    return out


# -- (b2) a READ in flight when the partition starts ------------------------------
def read_in_flight(fleet: Fleet, hosts: Any, p_stock: bool, d_stock: bool, n: int = 4) -> dict[str, Any]:
    """D issues its READs just after its link went down (its lease view is
    fresh, so the fence lets them through); they wait in TCP's queue while P's
    leases lapse and P reuses the blocks; then the link heals and the READs
    execute on the reused blocks.  A fence checked only when a READ is issued
    cannot see this; checking again when it completes can."""
    p, d = start_pair(fleet, p_stock, d_stock, p_blocks=n * BLOCKS_PER_REQ + 1)
    warm_up(p, d)  # reads now go straight over UCX, no handshake first
    ids, d_before = queue_on_d(p, d, "inflight", n)
    t_hb, t_cut = cut_after_heartbeat(hosts, "d", p, ids, 0.1 * INTERVAL)
    try:
        d.release()  # D admits them on its next step and posts the READs
        t_release = time.monotonic()
        time.sleep(0.5)
        posted = d.report()
        p_expired = wait_freed(p, ids, timeout=LEASE + 10)
        reuse_ids, _ = prefill(p, "reuse", n)  # overwrites the freed blocks
        d_at_heal = d.report()
    finally:
        hosts.heal("d")
    t_heal = time.monotonic()
    d_rep = wait_loaded(d, ids, 60)
    time.sleep(1.0)
    p_rep = p.report()
    done = [d_rep["reqs"][d_id(r)]["read_t"] for r in ids]
    out = {
        "ids": ids,
        "reuse_ids": reuse_ids,
        "p_at_heal": p_expired,
        "p": p_rep,
        "d": d_rep,
        "admitted_in_cut": sum("admitted_t" in posted["reqs"][d_id(r)] for r in ids),
        "read_done_in_cut": sum("read_t" in d_at_heal["reqs"][d_id(r)] for r in ids),
        "read_done_after_heal": (min(done) - t_heal, max(done) - t_heal),
        "t_release": t_release,
        **_ucx_facts(d_before, d_at_heal, p_rep, t_cut, t_heal),
        **_counts(p, d, p_rep, d_rep, ids),
    }
    first, last = out["read_done_after_heal"]
    print(
        f"\n== READs in flight across a {t_heal - t_cut:.1f}s partition ({who(p_stock, d_stock)}): "
        f"{out['admitted_in_cut']}/{n} admitted during the cut, {out['read_done_in_cut']} done before "
        f"the heal, the rest done +{first:.2f}s..+{last:.2f}s after it; "
        f"P expired {out['expired']}/{n}; D: failed loads {out['failed']}, fenced {out['fenced']}, "
        f"reads returning other requests' KV {out['wrong']}; P completions after expiry {out['after_expiry']}"
    )
    _print_ucx(out)
    return out


# -- (c) a flapping link ------------------------------------------------------------
def flapping_link(
    fleet: Fleet,
    hosts: Any,
    p_stock: bool,
    d_stock: bool,
    down_s: float = 1.5,
    up_s: float = 1.5,
    duration: float = 30.0,
    n: int = 4,
) -> dict[str, Any]:
    """D's link flaps while D holds queued requests; then D is let read.
    Every lease must be freed afterwards (by read or by expiry: none stuck)."""
    p, d = start_pair(fleet, p_stock, d_stock)
    warm_up(p, d)
    ids, d_before = queue_on_d(p, d, "flap", n)
    t0 = time.monotonic()
    flapper = hosts.flapping("d", down_s, up_s)
    try:
        time.sleep(duration)
    finally:
        flapper.stop()
    t_end = time.monotonic()
    d_at_end = d.report()
    time.sleep(2 * INTERVAL + 1)  # heartbeats queued in the last cut drain
    during = p.report()
    d.release()
    try:
        p_rep = wait_freed(p, ids, timeout=LEASE + 20)
        stuck = []
    except TimeoutError:
        p_rep = p.report()
        stuck = [r for r in ids if "freed_t" not in p_rep["reqs"][r]]
    time.sleep(0.5)
    d_rep = d.report()
    loaded = [r for r in ids if "read_t" in d_rep["reqs"][d_id(r)]]
    counts = _counts(p, d, p_rep, d_rep, loaded)
    premature = [r for r in ids if "freed_t" in during["reqs"][r]]
    notifs = notifs_between(during, t0, t_end)
    gaps = [b - a for a, b in zip(notifs, notifs[1:], strict=False)]
    out = {
        "ids": ids,
        "during": during,
        "p": p_rep,
        "d": d_rep,
        "premature": premature,
        "stuck": stuck,
        "cuts": flapper.cuts,
        "hb_sent": d_at_end["hb_sent"]["msgs"] - d_before["hb_sent"]["msgs"],
        "hb_failed": d_at_end["hb_sent"]["failed"] - d_before["hb_sent"]["failed"],
        "p_notifs": len(notifs),
        "max_gap": max(gaps) if gaps else None,
        **counts,
    }
    gap = "n/a" if out["max_gap"] is None else f"{out['max_gap']:.2f}s"
    print(
        f"\n== link flapping {down_s}s down / {up_s}s up for {t_end - t0:.0f}s ({flapper.cuts} cuts; "
        f"{who(p_stock, d_stock)}): premature expiries {len(premature)}/{n}, stuck leases {len(stuck)}, "
        f"fenced {out['fenced']}, failed loads {out['failed']}, wrong reads {out['wrong']}"
    )
    print(
        f"   D sent {out['hb_sent']} heartbeat(s) ({out['hb_failed']} raised), P got {out['p_notifs']} "
        f"notification(s) while flapping; longest gap between them {gap} (extension {EXTENSION}s)"
    )
    return out


# -- (d) a partition longer than UCX's connection timeouts ---------------------------
def partition_past_connection_timeout(
    fleet: Fleet,
    hosts: Any,
    p_stock: bool,
    d_stock: bool,
    cut_s: float,
    env: dict[str, str] | None = None,
    n: int = 2,
) -> dict[str, Any]:
    """The link stays down past UCX's TCP timeouts (``env`` may shorten them).
    Records whether D's sends start failing, then, after the heal, whether the
    old requests load and whether a new request is heartbeated and read."""
    p, d = start_pair(fleet, p_stock, d_stock, env=env)
    warm_up(p, d)
    ids, d_before = queue_on_d(p, d, "long", n)
    t_cut = time.monotonic()
    hosts.cut("d")
    timeline: list[tuple[float, int, int]] = []  # (t - t_cut, sends accepted, sends raised)
    try:
        while time.monotonic() - t_cut < cut_s:
            hb = d.report()["hb_sent"]
            timeline.append(
                (
                    time.monotonic() - t_cut,
                    hb["msgs"] - d_before["hb_sent"]["msgs"],
                    hb["failed"] - d_before["hb_sent"]["failed"],
                )
            )
            time.sleep(1.0)
        d_at_heal = d.report()
    finally:
        hosts.heal("d")
    t_heal = time.monotonic()
    # The old requests: released after the heal (P let them lapse long ago).
    d.release()
    try:
        old_rep = wait_loaded(d, ids, 40)
        old_loaded = True
    except TimeoutError:
        old_rep, old_loaded = d.report(), False
    t_old = time.monotonic()
    # A new request after the heal: is it heartbeated and read?
    new_ids, new_params = prefill(p, "new", 1)
    hand_to_d(d, new_params, hold=True)
    try:
        wait_for(
            lambda: p.report()["reqs"][new_ids[0]].get("hb", 0) >= 2,
            3 * INTERVAL + 5,
            what="heartbeats after the heal",
        )
        new_hb = True
    except TimeoutError:
        new_hb = False
    t_new_hb = time.monotonic()
    d.release()
    try:
        new_rep = wait_loaded(d, new_ids, 15)
        time.sleep(0.5)
        new_p = p.report()
        new_ok = not new_rep["reqs"][d_id(new_ids[0])].get("failed") and not data_mismatches(
            new_p, new_rep, new_ids
        )
    except TimeoutError:
        new_ok = False
    p_rep = p.report()
    first = notifs_between(p_rep, t_heal)
    out = {
        "ids": ids,
        "new_ids": new_ids,
        "timeline": timeline,
        "old_loaded": old_loaded,
        "old_failed": sum(bool(old_rep["reqs"][d_id(r)].get("failed")) for r in ids),
        "old_load_s": t_old - t_heal,
        "new_heartbeated": new_hb,
        "new_hb_s": t_new_hb - t_old,
        "new_read_ok": new_ok,
        "p": p_rep,
        "first_notif_after_heal": (first[0] - t_heal) if first else None,
        "d_log": open(d.log, errors="replace").read(),
        "p_log": open(p.log, errors="replace").read(),
        **_ucx_facts(d_before, d_at_heal, p_rep, t_cut, t_heal),
        "p_stats": p.stats(),
        "d_stats": d.stats(),
    }
    # D2a: our D releases a connection whose P stays silent, before UCX itself gives up
    out["released_silent"] = over_ranks(out["d_stats"], "num_connections_released_silent")
    first_fail = next((t for t, _, failed in timeline if failed), None)
    print(
        f"\n== partition {t_heal - t_cut:.0f}s ({who(p_stock, d_stock)}; env {env or {}}): "
        f"D's send_notif accepted {out['hb_sent_in_cut']} heartbeat(s), raised {out['hb_failed_in_cut']} "
        f"(first failure {'never' if first_fail is None else f'+{first_fail:.0f}s'}), released the "
        f"silent connection {out['released_silent']} time(s); P got {out['p_notifs_in_cut']} during the cut"
    )
    first_s = out["first_notif_after_heal"]
    print(
        f"   after the heal: first notification on P {'never' if first_s is None else f'+{first_s:.2f}s'}; "
        f"old requests loaded {old_loaded} ({out['old_failed']} failed) in {out['old_load_s']:.1f}s; "
        f"a new request heartbeated {new_hb} (in {out['new_hb_s']:.1f}s) and read correctly {new_ok}"
    )
    return out
