"""P side: the D agents that hold each lease, for readers on several Ds.

Only with ``kv_lease_claim_reads`` (``docs/PROTOCOL.md``, rules P14 and D11).
Upstream frees a lease on its first completion notification, whichever D
sent it.  When the same params reach two Ds (a router hedging or retrying the
decode, n > 1 fan-out), the first D's completion frees blocks the second may
be about to read.  So P keeps, per lease, the agents that claimed it: every
agent of version 4 (``_wire.CLAIM_HELLO_VERSION``) whose acknowledged
heartbeat P answered "held" for it.  D reads only after such an answer, so a
D that reads is always a holder on every P rank before its READ starts.

- A completion from a holder: it leaves.  If another holder remains the lease
  is kept (``HELD``); if none does, the lease is freed (``FREE`` when the
  lease had several holders, whatever count the completions said; ``PASS``:
  the one holder's completion goes to the router, which counts it as before).
- A completion from an agent that is not a holder while some holder remains:
  ignored (``IGNORED``, counted by the caller); the lease stays until its
  holders complete or it expires.
- An agent that completed never becomes a holder of that lease again (a
  heartbeat of it can arrive after its completion).
- Everything about a lease goes when the lease is freed (``forget``).

Keys are the names D heartbeats with: P's request id or the lease's tag.

Bounds: one entry per lease a version-4 agent named while it was held (so at
most the lease table's size), a dict of agents only for leases with two or
more claimants, at most ``MAX_HOLDERS_PER_LEASE`` agents each: past that,
``claim`` refuses (the caller answers "not held", so that D does not read).

No vLLM imports.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

# Agents one lease keeps as holders; a claim past this is answered "not held".
MAX_HOLDERS_PER_LEASE = 64


class Completion(enum.Enum):
    """What P does with one completion notification (``LeaseHolders.completed``)."""

    PASS = "pass"  # as without holders: the router counts it
    FREE = "free"  # the last holder finished: free the lease now
    HELD = "held"  # a holder finished, another remains: keep the lease
    IGNORED = "ignored"  # not a holder, while another holds it: keep the lease


class LeaseHolders:
    """Holders per lease key (an id or a tag)."""

    __slots__ = ("_one", "_many", "refused")

    def __init__(self) -> None:
        self._one: dict[str, str] = {}  # key -> its only holder
        # key -> {agent: done}: two or more claimants (done: it sent its completion)
        self._many: dict[str, dict[str, bool]] = {}
        self.refused = 0  # claims refused at the cap, ever (for tests)

    def __len__(self) -> int:
        return len(self._one) + len(self._many)

    def __bool__(self) -> bool:
        return bool(self._one) or bool(self._many)

    def claim(self, key: str, agent: str) -> bool | None:
        """``agent``'s heartbeat named ``key`` while P held it: record it.
        Returns True when it is a new holder, False when it already was (or
        finished with it), None when refused (``MAX_HOLDERS_PER_LEASE``)."""
        many = self._many.get(key)
        if many is not None:
            if agent in many:
                return False
            if len(many) >= MAX_HOLDERS_PER_LEASE:
                self.refused += 1
                return None
            many[agent] = False
            return True
        one = self._one.get(key)
        if one is None:
            self._one[key] = agent
            return True
        if one == agent:
            return False
        del self._one[key]
        self._many[key] = {one: False, agent: False}
        return True

    def completed(self, keys: Iterable[str], agent: str) -> Completion:
        """``agent`` sent a completion for the lease named by ``keys`` (its id,
        and its tag when it has one)."""
        keys = tuple(keys)
        known = False  # agent holds, or held, the lease
        others = False  # another agent still holds it
        several = False  # the lease had two or more claimants
        for key in keys:
            many = self._many.get(key)
            if many is not None:
                several = True
                known = known or agent in many
                others = others or any(not done and a != agent for a, done in many.items())
                continue
            one = self._one.get(key)
            if one is None:
                continue
            if one == agent:
                known = True
            else:
                others = True
        if others:
            if not known:
                return Completion.IGNORED
            for key in keys:  # it leaves, remembered as done: a late heartbeat does not bring it back
                many = self._many.get(key)
                if many is not None:
                    if agent in many:
                        many[agent] = True
                elif self._one.get(key) == agent:
                    del self._one[key]
                    self._many[key] = {agent: True}
            return Completion.HELD
        if not known:
            return Completion.PASS  # no holder left: as without holders
        self.forget(keys)
        return Completion.FREE if several else Completion.PASS

    def holders(self, key: str) -> list[str]:
        """The agents still holding ``key`` (for tests)."""
        many = self._many.get(key)
        if many is not None:
            return [a for a, done in many.items() if not done]
        one = self._one.get(key)
        return [] if one is None else [one]

    def forget(self, keys: Iterable[str]) -> None:
        """The lease these keys name was freed (a completion, an expiry, a release)."""
        for key in keys:
            if self._one.pop(key, None) is None:
                self._many.pop(key, None)

    def keys(self) -> list[str]:
        return [*self._one, *self._many]
