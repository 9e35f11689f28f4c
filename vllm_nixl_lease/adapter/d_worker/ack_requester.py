"""D worker: our side of the acknowledgement protocol (``docs/PROTOCOL.md``;
``decode/ack_ledger.py`` has the argument; ``p_worker/ack_answerer.py`` is P's side).

Only for requests whose own params advertise our protocol version (their
views carry a P instance); a stock P never receives our messages, and even
then each is behind the ``HB:,`` escape it parses harmlessly.

- Proof.  Every answer P sends names its instance (the P process).  A
  connection to engine E (upstream's ``_remote_agents[E]``) is **proven** to
  reach instance I once every one of its agents has answered with I.  NIXL
  agent names are per process, so a restarted P comes back under new names
  with nothing proven.  D sends acknowledged heartbeats (``LHB:``/``LHBT:``)
  for I only over a connection proven I, and reads I's blocks only then
  (``read_fence.py``).  Once a connection is proven another instance, I's
  views end (``LeaseViews.instance_proven``).
- Hello.  To an agent that has not proven the instance D wants, D says hello
  (its NIXL connection info, and the name of one lease it holds there, which
  P checks) at most every ``hello_retry_s``; P welcomes it at once.  To a
  proven agent silent for ``rehello_after_s`` (P forgot an idle D, or lost
  the hello) D says hello again.
- Answers (``LACK:``) renew the views they prove, only from an agent of the
  current connection, for sequence numbers D sent that agent, for sends the
  extension has not yet outlived.
- Asking.  A chunk's heartbeat asks for an answer (a sequence number from the
  ledger) only when its views need one: some view of it waits for its first
  answer, or its latest answer's renewal ends within ``ask_within`` (the
  view's margin, one interval of D's, half of P's, for P's answer tick, and
  an eighth of D's for the round trip), or a READ of that engine waits for
  proof.  Otherwise it goes as ``LHB:0``/``LHBT:0`` (``KEEPALIVE_SEQ``): P
  extends it and sends nothing (PROTOCOL D3b).  D then asks about every other
  interval instead of every one, and P sends half as many answers.  A proven
  agent counts as silent (hello again) once an answer D asked it for is
  ``rehello_after_s`` overdue.
- Silence.  A proven agent that owes an answer ``reconnect_after_s`` old
  while D keeps asking: D releases the connection (upstream's invalid-engine
  path) and forgets what its agents owe, so the next heartbeat or READ
  handshakes again (PROTOCOL D2a).  After a partition UCX can leave a
  connection half-open: P's sends to D fail and P unloads D's agent, while
  D's sends, its hellos included, still succeed and arrive nowhere.
- Another instance.  A connection proven to reach another instance than the
  one that granted leases D holds, and of whose instance D holds no lease, is
  released once per (engine, instance) within ``REHANDSHAKE_ONCE_PER_S``
  (``other_instance``), so the next heartbeat or READ handshakes again: P may
  have restarted under the same engine id while D had nothing queued there,
  and then nothing ever fails on the connection to the dead process.  Which
  instance is the live one only a new connection's proof tells; if it proves
  the other instance again, those leases are the dead ones and their views
  end.  A connection whose instance D holds leases of is kept: it was proven
  after those leases were granted, so it reaches the live process, and the
  other instance's views simply end (a restart while D held leases of both).
- Clock (version 3).  An answer to heartbeats from a P that takes version 3
  hellos carries P's clock ``t_p`` when the newest of them arrived.  The
  newest of the heartbeats it answers that D recorded, sent at ``s`` (D's
  clock), reached P before ``t_p``, so P's clock minus D's was at most
  ``t_p - s``: D writes that into upstream's ``_engine_clock_offset`` (read
  by every conversion of a P deadline, upstream's too), replacing the
  handshake's estimate with one never too small, off by at most the round
  trip.  The newest measurement wins (by ``s``), so drift since is at most
  one answer interval's worth.  Views already converted keep their deadline.
  Hellos say version 3 only to a P whose params advertise it
  (``LeaseTerms.hello_version``, learned from the views the scheduler ships).
Per-agent state is kept only for agents of current connections.

Bounds: per-agent state (proof, hellos, last answer, the agent -> engine
map) only for agents of current connections, swept every ``forget_sweep_s``
and whenever the engine reaper releases engines (``forget_engines``, which
also drops the ledger's sends to them); the ledger holds sends younger than
the longest view extension, itself at most ``max_view_extension``
(``LeaseViews.extension_cap``); re-handshakes are remembered for
``REHANDSHAKE_ONCE_PER_S``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence

from vllm.logger import init_logger

from ..._wire import (
    CLAIM_HELLO_VERSION,
    HEARTBEAT_ACK_PREFIX,
    KEEPALIVE_SEQ,
    LEASE_PROTOCOL_BASE,
    LEASE_PROTOCOL_VERSION,
    acked_heartbeat_message,
    heartbeat_payload,
    hello_message,
    parse_heartbeat_ack,
)
from ...decode.ack_ledger import AckLedger, Proven
from ...decode.lease_views import LeaseViews
from ..config import MARGIN_FLOOR_SHARE, LeaseConfig
from ..metadata import LEASE_VIEWS_ATTR, LeaseViewUpdates
from ..ratelimit import RateLimitedLog
from ..upstream import NixlWrapper, UpstreamWorker

logger = init_logger(__name__)

PROVEN, PENDING, OTHER = "proven", "pending", "other"
REHANDSHAKE_ONCE_PER_S = 60.0


def connection_metadata(wrapper: NixlWrapper) -> bytes:
    """This agent's NIXL metadata without memory registrations: connection info only,
    small enough for one notification."""
    from nixl._bindings import DRAM_SEG, nixlRegDList

    return wrapper.get_partial_agent_metadata(nixlRegDList(DRAM_SEG), True, ["UCX"])


def _never(engine_id: str) -> bool:
    return False


def agent_name(agent: str | bytes) -> str:
    """Upstream keeps the names ``add_remote_agent`` returned (bytes); answers arrive keyed by str."""
    return agent.decode() if isinstance(agent, bytes) else agent


# D3b's asking rule, off: it lets a view's time left fall to ask_within before D asks, so a P
# stall shorter than P's own stall bound lapses D's views (tests/nixl/test_nixl_lease_terms.py,
# "within-extension": 4 of 4 fenced). Tolerating such stalls needs ask_within past the extension,
# i.e. asking in every heartbeat (docs/PROTOCOL.md D3b has the arithmetic).
ASK_ONLY_WHEN_NEEDED = False


class AckRequester:
    """D's acknowledged heartbeats: hellos, proof per connection, ``LHB:`` sends, ``LACK:`` answers."""

    def __init__(self, upstream: UpstreamWorker, views: LeaseViews, lease_config: LeaseConfig) -> None:
        self._upstream = upstream
        self._views = views
        self._rehello_s = lease_config.rehello_after_s
        self._reconnect_s = lease_config.reconnect_after_s
        self._hello_retry_s = lease_config.hello_retry_s
        self._interval = lease_config.heartbeat_interval
        self._sweep_s = lease_config.forget_sweep_s
        # A step with no message only ages state (the ledger, chunk answers, the
        # sweep); doing that this often, not every step, bounds it as well.
        self._age_every_s = min(self._sweep_s, lease_config.heartbeat_interval / 4)
        self._next_age = 0.0
        self.ledger = AckLedger()
        self._metadata: bytes | None = None
        self._proven: dict[str, str] = {}  # P agent -> the instance its answers carry
        self._hello_sent: dict[tuple[str, str], float] = {}  # (P agent, instance D wants) -> last hello
        self._answered: dict[str, float] = {}  # P agent -> last answer
        self._owed: dict[str, float] = {}  # P agent -> first ask since its last answer
        # engine -> how close to its end a chunk's renewal must be for D to ask (D3b)
        self._ask_within: dict[str, float] = {}
        self._ask_terms: dict[str, tuple[float, float | None]] = {}  # engine -> terms it was computed for
        self._margin = lease_config.lease_safety_margin
        # A READ of this engine waits for proof (set by the worker: ReadFence.parked).
        self.reads_waiting: Callable[[str], bool] = _never
        self._next_sweep = 0.0
        self._engine_by_agent: dict[str, str] = {}  # P agent -> engine, checked on each use
        # engine id -> (the instance D released the connection for, when)
        self.rehandshaken: dict[str, tuple[str, float]] = {}
        # (engine, instance) -> the hello version its P accepts, when newer than 2
        self._hello_versions: dict[tuple[str, str], int] = {}
        # engine id -> send time of the heartbeat its clock offset was last measured from
        self._offset_sent: dict[str, float] = {}
        self._log = RateLimitedLog(logger)
        self._stranger_log = RateLimitedLog(logger)
        self._silent_log = RateLimitedLog(logger)
        # kv_lease_claim_reads: hellos say 4 (claims) to a P that takes them; every
        # heartbeat all ranks answered is reported with its seq (claim_requester.py).
        self._newest_hello = CLAIM_HELLO_VERSION if lease_config.claim_reads else LEASE_PROTOCOL_VERSION
        self.on_proven: Callable[[int, Proven], None] | None = None

    # -- proof -------------------------------------------------------------
    @property
    def proven_agents(self) -> Mapping[str, str]:
        """The instance each P agent's answers carry (the table ``proof`` reads; live)."""
        return self._proven

    def proof(self, engine_id: str, instance: str) -> str:
        """``PROVEN``: every agent of the connection to ``engine_id`` answered as
        ``instance``; ``OTHER``: one answered as another instance; else ``PENDING``
        (not connected, or not all have answered yet)."""
        agents = self._upstream._remote_agents.get(engine_id)
        if not agents:
            return PENDING
        proven = self._proven
        state = PROVEN
        for agent in agents.values():
            seen = proven.get(agent_name(agent))
            if seen != instance:
                if seen is not None:
                    return OTHER
                state = PENDING
        return state

    def reached(self, engine_id: str) -> str | None:
        """The instance an agent of the current connection to ``engine_id`` has
        answered as (the first found); None if none has, or not connected."""
        agents = self._upstream._remote_agents.get(engine_id)
        if not agents:
            return None
        proven = self._proven
        for agent in agents.values():
            seen = proven.get(agent_name(agent))
            if seen is not None:
                return seen
        return None

    def other_instance(self, engine_id: str, instance: str) -> None:
        """D holds leases of ``instance`` but the connection to ``engine_id`` is
        proven another: release it (upstream's invalid-engine path, which waits
        for READs in flight) so the next heartbeat or READ handshakes again,
        once per (engine, instance) within ``REHANDSHAKE_ONCE_PER_S``.  Kept when
        D holds leases of the instance the connection reaches."""
        agents = self._upstream._remote_agents.get(engine_id) or {}
        reached = {self._proven.get(agent_name(a)) for a in agents.values()} - {None, instance}
        if any(self._views.any_name(engine_id, other) is not None for other in reached if other):
            return
        now = time.perf_counter()
        done = self.rehandshaken
        for eid in [e for e, (_, t) in done.items() if now - t > REHANDSHAKE_ONCE_PER_S]:
            del done[eid]
        if done.get(engine_id, ("", 0.0))[0] == instance:
            return
        done[engine_id] = (instance, now)
        up = self._upstream
        if engine_id in up._invalid_remote_engines:
            return
        logger.warning(  # once per (engine, instance) a minute at most: no rate limit needed
            "The NIXL connection to P engine %s reaches another P process than the one that granted "
            "leases D holds (P restarted under the same engine id?); releasing it so that D "
            "handshakes again",
            engine_id,
        )
        up._mark_remote_engine_invalid(engine_id, now)

    def hellos(
        self, engine_id: str, instance: str, agents: Sequence[str | bytes]
    ) -> list[tuple[str | bytes, bytes]]:
        """Hellos for the agents of ``engine_id`` that have not proven ``instance``
        and were not greeted in the last ``hello_retry_s``."""
        now = time.perf_counter()
        return self._hellos(engine_id, instance, agents, now, lambda name: self._proven.get(name) != instance)

    def sends(
        self,
        engine_id: str,
        instance: str,
        agents: Sequence[str | bytes],
        messages: Sequence[bytes],
        chunks: Sequence[tuple[int, int]] | None = None,
        counts: Sequence[int] | None = None,
        tagged: bool = False,
    ) -> list[tuple[str | bytes, bytes]]:
        """The (agent, message) pairs for one group's heartbeats over a proven
        connection: hellos to agents silent for ``rehello_after_s``, then each
        ``HB:`` message in its acknowledged form to every agent, recorded.
        ``chunks``: each message's tracker chunk ``(key, version)``, so that
        its answer renews the chunk's views at once instead of name by name.
        ``counts``: each message's name count, if the caller has it."""
        now = time.perf_counter()
        names = [agent_name(agent) for agent in agents]
        self._release_if_silent(engine_id, names, now)
        pairs = self._hellos(engine_id, instance, agents, now, self._silent(now))
        asked = False
        for i, msg in enumerate(messages):
            chunk = chunks[i] if chunks is not None else None
            if chunk is not None and not self._wants_answer(engine_id, chunk[0], now):
                unasked = acked_heartbeat_message(KEEPALIVE_SEQ, msg, tagged)
                pairs.extend((agent, unasked) for agent in agents)
                continue
            asked = True
            count = counts[i] if counts is not None else None
            # The ledger keeps names only for a message of no chunk; a chunk's needs its count.
            payload = heartbeat_payload(msg) if chunk is None or count is None else b""
            seq = self.ledger.open(engine_id, names, payload, now, chunk, count, instance=instance)
            acked = acked_heartbeat_message(seq, msg, tagged)
            pairs.extend((agent, acked) for agent in agents)
        if asked:
            owed = self._owed
            for name in names:
                owed.setdefault(name, now)
        return pairs

    def _release_if_silent(self, engine_id: str, names: list[str], now: float) -> None:
        """D2a: an agent of the connection owes an answer ``reconnect_after_s`` old:
        release the connection (sends on it may be arriving nowhere) and forget what
        its agents owe, so that the next release takes as long again."""
        owed = self._owed
        if not owed:
            return
        oldest = min((owed[name] for name in names if name in owed), default=now)
        if now - oldest < self._reconnect_s:
            return
        for name in names:
            owed.pop(name, None)
        up = self._upstream
        if engine_id in up._invalid_remote_engines:
            return  # already being released (a failed send, another instance)
        up.xfer_stats.add("num_connections_released_silent", 1)
        self._silent_log.warning(
            1,
            "P engine %s has not answered D's heartbeats for %.1f s over a connection that answered "
            "before; releasing it so that D handshakes again (UCX may have lost it on P's side only)",
            engine_id,
            now - oldest,
        )
        up._mark_remote_engine_invalid(engine_id, now)

    def _wants_answer(self, engine_id: str, key: int, now: float) -> bool:
        """D3b: does chunk ``key`` of ``engine_id`` need an answer to this tick?"""
        if not ASK_ONLY_WHEN_NEEDED:
            return True
        within = self._ask_within.get(engine_id)
        if within is None or not self._interval:
            return True  # no terms known, or heartbeats every step: always ask
        until = self._views.chunk_renewed_until(engine_id, key)
        return until is None or until - now <= within or self.reads_waiting(engine_id)

    def _silent(self, now: float) -> Callable[[str], bool]:
        """A proven agent that never answered, or owes an answer ``rehello_after_s`` old."""
        rehello, answered, owed = self._rehello_s, self._answered, self._owed
        return lambda name: name not in answered or now - owed.get(name, math.inf) >= rehello

    def _hellos(
        self,
        engine_id: str,
        instance: str,
        agents: Sequence[str | bytes],
        now: float,
        wanted: Callable[[str], bool],
    ) -> list[tuple[str | bytes, bytes]]:
        pairs: list[tuple[str | bytes, bytes]] = []
        hello: bytes | None = None
        for agent in agents:
            name = agent_name(agent)
            # Per instance: a hello for an old process P refuses must not hold back the new one's.
            last = self._hello_sent.get((name, instance), -math.inf)
            if not wanted(name) or now - last < self._hello_retry_s:
                continue
            if hello is None:
                hello = self._hello_message(engine_id, instance)
                if hello is None:
                    return pairs
            pairs.append((agent, hello))
            self._hello_sent[(name, instance)] = now
        return pairs

    def _hello_message(self, engine_id: str, instance: str) -> bytes | None:
        key = self._views.any_name(engine_id, instance)
        if key is None:
            return None  # no lease of it left to name: nothing to prove
        if self._metadata is None:
            try:
                self._metadata = connection_metadata(self._upstream.nixl_wrapper)
            except Exception as exc:
                self._log.warning(1, "Cannot build the heartbeat-ack hello (no acknowledgements): %s", exc)
                return None
        version = self._hello_versions.get((engine_id, instance), LEASE_PROTOCOL_BASE)
        return hello_message(self._interval, self._metadata, key, version)

    def note_views(self, metadata: object) -> None:
        """The hello version of each P instance the step's new views name, and
        ``ask_within`` for each engine whose lease terms changed."""
        updates: LeaseViewUpdates | None = getattr(metadata, LEASE_VIEWS_ATTR, None)
        if updates is None:
            return
        # One call into the views core for the step's views (a Python loop cost ~4k instructions each).
        changed = self._views.note_terms(
            updates.new, self._hello_versions, self._ask_terms, LEASE_PROTOCOL_BASE, self._newest_hello
        )
        for engine_id, extension, interval in changed:
            self._note_terms(engine_id, extension, interval)

    def _note_terms(self, engine_id: str, extension: float, p_interval: float | None) -> None:
        """``ask_within`` for a view of these terms (the largest an engine's views need):
        its margin (``LeaseViews.terms_margin``, floored as ``ReadFence.add_views`` does)
        plus one interval of D's, P's answer tick (half P's interval) and an eighth of
        D's interval for the round trip.  Asked then, a view keeps more than its margin until the answer."""
        d_interval = self._interval
        p_half = (d_interval if p_interval is None else p_interval) / 2
        room = extension - d_interval - p_half
        margin = max(self._margin * MARGIN_FLOOR_SHARE, min(self._margin, room / 2))
        within = margin + d_interval + p_half + d_interval / 8
        self._ask_within[engine_id] = max(within, self._ask_within.get(engine_id, 0.0))

    # -- answers -------------------------------------------------------------
    def idle(self) -> bool:
        """No P agent heard from or asked and no re-handshake remembered: with no
        message, a step has nothing to take, prune or forget.  (A re-handshake is
        remembered for ``REHANDSHAKE_ONCE_PER_S``; its connection is often gone
        before that, and only a step that is not idle forgets it.)"""
        return not (
            len(self.ledger) or self._proven or self._answered or self._hello_sent or self.rehandshaken
        )

    def received(self, messages: Mapping[str, list[bytes]]) -> None:
        """One step's ``LACK:`` answers: record proof, renew the views they prove."""
        now = time.perf_counter()
        if not messages and now < self._next_age:
            return
        self._next_age = now + self._age_every_s
        if not messages and self.idle():
            return
        stats = self._upstream.xfer_stats
        answers = renewed = 0
        looked_again = False
        for agent, msgs in messages.items():
            for msg in msgs:
                if not msg.startswith(HEARTBEAT_ACK_PREFIX):
                    continue
                ack = parse_heartbeat_ack(msg)
                if ack is None:
                    stats.add("num_malformed_notifs", 1)
                    self._log.warning(
                        1, "Skipped a malformed heartbeat acknowledgement from %.64s: %r", agent, msg[:64]
                    )
                    continue
                engine_id, rebuilt = self._engine_of(agent, not looked_again)
                looked_again = looked_again or rebuilt
                if engine_id is None:
                    # Not an agent of any connection this worker holds: proves nothing.
                    stats.add("num_heartbeat_acks_ignored", 1)
                    self._stranger_log.warning(
                        1, "Ignored an acknowledgement from %.64s: not a P agent D reads from", agent
                    )
                    continue
                self._answered[agent] = now
                self._owed.pop(agent, None)
                self._proven[agent] = ack.instance
                if self.proof(engine_id, ack.instance) == PROVEN:
                    ended = self._views.instance_proven(engine_id, ack.instance)
                    if ended:
                        stats.add("num_views_ended", ended)
                answers += len(ack.seqs)
                resolved: list[Proven] = []
                for seq in ack.seqs:
                    proven = self.ledger.answered(agent, seq, ack.not_extended, ack.instance)
                    if proven is not None and proven.engine_id == engine_id:
                        resolved.append(proven)
                        if self.on_proven is not None:
                            self.on_proven(seq, proven)
                if ack.clock is not None and resolved:
                    # Before the renewals: the views they convert take the fresh offset.
                    self._refresh_offset(engine_id, agent, ack.clock, max(p.started for p in resolved))
                offset = self._upstream._engine_clock_offset.get(engine_id)
                for proven in resolved:
                    if proven.chunk is not None:
                        key, version = proven.chunk
                        self._views.chunk_acked(
                            engine_id, proven.instance, key, version, proven.started,
                            proven.not_extended, offset, now,
                        )  # fmt: skip
                        renewed += max(0, proven.count - len(proven.not_extended))
                    else:
                        self._views.end(engine_id, proven.instance, proven.not_extended)
                        if offset is not None:
                            renewed += self._views.heartbeat_acked(
                                engine_id, proven.instance, proven.remote_ids, offset, proven.started, now
                            )
        if answers:
            stats.add("num_heartbeat_acks_recv", answers)
            # per-name answers count the views they moved, chunk answers the names they proved
            stats.add("num_heartbeat_views_renewed", renewed)
        # An answer to a heartbeat older than the longest extension could
        # not move any view: stop waiting for it (and forget chunk answers
        # whose renewals are over).
        horizon = now - self._views.max_extension
        if len(self.ledger):
            self.ledger.prune(horizon)
        self._views.prune_chunk_acks(horizon)
        if now >= self._next_sweep:
            self._next_sweep = now + self._sweep_s
            self._forget_gone()

    def _refresh_offset(self, engine_id: str, agent: str, p_clock: float, sent: float) -> None:
        """P's clock read ``p_clock`` after the heartbeat D sent at ``sent``
        arrived: P's clock minus D's is at most ``p_clock - sent``.  Written
        under upstream's handshake lock, and only while ``agent`` is still of
        the connection (a handshake finishing meanwhile measures its own)."""
        if sent < self._offset_sent.get(engine_id, -math.inf):
            return  # an older measurement than the one in use
        up = self._upstream
        with up._handshake_lock:
            agents = up._remote_agents.get(engine_id)
            offsets = up._engine_clock_offset
            if engine_id not in offsets or not agents or all(agent_name(a) != agent for a in agents.values()):
                return
            offsets[engine_id] = p_clock - sent
        self._offset_sent[engine_id] = sent
        up.xfer_stats.add("num_clock_offset_refreshes", 1)

    def _engine_of(self, agent: str, look_again: bool) -> tuple[str | None, bool]:
        """The engine of the current connection ``agent`` belongs to (None: none).
        Remembered, and checked against upstream's connections on each use, so
        that a step with answers does not rebuild the map of every agent;
        rebuilt on a miss only when ``look_again`` (once per step: a stranger's
        flood must not rebuild it per message).  Returns (engine, rebuilt)."""
        engine_id = self._engine_by_agent.get(agent)
        if engine_id is not None:
            agents = self._upstream._remote_agents.get(engine_id)
            if agents is not None and any(agent_name(a) == agent for a in agents.values()):
                return engine_id, False
        if not look_again:
            return None, False
        self._engine_by_agent = self._engines_by_agent()  # a connection changed: look again
        return self._engine_by_agent.get(agent), True

    def _engines_by_agent(self) -> dict[str, str]:
        return {
            agent_name(agent): engine_id
            for engine_id, agents in self._upstream._remote_agents.items()
            for agent in agents.values()
        }

    def _forget_gone(self) -> None:
        """Keep per-agent state only for agents of current connections; forget
        re-handshakes that are over."""
        current = self._engines_by_agent()
        for table in (self._proven, self._answered, self._owed):
            for agent in [a for a in table if a not in current]:
                del table[agent]
        for sent in [k for k in self._hello_sent if k[0] not in current]:
            del self._hello_sent[sent]
        engines = self._upstream._remote_agents
        for per_engine in (self._offset_sent, self._ask_within, self._ask_terms):
            for engine_id in [e for e in per_engine if e not in engines]:
                del per_engine[engine_id]
        views = self._views
        for key in [k for k in self._hello_versions if views.any_name(*k) is None]:
            del self._hello_versions[key]
        now = time.perf_counter()
        done = self.rehandshaken
        for engine_id in [e for e, (_, t) in done.items() if now - t > REHANDSHAKE_ONCE_PER_S]:
            del done[engine_id]

    def holds(self, engine_id: str, instance: str) -> bool:
        """Does D still view a lease of this P instance (something to prove)?"""
        return self._views.any_name(engine_id, instance) is not None

    def forget_engines(self, keep: set[str]) -> None:
        """The engine reaper released every engine not in ``keep``: forget the
        state of agents of no current connection, and sends to released engines."""
        self._forget_gone()
        self._engine_by_agent = {a: e for a, e in self._engine_by_agent.items() if e in keep}
        if len(self.ledger):
            self.ledger.forget_engines(keep)

    def agents_known(self) -> int:
        """Agents this worker keeps state for (for bounds tests)."""
        return len(self._proven.keys() | {name for name, _ in self._hello_sent} | self._answered.keys())
