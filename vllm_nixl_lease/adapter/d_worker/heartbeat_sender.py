"""D worker: send the scheduler's pre-encoded heartbeats to every P rank.

The scheduler builds the messages (``d_scheduler/heartbeat_schedule.py``); this
only forwards bytes.  Differences from upstream's ``_send_heartbeats``, all on purpose:
- an engine whose proactive handshake is still running is remembered and
  heartbeated on the first step after it completes, not one interval later;
- a failed ``send_notif`` is counted and retried on the next step (until a
  fresher tick for that engine replaces it; with paced heartbeats, where a
  tick names only some chunks, retries are kept and what waited on a
  handshake is merged with the fresh tick, chunk by chunk);
- the pull worker sends before the step's reads, not after;
- a send that fails because UCX lost the connection (a partition longer than
  its TCP timeouts, a restarted P) marks the engine invalid through upstream's
  own mechanism, so it is released and handshaken again; upstream keeps the
  dead agent and every later heartbeat and READ to that P fails;
- a group whose P instance speaks our protocol (``EngineHeartbeats.instance``)
  is heartbeated acknowledged (``LHB:``, or ``LHBT:`` when its messages name
  lease tags) through ``AckRequester``, whose answers renew D's views, and only
  over a connection proven to reach that instance: until then the group waits
  (``awaiting_proof``) while D says hello, and is sent on the first step the
  proof is there; meanwhile each tick still keeps P's leases alive with a
  keep-alive (``_wire.keepalive_message``: upstream's ``HB:`` for ids,
  ``HB:,LHBT:0,...`` for tags), which renews no view (only answers do), so
  a slow admission (P loading many D agents, a TP=8 P's eight welcomes)
  does not let P's leases lapse; a waiting group whose views are all gone
  (its requests ended) is dropped, so it neither repeats nor keeps the
  engine active for the engine reaper; a connection proven to reach another instance drops it
  (those leases died with their process) after handshaking again once: P may
  have restarted under the same engine id while D had nothing queued there,
  so that nothing ever failed on the connection to the dead process (which
  instance is the live one, only a new connection's proof tells).  A plain
  group goes out as upstream's ``HB:``, and a completed send is reported to
  ``on_delivered``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from vllm.logger import init_logger

from ..._wire import ESCAPE_PREFIX, HELLO_KIND, keepalive_message
from ...decode.heartbeat_tracker import encode_heartbeats
from ..metadata import LEASE_HEARTBEATS_ATTR, EngineHeartbeats
from ..upstream import AgentName, StockHeartbeatInfo, UpstreamWorker
from .ack_requester import OTHER, PROVEN, AckRequester

logger = init_logger(__name__)

# (engine id, messages every P rank got, send started, send finished)
OnDelivered = Callable[[str, list[bytes], float, float], None]
# Failed sends kept per engine for retry (a peer failing every send for long
# must not grow it without bound; a dropped retry's chunk goes out again
# within an interval anyway).
MAX_RETRY_PAIRS = 4096


class HeartbeatSender:
    """Sends, waits for handshakes, retries; reports delivered messages to ``on_delivered``."""

    def __init__(
        self,
        upstream: UpstreamWorker,
        max_heartbeat_bytes: int,
        on_delivered: OnDelivered | None = None,
        acks: AckRequester | None = None,
    ) -> None:
        self._upstream = upstream
        self._max_bytes = max_heartbeat_bytes
        self._on_delivered = on_delivered
        self._acks = acks
        self._last_metadata: object = None  # one send per step's metadata
        # Keyed by heartbeat group (the scheduler's; one P engine and instance):
        # (heartbeats, handshake future) while the engine's handshake runs
        self.waiting: dict[str, tuple[EngineHeartbeats, Future[Any]]] = {}
        # heartbeats waiting for the connection's proof of the group's instance
        self.awaiting_proof: dict[str, EngineHeartbeats] = {}
        # (heartbeats, [(agent, message), ...]) whose send failed
        self.retry: dict[str, tuple[EngineHeartbeats, list[tuple[AgentName, bytes]]]] = {}

    def has_pending(self) -> bool:
        """Heartbeats from an earlier step wait: for a handshake, a proof or a retry."""
        return bool(self.waiting or self.awaiting_proof or self.retry)

    def send(self, metadata: object) -> None:
        """One step: this step's ticks, then what waited on a handshake, then
        retries.  A second call with the same metadata does nothing (the pull
        worker sends before its reads; upstream calls again after them)."""
        if metadata is self._last_metadata:
            return
        self._last_metadata = metadata
        fresh: dict[str, EngineHeartbeats] | None = getattr(metadata, LEASE_HEARTBEATS_ATTR, None)
        if fresh is None:
            fresh = self._from_stock_metadata(metadata)
        if not (fresh or self.waiting or self.awaiting_proof or self.retry):
            return
        # Take what was left over from earlier steps before sending this
        # step's tick, so a send failing now is retried next step, not now.
        waiting, self.waiting = self.waiting, {}
        awaiting, self.awaiting_proof = self.awaiting_proof, {}
        retry, self.retry = self.retry, {}
        for key, hb in fresh.items():
            held = waiting.pop(key, (None, None))[0] or awaiting.pop(key, None)
            if hb.chunks is None:
                # A whole-engine tick supersedes what was waiting or queued for retry.
                retry.pop(key, None)
            elif held is not None and held.chunks is not None:
                hb = merged(held, hb)  # a paced tick names only some chunks
            self._send_group(key, hb, None)
        for key, (hb, fut) in waiting.items():
            if not fut.done():
                self.waiting[key] = (hb, fut)
            elif hb.engine_id in self._upstream._remote_agents:
                self._send_group(key, hb, None)
            # else: the handshake failed (upstream logged and counted it);
            # the next tick starts a new one, as upstream does.
        acks = self._acks
        for key, hb in awaiting.items():
            if acks is not None and not acks.holds(hb.engine_id, hb.instance):
                continue  # its requests ended: nothing left to prove or keep alive
            self._send_group(key, hb, None, tick=False)
        for key, (hb, pairs) in retry.items():
            self._send_group(key, hb, pairs)

    def _from_stock_metadata(self, metadata: object) -> dict[str, EngineHeartbeats]:
        # Metadata built by a stock scheduler (e.g. a test) carries id sets.
        out = {}
        stock: Mapping[str, StockHeartbeatInfo] = getattr(metadata, "heartbeat_by_engine", {})
        for engine_id, info in stock.items():
            messages = encode_heartbeats(sorted(info.req_ids), self._max_bytes)
            out[engine_id] = EngineHeartbeats(
                engine_id, messages, info.host, info.port, info.tp_size, info.dcp_size, info.pp_size
            )
        return out

    def _handshake(self, hb: EngineHeartbeats) -> Future[Any] | None:
        """Upstream's handshake with ``hb``'s P engine (None: connected).  Only an
        engine not connected yet needs upstream's call: it first scans every
        engine for TTL eviction (engine_reaper.py does that every few seconds),
        which a step sending to a connected engine need not pay."""
        up = self._upstream
        engine_id = hb.engine_id
        notif_only = up._hb_handshake_notif_only and hb.pp_size > 1
        starts = engine_id not in up._handshake_futures  # handshakes start on this thread only
        fut = up._ensure_handshake(
            engine_id, hb.host, hb.port, hb.tp_size, hb.dcp_size, hb.pp_size, notif_only
        )
        if fut is not None and starts and not notif_only:
            self._note_generation(engine_id, hb.registration_generation)
        return fut

    def _note_generation(self, engine_id: str, generation: object) -> None:
        """A handshake starting now loads P's registration as it is now, so at
        least the generation this group's requests named (P handed them out
        earlier).  Upstream (vLLM 0.33's pull worker) learns a generation only
        from a READ: its first READ over a connection a heartbeat made would
        find one newer than none, drop the connection and handshake again.
        Kept by upstream's rule (highest seen); a generation that is not an int
        (crafted params) is ignored."""
        generations = getattr(self._upstream, "_remote_registration_generations", None)
        if generations is None or type(generation) is not int:
            return
        if generation > generations.get(engine_id, 0):
            generations[engine_id] = generation

    def forget_engines(self, keep: set[str]) -> None:
        """The engine reaper released every engine not in ``keep``: drop what
        waits for them, unless D still views leases of that group."""
        acks = self._acks
        for table in (self.awaiting_proof, self.retry):
            for key in list(table):
                value = table[key]
                hb = value if isinstance(value, EngineHeartbeats) else value[0]
                held = acks is not None and acks.holds(hb.engine_id, hb.instance)
                if hb.engine_id not in keep and not held:
                    del table[key]

    def _send_group(
        self, key: str, hb: EngineHeartbeats, pairs: list[tuple[AgentName, bytes]] | None, tick: bool = True
    ) -> None:
        """``tick``: a tick of the scheduler's (not one re-tried every step while
        it waits for proof): only a tick sends keep-alives."""
        up = self._upstream
        engine_id = hb.engine_id
        if engine_id not in up._remote_agents:
            if pairs is not None:
                return  # engine evicted since the failure
            fut = self._handshake(hb)
            if fut is not None:
                self.waiting[key] = (hb, fut)
                return
        # A heartbeat means the router still pairs this P with us (upstream).
        up._engine_last_active[engine_id] = time.perf_counter()
        fresh = pairs is None
        acked = False
        # Ids per message, counted once here for the ledger and the stats
        # (counting scans the whole message); None: retried pairs, counted as sent.
        counts: list[int] | None = None
        agents: list[AgentName] = []  # read below only where counts is set with it
        if pairs is None:
            agents = list(up._remote_agents[engine_id].values())
            counts = hb.counts if hb.counts is not None else [ids_in(msg) for msg in hb.messages]
            if hb.instance:
                if self._acks is None:
                    return  # no acknowledgements on this worker: nothing to renew
                proof = self._acks.proof(engine_id, hb.instance)
                if proof == OTHER:
                    # Another P process answers there: either these leases died with
                    # theirs, or that process is the dead one (P restarted under the
                    # same id).  Only a new connection's proof tells which.
                    self._acks.other_instance(engine_id, hb.instance)
                    return
                acked = True
                if proof == PROVEN:
                    pairs = self._acks.sends(
                        engine_id, hb.instance, agents, hb.messages, hb.chunks, counts, hb.tagged
                    )
                else:
                    # Never our heartbeats to a process not proven to be the one
                    # that granted them: say hello, keep them for the proof.
                    self.awaiting_proof[key] = hb
                    pairs = self._acks.hellos(engine_id, hb.instance, agents)
                    if tick:
                        # Keep P's leases alive meanwhile; no view renews from these.
                        alive = [keepalive_message(msg, hb.tagged) for msg in hb.messages]
                        pairs += [(agent, msg) for msg in alive for agent in agents]
                    else:
                        counts = [0]
            else:
                pairs = [(agent, msg) for agent in agents for msg in hb.messages]
        failed: list[tuple[AgentName, bytes]] = []
        sent = ids = nbytes = 0
        disconnected = False
        wrapper = up.nixl_wrapper
        started = time.perf_counter()
        for agent, msg in pairs:
            try:
                wrapper.send_notif(agent, notif_msg=msg)
            except Exception as exc:
                failed.append((agent, msg))
                disconnected = disconnected or is_disconnect(exc)
                logger.debug("Failed to send heartbeat to engine %s", engine_id, exc_info=True)
                continue
            nbytes += len(msg)
            if not msg.startswith(_HELLO):
                sent += 1
                if counts is None:
                    ids += ids_in(msg)
        if counts is not None:  # every agent got every message, less what failed
            ids = sum(counts) * len(agents)
            ids -= sum(ids_in(msg) for _, msg in failed)
        if fresh and not acked and self._on_delivered is not None:
            # A message renews D's lease views only once every P rank has it;
            # retried sends (later, partial) never do: conservative.
            failed_msgs = {msg for _, msg in failed}
            delivered = [msg for msg in hb.messages if msg not in failed_msgs]
            if delivered:
                self._on_delivered(engine_id, delivered, started, time.perf_counter())
        stats = up.xfer_stats
        stats.add("num_heartbeat_msgs_sent", sent)
        stats.add("num_heartbeat_ids_sent", ids)
        stats.add("num_heartbeat_bytes_sent", nbytes)
        if failed:
            stats.add("num_heartbeat_send_failures", len(failed))
            if disconnected:
                self._reconnect(engine_id)  # the next tick handshakes again
            else:
                queued = self.retry.get(key)
                if queued is not None:  # this step's tick and an older retry both failed
                    known = set(queued[1])
                    failed = queued[1] + [pair for pair in failed if pair not in known]
                self.retry[key] = (hb, failed[-MAX_RETRY_PAIRS:])

    def _reconnect(self, engine_id: str) -> None:
        up = self._upstream
        if engine_id in up._invalid_remote_engines:
            return
        logger.warning(
            "Lost the NIXL connection to P engine %s (remote disconnect); releasing it so that the "
            "next heartbeat handshakes again",
            engine_id,
        )
        up._mark_remote_engine_invalid(engine_id, time.perf_counter())


def merged(older: EngineHeartbeats, newer: EngineHeartbeats) -> EngineHeartbeats:
    """``newer`` plus the messages of ``older`` whose chunks it does not name."""
    assert older.chunks is not None and newer.chunks is not None
    keys = {key for key, _ in newer.chunks}
    kept = [i for i, chunk in enumerate(older.chunks) if chunk[0] not in keys]
    if not kept:
        return newer
    counts = None  # counted by the sender unless both ticks carry them
    if older.counts is not None and newer.counts is not None:
        counts = [older.counts[i] for i in kept] + newer.counts
    return replace(
        newer,
        messages=[older.messages[i] for i in kept] + newer.messages,
        chunks=[older.chunks[i] for i in kept] + newer.chunks,
        counts=counts,
    )


def is_disconnect(exc: BaseException) -> bool:
    """NIXL's ``nixlRemoteDisconnectError`` (UCX gave the connection up)."""
    return type(exc).__name__ == "nixlRemoteDisconnectError" or "REMOTE_DISCONNECT" in str(exc)


_HELLO = ESCAPE_PREFIX + HELLO_KIND


def ids_in(msg: bytes) -> int:
    """How many names a heartbeat message carries (``HB:a,b`` or ``HB:,LHB:<seq>,a,b``;
    a hello, none)."""
    if msg.startswith(ESCAPE_PREFIX):
        return 0 if msg.startswith(_HELLO) else msg.count(b",") - 1
    return msg.count(b",") + 1
