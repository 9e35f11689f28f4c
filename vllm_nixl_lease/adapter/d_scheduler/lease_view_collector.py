"""D scheduler: the lease fields P put in a request's ``kv_transfer_params``
(``p_scheduler/lease_params.py``) become a view of P's lease for the workers'
read fence (``d_worker/read_fence.py``); the metadata of the next step carries
the new views and the ids whose tracking ended, so the workers' tables stay
bounded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import chain
from operator import itemgetter
from typing import Any

from vllm.logger import init_logger

from ..._wire import LeaseTerms, lease_terms
from ..config import LeaseConfig
from ..metadata import LEASE_VIEWS_ATTR, LeaseViewUpdates, NewView
from ..ratelimit import RateLimitedLog

logger = init_logger(__name__)


# Engines whose "no lease deadline" line was logged, remembered to log it once
# each; past this many the oldest is forgotten (and may be logged again).
MAX_LOGGED_ENGINES = 1024

_new_view = tuple.__new__
_engine_of = itemgetter(0)  # a NewView's engine_id


class LeaseViewCollector:
    """D side: lease views of newly tracked requests, shipped to the workers once."""

    def __init__(self, lease_config: LeaseConfig, transfer_mode: str) -> None:
        # Push mode: P writes into D, D never reads, nothing to fence.
        self.enabled = lease_config.lease_fencing and transfer_mode == "pull"
        # Public: the core's intake (``decode/intake.py``) fills them too.
        self.new: dict[str, NewView] = {}
        self.dropped: list[str] = []
        self.chunks: dict[str, tuple[int, int]] = {}
        self.shipped: dict[str, str] = {}  # local id -> P engine id
        self._fencing_off_engines: dict[str, None] = {}
        self._malformed_log = RateLimitedLog(logger)

    def terms_of(self, local_id: str, engine_id: str, params: dict[str, Any] | None) -> LeaseTerms | None:
        """The request's lease terms (``_wire.lease_terms``), or None: fencing
        is off, P reports no lease (stock: logged once per engine) or the
        fields are malformed (logged, rate-limited); its read is then not fenced."""
        if not self.enabled:
            return None
        try:
            terms = lease_terms(params)
        except ValueError as exc:
            self._malformed_log.warning(
                1, "Request %s: ignoring malformed lease fields from P engine %s (%s); its read is "
                "not fenced", local_id, engine_id, exc,
            )  # fmt: skip
            return None
        if terms is None and engine_id not in self._fencing_off_engines:
            self._fencing_off_engines[engine_id] = None
            if len(self._fencing_off_engines) > MAX_LOGGED_ENGINES:
                del self._fencing_off_engines[next(iter(self._fencing_off_engines))]
            logger.info(
                "P engine %s reports no lease deadline (a stock prefill connector): reads from it are "
                "not fenced, as upstream",
                engine_id,
            )
        return terms

    def add(
        self,
        local_id: str,
        engine_id: str,
        instance: str,
        name: str,
        terms: LeaseTerms,
        chunk: tuple[int, int] | None = None,
    ) -> None:
        """Start a view of the lease ``name`` (P's id or tag) of P ``engine_id``,
        ``instance`` (empty: a plain P).  ``chunk``: the heartbeat chunk
        ``(key, version)`` naming the request (``HeartbeatTracker.chunk_of``
        right after tracking it)."""
        # Every field given: the plain tuple constructor builds the same NewView
        # without the NamedTuple's Python-level constructor (once per arriving request).
        self.new[local_id] = _new_view(
            NewView,
            (engine_id, instance, name, terms.deadline, terms.extension, terms.interval, terms.hello_version),
        )
        if chunk is not None:
            self.chunks[local_id] = chunk

    def drop(self, local_id: str) -> None:
        self.chunks.pop(local_id, None)
        if self.new.pop(local_id, None) is None and self.shipped.pop(local_id, None) is not None:
            self.dropped.append(local_id)

    def rechunk(self, engine_ids: Iterable[str], chunk_of: Callable[[str], tuple[int, int] | None]) -> None:
        """The heartbeat chunks of these engines were repacked: ship every
        viewed request's new chunk (rare: O(views), like the repack itself)."""
        engines = set(engine_ids)
        if not engines:
            return
        new = ((local_id, view.engine_id) for local_id, view in self.new.items())
        viewed = chain(self.shipped.items(), new)
        for local_id, engine_id in viewed:
            if engine_id in engines:
                chunk = chunk_of(local_id)
                if chunk is not None:
                    self.chunks[local_id] = chunk

    @property
    def pending(self) -> bool:
        """News for the workers that the next ``attach`` ships."""
        return bool(self.new or self.dropped or self.chunks)

    def attach(self, meta: object) -> None:
        if not self.pending:
            return  # the workers read no attribute as no news
        new = self.new
        updates = LeaseViewUpdates(new, self.dropped, self.chunks)
        if new:  # local id -> engine id of each, in one C-level pass
            self.shipped.update(zip(new, map(_engine_of, new.values()), strict=True))
        self.new, self.dropped, self.chunks = {}, [], {}
        setattr(meta, LEASE_VIEWS_ATTR, updates)
