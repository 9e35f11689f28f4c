"""D worker: release upstream's state of P engines that are gone.

Upstream keeps a P engine's connection, descriptors and bookkeeping until the
engine has been idle for ``engine_ttl`` -- but it checks that only when a new
engine handshakes.  A P that dies, or restarts under a new engine id on a new
port, while D has nothing queued for it fails nothing and is never replaced by
address, so a D whose P set has settled keeps the dead engine's state for ever.
Two kinds of upstream entry are never forgotten at all: the invalid-engine
backoff of an engine id that is never invalidated again, and the registration
generation of every engine ever read from.

Every ``sweep_s`` this runs upstream's own TTL eviction (the same rule: an
engine with READs in flight, heartbeats or a pending handshake is never idle;
our heartbeats stamp ``_engine_last_active`` like upstream's), then forgets
backoffs that are over and the generations of engines no longer connected.
A forgotten generation costs nothing: an engine that comes back handshakes
anew, and its first READ records its generation again.

Then each of our components forgets its own per-engine and per-agent state
of every engine D is no longer connected or handshaking to and reads nothing
from (``forget``: ``LeaseViews.forget_engines``, ``AckRequester.forget_engines``,
``HeartbeatSender.forget_engines``; each keeps an engine it still has views
or heartbeats of).  vLLM's default engine id is fresh per P start, so with
P restarts this is what bounds D's state: by the engines of the last
``engine_ttl`` plus those D still holds requests of.  Each sweep also runs the
time-based expiries that would otherwise wait for the next READ (``expire``:
``LeaseViews.prune_claims``), so an idle D keeps none of them either.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from ..upstream import UpstreamWorker

# A component's pruning hook: forget every engine not in the set (engines kept).
Forget = Callable[[set[str]], object]
# A time-based expiry run at each sweep, with the sweep's time (D's perf_counter).
Expire = Callable[[float], object]

# Upstream's _INVALID_PEER_MAX_BACKOFF_S: an invalid-engine backoff entry released
# longer ago than this is forgotten (upstream does it only on the next invalidation).
INVALID_BACKOFF_MEMORY_S = 60.0
# Steps between two looks at the clock: the sweep is due every few seconds, and an
# engine step must not pay a clock read for it.
STEPS_PER_CLOCK_READ = 64


class EngineReaper:
    """Runs upstream's idle-engine eviction and forgets per-engine entries it never does."""

    def __init__(
        self,
        upstream: UpstreamWorker,
        sweep_s: float,
        forget: Iterable[Forget] = (),
        expire: Iterable[Expire] = (),
    ) -> None:
        self._upstream = upstream
        self._forget: Sequence[Forget] = tuple(forget)
        self._expire: Sequence[Expire] = tuple(expire)
        self._sweep_s = sweep_s
        self._countdown = STEPS_PER_CLOCK_READ
        self._next_sweep = 0.0
        self.sweeps = 0

    def step(self) -> None:
        """Once a step; sweeps when one is due."""
        self._countdown -= 1
        if self._countdown:
            return
        self._countdown = STEPS_PER_CLOCK_READ
        now = time.perf_counter()
        if now >= self._next_sweep:
            self._next_sweep = now + self._sweep_s
            self.sweep(now)

    def sweep(self, now: float) -> None:
        up = self._upstream
        self.sweeps += 1
        for expire in self._expire:
            expire(now)
        if up._remote_agents:
            up._evict_stale_engines()
        backoff = up._invalid_engine_backoff
        over = now - INVALID_BACKOFF_MEMORY_S
        for engine_id in [e for e, (_, release) in backoff.items() if release < over]:
            del backoff[engine_id]
        generations = getattr(up, "_remote_registration_generations", None)  # vLLM 0.33+
        if not (generations or self._forget):
            return
        reading = {m.remote.engine_id for m in up._recving_metadata.values() if m.remote is not None}
        with up._handshake_lock:
            keep = reading | up._handshake_futures.keys() | up._remote_agents.keys()
        if generations:
            for engine_id in [e for e in generations if e not in keep]:
                del generations[engine_id]
        for forget in self._forget:
            forget(keep)
