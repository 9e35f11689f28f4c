"""Push mode P side: heartbeats that name the router's request id renew the
lease P holds under its own id (upstream's push P renews nothing for them).

In push mode D never learns P's request id: its ``remote_request_id`` is the
router's, while P keys the lease by its internal id, which vLLM suffixes with
``-<8 hex>``.  Upstream already matches D's PUSH_REG registrations to P's
finished blocks by that base id (``get_base_request_id``); heartbeat ids get
the same lookup here, on P, so it works for stock D engines too.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

from ..._wire import HEARTBEAT_SEPARATOR
from ...prefill.lease_table import LeaseTable


class LeaseAliases:
    """Base request id -> P ids leased under it (usually exactly one)."""

    __slots__ = ("_by_base",)

    def __init__(self) -> None:
        self._by_base: dict[str, set[str]] = {}

    def __bool__(self) -> bool:
        return bool(self._by_base)

    def __len__(self) -> int:
        return len(self._by_base)

    def __contains__(self, base_id: object) -> bool:
        return base_id in self._by_base

    def add(self, req_id: str) -> None:
        self._by_base.setdefault(get_base_request_id(req_id), set()).add(req_id)

    def discard(self, req_id: str) -> None:
        base = get_base_request_id(req_id)
        ids = self._by_base.get(base)
        if ids is not None:
            ids.discard(req_id)
            if not ids:
                del self._by_base[base]

    def extend(self, table: LeaseTable, payload: bytes, now: float) -> int:
        """Extend leases named by base id; return how many ids matched.  The
        ids the table extended directly are skipped; only ``LeaseKeeper.extend``
        (push) calls this, after that direct pass."""
        matched = 0
        for raw in payload.split(HEARTBEAT_SEPARATOR):
            try:
                req_id = raw.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if not req_id or req_id in table:
                continue  # empty, or extended by the direct pass
            leased = self._by_base.get(req_id) or self._by_base.get(get_base_request_id(req_id))
            hit = False
            for p_id in leased or ():
                if p_id in table:
                    table.extend(p_id, now)
                    hit = True
            matched += hit
        return matched
