"""Idle P: stop spinning a core while only unread leases keep the engine busy.

vLLM's engine keeps stepping while finished requests hold KV blocks for D;
each empty step runs the connector and returns at once, so a P whose D is slow
or gone burns a whole core doing nothing.  When the scheduler marks a step idle
(no tokens scheduled, no reads to start) and the worker finished nothing, got
no notification and has no read in flight, the worker pauses for
``idle_step_sleep_ms`` (never past the next lease deadline).  A request that
arrives meanwhile waits at most that long.

Off by default: with vLLM's multiprocess executor the process waiting on the
other end of the shared-memory queue busy-waits (sched_yield) after each
message, so the pause only moves the spinning (see docs/BENCHMARKS.md).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ...prefill.lease_table import LeaseTable
from ..metadata import LEASE_IDLE_ATTR

if TYPE_CHECKING:
    from ..upstream import TransferResults


class IdlePause:
    """Worker side: one step's idle verdict, and the pause at its end."""

    def __init__(self, sleep_s: float, table: LeaseTable) -> None:
        self.sleep_s = sleep_s
        self._table = table
        self._idle_step = False
        self._notified = False

    @property
    def enabled(self) -> bool:
        return self.sleep_s > 0

    def begin_step(self, metadata: object) -> None:
        if self.sleep_s > 0:
            self._idle_step = bool(getattr(metadata, LEASE_IDLE_ATTR, False))
            self._notified = False

    def saw_notifications(self, notifs: object) -> None:
        """``notifs``: what the step drained (anything non-empty means a peer spoke)."""
        if notifs:
            self._notified = True

    def end_step(self, results: TransferResults, reads_pending: int) -> None:
        """``reads_pending``: READs in flight or waiting to be posted (D side)."""
        if (
            self.sleep_s > 0
            and self._idle_step
            and not self._notified
            and not results.finished_sending
            and not results.finished_recving
            and not reads_pending
            and len(self._table)
        ):
            self._idle_step = False  # one pause per step
            pause = self.sleep_s
            next_deadline = self._table.next_deadline()
            if next_deadline is not None:
                pause = min(pause, max(0.0, next_deadline - time.perf_counter()))
            if pause > 0:
                time.sleep(pause)
