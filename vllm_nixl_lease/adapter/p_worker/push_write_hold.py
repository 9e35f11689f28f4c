"""Push mode P side: a lease that expires while P's own WRITE of its blocks
is being posted or is in flight frees nothing until that WRITE ends.

Upstream's push worker reports an expired request as finished sending at
once ("Expired requests were already reported, even if their WRITEs finish
later"), so vLLM frees and reuses the blocks while UCX may still read them
for the WRITE (queued behind a cut link, say): D then receives another
request's KV.  Here the expiry is counted when it happens; the free follows
the WRITE's end (done or failed).  A WRITE that has not ended ``bound_s``
after the expiry (a dead peer whose transport never reports) is cancelled
through NIXL's ``release_xfer_handle``, which either stops the transfer or
refuses (then the blocks stay held and the cancel is retried next step).
A WRITE the writer thread would start for a lease already freed is refused.

Threads: ``begin``/``end`` run on upstream's push writer thread, the rest on
the engine's main thread.  One lock orders them: the main thread decides
"in flight or freed" under it, so a WRITE either was posting (and the free
waits) or sees the lease freed (and is never posted).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

# Leases freed by expiry that the writer thread may still try to WRITE (a
# registration or handshake arriving late); the oldest are forgotten past this.
FREED_REMEMBERED = 65536


class PushWriteHold:
    def __init__(self, bound_s: float, remembered: int = FREED_REMEMBERED) -> None:
        self.bound_s = bound_s
        self._remembered = remembered
        self._lock = threading.Lock()
        self._posting: set[str] = set()  # the writer thread is posting these requests' WRITEs
        self._freed: OrderedDict[str, None] = OrderedDict()
        self._refused = 0
        # request id -> when its lease expired (worker clock); its free waits for its WRITE
        self.held: dict[str, float] = {}

    # -- writer thread --------------------------------------------------------
    def begin(self, req_id: str) -> bool:
        """Before posting ``req_id``'s WRITE: False if its lease was already freed."""
        with self._lock:
            if req_id in self._freed:
                self._refused += 1
                return False
            self._posting.add(req_id)
            return True

    def end(self, req_id: str) -> None:
        """After posting: its handles (if any) are now in upstream's ``_sending_transfers``."""
        with self._lock:
            self._posting.discard(req_id)

    # -- main thread ----------------------------------------------------------
    def hold_expired(self, expired: Iterable[str], in_flight: Callable[[str], bool], now: float) -> set[str]:
        """Of the requests whose lease just expired, those whose free must wait
        (a WRITE posting or in flight); the others are freed now."""
        held: set[str] = set()
        with self._lock:
            for req_id in expired:
                if req_id in self._posting or in_flight(req_id):
                    held.add(req_id)
                    self.held[req_id] = now
                else:
                    self._forget(req_id)
        return held

    def settle(
        self, in_flight: Callable[[str], bool], cancel: Callable[[str], bool], now: float
    ) -> tuple[set[str], int]:
        """Held requests whose WRITE ended, or was cancelled past ``bound_s``:
        their blocks may be freed now.  Returns them and how many were cancelled."""
        freed: set[str] = set()
        cancelled = 0
        with self._lock:
            for req_id, expired_at in list(self.held.items()):
                if req_id in self._posting:
                    continue
                if in_flight(req_id):
                    if now - expired_at < self.bound_s or not cancel(req_id):
                        continue
                    cancelled += 1
                del self.held[req_id]
                self._forget(req_id)
                freed.add(req_id)
        return freed, cancelled

    def take_refused(self) -> int:
        with self._lock:
            refused, self._refused = self._refused, 0
        return refused

    def _forget(self, req_id: str) -> None:
        self._freed[req_id] = None
        if len(self._freed) > self._remembered:
            self._freed.popitem(last=False)
