"""One READ per lease on this D (``docs/PROTOCOL.md``, rule D8).

Upstream attaches P's completion notification to the READ itself, so the first
READ of a lease that completes lets P free and reuse its blocks.  Several local
requests can carry one lease's params (n > 1 children, a retried or hedged
decode, a duplicate submission); each would READ, and every READ after the
first may read freed blocks.  D cannot defer the notification, so it lets the
first request read and fences the others (a failed load:
``kv_load_failure_policy`` recomputes them).

A lease is keyed as the views key it: ``(P engine, P instance, name)``; a plain
P's instance is empty and its name is P's request id.  A claim lives while
some local view of its key remains, and after the last one ends until
``expiry``: the end, on D's clock, of a fresh unrenewed view of the same
params (P's granted deadline converted), so a duplicate that reaches D after
the first reader's request ended is fenced too.  The claims are bounded by
the leases read within one lease duration, plus those still viewed.

A stock P reports no lease deadline, so D keeps no view of its leases: nothing
says how long a duplicate may wait in D's queue.  Those leases
(``claim_unviewed``) are remembered by key, the most recently read
``MAX_UNVIEWED`` of them (oldest forgotten first): bounded memory, and every
duplicate of the last ``MAX_UNVIEWED`` reads is fenced.

Cost: one dict lookup per READ (``claim``); an ended claim is one ordered-dict
entry, pruned from the front as ``claim`` is called.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Container

LeaseKey = tuple[str, str, str]  # (engine, instance, name), as LeaseViews keys views
MAX_UNVIEWED = 1 << 16  # leases of a stock P (no view) remembered as read


class ReadClaims:
    """Which local request reads each lease; keys of ended claims until their expiry."""

    __slots__ = ("_reader", "_ended", "_unviewed")

    def __init__(self) -> None:
        # key -> [the local request that reads it, the end of a fresh view of it (D's clock)]
        self._reader: dict[LeaseKey, tuple[str, float]] = {}
        # keys no local view names any more -> when a fresh view of it would end (oldest first)
        self._ended: OrderedDict[LeaseKey, float] = OrderedDict()
        # leases of a P that reports no deadline -> their reader, most recently read last
        self._unviewed: OrderedDict[LeaseKey, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._reader) + len(self._ended) + len(self._unviewed)

    def claim_unviewed(self, key: LeaseKey, local_id: str) -> bool:
        """``claim`` for a lease D keeps no view of (a stock P): True for its
        first reader, False for another while the key is among the last
        ``MAX_UNVIEWED`` read."""
        unviewed = self._unviewed
        reader = unviewed.get(key)
        if reader is not None:
            return reader == local_id
        unviewed[key] = local_id
        if len(unviewed) > MAX_UNVIEWED:
            unviewed.popitem(last=False)
        return True

    def claim(
        self, key: LeaseKey, local_id: str, expiry: float, now: float, viewed: Container[LeaseKey]
    ) -> bool:
        """May ``local_id`` read the lease ``key``?  True for its first reader (and
        again for it); False for any other local request while the claim lives.
        ``expiry``: when a fresh view of the lease would end (D's clock; -inf if
        unknown); ``viewed``: the keys some local view still names (for pruning)."""
        ended = self._ended
        # Pruned only when the oldest ended claim is due (``_prune``'s own first test, without its call)
        if ended and next(iter(ended.values())) <= now:
            self._prune(now, viewed)
        held = self._reader.get(key)
        if held is None:
            if key in self._ended:
                return False  # read by a request that has ended: the lease may be freed
            self._reader[key] = (local_id, expiry)
            return True
        reader, known = held
        if reader != local_id:
            return False
        if expiry > known:
            self._reader[key] = (reader, expiry)
        return True

    def release(self, key: LeaseKey) -> None:
        """No local view names ``key`` any more: keep its claim until its expiry."""
        held = self._reader.pop(key, None)
        if held is None:
            return
        expiry = held[1]
        if math.isfinite(expiry):
            self._ended[key] = expiry
            self._ended.move_to_end(key)

    def prune(self, now: float, viewed: Container[LeaseKey]) -> int:
        """``_prune`` on a timer (the engine reaper's sweep): ``claim`` prunes only
        when a READ comes, so an idle D would keep its last lease duration's ended
        claims for ever.  Returns how many ended claims it forgot."""
        before = len(self._ended)
        self._prune(now, viewed)
        return before - len(self._ended)

    def _prune(self, now: float, viewed: Container[LeaseKey]) -> None:
        """Forget ended claims past their expiry, oldest first.  An ended claim
        whose key is viewed again (a duplicate that arrived since) becomes live
        again instead: it then lives as long as that view does."""
        ended = self._ended
        while ended:
            key, expiry = next(iter(ended.items()))
            if expiry > now:
                break
            del ended[key]
            if key in viewed:
                self._reader[key] = ("", -math.inf)
