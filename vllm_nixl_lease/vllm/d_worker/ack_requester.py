"""D worker: ask P to acknowledge heartbeats and renew lease views only on
its answers (``ack_ledger.py`` has the argument; ``ack_answerer.py`` is P's side).

Only for P engines that advertised acknowledgements in ``kv_transfer_params``
(their views are ``acked``); a stock P never receives ``LHB:``/``LHELLO:``.
Per P agent, D first sends ``LHELLO:`` with its NIXL connection info, and
again when that agent has not answered for ``rehello_s`` (P restarted its
bookkeeping, forgot an idle D, or the hello was lost).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from vllm.logger import init_logger

from ..._wire import (
    ACK_HELLO_PREFIX,
    HEARTBEAT_ACK_PREFIX,
    acked_heartbeat_message,
    heartbeat_payload,
    parse_heartbeat_ack,
)
from ...decode.ack_ledger import AckLedger
from ...decode.lease_views import LeaseViews
from ..ratelimit import RateLimitedLog
from ..upstream import UpstreamWorker

logger = init_logger(__name__)


def connection_metadata(wrapper: object) -> bytes:
    """This agent's NIXL metadata without memory registrations: connection info only,
    small enough for one notification."""
    from nixl._bindings import DRAM_SEG, nixlRegDList

    return wrapper.get_partial_agent_metadata(nixlRegDList(DRAM_SEG), True, ["UCX"])  # type: ignore[attr-defined]


class AckRequester:
    """D's acknowledged heartbeats: builds ``LHB:`` sends, takes ``LACK:`` answers."""

    def __init__(self, upstream: UpstreamWorker, views: LeaseViews, rehello_s: float) -> None:
        self._upstream = upstream
        self._views = views
        self._rehello_s = rehello_s
        self.ledger = AckLedger()
        self._hello: bytes | None = None
        self._hello_sent: dict[str, float] = {}  # P agent -> last hello
        self._answered: dict[str, float] = {}  # P agent -> last answer
        self._log = RateLimitedLog(logger)

    def wanted(self, engine_id: str) -> bool:
        """Does this P engine acknowledge heartbeats?"""
        return engine_id in self._views.acked_engines

    def sends(
        self,
        engine_id: str,
        agents: Sequence[str],
        messages: Sequence[bytes],
        chunks: Sequence[tuple[int, int]] | None = None,
        counts: Sequence[int] | None = None,
        tagged: bool = False,
    ) -> list[tuple[str, bytes]]:
        """The (agent, message) pairs for one engine's heartbeats: hellos where
        due, then each ``HB:`` message as ``LHB:`` (``LHBT:`` when ``tagged``)
        to every agent, recorded.  ``chunks``: each message's tracker chunk
        ``(key, version)``, so that its answer renews the chunk's views at once
        instead of id by id.  ``counts``: each message's id count, if the
        caller has it."""
        now = time.perf_counter()
        pairs: list[tuple[str, bytes]] = []
        # Upstream keeps the names add_remote_agent returned (bytes); answers
        # arrive keyed by str.
        names = [agent.decode() if isinstance(agent, bytes) else agent for agent in agents]
        for agent, name in zip(agents, names, strict=True):
            if self._hello_due(name, now):
                hello = self._hello_message()
                if hello is not None:
                    pairs.append((agent, hello))
                    self._hello_sent[name] = now
        for i, msg in enumerate(messages):
            chunk = chunks[i] if chunks is not None else None
            count = counts[i] if counts is not None else None
            seq = self.ledger.open(engine_id, names, heartbeat_payload(msg), now, chunk, count)
            acked = acked_heartbeat_message(seq, msg, tagged)
            pairs.extend((agent, acked) for agent in agents)
        return pairs

    def received(self, messages: Mapping[str, list[bytes]]) -> None:
        """One step's ``LACK:`` answers; renew the views they prove."""
        now = time.perf_counter()
        stats = self._upstream.xfer_stats
        offsets = self._upstream._engine_clock_offset
        answers = renewed = 0
        for agent, msgs in messages.items():
            for msg in msgs:
                if not msg.startswith(HEARTBEAT_ACK_PREFIX):
                    continue
                parsed = parse_heartbeat_ack(msg)
                if parsed is None:
                    stats.add("num_malformed_notifs", 1)
                    self._log.warning(
                        1, "Skipped a malformed heartbeat acknowledgement from %s: %r", agent, msg[:64]
                    )
                    continue
                seqs, not_extended = parsed
                answers += len(seqs)
                self._answered[agent] = now
                for seq in seqs:
                    proven = self.ledger.answered(agent, seq, not_extended)
                    if proven is None:
                        continue
                    offset = offsets.get(proven.engine_id)
                    if proven.chunk is not None:
                        key, version = proven.chunk
                        self._views.chunk_acked(
                            proven.engine_id, key, version, proven.started, proven.not_extended, offset
                        )
                        renewed += max(0, proven.count - len(proven.not_extended))
                    elif offset is not None:
                        renewed += self._views.heartbeat_acked(
                            proven.engine_id, proven.remote_ids, offset, proven.started
                        )
        if answers:
            stats.add("num_heartbeat_acks_recv", answers)
            # per-id answers count the views they moved, chunk answers the ids they proved
            stats.add("num_heartbeat_views_renewed", renewed)
        # An answer to a heartbeat older than the longest extension could
        # not move any view: stop waiting for it (and forget chunk answers
        # whose renewals are over).
        horizon = now - self._views.max_extension
        if len(self.ledger):
            self.ledger.prune(horizon)
        self._views.prune_chunk_acks(horizon)

    def _hello_due(self, agent: str, now: float) -> bool:
        sent = self._hello_sent.get(agent)
        if sent is None:
            return True
        last = max(sent, self._answered.get(agent, sent))
        return now - last >= self._rehello_s

    def _hello_message(self) -> bytes | None:
        if self._hello is None:
            try:
                self._hello = ACK_HELLO_PREFIX + connection_metadata(self._upstream.nixl_wrapper)
            except Exception as exc:
                self._log.warning(1, "Cannot build the heartbeat-ack hello (no acknowledgements): %s", exc)
                return None
        return self._hello
