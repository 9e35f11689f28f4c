"""P scheduler: tell D, through the ``kv_transfer_params`` a finished prefill
returns, when its lease ends and what this P understands (``_wire.py`` names
the keys).  Stock D ignores the extra keys."""

from __future__ import annotations

from typing import Any

from ..._wire import PARAM_LEASE_ACKS, PARAM_LEASE_DEADLINE, PARAM_LEASE_EXTENSION, PARAM_LEASE_TAGS


def add_lease_params(params: dict[str, Any], deadline: float | None, extension: float) -> None:
    """Pull mode: the lease deadline (this scheduler's ``perf_counter``, the
    clock the handshake listener echoes for D's offset estimate), how far a
    heartbeat moves it, and that this P acknowledges heartbeats, also by tag."""
    if deadline is not None:
        params[PARAM_LEASE_DEADLINE] = deadline
        params[PARAM_LEASE_EXTENSION] = extension
        params[PARAM_LEASE_ACKS] = True
        params[PARAM_LEASE_TAGS] = True
