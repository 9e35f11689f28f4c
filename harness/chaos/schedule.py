"""The nemesis's plan: a seeded random schedule of overlapping faults.

Same seed, same fleet layout, same horizon: the same plan, fault for fault (the
stock run replays ours).  Faults arrive at random (exponential gaps) and each
picks a kind, a target and a duration; the first ones cover every kind, so a
short run still mixes them all.  Rules that keep the run meaningful:

- two link faults (a cut, a flapping link) never overlap on one host (a heal
  of one would end the other);
- one engine carries at most one process fault (stop, kill, starve) at a time,
  and at least one engine of each role is free of process faults;
- every fault ends by the horizon; a kill "ends" when its restart begins and
  keeps its engine reserved for ``RESTART_ALLOWANCE_S`` after that.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

KINDS = ("partition", "partition_group", "asym", "flap", "stop", "kill", "starve")
WEIGHTS = {"partition": 3, "partition_group": 2, "asym": 3, "flap": 2, "stop": 3, "kill": 1.5, "starve": 2}
MEAN_GAP_S = 3.0
RESTART_ALLOWANCE_S = 25.0


@dataclass(frozen=True)
class Pace:
    """How dense the plan is, and what a restart costs: the harness lane's by default.
    ``spare`` engines of each role are kept free of process faults at any time (0 lets
    a single P be stopped); ``kill_roles`` are the roles whose engines may be killed."""

    mean_gap_s: float = MEAN_GAP_S
    restart_allowance_s: float = RESTART_ALLOWANCE_S
    spare: tuple[tuple[str, int], ...] = (("P", 1), ("D", 1))
    kill_roles: tuple[str, ...] = ("P", "D")


@dataclass
class Planned:
    fid: int
    kind: str
    start: float  # seconds after the fault phase began
    end: float
    hosts: tuple[str, ...] = ()
    engines: tuple[str, ...] = ()
    detail: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        where = ",".join(self.engines or self.hosts)
        extra = " ".join(f"{k}={v}" for k, v in self.detail.items())
        return f"#{self.fid} {self.kind} {where} {self.start:.1f}s..{self.end:.1f}s {extra}".rstrip()


@dataclass
class Layout:
    """The fleet the plan is for: engine name -> (role, host)."""

    engines: dict[str, tuple[str, str]]

    @property
    def hosts(self) -> list[str]:
        return sorted({h for _, h in self.engines.values()})

    def role(self, role: str) -> list[str]:
        return sorted(n for n, (r, _) in self.engines.items() if r == role)

    def host_of(self, name: str) -> str:
        return self.engines[name][1]


def plan(
    seed: int, horizon_s: float, layout: Layout, kinds: tuple[str, ...] = KINDS, pace: Pace = Pace()
) -> list[Planned]:
    """Faults in start order, all ending by ``horizon_s``."""
    rng = random.Random(seed)
    out: list[Planned] = []
    first = list(kinds)
    rng.shuffle(first)
    t = rng.uniform(1.0, 3.0)
    fid = 0
    while t < horizon_s - 2.0:
        kind = first.pop() if first else rng.choices(kinds, weights=[WEIGHTS[k] for k in kinds])[0]
        f = _draw(rng, fid + 1, kind, t, horizon_s, layout, out, pace)
        if f is not None:
            fid += 1
            out.append(f)
        t += rng.expovariate(1.0 / pace.mean_gap_s)
    return out


def _busy(out: list[Planned], resource: str, start: float, end: float, pace: Pace) -> bool:
    return any(_resources(f) & {resource} and f.start < end and start < _held_until(f, pace) for f in out)


def _held_until(f: Planned, pace: Pace) -> float:
    return f.end + (pace.restart_allowance_s if f.kind == "kill" else 0.5)


def _resources(f: Planned) -> set[str]:
    if f.kind in ("partition", "flap"):
        return {f"link:{h}" for h in f.hosts}
    if f.kind in ("stop", "kill", "starve"):
        return {f"proc:{e}" for e in f.engines}
    return set()


def _role_busy(out: list[Planned], layout: Layout, role: str, start: float, end: float, pace: Pace) -> int:
    names = set(layout.role(role))
    return sum(
        1
        for f in out
        if f.kind in ("stop", "kill", "starve")
        and set(f.engines) & names
        and f.start < end
        and start < _held_until(f, pace)
    )


def _draw(
    rng: random.Random,
    fid: int,
    kind: str,
    t: float,
    horizon: float,
    layout: Layout,
    out: list[Planned],
    pace: Pace,
) -> Planned | None:
    hosts = layout.hosts

    def until(lo: float, hi: float) -> float:
        return min(horizon, t + rng.uniform(lo, hi))

    if kind in ("partition", "flap"):
        free = [h for h in hosts if not _busy(out, f"link:{h}", t, t + 20.0, pace)]
        if not free:
            return None
        h = rng.choice(free)
        if kind == "partition":
            return Planned(fid, kind, t, until(1.5, 12.0), hosts=(h,))
        detail = {"down_s": round(rng.uniform(0.5, 2.5), 2), "up_s": round(rng.uniform(0.5, 2.0), 2)}
        return Planned(fid, kind, t, until(8.0, 20.0), hosts=(h,), detail=detail)
    if kind == "partition_group":
        size = rng.choice([2, 2, 3]) if len(hosts) > 3 else 1
        group = tuple(sorted(rng.sample(hosts, size)))
        return Planned(fid, kind, t, until(3.0, 12.0), hosts=group)
    if kind == "asym":
        h = rng.choice(hosts)
        return Planned(
            fid, kind, t, until(2.0, 12.0), hosts=(h,), detail={"direction": rng.choice(["in", "out"])}
        )
    # Process faults: P or D (alternating by draw), never a role's spare engines.
    role = rng.choice(list(pace.kill_roles) if kind == "kill" else ["P", "D"])
    names = layout.role(role)
    if _role_busy(out, layout, role, t, t + 12.0, pace) >= len(names) - dict(pace.spare).get(role, 1):
        return None
    free = [n for n in names if not _busy(out, f"proc:{n}", t, t + 12.0, pace)]
    if not free:
        return None
    name = rng.choice(free)
    if kind == "stop":
        return Planned(fid, kind, t, until(1.0, 10.0), engines=(name,))
    if kind == "starve":
        return Planned(fid, kind, t, until(3.0, 12.0), engines=(name,), detail={"share": 0.03})
    end = until(1.0, 6.0)
    if end + pace.restart_allowance_s > horizon + pace.restart_allowance_s / 2:
        return None  # a restart must finish near the horizon, not long after it
    return Planned(fid, kind, t, end, engines=(name,), detail={"same_id": int(rng.random() < 0.5)})
