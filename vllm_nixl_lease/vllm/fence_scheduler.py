"""Read fencing, scheduler side.

P: ``request_finished`` adds the lease deadline (this scheduler process's
``perf_counter``, the clock the handshake listener echoes for D's offset
estimate) and the heartbeat extension to the ``kv_transfer_params`` it returns.
Stock D ignores the extra keys.

D: ``on_new_request`` turns those keys into a lease view for the workers
(``fence_worker.py``); the metadata of the next step carries the new views and
the ids whose tracking ended, so the workers' tables stay bounded.
"""

from __future__ import annotations

import math
from typing import Any

from vllm.logger import init_logger

from .metadata import LEASE_VIEWS_ATTR, LeaseViewUpdates

logger = init_logger(__name__)

PARAM_LEASE_DEADLINE = "remote_lease_deadline"
PARAM_LEASE_EXTENSION = "remote_lease_extension"


class LeaseParamsSchedulerMixin:
    """P side (pull): tell D when its lease ends and how far a heartbeat moves it."""

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        delay_free, params = super().request_finished(request, block_ids)  # type: ignore[misc]
        if delay_free and params and params.get("do_remote_prefill"):
            deadline = self._reqs_need_send.get(request.request_id)  # type: ignore[attr-defined]
            if deadline is not None:
                params[PARAM_LEASE_DEADLINE] = deadline
                params[PARAM_LEASE_EXTENSION] = self.lease_config.lease_extension  # type: ignore[attr-defined]
        return delay_free, params


class LeaseViewSchedulerMixin:
    """D side: collect lease views of newly tracked requests for the workers."""

    def _setup_lease_views(self) -> None:
        self._views_new: dict[str, tuple[str, str, float, float]] = {}
        self._views_dropped: list[str] = []
        self._views_shipped: set[str] = set()
        self._fencing_off_engines: set[str] = set()

    def _add_lease_view(self, local_id: str, engine_id: str, remote_id: str, params: dict[str, Any]) -> None:
        # Push mode: P writes into D, D never reads, nothing to fence.
        if not self.lease_config.lease_fencing or self._TRANSFER_MODE != "pull":  # type: ignore[attr-defined]
            return
        deadline = params.get(PARAM_LEASE_DEADLINE)
        extension = params.get(PARAM_LEASE_EXTENSION)
        if _finite(deadline) and _finite(extension) and extension > 0:
            self._views_new[local_id] = (engine_id, remote_id, float(deadline), float(extension))
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

    def _drop_lease_view(self, local_id: str) -> None:
        if self._views_new.pop(local_id, None) is None and local_id in self._views_shipped:
            self._views_shipped.discard(local_id)
            self._views_dropped.append(local_id)

    def _attach_lease_views(self, meta: Any) -> None:
        updates = LeaseViewUpdates(self._views_new, self._views_dropped)
        self._views_shipped.update(self._views_new)
        self._views_new, self._views_dropped = {}, []
        setattr(meta, LEASE_VIEWS_ATTR, updates)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
