"""P worker: answer acknowledged heartbeats (``LHB:``) so D renews its lease
views on evidence, not on the timing of its own sends (``ack_ledger.py`` has
the argument; ``ack_requester.py`` is D's side).

- ``LHELLO:<metadata>``: D's NIXL connection info (no memory).  P loads it on
  a one-thread executor, like upstream's proactive handshake (loading a remote
  agent can take far longer than a step), and checks that the metadata names
  the agent that sent it.
- ``LHB:<seq>:<ids>`` / ``LHBT:<seq>:<tags>``: extended in this step, before
  the sweep (``LeaseKeeper.extend``), then answered with
  ``LACK:<seq>,<seq>,...[:<names not held>]``.  Answers to one agent are
  gathered over steps: an agent is answered once its last answer is
  ``answer_gap_s`` old, at most ``MAX_PACED_ANSWERS_PER_STEP`` agents a step,
  and always once its oldest unanswered heartbeat is ``answer_gap_s * 2`` old.
  Each answer is a NIXL send, and D paces its heartbeats over the interval:
  answering every agent in the step its heartbeats arrive would make a P with
  many D engines send answers nearly every step.  Delay is safe: D renews a
  view from the time it *sent* the heartbeat, so a later answer proves the
  same (``ack_ledger.py``); the gap is far inside the extension.  Seqs whose
  names were all held share one answer; the rest share a second one naming
  those not held (a name missing from one counts as missing from all of
  them: conservative).  An answer for an agent still loading waits (bounded);
  for an agent that never said hello it is dropped and counted: D says hello
  again.
- Agents not heard from for ``forget_after_s`` are unloaded, unless upstream
  uses them too.

Only our D sends these, and only to a P that advertised acknowledgements
(``p_scheduler/lease_params.py``).  Nothing here can raise into the step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

from vllm.logger import init_logger

from ..._wire import (
    ACK_HELLO_PREFIX,
    ACK_NONE,
    ACKED_HEARTBEAT_PREFIX,
    TAGGED_HEARTBEAT_PREFIX,
    heartbeat_ack_message,
    is_tagged_heartbeat,
    parse_acked_heartbeat,
)
from ..d_worker.heartbeat_sender import is_disconnect
from ..ratelimit import RateLimitedLog
from ..upstream import UpstreamWorker
from .lease_keeper import HeartbeatForm, LeaseKeeper

logger = init_logger(__name__)

# Answers kept per agent while its metadata loads; older ones are dropped
# (D then just does not renew from them).
MAX_QUEUED_ACKS = 256
# Distinct D agents P loads; a hello flood past this is ignored and logged.
MAX_AGENTS = 4096
# One answer lists at most this many heartbeats ...
MAX_SEQS_PER_ANSWER = 256
# ... and names the ids P did not extend; past this many bytes it says "none"
# instead, so a hostile heartbeat cannot make P echo megabytes.
MAX_NOT_EXTENDED_BYTES = 4096
# Agents answered in one step because their gap is over (overdue ones on top).
MAX_PACED_ANSWERS_PER_STEP = 2
_IDS, _TAGS = HeartbeatForm.IDS, HeartbeatForm.TAGS  # module globals: cheaper than class lookups


class _Answer:
    """The heartbeats of one agent not answered yet."""

    __slots__ = ("since", "held", "partial", "missing", "none")

    def __init__(self, since: float) -> None:
        self.since = since  # when the oldest of them arrived
        self.held: list[int] = []  # seqs whose ids were all leased here
        self.partial: list[int] = []  # seqs naming ids not leased here
        self.missing: set[str] = set()
        self.none = False  # some id could not be read: none counts as extended


class AckAnswerer:
    """Answers ``LHB:`` heartbeats; loads and forgets the D agents it answers.

    The times come from ``LeaseConfig`` (``forget_after_s``, ``answer_gap_s``,
    ``forget_sweep_s``)."""

    def __init__(
        self,
        upstream: UpstreamWorker,
        keeper: LeaseKeeper,
        forget_after_s: float,
        answer_gap_s: float = 0.0,
        forget_sweep_s: float = 10.0,
    ) -> None:
        self._upstream = upstream
        self._keeper = keeper
        self._forget_after = forget_after_s
        self._forget_sweep = forget_sweep_s
        self._answer_gap = answer_gap_s  # 0: every agent answered in the step its heartbeats arrive
        self._pending: dict[str, _Answer] = {}  # oldest first
        self._answered: dict[str, float] = {}  # agent -> last answer sent
        self._heard: dict[str, float] = {}  # loaded agent -> last hello/heartbeat
        self._loading: dict[str, Future[bytes]] = {}
        # agent -> (answer, heartbeats it acknowledges) waiting for the agent's load
        self._queued: dict[str, list[tuple[bytes, int]]] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._next_sweep = 0.0
        self._log = RateLimitedLog(logger)

    def handle(self, messages: Mapping[str, list[bytes]]) -> None:
        """One step's ``LHELLO:`` / ``LHB:`` messages (other prefixes are someone
        else's); then the answers that are due."""
        now = time.perf_counter()
        if self._loading:
            self._finish_loads()
        for agent, msgs in messages.items():
            for msg in msgs:
                if msg.startswith((ACKED_HEARTBEAT_PREFIX, TAGGED_HEARTBEAT_PREFIX)):
                    self._heartbeat(agent, msg, now)
                elif msg.startswith(ACK_HELLO_PREFIX):
                    self._hello(agent, msg[len(ACK_HELLO_PREFIX) :], now)
        if self._pending:
            self._answer_due(now)
        if now >= self._next_sweep:
            self._next_sweep = now + self._forget_sweep
            self._forget_idle(now)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # -- LHB ------------------------------------------------------------------
    def _heartbeat(self, agent: str, msg: bytes, now: float) -> None:
        parsed = parse_acked_heartbeat(msg)
        if parsed is None:
            self._upstream.xfer_stats.add("num_malformed_notifs", 1)
            self._log.warning(1, "Skipped a malformed acknowledged heartbeat from %s: %r", agent, msg[:64])
            return
        seq, payload = parsed
        missing = self._keeper.extend(_TAGS if is_tagged_heartbeat(msg) else _IDS, (payload,), now)
        if not self._answerable(agent):
            # No hello yet (or forgotten): D says hello again when answers stop.
            self._upstream.xfer_stats.add("num_heartbeat_acks_dropped", 1)
            return
        answer = self._pending.get(agent)
        if answer is None:
            answer = self._pending[agent] = _Answer(now)
        if missing is None:
            answer.none = True
            answer.partial.append(seq)
        elif missing:
            answer.missing.update(missing)
            answer.partial.append(seq)
        else:
            answer.held.append(seq)

    def _answer_due(self, now: float) -> None:
        gap = self._answer_gap
        budget = MAX_PACED_ANSWERS_PER_STEP
        for agent, answer in list(self._pending.items()):
            if gap and now - answer.since < 2 * gap:  # not overdue
                if budget <= 0:
                    break  # the rest arrived later still: none is overdue
                if now - self._answered.get(agent, -math.inf) < gap:
                    continue
                budget -= 1
            del self._pending[agent]
            self._answered[agent] = now
            self._answer(agent, answer, now)

    def _answer(self, agent: str, answer: _Answer, now: float) -> None:
        if not self._answerable(agent):
            # Forgotten or unloaded since the heartbeats arrived.
            dropped = len(answer.held) + len(answer.partial)
            self._upstream.xfer_stats.add("num_heartbeat_acks_dropped", dropped)
            return
        self._answer_seqs(agent, answer.held, b"", now)
        if answer.partial:
            not_extended = b",".join(sorted(m.encode() for m in answer.missing))
            if answer.none or len(not_extended) > MAX_NOT_EXTENDED_BYTES:
                not_extended = ACK_NONE
            self._answer_seqs(agent, answer.partial, not_extended, now)

    def _answerable(self, agent: str) -> bool:
        """Loaded from its hello, or loading (answers then wait in ``_queued``)."""
        return agent in self._heard or agent in self._loading

    def _answer_seqs(self, agent: str, seqs: list[int], not_extended: bytes, now: float) -> None:
        stats = self._upstream.xfer_stats
        for start in range(0, len(seqs), MAX_SEQS_PER_ANSWER):
            chunk = seqs[start : start + MAX_SEQS_PER_ANSWER]
            msg = heartbeat_ack_message(chunk, not_extended)
            if agent in self._heard:
                self._heard[agent] = now
                self._send(agent, msg, len(chunk))
                continue
            queued = self._queued.setdefault(agent, [])
            if len(queued) >= MAX_QUEUED_ACKS:
                stats.add("num_heartbeat_acks_dropped", queued.pop(0)[1])
            queued.append((msg, len(chunk)))

    def _send(self, agent: str, msg: bytes, heartbeats: int) -> None:
        stats = self._upstream.xfer_stats
        try:
            self._upstream.nixl_wrapper.send_notif(agent, notif_msg=msg)
        except Exception as exc:
            stats.add("num_heartbeat_acks_dropped", heartbeats)
            self._log.warning(1, "Could not acknowledge heartbeats to %s: %s", agent, exc)
            if is_disconnect(exc) and self._heard.pop(agent, None) is not None:
                # UCX gave the connection up: unload it; D's next hello loads it afresh.
                if not self._used_by_upstream(agent):
                    self._remove(agent)
            return
        stats.add("num_heartbeat_acks_sent", heartbeats)

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
                self._upstream.xfer_stats.add("num_heartbeat_acks_dropped", sum(n for _, n in queued))
                self._log.warning(1, "Could not load the agent metadata %s sent in its hello: %s", agent, exc)
                continue
            if name != agent:
                # Someone else's metadata: never answer on another agent's behalf.
                self._upstream.xfer_stats.add("num_heartbeat_acks_dropped", sum(n for _, n in queued))
                self._log.warning(1, "Hello from %s carried the metadata of %s; ignored", agent, name)
                if name not in self._heard and not self._used_by_upstream(name):
                    self._remove(name)
                continue
            self._heard[agent] = now
            for msg, heartbeats in queued:
                self._send(agent, msg, heartbeats)

    # -- forgetting ---------------------------------------------------------------
    def _forget_idle(self, now: float) -> None:
        for agent, heard in list(self._heard.items()):
            if now - heard > self._forget_after:
                del self._heard[agent]
                if not self._used_by_upstream(agent):
                    self._remove(agent)
        for agent in [a for a in self._answered if not self._answerable(a)]:
            del self._answered[agent]

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
