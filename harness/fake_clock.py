"""A hand-driven stand-in for ``time.perf_counter`` (no vLLM import)."""

from __future__ import annotations


class Clock:
    """Stand-in for ``time.perf_counter``."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> float:
        self.now += dt
        return self.now
