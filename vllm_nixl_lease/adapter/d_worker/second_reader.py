"""Fence every local READ of a lease after the first (``decode/read_claims.py``).

The second local request of a lease this D has read, or is reading, is
reported as a failed load (``kv_load_failure_policy`` recomputes it), counted
(``num_reads_fenced_second_reader``) and logged, rate-limited.
"""

from __future__ import annotations

import time

from vllm.logger import init_logger

from ...decode.lease_views import LeaseViews
from ..ratelimit import RateLimitedLog
from ..upstream import ReadMeta, UpstreamWorker

logger = init_logger(__name__)


class SecondReaderFence:
    """One READ per lease on this D; the others become failed loads."""

    def __init__(self, upstream: UpstreamWorker, views: LeaseViews) -> None:
        self._upstream = upstream
        self._views = views
        self._log = RateLimitedLog(logger)

    def fenced(self, req_id: str, meta: ReadMeta) -> bool:
        """True when another local request reads (or has read) this READ's
        lease: it is then reported as a failed load, and must not be posted."""
        if meta.remote is None:
            return False
        up = self._upstream
        remote = meta.remote
        offset = up._engine_clock_offset.get(remote.engine_id)
        unviewed = (remote.engine_id, getattr(remote, "request_id", ""))
        if self._views.claim_read(req_id, time.perf_counter(), offset, unviewed if unviewed[1] else None):
            return False
        self.refuse(req_id, meta)
        return True

    def refuse(self, req_id: str, meta: ReadMeta) -> None:
        """Report a READ whose lease another local request claimed as a failed
        load (``fenced``'s refusal; ``ReadFence`` claims most READs itself,
        through ``LeaseViews.admit_read``)."""
        assert meta.remote is not None  # only a READ with a remote side claims a lease
        up = self._upstream
        up.xfer_stats.add("num_reads_fenced_second_reader", 1)
        self._log.warning(
            1,
            "Not reading KV of %s from engine %s: another request on this D reads (or has read) the "
            "same lease, whose completion lets P free the blocks; reported as a failed load "
            "(kv_load_failure_policy applies)",
            req_id,
            meta.remote.engine_id,
        )
        up._handle_failed_transfer(req_id, None, up._recv_failures, record_failed_transfer=False)
