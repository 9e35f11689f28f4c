"""D worker: forward the scheduler's pre-encoded heartbeats to P agents.

Differences from upstream's ``_send_heartbeats``, both on purpose:
- an engine whose proactive handshake is still running is remembered and
  heartbeated on the first step after it completes, not one interval later;
- a failed ``send_notif`` is counted and retried on the next step (until a
  fresher tick for that engine replaces it).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

from vllm.logger import init_logger

from .. import encode_heartbeats
from .metadata import LEASE_HEARTBEATS_ATTR, EngineHeartbeats
from .stats import LeaseKVConnectorStats

logger = init_logger(__name__)


class HeartbeatSenderMixin:
    """Mixed in front of vLLM's pull/push worker classes."""

    xfer_stats: LeaseKVConnectorStats

    def _setup_heartbeat_sender(self, max_heartbeat_bytes: int) -> None:
        self._hb_max_bytes = max_heartbeat_bytes
        # engine -> (heartbeats, handshake future) while its handshake runs
        self._hb_waiting: dict[str, tuple[EngineHeartbeats, Future[Any]]] = {}
        # engine -> (heartbeats, [(agent, message), ...]) whose send failed
        self._hb_retry: dict[str, tuple[EngineHeartbeats, list[tuple[str, bytes]]]] = {}

    def _send_heartbeats(self, metadata: Any) -> None:
        fresh: dict[str, EngineHeartbeats] | None = getattr(metadata, LEASE_HEARTBEATS_ATTR, None)
        if fresh is None:
            fresh = self._from_stock_metadata(metadata)
        if not (fresh or self._hb_waiting or self._hb_retry):
            return
        # Take what was left over from earlier steps before sending this
        # step's tick, so a send failing now is retried next step, not now.
        waiting, self._hb_waiting = self._hb_waiting, {}
        retry, self._hb_retry = self._hb_retry, {}
        for engine_id, hb in fresh.items():
            # A fresh tick supersedes what was waiting or queued for retry.
            waiting.pop(engine_id, None)
            retry.pop(engine_id, None)
            self._heartbeat_engine(engine_id, hb, None)
        for engine_id, (hb, fut) in waiting.items():
            if not fut.done():
                self._hb_waiting[engine_id] = (hb, fut)
            elif engine_id in self._remote_agents:  # type: ignore[attr-defined]
                self._heartbeat_engine(engine_id, hb, None)
            # else: the handshake failed (upstream logged and counted it);
            # the next tick starts a new one, as upstream does.
        for engine_id, (hb, pairs) in retry.items():
            self._heartbeat_engine(engine_id, hb, pairs)

    def _on_heartbeat_sent(
        self, engine_id: str, messages: list[bytes], started: float, finished: float
    ) -> None:
        """Hook: ``messages`` reached every P rank of ``engine_id`` (read fencing uses it)."""

    def _from_stock_metadata(self, metadata: Any) -> dict[str, EngineHeartbeats]:
        # Metadata built by a stock scheduler (e.g. a test) carries id sets.
        out = {}
        for engine_id, info in getattr(metadata, "heartbeat_by_engine", {}).items():
            messages = encode_heartbeats(sorted(info.req_ids), self._hb_max_bytes)
            out[engine_id] = EngineHeartbeats(
                messages, info.host, info.port, info.tp_size, info.dcp_size, info.pp_size
            )
        return out

    def _heartbeat_engine(
        self, engine_id: str, hb: EngineHeartbeats, pairs: list[tuple[str, bytes]] | None
    ) -> None:
        if pairs is None:
            fut = self._ensure_handshake(  # type: ignore[attr-defined]
                engine_id,
                hb.host,
                hb.port,
                hb.tp_size,
                hb.dcp_size,
                hb.pp_size,
                self._hb_handshake_notif_only and hb.pp_size > 1,  # type: ignore[attr-defined]
            )
            if fut is not None:
                self._hb_waiting[engine_id] = (hb, fut)
                return
        elif engine_id not in self._remote_agents:  # type: ignore[attr-defined]
            return  # engine evicted since the failure
        # A heartbeat means the router still pairs this P with us (upstream).
        self._engine_last_active[engine_id] = time.perf_counter()  # type: ignore[attr-defined]
        fresh = pairs is None
        if fresh:
            agents = list(self._remote_agents[engine_id].values())  # type: ignore[attr-defined]
            pairs = [(agent, msg) for agent in agents for msg in hb.messages]
        failed: list[tuple[str, bytes]] = []
        sent = ids = nbytes = 0
        wrapper = self.nixl_wrapper  # type: ignore[attr-defined]
        started = time.perf_counter()
        for agent, msg in pairs:
            try:
                wrapper.send_notif(agent, notif_msg=msg)
            except Exception:
                failed.append((agent, msg))
                logger.debug("Failed to send heartbeat to engine %s", engine_id, exc_info=True)
                continue
            sent += 1
            ids += msg.count(b",") + 1
            nbytes += len(msg)
        if fresh:
            # A message renews D's lease views only once every P rank has it;
            # retried sends (later, partial) never do: conservative.
            failed_msgs = {msg for _, msg in failed}
            delivered = [msg for msg in hb.messages if msg not in failed_msgs]
            if delivered:
                self._on_heartbeat_sent(engine_id, delivered, started, time.perf_counter())
        stats = self.xfer_stats
        stats.add("num_heartbeat_msgs_sent", sent)
        stats.add("num_heartbeat_ids_sent", ids)
        stats.add("num_heartbeat_bytes_sent", nbytes)
        if failed:
            stats.add("num_heartbeat_send_failures", len(failed))
            self._hb_retry[engine_id] = (hb, failed)
