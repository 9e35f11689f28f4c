"""Push mode P side: heartbeats that name the router's request id renew the
lease P holds under its own id (fixes vLLM issue 53095).

In push mode D never learns P's request id: its ``remote_request_id`` is the
router's, while P keys the lease by its internal id, which vLLM suffixes with
``-<8 hex>``.  Upstream already matches D's PUSH_REG registrations to P's
finished blocks by that base id (``get_base_request_id``); heartbeat ids get
the same lookup here, on P, so stock D engines are fixed too.
"""

from __future__ import annotations

import queue
import time

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

from .p_worker import LeaseSenderMixin

_HB = b"HB:"


class PushLeaseSenderMixin(LeaseSenderMixin):
    """Lease core for the push worker, with base-id heartbeat matching."""

    def _setup_lease_sender(self, lease_config) -> None:  # type: ignore[override]
        super()._setup_lease_sender(lease_config)
        # base request id -> P ids leased under it (usually exactly one)
        self._lease_aliases: dict[str, set[str]] = {}

    def _on_lease_granted(self, req_id: str) -> None:
        super()._on_lease_granted(req_id)
        self._lease_aliases.setdefault(get_base_request_id(req_id), set()).add(req_id)

    def _on_lease_released(self, req_id: str) -> None:
        base = get_base_request_id(req_id)
        ids = self._lease_aliases.get(base)
        if ids is not None:
            ids.discard(req_id)
            if not ids:
                del self._lease_aliases[base]

    def _get_new_notifs(self) -> set[str]:
        # The push writer thread forwards every non-PUSH_REG notification to
        # this queue; take the heartbeats, hand the rest back to upstream.
        pending: queue.Queue[bytes] = self._pending_completion_notifs  # type: ignore[attr-defined]
        heartbeats: list[bytes] = []
        others: list[bytes] = []
        while True:
            try:
                notif = pending.get_nowait()
            except queue.Empty:
                break
            (heartbeats if notif.startswith(_HB) else others).append(notif)
        for notif in others:
            pending.put(notif)
        if heartbeats:
            self._extend_push_heartbeats(heartbeats)
        # Skip LeaseSenderMixin's pull routing: upstream's push method drains
        # the (now heartbeat-free) queue for completions through our views.
        return super(LeaseSenderMixin, self)._get_new_notifs()  # type: ignore[misc]

    def _extend_push_heartbeats(self, heartbeats: list[bytes]) -> None:
        start = time.perf_counter_ns()
        now = time.perf_counter()
        table = self.lease_router.table
        ids_total = extended_total = 0
        for msg in heartbeats:
            extended, ids = table.extend_counted(msg[3:], now)
            if extended < ids and self._lease_aliases:
                extended += self._extend_aliases(msg[3:], now)
            ids_total += ids
            extended_total += extended
        self.xfer_stats.observe_time("lease_route_time", (time.perf_counter_ns() - start) / 1e9)
        self._account_heartbeats(len(heartbeats), ids_total, extended_total)

    def _extend_aliases(self, payload: bytes, now: float) -> int:
        """Extend leases named by base id; return how many ids matched."""
        table = self.lease_router.table
        matched = 0
        for raw in payload.split(b","):
            try:
                req_id = raw.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if not req_id or req_id in table:
                continue  # empty, or extended by the direct pass
            leased = self._lease_aliases.get(req_id) or self._lease_aliases.get(get_base_request_id(req_id))
            hit = False
            for p_id in leased or ():
                if p_id in table:
                    table.extend(p_id, now)
                    hit = True
            matched += hit
        return matched
