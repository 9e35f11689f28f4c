"""NIXL progress threads that sleep between events (harness engines only).

NIXL's UCX backend progresses its UCX workers on a thread that waits for
their event fds with ``poll(timeout=pthrDelay)`` (``nixlAgentConfig.pthrDelay``,
microseconds, rounded up to whole milliseconds; ucx_backend.cpp).  NIXL's
Python API sets it to 0, so ``poll`` returns at once and each agent's thread
spins one core: this 2-core machine then holds two engines, not a fleet.
With a delay the thread sleeps until UCX signals an event, and at most that
long (the periodic wake-up NIXL keeps for fds that fail to wake ``poll``).

Measured here, two agents in one process: 1.98 cores idle with 0, 0.04
with 1000 us; notification latency p50 34 us, p99 0.11 ms with 1000 us.
It is the same NIXL and UCX code, only the wait differs, so the fleet
scenarios use it to fit many engines on two cores (``EngineSpec.progress_delay_us``).
"""

from __future__ import annotations

# The delay every harness agent that shares the cores uses: NIXL's poll timeout, in us (0 would spin
# a core per agent; 1000 measured above).
PROGRESS_DELAY_US = 1000


def sleep_between_events(delay_us: int) -> None:
    """Make every NIXL agent created later in this process (and its forks)
    use ``pthrDelay = delay_us`` instead of the Python API's 0."""
    import nixl._api as api

    base = api.nixlBind.nixlAgentConfig
    floor = int(delay_us)

    # NIXL's binding class is a runtime attribute (Any to mypy): nothing to type the subclass against.
    class SleepingProgressConfig(base):  # type: ignore[misc, valid-type]
        # The API assigns pthrDelay = 0 after construction; keep ours.
        @property
        def pthrDelay(self) -> int:  # noqa: N802 - NIXL's binding name
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:  # noqa: N802
            base.pthrDelay.__set__(self, max(int(value), floor))

    api.nixlBind.nixlAgentConfig = SleepingProgressConfig
