"""D rank: a forward loop that stalls right after posting its loads, while the
loads themselves wait in the transport (a congested link, a retransmission
backed off), so that they run only when the stall ends, on whatever P's blocks
hold by then.

Armed by the ``hold_reads`` engine command (rank 0: TP 1).  The next step that
posts READs keeps them: NIXL's ``transfer`` is deferred and ``check_xfer_state``
answers "PROC" for them, as for a READ still in flight.  After that step the
engine thread blocks (no steps: no heartbeats, no answers taken in) until the
file ``release`` exists; it writes the file ``stalled`` first, so the test knows
when the stall began.  Then it posts the READs for real and waits until NIXL
reports them done, so the next step sees them complete before any answer to a
heartbeat D sends after the stall can reach it.  The READs are real NIXL READs
of P's memory; only their start is moved.
"""

from __future__ import annotations

import os
import time
from typing import Any

# After the release: how long the READs get to complete before the step goes on.
POST_WAIT_S = 5.0


class ReadHold:
    def __init__(self, wrapper: Any, stalled: str, release: str, timeout_s: float) -> None:
        self._wrapper = wrapper
        self._stalled, self._release, self._timeout_s = stalled, release, timeout_s
        self._transfer = wrapper.transfer
        self._check = wrapper.check_xfer_state
        self.held: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
        self.stall_s = 0.0
        wrapper.transfer = self._hold
        wrapper.check_xfer_state = self._state

    def _hold(self, handle: Any, *args: Any, **kwargs: Any) -> str:
        self.held.append((handle, args, kwargs))
        return "PROC"

    def _state(self, handle: Any) -> str:
        if any(h == handle for h, _, _ in self.held):
            return "PROC"  # not posted yet: as a READ queued in the transport
        state: str = self._check(handle)
        return state

    def stall_if_held(self) -> bool:
        """After a step: if it posted READs, stall, then post them and wait for
        them.  True once done (the hold is then removed)."""
        if not self.held:
            return False
        t0 = time.monotonic()
        with open(self._stalled, "w") as f:
            f.write(f"{len(self.held)}\n")
        while not os.path.exists(self._release) and time.monotonic() - t0 < self._timeout_s:
            time.sleep(0.005)
        self.stall_s = time.monotonic() - t0
        held, self.held = self.held, []
        self._wrapper.transfer = self._transfer
        for handle, args, kwargs in held:
            self._transfer(handle, *args, **kwargs)
        deadline = time.monotonic() + POST_WAIT_S
        while any(self._check(h) == "PROC" for h, _, _ in held) and time.monotonic() < deadline:
            time.sleep(0.001)
        self._wrapper.check_xfer_state = self._check
        return True
