"""Two D-side liveness and bounds scenarios over real NIXL.

``restarts``: one D, and ``n`` P processes one after the other, each under a
fresh engine id (vLLM's default: a new uuid per start), each granting one
lease that D reads, then killed.  D's connector structures (two levels into
our components, ``engine.structure_sizes``) and its RSS are sampled after the
first quarter and again once D's engine reaper has released the dead engines
(``engine_ttl`` short): nothing may grow with the number of restarts.

``slow_admission``: P holds back every hello for longer than the lease (its
admission stalls: many agents loading, a TP=8 P's eight welcomes) while D
holds queued requests of it; P's leases must not lapse meanwhile.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from .fleet import Fleet, wait_for
from .progress import PROGRESS_DELAY_US
from .scenarios import d_id, hand_to_d, over_ranks, prefill

ENGINE_TTL_S = 2  # upstream's engine_ttl on D: a dead P's connection is released this long after its last use
SETTLE_S = 30.0  # the reaper sweeps every forget_sweep_s (10 s at lease 6), then TTL eviction


def _sample(d: Any) -> tuple[dict[str, int], dict[str, list[str]], int]:
    out = d.call("structure_sizes", depth=2)
    return out["sizes"], out["keys"], d.call("rss_kib")


def restarts(
    fleet: Fleet, n: int = 20, say: Callable[[str], None] | None = None, stock: bool = False
) -> dict[str, Any]:
    """``say``: a line every 50 restarts (D's RSS and open descriptors), for long runs;
    ``stock``: stock vLLM's connector on both sides."""
    d = fleet.start(
        "D",
        "d",
        stock=stock,
        progress_delay_us=PROGRESS_DELAY_US,
        extra={"engine_ttl": ENGINE_TTL_S},
        num_blocks=64,
        max_lifetime_s=max(600.0, 5.0 * n),  # an engine exits on its own past this (a leak guard)
    )

    def settle() -> None:
        if not stock:  # stock D releases a dead engine only when another one handshakes
            wait_for(lambda: _connected(d) == 0, SETTLE_S, poll=1.0, what="D releasing the dead P engines")

    early: tuple[dict[str, int], dict[str, list[str]], int] | None = None
    engine_ids: list[str] = []
    read = 0
    t0 = time.monotonic()
    for i in range(n):
        p = fleet.start("P", f"p{i}", stock=stock, progress_delay_us=PROGRESS_DELAY_US, num_blocks=16)
        ids, params = prefill(p, f"r{i}", 1)
        engine_ids.append(p.report()["engine_id"])
        hand_to_d(d, params, hold=False)
        local = d_id(ids[0])
        wait_for(lambda: "read_t" in d.report()["reqs"][local], 30, poll=0.05, what="D reading")  # noqa: B023
        read += not d.report()["reqs"][local].get("failed")
        p.kill()
        d.call("drain")  # forget the harness's own per-request records
        if say is not None and (i + 1) % 50 == 0:
            fds = len(os.listdir(f"/proc/{d.pid}/fd"))
            with open(f"/proc/{d.pid}/maps") as maps:
                n_maps = sum(1 for _ in maps)
            threads = len(os.listdir(f"/proc/{d.pid}/task"))
            say(
                f"{i + 1} restarts in {time.monotonic() - t0:.0f}s: D RSS {d.call('rss_kib')} KiB, "
                f"{fds} fds, {n_maps} maps, {threads} threads"
            )
        if i + 1 == max(1, n // 4):
            settle()
            early = _sample(d)
    settle()
    time.sleep(12)  # one more reaper sweep after the eviction
    late = _sample(d)
    assert early is not None
    dead = set(engine_ids)
    holding = {path: [k for k in keys if k in dead] for path, keys in late[1].items() if set(keys) & dead}
    out = {
        "n": n,
        "read": read,
        "elapsed_s": time.monotonic() - t0,
        "early": early[0],
        "late": late[0],
        "grown": {k: (early[0].get(k, 0), v) for k, v in late[0].items() if v > early[0].get(k, 0)},
        "holding_engine_ids": holding,
        "rss_kib": (early[2], late[2]),
        "d_errors": d.report()["errors"],
    }
    top = sorted(late[0].items(), key=lambda kv: -kv[1])[:4]
    print(
        f"\n== {n} P restarts, fresh engine ids, one D: read {read}/{n} in {out['elapsed_s']:.0f}s; "
        f"D RSS {early[2]} KiB after {max(1, n // 4)}, {late[2]} KiB after {n}; largest structures {top}; "
        f"grown {out['grown']}; dicts still naming a dead engine {holding}"
    )
    return out


def _connected(d: Any) -> int:
    return int(d.call("structure_sizes")["sizes"].get("worker._remote_agents", 0))


def slow_admission(fleet: Fleet, hold_s: float, n: int = 4) -> dict[str, Any]:
    p = fleet.start("P", "p", progress_delay_us=PROGRESS_DELAY_US)
    d = fleet.start("D", "d", progress_delay_us=PROGRESS_DELAY_US)
    p.call("hold_hellos", seconds=hold_s)
    ids, params = prefill(p, "slow", n)
    hand_to_d(d, params, hold=True)  # queued on D: heartbeated, not read
    time.sleep(hold_s)
    p_rep = p.report()
    expired = sum(p_rep["reqs"][r].get("freed_reason") == "expiry" for r in ids)
    beats = min(p_rep["reqs"][r].get("hb", 0) for r in ids)
    held = p.call("hold_hellos", seconds=0.0)
    d_stats = d.stats()
    out = {
        "n": n,
        "hold_s": hold_s,
        "expired_during_hold": expired,
        "min_heartbeats_per_lease": beats,
        "hellos_held": held,
        "reads_waiting_proof": over_ranks(d_stats, "num_reads_waiting_proof"),
        "p_errors": p_rep["errors"],
        "d_errors": d.report()["errors"],
    }
    print(
        f"\n== P held back D's hellos for {hold_s:.0f}s (lease {fleet.lease}s): {expired}/{n} of P's leases "
        f"expired meanwhile; fewest heartbeats a lease got {beats}; hellos held {held}"
    )
    return out
