"""Read fencing, D worker side: never READ blocks P may already have freed.

The scheduler ships a view of each P lease (``fence_scheduler.py``); heartbeats
this worker sends move the views forward (``holder_view.py`` says when that is
safe); a READ whose view has ``lease_safety_margin`` or less left is not
issued but reported as a failed load, so vLLM's ``kv_load_failure_policy``
applies (``recompute`` or ``fail``), the same path upstream takes for an
expired turn-2 readback.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.logger import init_logger

from ..holder_view import HolderLeaseViews
from .config import LeaseConfig
from .metadata import LEASE_VIEWS_ATTR
from .ratelimit import RateLimitedLog
from .stats import LeaseKVConnectorStats

logger = init_logger(__name__)


class ReadFenceMixin:
    """Mixed in front of vLLM's pull worker."""

    xfer_stats: LeaseKVConnectorStats
    lease_views: HolderLeaseViews

    def _setup_read_fence(self, lease_config: LeaseConfig) -> None:
        self.lease_views = HolderLeaseViews(lease_config.lease_safety_margin)
        self._fence_log = RateLimitedLog(logger)

    def start_load_kv(self, metadata: Any) -> None:
        updates = getattr(metadata, LEASE_VIEWS_ATTR, None)
        if updates is not None:
            for local_id, (engine_id, remote_id, deadline, extension) in updates.new.items():
                self.lease_views.add(local_id, engine_id, remote_id, deadline, extension)
        super().start_load_kv(metadata)  # type: ignore[misc]
        # After the reads: an id whose tracking ended this step may still be read in it.
        if updates is not None:
            for local_id in updates.dropped:
                self.lease_views.drop(local_id)

    def _read_blocks_for_req(self, req_id: str, meta: Any) -> None:
        if self._must_fence(req_id, meta):
            engine_id = meta.remote.engine_id
            self.xfer_stats.add("num_reads_fenced", 1)
            self._fence_log.warning(
                1,
                "Not reading KV of %s from engine %s: its lease on P may already have ended (D's view "
                "has <= %.1fs left); reported as a failed load (kv_load_failure_policy applies)",
                req_id,
                engine_id,
                self.lease_views.margin,
            )
            self.lease_views.drop(req_id)
            self._handle_failed_transfer(  # type: ignore[attr-defined]
                req_id,
                None,
                self._recv_failures,
                record_failed_transfer=False,  # type: ignore[attr-defined]
            )
            return
        super()._read_blocks_for_req(req_id, meta)  # type: ignore[misc]

    def _must_fence(self, req_id: str, meta: Any) -> bool:
        if req_id not in self.lease_views or meta.remote is None:
            return False
        engine_id = meta.remote.engine_id
        # Not connected yet: upstream defers the read to after the handshake
        # and calls us again then, with the clock offset measured.
        if engine_id not in self._remote_agents:  # type: ignore[attr-defined]
            return False
        offset = self._engine_clock_offset.get(engine_id)  # type: ignore[attr-defined]
        if offset is None:
            return False
        # Nothing to read (e.g. all prefix-cached): upstream only notifies P.
        if not any(len(group) > 0 for group in meta.local_block_ids):
            return False
        return not self.lease_views.may_read(req_id, time.perf_counter(), offset)

    def _on_heartbeat_sent(
        self, engine_id: str, messages: list[bytes], started: float, finished: float
    ) -> None:
        offset = self._engine_clock_offset.get(engine_id)  # type: ignore[attr-defined]
        if offset is None or not len(self.lease_views):
            return
        renewed = 0
        for msg in messages:
            ids = msg[3:].decode("utf-8", "replace").split(",")
            renewed += self.lease_views.heartbeat_sent(engine_id, ids, offset, started, finished)
        self.xfer_stats.add("num_heartbeat_views_renewed", renewed)
