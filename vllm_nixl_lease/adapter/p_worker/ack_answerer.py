"""P worker: admit D's hellos and answer its acknowledged heartbeats, so D
renews its lease views on evidence, not on the timing of its own sends
(``docs/PROTOCOL.md``; ``decode/ack_ledger.py`` has the argument;
``d_worker/ack_requester.py`` is D's side).

- Hello (``HB:,LHELLO:...``): D's NIXL connection info (no memory).  It is
  admitted only if it speaks this protocol version, fits ``MAX_HELLO_BYTES``,
  and names a lease this P holds (tags are keyed with P's secret, so a peer
  that holds no lease here cannot guess one).  P then loads it on a one-thread
  executor, like upstream's proactive handshake (loading a remote agent can
  take far longer than a step), at most ``MAX_AGENT_LOADS`` at a time, checks
  that the metadata names the agent that sent it, and welcomes it at once
  (``LACK:<instance>:``): that answer is D's proof of which P process it
  reached.  At most ``MAX_AGENTS`` agents stay loaded; past that the one whose
  heartbeats last renewed a lease longest ago is unloaded first, so peers
  that hold nothing here cannot keep real D engines out.
- Acknowledged heartbeats (``HB:,LHB:<seq>,<ids>`` / ``HB:,LHBT:<seq>,<tags>``):
  extended in this step, before the sweep (``LeaseKeeper.extend``), then
  answered with ``LACK:<instance>:<seqs>[:<names not held>]``, on a tick:
  every half heartbeat interval (``answer_tick_s``) P answers every agent
  with heartbeats waiting, all in one step (at most ``MAX_ANSWERS_PER_STEP``
  agents; the rest in the next steps, the tick still due).  Each answer is a
  NIXL send (110-180 us cold over UCX/TCP), and D paces its heartbeats over
  the interval: answering each agent in its own step would make a P with
  many D engines send in a large share of its steps; on the tick it sends in
  at most one step per tick.  A heartbeat waits at most one tick (half an
  interval, what D's margin allows for) plus the steps a tick over the cap
  spills into.  Delay is safe: D renews a view from the time it *sent* the
  heartbeat, so a late answer only leaves the view shorter.  A heartbeat
  with sequence number 0 (``KEEPALIVE_SEQ``: D wants no answer, its views
  are long, ``ack_requester.py``) is extended and never answered.  Seqs whose names were
  all held share one answer; the rest share a second one naming those not
  held (a name missing from one counts as missing from all: conservative).
  What one agent's pending answer collects is bounded: past
  ``MAX_NOT_EXTENDED_BYTES`` of names it says "none" (``*``) and stops
  collecting, past ``MAX_PENDING_SEQS`` heartbeats it is answered at once.
- Agents not heard from for ``forget_after_s`` are unloaded, unless upstream
  uses them too.
- P's clock (version 3).  To an agent whose hello said 3, an answer to
  heartbeats carries P's clock when the newest of them arrived, on the clock
  of P's scheduler (the one its lease deadlines and the handshake use), so D
  can refresh its clock offset (``ack_requester.py``).  This worker's clock is
  moved onto the scheduler's by the largest ``scheduler_clock - perf_counter()``
  seen in the metadata (``observe_scheduler_clock``): each such reading is at
  most the true shift, and at least the one upstream rebased any lease with
  (it reads its clock after ours), so the clock P reports is never later
  than the scheduler's, and D never converts a deadline past this worker's.
  No reading yet: no clock (D keeps the offset it has).

Only our D sends these, and only to a P whose params advertise this protocol
version (``p_scheduler/lease_params.py``).  Nothing here can raise into the step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

from vllm.logger import init_logger

from ..._wire import (
    ACK_NONE,
    CLAIM_HELLO_VERSION,
    CLOCK_HELLO_VERSION,
    ESCAPE_PREFIX,
    HELLO_KIND,
    HELLO_VERSIONS,
    KEEPALIVE_SEQ,
    heartbeat_ack_message,
    is_tag,
    parse_acked_heartbeat,
    parse_hello,
)
from ..config import LeaseConfig
from ..d_worker.heartbeat_sender import is_disconnect
from ..ratelimit import RateLimitedLog
from ..upstream import AgentName, UpstreamWorker
from .lease_keeper import HeartbeatForm, LeaseKeeper

logger = init_logger(__name__)

# Answers kept per agent while its metadata loads; older ones are dropped
# (D then just does not renew from them).
MAX_QUEUED_ACKS = 256
# D agents loaded at once; past this the least recently useful is unloaded.
MAX_AGENTS = 4096
# Hellos loading at once; more wait for D's next hello.
MAX_AGENT_LOADS = 8
# One answer lists at most this many heartbeats ...
MAX_SEQS_PER_ANSWER = 256
# ... and names the keys P did not extend; past this many bytes it says "none"
# instead, so a hostile heartbeat cannot make P echo megabytes.
MAX_NOT_EXTENDED_BYTES = 4096
# Heartbeats one agent may have waiting for an answer; then it is answered at once.
MAX_PENDING_SEQS = 4 * MAX_SEQS_PER_ANSWER
# A loaded agent's repeated hello is welcomed again at most this often (or every
# answer gap, when shorter); D repeats a hello no more than every hello_retry_s.
MAX_WELCOME_GAP_S = 0.1
# Agents answered in one step of a tick; the rest go in the next steps.
MAX_ANSWERS_PER_STEP = 64
_IDS, _TAGS = HeartbeatForm.IDS, HeartbeatForm.TAGS  # module globals: cheaper than class lookups


class _Answer:
    """The heartbeats of one agent not answered yet."""

    __slots__ = ("since", "newest", "held", "partial", "missing", "missing_bytes", "none")

    def __init__(self, since: float) -> None:
        self.since = since  # when the oldest of them arrived
        self.newest = since  # ... and the newest (the clock a version-3 answer carries)
        self.held: list[int] = []  # seqs whose names were all held here
        self.partial: list[int] = []  # seqs naming some that were not
        self.missing: set[str] = set()
        self.missing_bytes = 0  # the joined length of ``missing``, about
        self.none = False  # some name could not be read, or too many: none counts as extended

    def add_missing(self, names: list[str]) -> None:
        if self.none:
            return
        for name in names:
            if name not in self.missing:
                self.missing.add(name)
                self.missing_bytes += len(name) + 1
        if self.missing_bytes > MAX_NOT_EXTENDED_BYTES:
            self.none = True
            self.missing = set()

    def __len__(self) -> int:
        return len(self.held) + len(self.partial)


class _Agent:
    """A D agent whose hello P admitted and loaded."""

    __slots__ = ("heard", "useful", "interval_s", "version")

    def __init__(self, now: float, interval_s: float, version: int) -> None:
        self.heard = now  # last hello or heartbeat
        self.useful = now  # last heartbeat that named a lease held here
        self.interval_s = interval_s  # the heartbeat interval it said it keeps
        self.version = version  # the protocol version its hello said


class AckAnswerer:
    """Admits hellos and answers acknowledged heartbeats; loads and forgets the
    D agents it answers.  Times come from ``LeaseConfig``."""

    def __init__(self, upstream: UpstreamWorker, keeper: LeaseKeeper, lease_config: LeaseConfig) -> None:
        self._upstream = upstream
        self._keeper = keeper
        self._forget_after = lease_config.forget_after_s
        self._forget_sweep = lease_config.forget_sweep_s
        # Every agent's answers go out together this often (0: in the step they arrive).
        self._tick = lease_config.answer_tick_s
        self._next_tick = 0.0  # the tick is due from then, once an answer waits
        self._pending: dict[str, _Answer] = {}  # oldest first
        self._welcomed: dict[str, float] = {}  # agent -> last welcome sent
        self._welcome_gap = min(lease_config.answer_gap_s, MAX_WELCOME_GAP_S)
        self._agents: dict[str, _Agent] = {}  # loaded agents
        # agent -> (load, its interval, its hello's version)
        self._loading: dict[str, tuple[Future[AgentName], float, int]] = {}
        # agent -> (answer, heartbeats it acknowledges) waiting for the agent's load
        self._queued: dict[str, list[tuple[bytes, int]]] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._next_sweep = 0.0
        # The scheduler's clock minus this worker's, the largest seen (None: none yet).
        self._clock_shift: float | None = None
        self._log = RateLimitedLog(logger)
        self._refused_log = RateLimitedLog(logger)
        # kv_lease_claim_reads: version-4 hellos, their heartbeats' holders (claim_gate.py)
        self._versions = (
            HELLO_VERSIONS | {CLAIM_HELLO_VERSION} if keeper.claims is not None else HELLO_VERSIONS
        )
        self._claimed: set[str] = set()  # agents that claimed a lease this step: answered in it

    def observe_scheduler_clock(self, scheduler_clock: object) -> None:
        """One step's ``meta.scheduler_clock`` (0 or absent: a scheduler that
        sets none), read before upstream rebases the step's leases with it."""
        if (
            not isinstance(scheduler_clock, float)
            or not scheduler_clock > 0
            or not math.isfinite(scheduler_clock)
        ):
            return
        shift = scheduler_clock - time.perf_counter()
        if self._clock_shift is None or shift > self._clock_shift:
            self._clock_shift = shift

    def idle(self) -> bool:
        """No D agent known: with no message, a step has nothing to answer or forget."""
        return not (self._pending or self._loading or self._agents or self._welcomed or self._queued)

    def handle(self, messages: Mapping[str, list[bytes]]) -> None:
        """One step's messages behind the ``HB:,`` escape (other prefixes are
        someone else's); then the answers that are due."""
        if not messages and self.idle():
            return
        now = time.perf_counter()
        if self._loading:
            self._finish_loads()
        for agent, msgs in messages.items():
            said_hello = False
            for msg in msgs:
                if not msg.startswith(ESCAPE_PREFIX):
                    continue
                if msg.startswith(HELLO_KIND, len(ESCAPE_PREFIX)):
                    if said_hello:
                        # One hello per agent per step: a D repeats its hello at
                        # most every hello_retry_s, so more is a flood.
                        self._upstream.xfer_stats.add("num_hellos_refused", 1)
                        continue
                    said_hello = True
                    self._hello(agent, msg, now)
                else:
                    self._heartbeat(agent, msg, now)
        if self._claimed:
            self._answer_claims(now)
        if self._pending:
            self._answer_due(now)
        if now >= self._next_sweep:
            self._next_sweep = now + self._forget_sweep
            self._forget_idle(now)

    def longest_interval(self) -> float:
        """The longest heartbeat interval a loaded D agent said it keeps (0: none)."""
        return max((a.interval_s for a in self._agents.values()), default=0.0)

    def __len__(self) -> int:
        """Agents loaded or loading (for bounds tests)."""
        return len(self._agents) + len(self._loading)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # -- acknowledged heartbeats ------------------------------------------------
    def _heartbeat(self, agent: str, msg: bytes, now: float) -> None:
        parsed = parse_acked_heartbeat(msg)
        if parsed is None:
            self._malformed(agent, msg)
            return
        seq, payload, tagged = parsed
        missing = self._keeper.extend(_TAGS if tagged else _IDS, (payload,), now)
        known = self._agents.get(agent)
        if known is None and agent not in self._loading:
            if seq != KEEPALIVE_SEQ:
                # No hello admitted (or forgotten): D says hello again when answers stop.
                self._upstream.xfer_stats.add("num_heartbeat_acks_dropped", 1)
            return
        if known is not None:
            known.heard = now
            if missing is not None and payload and len(missing) <= payload.count(b","):
                known.useful = now  # it named at least one lease held here
        if seq == KEEPALIVE_SEQ:
            return  # D wants no answer: extended, nothing to send
        if missing is not None and self._keeper.claims is not None:
            missing = self._claim(agent, payload, missing)
        answer = self._pending.get(agent)
        if answer is None:
            answer = self._pending[agent] = _Answer(now)
        else:
            answer.newest = now
        if missing is None:
            answer.none = True
            answer.partial.append(seq)
        elif missing:
            answer.add_missing(missing)
            answer.partial.append(seq)
        else:
            answer.held.append(seq)
        if len(answer) >= MAX_PENDING_SEQS:
            del self._pending[agent]
            self._answer(agent, answer, now)

    def _claim(self, agent: str, payload: bytes, missing: list[str]) -> list[str]:
        """kv_lease_claim_reads: a version-4 agent holds every name of its
        heartbeat that was held here; one that became a holder is answered in
        this step (``_answer_claims``).  Returns ``missing`` plus the names
        refused at the holder cap (answered not held)."""
        known = self._agents.get(agent)
        loading = self._loading.get(agent)
        version = known.version if known is not None else loading[2] if loading is not None else 0
        gate = self._keeper.claims
        if version < CLAIM_HELLO_VERSION or gate is None or not payload:
            return missing
        skip = set(missing)
        names = payload.decode("utf-8", "replace").split(",")
        new, refused = gate.claim(agent, [n for n in names if n not in skip])
        if new:
            self._claimed.add(agent)
        return missing + refused if refused else missing

    def _answer_claims(self, now: float) -> None:
        """Claims are answered in the step they arrive (not on the tick): D waits
        for the answer to read.  Still one answer per agent per step."""
        pending = self._pending
        for agent in self._claimed:
            answer = pending.pop(agent, None)
            if answer is not None:
                self._answer(agent, answer, now)
        self._claimed.clear()

    def _answer_due(self, now: float) -> None:
        """On the tick: every waiting agent's answer, oldest first, at most
        ``MAX_ANSWERS_PER_STEP`` of them; the tick stays due until none waits."""
        if now < self._next_tick:
            return
        pending = self._pending
        for _ in range(min(len(pending), MAX_ANSWERS_PER_STEP)):
            agent = next(iter(pending))
            self._answer(agent, pending.pop(agent), now)
        self._upstream.xfer_stats.add("num_answer_steps", 1)
        if not pending:
            self._next_tick = now + self._tick

    def _answer(self, agent: str, answer: _Answer, now: float) -> None:
        if not self._answerable(agent) or not self._keeper.instance:
            # Forgotten or unloaded since the heartbeats arrived.
            self._upstream.xfer_stats.add("num_heartbeat_acks_dropped", len(answer))
            return
        clock = self._clock_for(agent, answer.newest)
        self._answer_seqs(agent, answer.held, b"", clock)
        if answer.partial:
            not_extended = ACK_NONE if answer.none else b",".join(sorted(m.encode() for m in answer.missing))
            self._answer_seqs(agent, answer.partial, not_extended, clock)

    def _clock_for(self, agent: str, arrived: float) -> float | None:
        """The clock a version-3 agent's answer carries: ``arrived`` on the scheduler's clock."""
        shift = self._clock_shift
        if shift is None:
            return None
        known = self._agents.get(agent)
        loading = self._loading.get(agent)
        version = known.version if known is not None else loading[2] if loading is not None else 0
        return arrived + shift if version >= CLOCK_HELLO_VERSION else None

    def _answerable(self, agent: str) -> bool:
        """Loaded from its hello, or loading (answers then wait in ``_queued``)."""
        return agent in self._agents or agent in self._loading

    def _answer_seqs(self, agent: str, seqs: list[int], not_extended: bytes, clock: float | None) -> None:
        instance = self._keeper.instance  # this P process (LeaseKeeper.adopt_instance)
        stats = self._upstream.xfer_stats
        for start in range(0, len(seqs), MAX_SEQS_PER_ANSWER):
            chunk = seqs[start : start + MAX_SEQS_PER_ANSWER]
            msg = heartbeat_ack_message(instance, chunk, not_extended, clock)
            if agent in self._agents:
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
            self._log.warning(1, "Could not answer %s: %s", agent, exc)
            if is_disconnect(exc) and self._agents.pop(agent, None) is not None:
                # UCX gave the connection up: unload it; D's next hello loads it afresh.
                if not self._used_by_upstream(agent):
                    self._remove(agent)
            return
        if heartbeats:
            stats.add("num_heartbeat_acks_sent", heartbeats)

    def _welcome(self, agent: str) -> None:
        """The answer to a hello: which P process D reached (D's proof)."""
        self._welcomed[agent] = time.perf_counter()
        if self._keeper.instance:
            self._send(agent, heartbeat_ack_message(self._keeper.instance, ()), 0)

    # -- hellos -----------------------------------------------------------------
    def _hello(self, agent: str, msg: bytes, now: float) -> None:
        hello = parse_hello(msg)
        if hello is None:
            self._malformed(agent, msg)
            return
        if hello.version not in self._versions:
            self._refuse(agent, f"protocol version {hello.version}, not one of {sorted(self._versions)}")
            return
        known = self._agents.get(agent)
        if known is not None:
            known.heard = now
            known.interval_s = hello.interval_s
            known.version = hello.version
            # D asks again when it lacks proof or answers; repeats closer than
            # this are a flood, which must not make P send every step.
            if now - self._welcomed.get(agent, -math.inf) >= self._welcome_gap:
                self._welcome(agent)
            return
        if agent in self._loading:
            return
        if not self._holds(hello.key):
            self._refuse(agent, "it names no lease held here")
            return
        if self._used_by_upstream(agent):
            # Already loaded (e.g. kv_both): nothing to add.
            self._agents[agent] = _Agent(now, hello.interval_s, hello.version)
            self._welcome(agent)
            return
        if len(self._loading) >= MAX_AGENT_LOADS:
            self._refuse(agent, f"{MAX_AGENT_LOADS} hellos are loading")
            return
        if len(self._agents) + len(self._loading) >= MAX_AGENTS:
            self._evict_least_useful()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="lease-ack-hello")
        load = self._executor.submit(self._upstream.nixl_wrapper.add_remote_agent, hello.metadata)
        self._loading[agent] = (load, hello.interval_s, hello.version)

    def _holds(self, key: str) -> bool:
        """Does ``key`` (a tag or P's request id) name a lease held here?  A key
        shaped like a tag may also be a request id (any 11 base64url
        characters are a valid id): either admits it."""
        table = self._keeper.table
        return (is_tag(key) and table.holds_tag(key)) or key in table

    def _evict_least_useful(self) -> None:
        if not self._agents:
            return
        agent = min(self._agents, key=lambda a: self._agents[a].useful)
        del self._agents[agent]
        self._pending.pop(agent, None)
        self._upstream.xfer_stats.add("num_ack_agents_evicted", 1)
        if not self._used_by_upstream(agent):
            self._remove(agent)

    def _finish_loads(self) -> None:
        now = time.perf_counter()
        for agent, (fut, interval_s, version) in list(self._loading.items()):
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
                if name not in self._agents and not self._used_by_upstream(name):
                    self._remove(name)
                continue
            self._agents[agent] = _Agent(now, interval_s, version)
            self._welcome(agent)
            for msg, heartbeats in queued:
                self._send(agent, msg, heartbeats)

    def _refuse(self, agent: str, why: str) -> None:
        self._upstream.xfer_stats.add("num_hellos_refused", 1)
        self._refused_log.warning(1, "Refused a heartbeat-acknowledgement hello from %.64s: %s", agent, why)

    def _malformed(self, agent: str, msg: bytes) -> None:
        self._upstream.xfer_stats.add("num_malformed_notifs", 1)
        self._log.warning(1, "Skipped a malformed lease message from %.64s: %r", agent, msg[:64])

    # -- forgetting ---------------------------------------------------------------
    def _forget_idle(self, now: float) -> None:
        for agent, known in list(self._agents.items()):
            if now - known.heard > self._forget_after:
                del self._agents[agent]
                if not self._used_by_upstream(agent):
                    self._remove(agent)
        for agent in [a for a in self._welcomed if not self._answerable(a)]:
            del self._welcomed[agent]
        for agent in [a for a in self._queued if a not in self._loading]:
            del self._queued[agent]

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
