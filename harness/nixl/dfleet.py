"""One D against M P engines over real NIXL (the D side of the fleet
benchmark, ``tools/bench_fleet.py``).

Each P prefills its share of one-block requests and hands them to the one D,
which keeps them all queued (``hold=True``) and heartbeats each P's share to
that P.  What it measures is D's heartbeat bookkeeping per step: the
scheduler's ``build_connector_meta`` (which ids are due, the lease views) plus
the worker's ``start_load_kv`` and ``get_transfer_results`` (sends, P's
acknowledgements, view renewals); with every request held, D's connector does
nothing else.  Expiries on any P while D heartbeats are premature.

- ``start``: the P engines and the D, side by side;
- ``grow``: every P prefills up to its share, handed to D at once;
- ``hold``: D's steps while everything stays queued;
- ``release_and_check``: D reads everything; how the P engines freed it;
- ``churn``: beside the queue, new requests every D step, read and finished.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .fleet import EngineProcess, Fleet, wait_for
from .pfleet import BATCH, TOKENS, WARM_IDS_PER_D, cpu_seconds
from .progress import PROGRESS_DELAY_US
from .scenarios import data_mismatches, hand_to_d, prefill, wait_loaded


@dataclass
class DFleet:
    d: EngineProcess
    ps: list[EngineProcess]
    stock: bool
    # P's request ids, per P.
    ids: list[list[str]] = field(default_factory=list)
    start_s: float = 0.0
    say: Callable[[str], None] = print

    @property
    def leases(self) -> int:
        return sum(map(len, self.ids))

    @property
    def impl(self) -> str:
        return "stock" if self.stock else "ours"


def start(
    fleet: Fleet,
    n_p: int,
    max_leases: int,
    stock: bool,
    observe_ids: bool = False,
    extra: dict[str, Any] | None = None,
    say: Callable[[str], None] = print,
) -> DFleet:
    """``n_p`` P engines with room for their share of ``max_leases``, and one D
    (``extra``: their ``kv_connector_extra_config`` additions)."""
    common = {"progress_delay_us": PROGRESS_DELAY_US, "observe_ids": observe_ids, "extra": dict(extra or {})}
    share = -(-max_leases // n_p)
    engines = [("P", f"p{i}", {**common, "num_blocks": share + 64}) for i in range(n_p)]
    engines.append(("D", "d", {**common, "num_blocks": max_leases + 64}))
    t0 = time.monotonic()
    *ps, d = fleet.start_many(engines, stock=stock)
    df = DFleet(d=d, ps=ps, stock=stock, ids=[[] for _ in ps], start_s=time.monotonic() - t0, say=say)
    say(f"  {df.impl}: {n_p} P + 1 D engines started in {df.start_s:.1f}s")
    return df


def _hand_out(df: DFleet, i: int, n: int, tag: str) -> None:
    ids, params = prefill(df.ps[i], tag, n, tokens=TOKENS)
    hand_to_d(df.d, params, hold=True, tokens=TOKENS)
    df.ids[i].extend(ids)


def grow(df: DFleet, leases: int, batch: int = BATCH) -> dict[str, Any]:
    """Prefill and hand to D until the P engines hold ``leases`` leases in all."""
    t0 = time.monotonic()
    if not df.leases:
        # A few first: D's handshake with every P is done before the bulk.
        for i in range(len(df.ps)):
            _hand_out(df, i, WARM_IDS_PER_D, "warm")
        agent = df.d.info["agent"]

        def heard() -> bool:
            return all(agent in p.summary()["hb_agents"] for p in df.ps)

        wait_for(heard, 60, what="D's heartbeats on every P")
    share = -(-leases // len(df.ps))
    for i in range(len(df.ps)):
        while len(df.ids[i]) < share and df.leases < leases:
            _hand_out(df, i, min(batch, share - len(df.ids[i]), leases - df.leases), f"L{leases}p{i}")
    took = time.monotonic() - t0
    df.say(f"  {df.impl}: {len(df.ps)} P hold {df.leases} leases for one D ({took:.1f}s)")
    return {"leases": df.leases, "grow_s": took}


def _expired(df: DFleet) -> int:
    return sum(p.summary()["freed_by"].get("expiry", 0) for p in df.ps)


def hold(df: DFleet, seconds: float) -> dict[str, Any]:
    """Keep every request queued on D for ``seconds``; return D's steps in
    that time (``engine.step_log``), expiries on the P engines and D's CPU use."""
    df.d.timings()
    expired0 = _expired(df)
    cpu0 = cpu_seconds(df.d.pid)
    t0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    cpu_d = (cpu_seconds(df.d.pid) - cpu0) / wall
    t = df.d.timings()
    summary = df.d.summary()
    out = {
        "leases": df.leases,
        "hold_s": wall,
        "steps": t["steps"],
        "hb_msgs": len(t["hb_sent"]),
        "hb_ids_sent": sum(n for _, _, n in t["hb_sent"]),
        "expired": _expired(df) - expired0,
        "errors": summary["errors"] + [e for p in df.ps for e in p.summary()["errors"]],
        "cpu_d": cpu_d,
    }
    df.say(
        f"  {df.impl}: D held {df.leases} requests for {len(df.ps)} P {wall:.1f}s: {len(t['steps'])} "
        f"D steps, {out['hb_msgs']} heartbeat messages sent, {out['expired']} expired on P, "
        f"CPU D {cpu_d:.2f} core"
    )
    return out


def release_and_check(df: DFleet, timeout: float = 120.0) -> dict[str, Any]:
    """Let D read everything; return how the P engines freed it and, with
    ``observe_ids``, how many reads returned data other than P's."""
    df.d.release()
    wait_for(
        lambda: all(p.summary()["live"] == 0 for p in df.ps),
        timeout,
        poll=0.5,
        what=f"P engines freeing {df.leases} lease(s)",
    )
    freed_by: dict[str, int] = {}
    errors: list[str] = []
    for p in df.ps:
        s = p.summary()
        errors += s["errors"]
        for reason, n in s["freed_by"].items():
            freed_by[reason] = freed_by.get(reason, 0) + n
    out: dict[str, Any] = {"freed_by": freed_by, "errors": errors, "wrong": None}
    if df.d.spec.observe_ids:
        d_rep = wait_loaded(df.d, [r for ids in df.ids for r in ids], timeout)
        out["errors"] += d_rep["errors"]
        pairs = zip(df.ps, df.ids, strict=True)
        out["wrong"] = sum(len(data_mismatches(p.report(), d_rep, ids)) for p, ids in pairs)
    df.say(f"  {df.impl}: released: P engines freed {freed_by}, wrong reads {out['wrong']}")
    return out


def churn(df: DFleet, seconds: float, per_step: int) -> dict[str, Any]:
    """The common regime: while D keeps its queue, each ``step_s`` (D's step) one
    P in turn prefills ``per_step`` new requests and hands them to D unheld, which
    admits them, READs their blocks and finishes them (``request_finished``), and
    P frees them on the completion.  Returns D's steps in that time, the requests
    handed over and read, expiries on the P engines (premature: D heartbeats them)."""
    df.d.timings()
    read0 = sum(p.summary()["freed_by"].get("read", 0) for p in df.ps)
    expired0 = _expired(df)
    handed = 0
    step_s = df.d.spec.step_s
    t0 = next_t = time.monotonic()
    end = t0 + seconds
    i = 0
    while time.monotonic() < end:
        ids, params = prefill(df.ps[i], f"c{handed}", per_step, tokens=TOKENS)
        hand_to_d(df.d, params, hold=False, tokens=TOKENS)
        handed += len(ids)
        i = (i + 1) % len(df.ps)
        next_t += step_s
        time.sleep(max(0.0, next_t - time.monotonic()))  # behind: the next hand-over goes at once
    wall = time.monotonic() - t0
    t = df.d.timings()
    # The last hand-overs' reads land after the window: wait for them so P's count is whole.
    wait_for(lambda: sum(p.summary()["live"] for p in df.ps) <= df.leases, 30, poll=0.2, what="D's reads")
    read = sum(p.summary()["freed_by"].get("read", 0) for p in df.ps) - read0
    for e in (df.d, *df.ps):
        e.call("drain")  # forget the churned requests' records: the next size starts as bare
    out = {
        "leases": df.leases,
        "hold_s": wall,
        "steps": t["steps"],
        "handed": handed,
        "read": read,
        "expired": _expired(df) - expired0,
        "errors": df.d.summary()["errors"] + [e for p in df.ps for e in p.summary()["errors"]],
    }
    df.say(
        f"  {df.impl}: D churned {handed} requests over {len(t['steps'])} steps ({wall:.1f}s) beside "
        f"{df.leases} queued: {read} read, {out['expired']} expired on P"
    )
    return out
