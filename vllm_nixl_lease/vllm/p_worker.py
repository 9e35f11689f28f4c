"""P side: leases, notification routing and expiry sweep on the lease core.

Mixed in front of vLLM's pull/push worker classes.  Upstream's
``_reqs_to_send``/``_reqs_to_process`` become views over the
``NotificationRouter`` (see ``views.py``), so upstream's ``start_load_kv``
grants leases, rebased onto the worker clock, through the core unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from itertools import repeat
from typing import Any

from vllm.logger import init_logger

from .. import LeaseTable, NotificationRouter
from .config import LeaseConfig
from .ratelimit import RateLimitedLog
from .stats import LeaseKVConnectorStats
from .views import InBatchSet, LeaseDeadlines

logger = init_logger(__name__)

# Ids named in the per-step expiry WARNING; the rest are at DEBUG.
_EXPIRY_SUMMARY_IDS = 5


class LeaseSenderMixin:
    """Replaces upstream's P-side lease bookkeeping with the lease core."""

    lease_config: LeaseConfig
    lease_router: Any
    xfer_stats: LeaseKVConnectorStats
    _lease_extension: float

    def _setup_lease_sender(self, lease_config: LeaseConfig) -> None:
        """Install the core; callable on objects built without ``__init__``."""
        self.lease_config = lease_config
        self._lease_extension = lease_config.lease_extension
        self.lease_router = NotificationRouter(LeaseTable(lease_config.lease_extension))
        self._reqs_to_send = LeaseDeadlines(
            self.lease_router, self._on_lease_granted, self._on_lease_released
        )
        self._reqs_to_process = InBatchSet(self.lease_router)
        self.xfer_stats = LeaseKVConnectorStats()
        self._lease_active_reported = 0
        self._malformed_log = RateLimitedLog(logger)
        self._unknown_log = RateLimitedLog(logger)

    # -- hooks for subclasses (push keeps an alias index) -----------------
    def _on_lease_granted(self, req_id: str) -> None:
        self.xfer_stats.add("num_leases_granted", 1)

    def _on_lease_released(self, req_id: str) -> None:
        pass

    # -- notifications ----------------------------------------------------
    def _get_new_notifs(self) -> set[str]:
        return self._route_notifications(self.nixl_wrapper.get_new_notifs())  # type: ignore[attr-defined]

    def _route_notifications(self, notifs: Mapping[str, list[bytes]]) -> set[str]:
        """Route one step's notifications; return requests read by all consumers."""
        if not notifs:
            return set()
        start = time.perf_counter_ns()
        result = self.lease_router.route(notifs, time.perf_counter())
        stats = self.xfer_stats
        stats.observe_time("lease_route_time", (time.perf_counter_ns() - start) / 1e9)
        if result.heartbeat_messages:
            self._account_heartbeats(result.heartbeat_messages, result.heartbeat_ids, result.extended)
        if result.unknown:
            # Upstream's counter (one item per notification) and ours; one
            # rate-limited line with a few cut ids, not one line per message.
            stats.data["num_notifications_after_expiry"].extend(repeat(1, result.unknown))
            stats.add("num_unknown_completions", result.unknown)
            self._unknown_log.warning(
                result.unknown,
                "Potentially invalid KV blocks for %d unrecognized request(s) were retrieved by "
                "a decode worker, e.g. %s. They may have expired.",
                result.unknown,
                result.unknown_sample,
            )
        if result.malformed:
            stats.add("num_malformed_notifs", result.malformed)
            self._malformed_log.warning(
                result.malformed,
                "Skipped %d malformed NIXL notification(s) (neither 'HB:...' nor 'id:count'), e.g. %r",
                result.malformed,
                result.malformed_sample[:1],
            )
        for agent, messages in result.passthrough.items():
            self._handle_passthrough(agent, messages)
        for req_id in result.completed:
            self._on_lease_released(req_id)
        return set(result.completed)

    def _handle_passthrough(self, agent: str, messages: list[bytes]) -> None:
        # Pull workers never receive PUSH_REG; one arriving is a misrouted peer.
        self._malformed_log.warning(
            len(messages), "Ignored %d PUSH_REG notification(s) on a pull worker", len(messages)
        )

    def _account_heartbeats(self, messages: int, ids: int, extended: int) -> None:
        stats = self.xfer_stats
        stats.add("num_heartbeat_msgs_recv", messages)
        stats.add("num_heartbeat_ids_recv", ids)
        stats.add("num_heartbeat_ids_unknown", ids - extended)
        if extended:
            logger.debug("Heartbeat extended %d of %d lease(s) by %ss", extended, ids, self._lease_extension)

    def _handle_heartbeat(self, payload: str) -> None:
        """Upstream's entry point for one ``HB:`` payload (kept for callers)."""
        extended, ids = self.lease_router.table.extend_counted(payload, time.perf_counter())
        self._account_heartbeats(1, ids, extended)

    # -- expiry -----------------------------------------------------------
    def _reap_expired_send_leases(self, done_sending: set[str]) -> None:
        router = self.lease_router
        if len(router.table):
            start = time.perf_counter_ns()
            expired = router.expire(time.perf_counter())
            self.xfer_stats.observe_time("lease_sweep_time", (time.perf_counter_ns() - start) / 1e9)
            if expired:
                self._report_expired(expired)
                for req_id, _ in expired:
                    self._on_lease_released(req_id)
                    done_sending.add(req_id)
        active = len(router.table)
        if active != self._lease_active_reported:
            self._lease_active_reported = active
            self.xfer_stats.set_active_leases(getattr(self, "tp_rank", 0), active)

    def _report_expired(self, expired: list[tuple[str, int]]) -> None:
        read = 0
        for req_id, count in expired:
            self.xfer_stats.record_kv_expired_req()
            read += count > 0
            logger.debug(
                "Releasing expired KV blocks for request %s which were retrieved by %d remote "
                "worker(s) before lease expired.",
                req_id,
                count,
            )
        shown = ", ".join(req_id for req_id, _ in expired[:_EXPIRY_SUMMARY_IDS])
        more = len(expired) - _EXPIRY_SUMMARY_IDS
        logger.warning(
            "Releasing expired KV blocks for %d request(s) whose lease expired (%s%s); %d had been "
            "retrieved by at least one remote worker.",
            len(expired),
            shown,
            f", +{more} more" if more > 0 else "",
            read,
        )
