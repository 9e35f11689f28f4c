"""Idle P: stop spinning a core while only unread leases keep the engine busy.

vLLM's engine keeps stepping while finished requests hold KV blocks for D;
each empty step runs the connector and returns at once, so a P whose D is slow
or gone burns a whole core doing nothing.  When the scheduler marks a step idle
(no tokens scheduled, no reads to start) and the worker finished nothing, got
no notification and has no read in flight, the worker pauses for
``idle_step_sleep_ms`` (never past the next lease deadline).  A request that
arrives meanwhile waits at most that long.

Off by default: with vLLM's multiprocess executor the process waiting on the
other end of the shared-memory queue busy-waits (sched_yield) for a second
after each message, so the pause only moves the spinning (README "Idle P").
"""

from __future__ import annotations

import time
from typing import Any

# Attribute set on upstream's NixlConnectorMetadata by our schedulers.
LEASE_IDLE_ATTR = "lease_idle_step"


def step_is_idle(scheduler_output: Any, meta: Any) -> bool:
    """Scheduler side: nothing to compute and nothing to read this step."""
    tokens = getattr(scheduler_output, "total_num_scheduled_tokens", None)
    return tokens == 0 and not getattr(meta, "reqs_to_recv", None) and not getattr(meta, "reqs_to_save", None)


class IdleStepMixin:
    """Mixed in front of vLLM's pull/push worker classes (after the lease sender)."""

    lease_router: Any

    def _setup_idle_pause(self, sleep_s: float) -> None:
        self._idle_sleep_s = sleep_s
        self._idle_step = False
        self._notified_this_step = False

    def start_load_kv(self, metadata: Any) -> None:
        self._idle_step = bool(getattr(metadata, LEASE_IDLE_ATTR, False))
        self._notified_this_step = False
        super().start_load_kv(metadata)  # type: ignore[misc]

    def _route_notifications(self, notifs: Any) -> set[str]:
        if notifs:
            self._notified_this_step = True
        return super()._route_notifications(notifs)  # type: ignore[misc]

    def get_transfer_results(self) -> Any:
        results = super().get_transfer_results()  # type: ignore[misc]
        if (
            self._idle_sleep_s > 0
            and self._idle_step
            and not self._notified_this_step
            and not results.finished_sending
            and not results.finished_recving
            and not self._recving_transfers  # type: ignore[attr-defined]
            and len(self.lease_router.table)
        ):
            self._idle_step = False  # one pause per step
            pause = self._idle_sleep_s
            next_deadline = self.lease_router.table.next_deadline()
            if next_deadline is not None:
                pause = min(pause, max(0.0, next_deadline - time.perf_counter()))
            if pause > 0:
                time.sleep(pause)
        return results
