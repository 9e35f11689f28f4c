"""The run's history: one JSON object per line, ``t`` in seconds since the run began.

Kinds of line (``ev``) and their fields:

- ``run``: seed, impl, lane, lease, extension, interval, bounds, engines
- ``engine``: name, role, host, engine_id, pid, up (a start, a restart or a kill)
- ``request``: id, p, d, blocks, wait_s, burst, probe; abort_s (its client cancels it that long
  after it reached D), dup (d, wait_s: its P params submitted a second time)
- ``written``: id, digest (P wrote the request's KV) / ``read``: id, d, failed, digest; copy (1: the
  second submission's), aborted (the load of a cancelled request)
- ``abort``: id, copy, d, d_engine, d_gen, where (D found it "queued", "admitted" or "gone")
- ``freed``: id, p, reason ("read" or "expiry"), hb_last (P's last heartbeat naming it)
- ``stats``: engine, fenced, discarded (cumulative, this engine process)
- ``fault``: fid, kind, hosts, engines, until, detail / ``heal``: fid / ``heal_all``
- ``tcp_wait``: pair ("p0->d1"), backoffs, wait_s (looked at after ``heal_all`` until the pair
  served: the latest moment, in s after the heal, a backed-off retransmission of a TCP connection
  of the pair's engines, either way, was due; and that connection's backoffs)
- ``sizes``: engine, phase ("warm", "run", "end"), sizes, keys, rss_kb; held (D: free KV
  blocks, loads admitted and not reported, pending receives, with ids; ``Engine.d_held``)
- ``steps``: engine, start, conn, pre (P's steps: start, connector s, preemptions)
- ``phase``: name ("warm", "faults", "recovery", "quiet", "end")
- ``error``: engine, text
- ``routed``: id, prompt, burst, probe, n, cancel_s, hedge / ``answer``: id, status, equal (to P
  alone), error, elapsed_s, d, copy, cancelled (serve lane: a request through vllm-router, or a
  hedged decode step, and what came back)
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO


class History:
    """Appends events to ``path`` from any thread; times relative to ``t0`` (time.monotonic)."""

    def __init__(self, path: str | Path, t0: float | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic() if t0 is None else t0
        self._lock = threading.Lock()
        self._fh: TextIO = open(self.path, "w")
        self.counts: dict[str, int] = {}
        self.observers: list[Any] = []  # called with each event, under the lock

    def rel(self, mono: float) -> float:
        """A ``time.monotonic()`` reading as run time."""
        return round(mono - self.t0, 4)

    def now(self) -> float:
        return self.rel(time.monotonic())

    def add(self, ev: str, t: float | None = None, **fields: Any) -> dict[str, Any]:
        rec = {"t": self.now() if t is None else t, "ev": ev, **fields}
        line = json.dumps(rec, separators=(",", ":"), default=_default)
        with self._lock:
            self._fh.write(line + "\n")
            self.counts[ev] = self.counts.get(ev, 0) + 1
            for observe in self.observers:
                observe(rec)
        return rec

    def flush(self) -> None:
        with self._lock:
            self._fh.flush()

    def close(self) -> None:
        with self._lock:
            self._fh.close()


def _default(obj: Any) -> Any:
    if isinstance(obj, (set, frozenset, tuple)):
        return sorted(obj) if isinstance(obj, (set, frozenset)) else list(obj)
    raise TypeError(f"not JSON: {type(obj).__name__}")


def read(path: str | Path) -> list[dict[str, Any]]:
    """Every event of a history file, in time order (lines are written as they
    happen, by several threads: sorted by ``t`` here, stably)."""
    with open(path) as fh:
        return sort(json.loads(line) for line in fh if line.strip())


def sort(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(events, key=lambda e: e["t"])


def of(events: list[dict[str, Any]], *kinds: str) -> Iterator[dict[str, Any]]:
    return (e for e in events if e["ev"] in kinds)
