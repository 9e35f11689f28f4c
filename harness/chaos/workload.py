"""The workload: a continuous stream of requests and, now and then, a burst.

Each request picks a P and a D at random among the engines that are up (a
router sends nothing to an engine it sees down or stalled), a size of 1-4
blocks and how long it waits in D's queue: mostly well within the lease,
some near it and some past it.  A burst hands ``burst_size`` one-block
requests to every D at once.  Its KV is a pattern seeded by its request id
(``harness.nixl.kv_cache.fill_blocks``), so a read of any other request's blocks
shows as a digest that differs from the one P wrote.

Clients that cancel and duplicate readers (stream requests only, never the
warm-up's or the probes'): a fraction ``abort_frac`` of requests is cancelled by
its client (``abort_s`` after it reached D: half of them while still queued,
half after their queue wait, while the READ may be parked, posted or in flight),
and a fraction ``dup_frac`` is submitted twice with the same P params (``dup``:
a second request on the same D or, for ``dup_other_frac`` of them, on another
D, waiting up to a second longer than the first: as a retried or hedged decode
step, or n > 1 sampling, would).  P frees a lease at its first completion, so a
second reader that reads after that reads freed blocks unless fenced.

The random choices come from the run's seed (streams of their own, apart from
the nemesis's; aborts and duplicates from one more, so the sizes and waits of a
seed stay those it had before they existed), so a replay asks for the same
sizes, waits, aborts and duplicates; which engines are up when a request is
made depends on timing.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from typing import Any

from .history import History
from .nodes import Node

TICK_S = 0.2
MAX_BLOCKS = 4
ABORT_FRAC = 0.05  # of stream requests, cancelled by their client
DUP_FRAC = 0.05  # of stream requests, submitted twice with the same P params
DUP_OTHER_FRAC = 0.5  # of those, the second submission on another D (when one is up)
DUP_LAG_S = 1.0  # the second submission waits up to this much longer than the first


class Workload:
    def __init__(
        self,
        hist: History,
        ps: list[Node],
        ds: list[Node],
        seed: int,
        lease: float,
        rate: float,
        burst_size: int,
        burst_times: list[float],
        abort_frac: float = ABORT_FRAC,
        dup_frac: float = DUP_FRAC,
        dup_other_frac: float = DUP_OTHER_FRAC,
    ) -> None:
        self.hist, self.ps, self.ds = hist, ps, ds
        self.rng = random.Random(f"workload-{seed}")
        self.xrng = random.Random(f"workload-aborts-dups-{seed}")
        self.abort_frac, self.dup_frac, self.dup_other_frac = abort_frac, dup_frac, dup_other_frac
        self.lease = lease
        self.rate = rate
        self.burst_size = burst_size
        self.burst_times = sorted(burst_times)  # seconds after start()
        self.run_tag = uuid.uuid4().hex[:6]
        self._n = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.made = 0
        self.bursts = 0
        self.aborts = 0
        self.dups = 0

    def wait_s(self) -> float:
        """Queue wait in D: 70% short, 20% up to most of the lease, 10% past the lease."""
        x = self.rng.random()
        if x < 0.7:
            return round(self.rng.uniform(0.0, 1.0), 3) if self.rng.random() < 0.7 else 0.0
        if x < 0.9:
            return round(self.rng.uniform(1.0, 0.8 * self.lease), 3)
        return round(self.rng.uniform(self.lease, 1.8 * self.lease), 3)

    def cancel_and_copy(self, req: dict[str, Any], ds: list[Node]) -> None:
        """Maybe make ``req`` one its client cancels (``abort_s``), maybe one submitted twice (``dup``)."""
        x = self.xrng
        wait = req["wait_s"]
        if x.random() < self.abort_frac:
            queued = wait > 0 and x.random() < 0.5
            req["abort_s"] = round(x.uniform(0.0, wait) if queued else wait + x.uniform(0.0, 1.0), 3)
            self.aborts += 1
        if x.random() < self.dup_frac:
            others = [d for d in ds if d.name != req["d"]]
            other = bool(others) and x.random() < self.dup_other_frac
            d2 = x.choice(others).name if other else req["d"]
            req["dup"] = {"d": d2, "wait_s": round(wait + x.uniform(0.0, DUP_LAG_S), 3)}
            self.dups += 1

    def new_id(self, kind: str) -> str:
        self._n += 1
        return f"cmpl-{kind}-{self.run_tag}-{self._n}"

    def up(self, nodes: list[Node]) -> list[Node]:
        return [n for n in nodes if n.state == "up"]

    @property
    def by_name(self) -> dict[str, Node]:
        return {n.name: n for n in self.ps + self.ds}

    def send(self, p: Node, reqs: list[dict[str, Any]]) -> None:
        if not reqs:
            return
        by_d: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
        nodes = self.by_name
        submissions = sum(1 + ("dup" in r) for r in reqs)

        def route(req: dict[str, Any], params: dict[str, Any]) -> None:
            by_d.setdefault(req["d"], []).append((req, params))
            dup = req.get("dup")
            if dup is not None:  # the second reader: the same params, its own local id
                copy = {k: v for k, v in req.items() if k not in ("dup", "abort_s")}
                by_d.setdefault(dup["d"], []).append(({**copy, **dup, "copy": 1}, params))
            if sum(map(len, by_d.values())) == submissions:  # the whole batch prefilled: one submit per D
                for d, items in by_d.items():
                    nodes[d].submit_job(items)

        p.prefill_job(reqs, route)
        self.made += len(reqs)

    def one(
        self,
        probe: bool = False,
        p: Node | None = None,
        d: Node | None = None,
        wait: float | None = None,
        clients: bool = False,
    ) -> None:
        """One request; ``clients``: one of the stream's, which may be cancelled or duplicated."""
        ps, ds = self.up(self.ps), self.up(self.ds)
        if (p is None and not ps) or (d is None and not ds):
            return
        p = p or self.rng.choice(ps)
        d = d or self.rng.choice(ds)
        req = {
            "id": self.new_id("probe" if probe else "r"),
            "d": d.name,
            "blocks": self.rng.randint(1, MAX_BLOCKS),
            "wait_s": self.wait_s() if wait is None else wait,
            "burst": 0,
            "probe": int(probe),
        }
        if clients:
            self.cancel_and_copy(req, ds)
        self.send(p, [req])

    def burst(self) -> None:
        ps, ds = self.up(self.ps), self.up(self.ds)
        if not ps or not ds:
            return
        self.bursts += 1
        self.hist.add(
            "burst", n=self.burst_size, ps=[p.name for p in ps], ds=[d.name for d in ds], span_s=10.0
        )
        per_p: dict[str, list[dict[str, Any]]] = {p.name: [] for p in ps}
        for i in range(self.burst_size):
            req = {
                "id": self.new_id("b"),
                "d": ds[i % len(ds)].name,
                "blocks": 1,
                "wait_s": round(self.rng.uniform(0.0, 3.0), 3),
                "burst": 1,
                "probe": 0,
            }
            per_p[ps[i % len(ps)].name].append(req)
        nodes = self.by_name
        for name, reqs in per_p.items():
            self.send(nodes[name], reqs)

    # -- the stream --------------------------------------------------------
    def start(self) -> None:
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="workload", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def _run(self) -> None:
        bursts = list(self.burst_times)
        while not self._stop.wait(TICK_S):
            if bursts and time.monotonic() - self._t0 >= bursts[0]:
                bursts.pop(0)
                self.burst()
            # Poisson arrivals at ``rate`` per second.
            n = 0
            budget = self.rng.expovariate(self.rate)
            while budget < TICK_S:
                n += 1
                budget += self.rng.expovariate(self.rate)
            for _ in range(n):
                self.one(clients=True)
