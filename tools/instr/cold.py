"""Thread CPU time of the instruction cases' calls, with the caches cold.

``tools.bench_cold`` drives the same cases as ``make bench-instr``
(``tools/instr/cases.py``) through ``ColdProbe``, which has ``Probe``'s
interface but times each call with ``time.thread_time_ns`` instead of counting
its instructions.  Before every timed call it rewrites a buffer larger than
this machine's per-core caches: an engine step runs after the other engines
and the model have evicted what the last step touched, so what a step costs is
its instructions plus what it brings back into the caches, and the second part
is what instruction counts cannot see (a step can run fewer instructions than
stock's and still take longer, by touching more code and data).
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Callable
from typing import Any

from tools.instr.probe import gc_paused

EVICT_BYTES = 32 << 20  # 8x this machine's 4 MiB L2; see docs/BENCHMARKS.md on the L3


class ColdProbe:
    """``Probe``'s interface (``instrumented``, ``measure``, ``pause``, ``resume``),
    timing each measured call's thread CPU in ns (``records``: one per call)."""

    def __init__(self, repeats: int, evict_bytes: int = EVICT_BYTES) -> None:
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        self.repeats = repeats
        self.records: list[dict[str, Any]] = []
        self._buffer = ctypes.create_string_buffer(evict_bytes) if evict_bytes > 0 else None
        self._fill = 0
        self._paused_at = 0
        self._excluded = 0

    def evict(self) -> None:
        """Write every byte of the buffer (a new value each time, so no page stays clean)."""
        if self._buffer is not None:
            self._fill = (self._fill + 1) & 0xFF
            ctypes.memset(self._buffer, self._fill, len(self._buffer))

    def instrumented(self) -> contextlib.AbstractContextManager[None]:
        """No collection lands inside a timed call."""
        return gc_paused()

    def pause(self) -> None:
        """Leave out what follows (a fake peer's answers) until ``resume``."""
        self._paused_at = time.thread_time_ns()

    def resume(self) -> None:
        self._excluded += time.thread_time_ns() - self._paused_at

    def measure(
        self,
        case: str,
        side: str,
        fn: Callable[[], object],
        *,
        ops: int,
        setup: Callable[[], object] | None = None,
        warmup: int = 10,
        repeats: int = 3,
    ) -> None:
        """Time ``fn()`` ``self.repeats`` times (a case's ``repeats`` of 3 is what
        instruction counts need, a time needs more; a case asking for one call
        gets one), each after ``setup()`` and an eviction, neither timed.
        ``warmup`` calls first, untimed, as for the counts (CPython specialises
        a function after 8 calls)."""
        timed = 1 if repeats == 1 else self.repeats  # a step of an interval: timed once, as counted once
        for i in range(warmup + timed):
            if setup is not None:
                setup()
            if i < warmup:
                fn()
                continue
            self.evict()
            self._excluded = 0
            start = time.thread_time_ns()
            fn()
            elapsed = time.thread_time_ns() - start - self._excluded
            self.records.append({"case": case, "side": side, "ops": ops, "ns": elapsed})
