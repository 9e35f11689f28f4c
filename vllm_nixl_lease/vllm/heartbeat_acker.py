"""P worker: answer acknowledged heartbeats (``LHB:``) so D renews its lease
views on evidence, not on the timing of its own sends (``ack_ledger.py`` has
the argument; ``heartbeat_acks.py`` is D's side).

- ``LHELLO:<metadata>``: D's NIXL connection info (no memory).  P loads it on
  a one-thread executor, like upstream's proactive handshake (loading the
  first remote agent takes ~60 ms of UCX set-up here; later ones 1-6 ms), and
  checks that the metadata names the agent that sent it.
- ``LHB:<seq>:<ids>``: extended in the table by ``LeaseKeeper.extend_acked``
  in this step (before the sweep), then answered ``LACK:<seq>[:<ids not held>]``.
  An answer for an agent still loading waits (bounded); for an agent that
  never said hello it is dropped and counted: D says hello again.
- Agents not heard from for ``forget_after_s`` are unloaded, unless upstream
  uses them too.

Only our D sends these, and only to a P that advertised acknowledgements
(``lease_views.add_lease_params``).  Nothing here can raise into the step.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

from vllm.logger import init_logger

from .._wire import (
    ACK_HELLO_PREFIX,
    ACKED_HEARTBEAT_PREFIX,
    heartbeat_ack_message,
    parse_acked_heartbeat,
)
from .lease_keeper import LeaseKeeper
from .ratelimit import RateLimitedLog
from .upstream import UpstreamWorker

logger = init_logger(__name__)

# Answers kept per agent while its metadata loads; older ones are dropped
# (D then just does not renew from them).
MAX_QUEUED_ACKS = 256
# Distinct D agents P loads; a hello flood past this is ignored and logged.
MAX_AGENTS = 4096


class HeartbeatAcker:
    """Answers ``LHB:`` heartbeats; loads and forgets the D agents it answers."""

    def __init__(self, upstream: UpstreamWorker, keeper: LeaseKeeper, forget_after_s: float) -> None:
        self._upstream = upstream
        self._keeper = keeper
        self._forget_after = forget_after_s
        self._heard: dict[str, float] = {}  # loaded agent -> last hello/heartbeat
        self._loading: dict[str, Future[bytes]] = {}
        self._queued: dict[str, list[bytes]] = {}  # agent -> answers waiting for its load
        self._executor: ThreadPoolExecutor | None = None
        self._next_sweep = 0.0
        self._log = RateLimitedLog(logger)

    def handle(self, messages: Mapping[str, list[bytes]]) -> None:
        """One step's ``LHELLO:`` / ``LHB:`` messages (other prefixes are someone else's)."""
        now = time.perf_counter()
        if self._loading:
            self._finish_loads()
        for agent, msgs in messages.items():
            for msg in msgs:
                if msg.startswith(ACKED_HEARTBEAT_PREFIX):
                    self._heartbeat(agent, msg, now)
                elif msg.startswith(ACK_HELLO_PREFIX):
                    self._hello(agent, msg[len(ACK_HELLO_PREFIX) :], now)
        if now >= self._next_sweep:
            self._next_sweep = now + min(self._forget_after, 10.0)
            self._forget_idle(now)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # -- LHB ------------------------------------------------------------------
    def _heartbeat(self, agent: str, msg: bytes, now: float) -> None:
        stats = self._upstream.xfer_stats
        parsed = parse_acked_heartbeat(msg)
        if parsed is None:
            stats.add("num_malformed_notifs", 1)
            self._log.warning(1, "Skipped a malformed acknowledged heartbeat from %s: %r", agent, msg[:64])
            return
        seq, payload = parsed
        answer = heartbeat_ack_message(seq, self._keeper.extend_acked(payload, now))
        if agent in self._heard:
            self._heard[agent] = now
            self._send(agent, answer)
        elif agent in self._loading:
            queued = self._queued.setdefault(agent, [])
            if len(queued) >= MAX_QUEUED_ACKS:
                del queued[0]
                stats.add("num_heartbeat_acks_dropped", 1)
            queued.append(answer)
        else:
            # No hello yet (or forgotten): D says hello again when answers stop.
            stats.add("num_heartbeat_acks_dropped", 1)

    def _send(self, agent: str, answer: bytes) -> None:
        stats = self._upstream.xfer_stats
        try:
            self._upstream.nixl_wrapper.send_notif(agent, notif_msg=answer)
        except Exception as exc:
            stats.add("num_heartbeat_acks_dropped", 1)
            self._log.warning(1, "Could not acknowledge a heartbeat to %s: %s", agent, exc)
            return
        stats.add("num_heartbeat_acks_sent", 1)

    # -- LHELLO -----------------------------------------------------------------
    def _hello(self, agent: str, metadata: bytes, now: float) -> None:
        if agent in self._heard:
            self._heard[agent] = now
            return
        if agent in self._loading:
            return
        if self._used_by_upstream(agent):
            self._heard[agent] = now  # already loaded (e.g. kv_both): nothing to add
            return
        if len(self._heard) + len(self._loading) >= MAX_AGENTS:
            self._log.warning(1, "Ignoring a hello from %s: already answering %d agents", agent, MAX_AGENTS)
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="lease-ack-hello")
        self._loading[agent] = self._executor.submit(self._upstream.nixl_wrapper.add_remote_agent, metadata)

    def _finish_loads(self) -> None:
        now = time.perf_counter()
        for agent, fut in list(self._loading.items()):
            if not fut.done():
                continue
            del self._loading[agent]
            queued = self._queued.pop(agent, [])
            try:
                loaded = fut.result()
                name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            except Exception as exc:
                self._upstream.xfer_stats.add("num_heartbeat_acks_dropped", len(queued))
                self._log.warning(1, "Could not load the agent metadata %s sent in its hello: %s", agent, exc)
                continue
            if name != agent:
                # Someone else's metadata: never answer on another agent's behalf.
                self._upstream.xfer_stats.add("num_heartbeat_acks_dropped", len(queued))
                self._log.warning(1, "Hello from %s carried the metadata of %s; ignored", agent, name)
                if name not in self._heard and not self._used_by_upstream(name):
                    self._remove(name)
                continue
            self._heard[agent] = now
            for answer in queued:
                self._send(agent, answer)

    # -- forgetting ---------------------------------------------------------------
    def _forget_idle(self, now: float) -> None:
        for agent, heard in list(self._heard.items()):
            if now - heard > self._forget_after:
                del self._heard[agent]
                if not self._used_by_upstream(agent):
                    self._remove(agent)

    def _remove(self, agent: str) -> None:
        try:
            self._upstream.nixl_wrapper.remove_remote_agent(agent)
        except Exception:
            logger.debug("Could not unload agent %s", agent, exc_info=True)

    def _used_by_upstream(self, agent: str) -> bool:
        # Upstream keeps add_remote_agent's return value: bytes.
        raw = agent.encode()
        return any(
            agent in agents.values() or raw in agents.values()
            for agents in self._upstream._remote_agents.values()
        )
