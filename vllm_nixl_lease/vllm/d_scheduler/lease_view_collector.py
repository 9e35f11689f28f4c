"""D scheduler: the lease fields P put in a request's ``kv_transfer_params``
(``p_scheduler/lease_params.py``) become a view of P's lease for the workers'
read fence (``d_worker/read_fence.py``); the metadata of the next step carries
the new views and the ids whose tracking ended, so the workers' tables stay
bounded.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

from vllm.logger import init_logger

from ..._wire import PARAM_LEASE_ACKS, PARAM_LEASE_DEADLINE, PARAM_LEASE_EXTENSION
from ..config import LeaseConfig
from ..metadata import LEASE_VIEWS_ATTR, LeaseViewUpdates

logger = init_logger(__name__)


class LeaseViewCollector:
    """D side: lease views of newly tracked requests, shipped to the workers once."""

    def __init__(self, lease_config: LeaseConfig, transfer_mode: str) -> None:
        # Push mode: P writes into D, D never reads, nothing to fence.
        self.enabled = lease_config.lease_fencing and transfer_mode == "pull"
        self._new: dict[str, tuple[str, str, float, float, bool]] = {}
        self._dropped: list[str] = []
        self._chunks: dict[str, tuple[int, int]] = {}
        self._shipped: dict[str, str] = {}  # local id -> P engine id
        self._fencing_off_engines: set[str] = set()

    def add(
        self,
        local_id: str,
        engine_id: str,
        remote_id: str,
        params: dict[str, Any],
        chunk: tuple[int, int] | None = None,
    ) -> None:
        """``chunk``: the heartbeat chunk ``(key, version)`` naming the request
        (``HeartbeatTracker.chunk_of`` right after tracking it)."""
        if not self.enabled:
            return
        deadline = params.get(PARAM_LEASE_DEADLINE)
        extension = params.get(PARAM_LEASE_EXTENSION)
        if _finite(deadline) and _finite(extension) and extension > 0:
            acks = params.get(PARAM_LEASE_ACKS) is True
            self._new[local_id] = (engine_id, remote_id, float(deadline), float(extension), acks)
            if chunk is not None:
                self._chunks[local_id] = chunk
            return
        if deadline is not None or extension is not None:
            logger.warning(
                "Request %s: ignoring malformed lease fields from P engine %s (%s=%r, %s=%r); "
                "its read is not fenced",
                local_id, engine_id, PARAM_LEASE_DEADLINE, deadline, PARAM_LEASE_EXTENSION, extension,
            )  # fmt: skip
        elif engine_id not in self._fencing_off_engines:
            self._fencing_off_engines.add(engine_id)
            logger.info(
                "P engine %s reports no lease deadline (a stock prefill connector): reads from it are "
                "not fenced, as upstream",
                engine_id,
            )

    def drop(self, local_id: str) -> None:
        self._chunks.pop(local_id, None)
        if self._new.pop(local_id, None) is None and self._shipped.pop(local_id, None) is not None:
            self._dropped.append(local_id)

    def rechunk(self, engine_ids: Iterable[str], chunk_of: Callable[[str], tuple[int, int] | None]) -> None:
        """The heartbeat chunks of these engines were repacked: ship every
        viewed request's new chunk (rare: O(views), like the repack itself)."""
        engines = set(engine_ids)
        if not engines:
            return
        viewed = chain(self._shipped.items(), ((local_id, entry[0]) for local_id, entry in self._new.items()))
        for local_id, engine_id in viewed:
            if engine_id in engines:
                chunk = chunk_of(local_id)
                if chunk is not None:
                    self._chunks[local_id] = chunk

    def attach(self, meta: Any) -> None:
        updates = LeaseViewUpdates(self._new, self._dropped, self._chunks)
        for local_id, entry in self._new.items():
            self._shipped[local_id] = entry[0]
        self._new, self._dropped, self._chunks = {}, [], {}
        setattr(meta, LEASE_VIEWS_ATTR, updates)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
