"""Read fencing, D worker side: never READ blocks P may already have freed.

The scheduler ships a view of each P lease (``d_scheduler/lease_view_collector.py``);
P's answers to heartbeats (``ack_requester.py``), or for a P that does not
answer the heartbeats this worker delivers, move the views forward
(``decode/lease_views.py`` says when that is safe).  A READ whose view has
``lease_safety_margin`` or less left is not issued but reported as a failed
load, so vLLM's ``kv_load_failure_policy`` applies (``recompute`` or
``fail``), the same path upstream takes for an expired turn-2 readback.

A READ that was issued but whose completion D sees only after the view ended
(it stalled: a partition, a congested link) is discarded the same way
(``discard_late``): P may have freed and reused the blocks while it ran.
Seen before the view ended, every byte was read while P still held the lease.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.logger import init_logger

from ..._wire import heartbeat_ids
from ...decode.lease_views import LeaseViews
from ..config import LeaseConfig
from ..metadata import LEASE_VIEWS_ATTR
from ..ratelimit import RateLimitedLog
from ..upstream import UpstreamWorker

logger = init_logger(__name__)


class ReadFence:
    """D's views of P's leases, and the decision to skip a READ."""

    def __init__(self, upstream: UpstreamWorker, lease_config: LeaseConfig) -> None:
        self._upstream = upstream
        self.views = LeaseViews(lease_config.lease_safety_margin)
        self._log = RateLimitedLog(logger)
        self._log_late = RateLimitedLog(logger)

    # -- views shipped by the scheduler, around upstream's start_load_kv -----
    def add_views(self, metadata: Any) -> None:
        updates = getattr(metadata, LEASE_VIEWS_ATTR, None)
        if updates is None:
            return
        chunks = getattr(updates, "chunks", None) or {}
        for local_id, (engine_id, remote_id, deadline, extension, acked) in updates.new.items():
            self.views.add(local_id, engine_id, remote_id, deadline, extension, acked, chunks.get(local_id))
        if len(chunks) > len(updates.new):  # views whose ids were repacked into new chunks
            offsets = self._upstream._engine_clock_offset
            for local_id, chunk in chunks.items():
                if local_id not in updates.new:
                    engine_id = self.views.engine_of(local_id)
                    if engine_id is not None:
                        self.views.move_to_chunk(local_id, chunk, offsets.get(engine_id))

    def drop_views(self, metadata: Any) -> None:
        # After the reads: an id whose tracking ended this step may still be read in it.
        updates = getattr(metadata, LEASE_VIEWS_ATTR, None)
        if updates is not None:
            for local_id in updates.dropped:
                self.views.drop(local_id)

    # -- one READ ----------------------------------------------------------
    def fenced(self, req_id: str, meta: Any) -> bool:
        """True when the READ must not be issued; it is then reported as a failed load."""
        if not self._must_fence(req_id, meta):
            return False
        up = self._upstream
        up.xfer_stats.add("num_reads_fenced", 1)
        self._log.warning(
            1,
            "Not reading KV of %s from engine %s: its lease on P may already have ended (D's view "
            "has <= %.1fs left); reported as a failed load (kv_load_failure_policy applies)",
            req_id,
            meta.remote.engine_id,
            self.views.margin,
        )
        self.views.drop(req_id)
        up._handle_failed_transfer(req_id, None, up._recv_failures, record_failed_transfer=False)
        return True

    def _must_fence(self, req_id: str, meta: Any) -> bool:
        if req_id not in self.views or meta.remote is None:
            return False
        engine_id = meta.remote.engine_id
        # Not connected yet: upstream defers the read to after the handshake
        # and calls us again then, with the clock offset measured.
        if engine_id not in self._upstream._remote_agents:
            return False
        offset = self._upstream._engine_clock_offset.get(engine_id)
        if offset is None:
            return False
        # Nothing to read (e.g. all prefix-cached): upstream only notifies P.
        if not any(len(group) > 0 for group in meta.local_block_ids):
            return False
        return not self.views.may_read(req_id, time.perf_counter(), offset)

    # -- READs completed this step (after upstream's _pop_done_transfers) ----
    def discard_late(self, done: set[str], failed: set[str]) -> None:
        """Report as failed each completed READ whose view ended before D saw it complete."""
        if not len(self.views):
            return
        now = time.perf_counter()
        offsets = self._upstream._engine_clock_offset
        late = []
        for req_id in done:
            engine_id = self.views.engine_of(req_id)
            if engine_id is None or req_id in failed:
                continue
            offset = offsets.get(engine_id)
            left = None if offset is None else self.views.remaining(req_id, now, offset)
            if left is not None and left <= 0:
                late.append(req_id)
        if not late:
            return
        failed.update(late)
        self._upstream.xfer_stats.add("num_reads_discarded", len(late))
        self._log_late.warning(
            len(late),
            "Discarding %d READ(s) that completed after D's view of their lease on P ended (e.g. %s): "
            "P may have freed the blocks while they ran; reported as failed loads "
            "(kv_load_failure_policy applies)",
            len(late),
            late[:3],
        )

    # -- heartbeats this worker delivered to a P that does not answer ---------
    # (HeartbeatSender's callback; answered heartbeats go through AckRequester)
    def heartbeat_delivered(
        self, engine_id: str, messages: list[bytes], started: float, finished: float
    ) -> None:
        offset = self._upstream._engine_clock_offset.get(engine_id)
        if offset is None or not len(self.views):
            return
        renewed = 0
        for msg in messages:
            renewed += self.views.heartbeat_sent(engine_id, heartbeat_ids(msg), offset, started, finished)
        self._upstream.xfer_stats.add("num_heartbeat_views_renewed", renewed)
