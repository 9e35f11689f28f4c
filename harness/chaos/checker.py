"""The checker: rules over a chaos history (``history``), each a pure function of the events.

- **stale**: a read D accepted (not a failed load) returned data other than its
  request's pattern (its digest differs from what P wrote), or a read of a
  request P never wrote; a second reader of one lease (``readers``) included.
  A cancelled request's load is thrown away by vLLM: its data is counted
  (``stale_after_abort``), not judged.
- **premature expiry**: P let a lease lapse although no fault cut that lease's
  P-D pair off (or stopped, killed or starved either engine) during the
  extension before the expiry, plus a settle time after each fault (one step
  after a resume; after network faults, as long as the chain of faults on the
  pair lasted: TCP's retransmission backoff, ``pair_fault_ends``), and D had
  not given the request up (its load failed before the expiry: D no longer
  heartbeats it and tells P nothing) or cancelled it (every submission of it,
  ``readers.given_up``).  A legitimate expiry names the fault(s) that allowed
  it, or ``GAVE_UP`` or ``readers.ABORTED``.
- **leak**: at the end, a lease on a live P never ended; a D still holds
  per-engine state for an engine id that is not live; a connector structure is
  larger than in the quiet after warm-up; a D holds KV blocks or pending
  receives it did not hold after warm-up, or never reported the load of a
  request cancelled while admitted (``d_leaks``).
- **recovery**: after the final heal, some P-D pair of live engines did not
  serve a new request correctly within ``recovery_s`` of the heal, plus, on
  the harness lane, until when after the heal its engines' TCP connections
  still waited for a backed-off retransmission (``tcp_wait``: nothing queued
  moves before it; D owes service from then on).
- **P step**: a P step's connector time, while a peer of that P was dead,
  partitioned, stopped or starved, exceeded the quiet steps' p99 by more than
  ``step_gain_s`` (steps in which the stepping thread lost its core to another
  process, and steps during bursts, are load on a shared machine, not waiting:
  left out of both sides, and counted).
- **memory**: an engine's RSS exceeded ``rss_factor`` times its RSS after warm-up.
- **crash**: an engine died without a fault killing it (the harness restarts it
  under its engine id, as an orchestrator would; the crash counts as a process
  fault of that engine from its death to its restart).

Not a rule, a figure: **late heals**, the faults the nemesis healed more than
``LATE_HEAL_S`` after their planned end (a kill's heal waits for the restart, so
kills are left out).  The nemesis heals on time unless the machine starves it,
and what starves it starves the engines too, UCX's progress threads included:
a run with late heals was overloaded, and its expiries on unfaulted pairs say
more about the machine than about the connector.

``check`` returns every violation and the figures; ``explain`` prints one
violation with the seed, the history around it and the faults active then.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import readers
from .d_leaks import d_leaks

NETWORK_FAULTS = frozenset({"partition", "partition_group", "asym", "flap"})
PROCESS_FAULTS = frozenset({"stop", "kill", "starve", "crash"})

DEFAULT_BOUNDS = {
    "recovery_s": 30.0,
    "step_gain_s": 0.100,
    "rss_factor": 1.5,
    "settle_net_s": 3.0,
    "settle_proc_s": 1.0,
    "rss_warm_s": 15.0,
}

# Why an expiry with no fault on its pair is legitimate: D's load of it had failed first.
GAVE_UP = "load failed on D"

# Noise a P step's time may carry without being "waiting on a peer": the p99 of quiet steps.
QUIET_PERCENTILE = 0.99


@dataclass
class Violation:
    rule: str
    t: float
    what: str
    engines: tuple[str, ...] = ()


@dataclass
class Fault:
    fid: int
    kind: str
    start: float
    end: float  # heal time (or the end of the history)
    hosts: tuple[str, ...]
    engines: tuple[str, ...]
    detail: dict[str, Any] = field(default_factory=dict)

    def label(self) -> str:
        where = ",".join(self.engines or self.hosts)
        return f"#{self.fid} {self.kind} {where} [{self.start:.1f}s..{self.end:.1f}s]"


@dataclass
class Result:
    violations: list[Violation]
    figures: dict[str, Any]
    faults: list[Fault]

    @property
    def ok(self) -> bool:
        return not self.violations


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


class EngineLifetimes:
    """Engines over time: name -> host, role; generations (engine ids) and when each was up."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.host: dict[str, str] = {}
        self.role: dict[str, str] = {}
        self.ids_ever: set[str] = set()
        self.live_id: dict[str, str | None] = {}
        self.live_gen: dict[str, int | None] = {}  # the process generation (restarts count up)
        self.up_since: dict[str, list[tuple[float, str]]] = {}  # name -> [(t up, engine id)]
        for e in events:
            if e["ev"] != "engine":
                continue
            name = e["name"]
            self.host[name] = e["host"]
            self.role[name] = e["role"]
            self.ids_ever.add(e["engine_id"])
            if e["up"]:
                self.live_id[name] = e["engine_id"]
                self.live_gen[name] = e.get("gen", 0)
                self.up_since.setdefault(name, []).append((e["t"], e["engine_id"]))
            else:
                self.live_id[name] = None
                self.live_gen[name] = None

    def live(self, role: str) -> list[str]:
        return sorted(n for n, r in self.role.items() if r == role and self.live_id.get(n))

    def gen_at(self, name: str, t: float) -> str | None:
        gen = None
        for up_t, eid in self.up_since.get(name, []):
            if up_t <= t:
                gen = eid
        return gen


def faults_of(events: list[dict[str, Any]]) -> list[Fault]:
    end_t = events[-1]["t"] if events else 0.0
    heal_all = next((e["t"] for e in events if e["ev"] == "heal_all"), end_t)
    open_: dict[int, dict[str, Any]] = {}
    out: dict[int, Fault] = {}
    for e in events:
        if e["ev"] == "fault":
            open_[e["fid"]] = e
        elif e["ev"] == "heal" and e["fid"] in open_:
            f = open_.pop(e["fid"])
            out[f["fid"]] = _fault(f, e["t"])
    for fid, f in open_.items():
        out[fid] = _fault(f, heal_all)
    return sorted(out.values(), key=lambda f: (f.start, f.fid))


def _fault(e: dict[str, Any], end: float) -> Fault:
    return Fault(
        fid=e["fid"],
        kind=e["kind"],
        start=e["t"],
        end=end,
        hosts=tuple(e.get("hosts", ())),
        engines=tuple(e.get("engines", ())),
        detail=dict(e.get("detail", {})),
    )


def impairs(f: Fault, engines: EngineLifetimes, p: str, d: str) -> bool:
    """Whether fault ``f`` can stop traffic between engines ``p`` and ``d``."""
    if f.kind in NETWORK_FAULTS:
        hosts = set(f.hosts)
        return (engines.host.get(p) in hosts) != (engines.host.get(d) in hosts)
    return p in f.engines or d in f.engines


def _settle(f: Fault, bounds: dict[str, float]) -> float:
    return bounds["settle_net_s"] if f.kind in NETWORK_FAULTS else bounds["settle_proc_s"]


# Linux's TCP_RTO_MAX: the longest TCP waits between two retransmissions.
TCP_RTO_MAX_S = 120.0


def pair_fault_ends(
    faults: list[Fault], engines: EngineLifetimes, p: str, d: str, b: dict[str, float]
) -> dict[int, float]:
    """Until when each fault impairing the pair ``p``-``d`` may excuse its expiries
    (fid -> time).  Faults that overlap, or follow within the settle time, chain.
    After a chain with a network fault, TCP's retransmission timer has backed off
    for as long as the chain kept segments unacknowledged (each wait doubles the
    one before, so the next retry comes up to about the time lost so far after
    the heal): whatever either side queued waits for it, so the chain settles for
    its own length (at least ``settle_net_s``, at most TCP_RTO_MAX_S).  A chain of
    process faults alone settles for ``settle_proc_s``."""
    mine = sorted((f for f in faults if impairs(f, engines, p, d)), key=lambda f: f.start)
    out: dict[int, float] = {}
    chain: list[Fault] = []

    def close() -> None:
        if not chain:
            return
        start, end = chain[0].start, max(f.end for f in chain)
        if any(f.kind in NETWORK_FAULTS for f in chain):
            settled = end + max(b["settle_net_s"], min(TCP_RTO_MAX_S, end - start))
            for f in chain:
                out[f.fid] = settled
        else:
            for f in chain:
                out[f.fid] = f.end + _settle(f, b)

    for f in mine:
        if chain and f.start > max(g.end + _settle(g, b) for g in chain):
            close()
            chain = []
        chain.append(f)
    close()
    return out


def active_at(faults: Iterable[Fault], t: float) -> list[Fault]:
    return [f for f in faults if f.start <= t <= f.end]


def check(events: list[dict[str, Any]], bounds: dict[str, float] | None = None) -> Result:
    """Every rule over ``events`` (sorted by ``t``); bounds default to the run's, then to DEFAULT_BOUNDS."""
    run = next((e for e in events if e["ev"] == "run"), {})
    b = {**DEFAULT_BOUNDS, **run.get("bounds", {}), **(bounds or {})}
    extension = float(run.get("extension", 4.0))
    engines = EngineLifetimes(events)
    faults = faults_of(events)
    violations: list[Violation] = []
    figures: dict[str, Any] = {}

    requests = {e["id"]: e for e in events if e["ev"] == "request"}
    written = {e["id"]: e["digest"] for e in events if e["ev"] == "written"}
    figures["requests"] = len(requests)
    figures["bursts"] = sum(1 for e in events if e["ev"] == "burst")
    figures["faults_by_kind"] = by_kind(faults)
    figures.update(late_heals(events))

    _check_reads(events, written, violations, figures, requests)
    figures.update(readers.figures(events, requests))
    _check_expiries(events, requests, faults, engines, extension, b, violations, figures)
    check_leaks(events, requests, engines, violations, figures)
    check_d_leaks(events, engines, violations, figures)
    pairs = {f"{p}->{d}": (p, d) for p in engines.live("P") for d in engines.live("D")}
    check_recovery(
        events, _new_reads_by_pair(events, requests, written), pairs, "new request", b, violations, figures
    )
    _check_p_steps(events, faults, engines, b, violations, figures)
    check_memory(events, engines, b, violations, figures)
    check_crashes(events, violations, figures)
    figures["violations"] = len(violations)
    return Result(violations=sorted(violations, key=lambda v: v.t), figures=figures, faults=faults)


def check_crashes(events: list[dict[str, Any]], violations: list[Violation], figures: dict[str, Any]) -> None:
    crashes = [e for e in events if e["ev"] == "crash"]
    for e in crashes:
        violations.append(
            Violation(
                "crash",
                e["t"],
                f"{e['engine']} died unasked: {e.get('why') or 'no log line'}",
                (e["engine"],),
            )
        )
    figures["crashes"] = [f"{e['engine']} at {e['t']:.1f}s: {e.get('why', '')}" for e in crashes]


# A heal this much after its fault's planned end: the nemesis was starved.
LATE_HEAL_S = 1.0


def late_heals(events: list[dict[str, Any]]) -> dict[str, Any]:
    """How many faults (kills aside) were healed over ``LATE_HEAL_S`` late, and the latest."""
    planned = {e["fid"]: e for e in events if e["ev"] == "fault" and e.get("until") is not None}
    lateness = [
        e["t"] - planned[e["fid"]]["until"]
        for e in events
        if e["ev"] == "heal" and e["fid"] in planned and planned[e["fid"]]["kind"] != "kill"
    ]
    late = [s for s in lateness if s > LATE_HEAL_S]
    return {"late_heals": len(late), "latest_heal_s": round(max(lateness, default=0.0), 2)}


def by_kind(faults: list[Fault]) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in faults:
        key = f.kind
        if f.kind == "kill":
            key = f"kill_{'same_id' if f.detail.get('same_id') else 'new_id'}"
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def check_d_leaks(
    events: list[dict[str, Any]],
    engines: EngineLifetimes,
    violations: list[Violation],
    figures: dict[str, Any],
) -> None:
    """``d_leaks``'s findings as ``leak`` violations, counted into ``leaks``."""
    end_t = events[-1]["t"] if events else 0.0
    found, figs = d_leaks(events, engines.live_gen)
    violations.extend(Violation("leak", end_t, what, where) for what, where in found)
    figures.update(figs, leaks=figures.get("leaks", 0) + figs["d_leaks"])


def _check_reads(
    events: list[dict[str, Any]],
    written: dict[str, str],
    violations: list[Violation],
    figures: dict[str, Any],
    requests: dict[str, dict[str, Any]] | None = None,
) -> None:
    requests = requests or {}
    freed = {e["id"]: e for e in events if e["ev"] == "freed"}
    reads = ok = failed = stale = after_abort = stale_second = 0
    for e in events:
        if e["ev"] != "read":
            continue
        reads += 1
        if e["failed"]:
            failed += 1
            continue
        expect = written.get(e["id"])
        if expect is None:
            stale += 1
            violations.append(Violation("stale", e["t"], f"read of {e['id']} on {e['d']}: P never wrote it"))
        elif expect != e["digest"]:
            if e.get("aborted"):
                after_abort += 1  # thrown away by vLLM with its cancelled request
                continue
            stale += 1
            stale_second += bool(e.get("copy"))
            who, when = readers.reader(e, requests), readers.freed_before(e, freed)
            violations.append(
                Violation(
                    "stale",
                    e["t"],
                    f"read of {e['id']}{who} on {e['d']} returned other data{when}",
                    (e["d"],),
                )
            )
        else:
            ok += 1
    fenced = discarded = 0
    last: dict[tuple[str, str], dict[str, Any]] = {}
    for e in events:
        if e["ev"] == "stats":
            last[e["engine"], e.get("engine_id", "")] = e
    for e in last.values():
        fenced += e.get("fenced", 0)
        discarded += e.get("discarded", 0)
    figures.update(
        reads=reads, reads_ok=ok, reads_failed=failed, stale=stale, fenced=fenced, discarded=discarded,
        stale_second_reader=stale_second, stale_after_abort=after_abort,
    )  # fmt: skip


def _check_expiries(
    events: list[dict[str, Any]],
    requests: dict[str, dict[str, Any]],
    faults: list[Fault],
    engines: EngineLifetimes,
    extension: float,
    b: dict[str, float],
    violations: list[Violation],
    figures: dict[str, Any],
) -> None:
    expiries = premature = 0
    allowed_by: dict[str, int] = {}
    # When D gave each request up: its load failed (fenced, discarded, or the READ
    # failed).  D heartbeats only what it still waits for, and a failed load tells
    # P nothing, so P can only let that lease lapse.
    gave_up = readers.given_up(events, requests)  # id -> (when, why): every submission failed or cancelled
    ends: dict[tuple[str, str], dict[int, float]] = {}  # per pair: fid -> until when it excuses
    for e in events:
        if e["ev"] != "freed" or e["reason"] != "expiry":
            continue
        expiries += 1
        req = requests.get(e["id"])
        if req is None:
            continue  # warm-up traffic is not in the history's requests
        p, d = req["p"], req["d"]
        lo, hi = e["t"] - extension - b["settle_net_s"], e["t"]
        if (p, d) not in ends:
            ends[p, d] = pair_fault_ends(faults, engines, p, d, b)
        why = []
        for f in faults:
            if f.fid not in ends[p, d]:
                continue
            f_end = ends[p, d][f.fid]
            if f.kind in ("kill", "crash") and d in f.engines and req["t"] <= f.start:
                f_end = float("inf")  # the D that held it died: its lease can only lapse
            if f.start <= hi and f_end >= lo:
                why.append(f)
        if why:
            for f in why:
                allowed_by[f.kind] = allowed_by.get(f.kind, 0) + 1
            continue
        given_t, given_why = gave_up.get(e["id"], (float("inf"), None))
        if given_t <= e["t"]:
            label = given_why or GAVE_UP
            allowed_by[label] = allowed_by.get(label, 0) + 1
            continue
        premature += 1
        violations.append(
            Violation(
                "premature_expiry",
                e["t"],
                f"lease {e['id']} ({p}->{d}) expired on {p} with no fault on the pair in "
                f"[{lo:.1f}s, {hi:.1f}s]; last heartbeat on P at {e.get('hb_last')}",
                (p, d),
            )
        )
    figures.update(expiries=expiries, premature_expiries=premature, expiries_allowed_by=allowed_by)


def _last_phase_sizes(events: list[dict[str, Any]], phase: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for e in events:
        if e["ev"] == "sizes" and e.get("phase") == phase:
            out[e["engine"]] = e
    return out


def check_leaks(
    events: list[dict[str, Any]],
    requests: dict[str, dict[str, Any]],
    engines: EngineLifetimes,
    violations: list[Violation],
    figures: dict[str, Any],
) -> None:
    end_t = events[-1]["t"] if events else 0.0
    freed = {e["id"] for e in events if e["ev"] == "freed"}
    # Leases granted by the P process that is still alive, never ended.
    open_leases = [
        r
        for r in requests.values()
        if engines.live_gen.get(r["p"]) == r.get("p_gen", 0) and r["id"] not in freed
    ]
    for r in open_leases[:20]:
        violations.append(Violation("leak", end_t, f"lease {r['id']} on {r['p']} never ended", (r["p"],)))
    warm = _last_phase_sizes(events, "warm")
    end = _last_phase_sizes(events, "end")
    grown: list[str] = []
    stale_keys: list[str] = []
    live_ids = {eid for eid in engines.live_id.values() if eid}
    for name, e in end.items():
        base = warm.get(name)
        if base is not None:
            for key, size in e["sizes"].items():
                before = base["sizes"].get(key, 0)
                if size > before:
                    grown.append(f"{name} {key} {before}->{size}")
        for key, ids in e.get("keys", {}).items():
            dead = sorted(set(ids) & (engines.ids_ever - live_ids))
            if dead:
                stale_keys.append(f"{name} {key} holds {dead}")
    for g in grown:
        violations.append(Violation("leak", end_t, f"structure above its quiet size: {g}"))
    for s in stale_keys:
        violations.append(Violation("leak", end_t, f"state for an engine that is gone: {s}"))
    figures.update(
        leases_open=len(open_leases),
        structures_grown=grown,
        dead_engine_state=stale_keys,
        checked_end=bool(end),
    )
    figures["leaks"] = len(open_leases) + len(grown) + len(stale_keys)


def check_recovery(
    events: list[dict[str, Any]],
    served_after: Callable[[float], dict[str, float]],
    expected: Mapping[str, tuple[str, ...]],
    served: str,
    b: dict[str, float],
    violations: list[Violation],
    figures: dict[str, Any],
) -> None:
    """The recovery rule of both lanes: after the final heal, each of ``expected`` (a label, such as
    a P->D pair or a D, -> its engines) served ``served`` correctly within ``recovery_s``.

    ``served_after(heal)`` is the lane's own evidence: per label, the seconds from the heal to
    its first correct service. Without a final heal there is nothing to recover from.
    """
    heal = next((e["t"] for e in events if e["ev"] == "heal_all"), None)
    if heal is None:
        figures["recovery_s"] = None
        return
    first = served_after(heal)
    tcp: dict[str, float] = {}
    for e in events:
        if e["ev"] == "tcp_wait":
            tcp[e["pair"]] = max(tcp.get(e["pair"], 0.0), e["wait_s"])
    worst = 0.0
    wedged = []
    for label, involved in expected.items():
        took = first.get(label)
        bound = b["recovery_s"] + tcp.get(label, 0.0)
        if took is None or took > bound:
            wedged.append(label)
            late = "" if took is None else f" (took {took:.1f}s)"
            waited = ""
            if label in tcp:
                waited = f", TCP's retransmissions due until {tcp[label]:.1f}s after the heal included"
            violations.append(
                Violation(
                    "recovery",
                    heal + bound,
                    f"{label} served no {served} correctly within {bound:.0f}s of the final heal"
                    f"{waited}{late}",
                    involved,
                )
            )
        if took is not None:
            worst = max(worst, took)
    tcp_wait = max(tcp.values(), default=0.0)
    figures.update(recovery_s=round(worst, 3), wedged=wedged, tcp_wait_s=tcp_wait)


def _new_reads_by_pair(
    events: list[dict[str, Any]], requests: dict[str, dict[str, Any]], written: dict[str, str]
) -> Callable[[float], dict[str, float]]:
    """The harness lane's evidence of recovery: per P->D pair, its first correct read of a request
    made after the heal."""

    def served_after(heal: float) -> dict[str, float]:
        first: dict[str, float] = {}
        for e in events:
            if e["ev"] != "read" or e["failed"] or e["t"] < heal:
                continue
            req = requests.get(e["id"])
            if req is None or req["t"] < heal or written.get(e["id"]) != e["digest"]:
                continue
            label = f"{req['p']}->{req['d']}"
            first[label] = min(first.get(label, float("inf")), e["t"] - heal)
        return first

    return served_after


def _check_p_steps(
    events: list[dict[str, Any]],
    faults: list[Fault],
    engines: EngineLifetimes,
    b: dict[str, float],
    violations: list[Violation],
    figures: dict[str, Any],
) -> None:
    faults_start = next((e["t"] for e in events if e["ev"] == "phase" and e["name"] == "faults"), 0.0)
    bursts = [(e["t"], e["t"] + e.get("span_s", 5.0)) for e in events if e["ev"] == "burst"]
    worst_gain = 0.0
    worst_at: tuple[float, str] | None = None
    preempted = 0
    checked = 0
    for name in sorted(n for n, r in engines.role.items() if r == "P"):
        quiet: list[float] = []
        under: list[tuple[float, float, list[Fault]]] = []
        own = [f for f in faults if name in f.engines or engines.host.get(name) in f.hosts]
        peer = [f for f in faults if f not in own]
        for e in events:
            if e["ev"] != "steps" or e["engine"] != name:
                continue
            for t, conn, pre in zip(e["start"], e["conn"], e["pre"], strict=True):
                if t < faults_start:
                    continue
                if pre:
                    preempted += 1
                    continue
                if any(lo <= t <= hi for lo, hi in bursts) or active_at(own, t):
                    continue
                now = [f for f in active_at(peer, t) if _is_peer(f, engines, name)]
                if now:
                    under.append((t, conn, now))
                else:
                    quiet.append(conn)
        base = _percentile(quiet, QUIET_PERCENTILE)
        checked += len(quiet) + len(under)
        for t, conn, now in under:
            gain = conn - base
            if gain > worst_gain:
                worst_gain, worst_at = gain, (t, name)
            if gain > b["step_gain_s"]:
                violations.append(
                    Violation(
                        "p_step",
                        t,
                        f"{name}'s step took {conn * 1e3:.0f} ms in the connector, {gain * 1e3:.0f} ms over "
                        f"its quiet p99 ({base * 1e3:.1f} ms) during {', '.join(f.label() for f in now)}",
                        (name,),
                    )
                )
    figures.update(
        worst_p_step_gain_s=round(worst_gain, 4),
        worst_p_step_at=worst_at,
        p_steps_preempted=preempted,
        p_steps_checked=checked,
    )


def _is_peer(f: Fault, engines: EngineLifetimes, p: str) -> bool:
    """A fault on one of P's peers (a D, or the network between P and a D)."""
    return any(impairs(f, engines, p, d) for d, r in engines.role.items() if r == "D")


def check_memory(
    events: list[dict[str, Any]],
    engines: EngineLifetimes,
    b: dict[str, float],
    violations: list[Violation],
    figures: dict[str, Any],
) -> None:
    base: dict[tuple[str, str], float] = {}
    peak: dict[tuple[str, str], tuple[float, float]] = {}
    for e in events:
        if e["ev"] != "sizes" or not e.get("rss_kb"):
            continue
        key = (e["engine"], e.get("engine_id", ""))
        if key not in base:
            up = engines.up_since.get(e["engine"], [])
            up_t = max((t for t, eid in up if eid == key[1]), default=0.0)
            if e.get("phase") == "warm" or e["t"] >= up_t + b["rss_warm_s"]:
                base[key] = e["rss_kb"]
            continue
        if e["rss_kb"] > peak.get(key, (0.0, 0.0))[0]:
            peak[key] = (e["rss_kb"], e["t"])
    growth = 0.0
    for key, (rss, t) in peak.items():
        factor = rss / base[key]
        growth = max(growth, factor)
        if factor > b["rss_factor"]:
            violations.append(
                Violation(
                    "memory",
                    t,
                    f"{key[0]} ({key[1]}) RSS {rss / 1024:.0f} MiB, {factor:.2f}x its "
                    f"{base[key] / 1024:.0f} MiB after warm-up (bound {b['rss_factor']}x)",
                    (key[0],),
                )
            )
    figures["max_rss_growth"] = round(growth, 3)


QUIET_KINDS = frozenset({"steps", "sizes", "stats"})


def explain(
    v: Violation, events: list[dict[str, Any]], faults: list[Fault], seed: Any, window_s: float = 2.0
) -> str:
    """The seed, the history within ``window_s`` of the violation (at most 40
    lines) and the faults active then."""
    lines = [f"VIOLATION {v.rule} at t={v.t:.3f}s (seed {seed}): {v.what}"]
    active = active_at(faults, v.t)
    lines.append("  faults active: " + (", ".join(f.label() for f in active) if active else "none"))
    near = [
        e
        for e in events
        if abs(e["t"] - v.t) <= window_s
        and e["ev"] not in QUIET_KINDS
        and (not v.engines or e["ev"] in ("fault", "heal", "engine") or _mentions(e, v.engines))
    ]
    lines.append(
        f"  history within {window_s:.0f}s ({len(near)} events{', first 40' if len(near) > 40 else ''}):"
    )
    lines += [f"    {_fmt(e)}" for e in near[:40]]
    return "\n".join(lines)


def _mentions(e: dict[str, Any], engines: tuple[str, ...]) -> bool:
    return any(e.get(k) in engines for k in ("p", "d", "engine", "name"))


def _fmt(e: dict[str, Any]) -> str:
    rest = {k: v for k, v in e.items() if k not in ("t", "ev")}
    return f"{e['t']:9.3f} {e['ev']:8s} {rest}"
