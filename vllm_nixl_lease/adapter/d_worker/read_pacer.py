"""D worker: bound the time one step spends posting READs; carry the rest over.

A step that admits a burst of requests posts all their READs at once, as
upstream does, and posting a READ is not free.  Everything else in the worker
waits behind them: the next step's heartbeats, and the acknowledgements that
renew D's lease views.  P then sees a heartbeat gap of one interval plus the
whole burst, which can outlast a short extension: leases expire while D is
alive and about to read them (see docs/BENCHMARKS.md).

Here a step posts READs until ``read_post_budget_ms`` has passed, then queues
the rest in arrival order.  Next step posts the queue first, after that
step's heartbeats (the pull worker sends those before any READ), then new
requests.  A queued request still waits in ``WAITING_FOR_REMOTE_KVS`` and is
still heartbeated by the scheduler, and its READ goes through the fence when
it is finally posted: exactly the state upstream keeps for a request whose
handshake is still running.  Each step posts at least one READ, so the queue
always drains.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..upstream import ReadMeta


class ReadPacer:
    """Which READs a step posts now and which wait for the next step."""

    def __init__(self, budget_s: float) -> None:
        # 0: no bound (upstream's behaviour).
        self.budget_s = budget_s
        self.carried: deque[tuple[str, ReadMeta]] = deque()
        self._stop_at = float("inf")
        self._posted = 0  # READs posted this step
        self.newly_carried = 0  # READs this step queued (the ``num_reads_carried`` stat)

    def begin_step(self) -> None:
        self._posted = 0
        self.newly_carried = 0
        self._stop_at = time.perf_counter() + self.budget_s if self.budget_s else float("inf")

    def carried_over(self) -> Iterable[tuple[str, ReadMeta]]:
        """Earlier steps' READs, oldest first, while this step's budget lasts."""
        return self._take_carried() if self.carried else ()

    def _take_carried(self) -> Iterator[tuple[str, ReadMeta]]:
        carried = self.carried
        while carried and self._has_time():
            self._posted += 1
            yield carried.popleft()

    def defer(self, req_id: str, meta: ReadMeta) -> bool:
        """True: the READ waits for a later step (it is queued).  False: post it now.

        Anything queued goes first, so a new READ never overtakes an old one."""
        # ``_has_time`` inlined: this runs once per READ
        if self.carried or not (self._posted == 0 or time.perf_counter() < self._stop_at):
            self.carried.append((req_id, meta))
            self.newly_carried += 1
            return True
        self._posted += 1
        return False

    def _has_time(self) -> bool:
        # The first READ of a step always goes out, however slow the rest was.
        return self._posted == 0 or time.perf_counter() < self._stop_at

    def __len__(self) -> int:
        return len(self.carried)
