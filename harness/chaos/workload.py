"""The workload: a continuous stream of requests and, now and then, a burst.

Each request picks a P and a D at random among the engines that are up (a
router sends nothing to an engine it sees down or stalled), a size of 1-4
blocks and how long it waits in D's queue: mostly well within the lease,
some near it and some past it.  A burst hands ``burst_size`` one-block
requests to every D at once.  Its KV is a pattern seeded by its request id
(``harness.nixl.kv_cache.fill_blocks``), so a read of any other request's blocks
shows as a digest that differs from the one P wrote.

The random choices come from the run's seed (a stream of their own, apart from
the nemesis's), so a replay asks for the same sizes and waits; which engines
are up when a request is made depends on timing.
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
    ) -> None:
        self.hist, self.ps, self.ds = hist, ps, ds
        self.rng = random.Random(f"workload-{seed}")
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

    def wait_s(self) -> float:
        """Queue wait in D: 70% short, 20% up to most of the lease, 10% past the lease."""
        x = self.rng.random()
        if x < 0.7:
            return round(self.rng.uniform(0.0, 1.0), 3) if self.rng.random() < 0.7 else 0.0
        if x < 0.9:
            return round(self.rng.uniform(1.0, 0.8 * self.lease), 3)
        return round(self.rng.uniform(self.lease, 1.8 * self.lease), 3)

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

        def route(req: dict[str, Any], params: dict[str, Any]) -> None:
            by_d.setdefault(req["d"], []).append((req, params))
            if sum(map(len, by_d.values())) == len(reqs):  # the whole batch prefilled: one submit per D
                for d, items in by_d.items():
                    nodes[d].submit_job(items)

        p.prefill_job(reqs, route)
        self.made += len(reqs)

    def one(
        self, probe: bool = False, p: Node | None = None, d: Node | None = None, wait: float | None = None
    ) -> None:
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
                self.one()
