"""One small fake of ``vllm_nixl_lease.vllm.upstream.UpstreamWorker``: the
lease components are unit-tested against it, with no vLLM worker at all."""

from __future__ import annotations

import queue
from collections import defaultdict
from concurrent.futures import Future
from typing import Any

import vllm_support  # noqa: F401  (sets VLLM_TARGET_DEVICE before vLLM loads)

from tools.upstream_stub import FakeNixlWrapper
from vllm_nixl_lease.vllm.stats import LeaseKVConnectorStats


class FakeUpstreamWorker:
    """Exactly the attributes and methods the protocol names."""

    def __init__(self) -> None:
        self.nixl_wrapper = FakeNixlWrapper()
        self.xfer_stats = LeaseKVConnectorStats()
        self.tp_rank = 0
        self._remote_agents: dict[str, dict[int, str]] = defaultdict(dict)
        self._engine_clock_offset: dict[str, float] = {}
        self._engine_last_active: dict[str, float] = {}
        self._recving_transfers: dict[str, Any] = {}
        self._recv_failures: set[str] = set()
        self._hb_handshake_notif_only = False
        self._invalid_remote_engines: set[str] = set()
        self._pending_completion_notifs: queue.Queue[bytes] = queue.Queue()
        # engine id -> future returned by _ensure_handshake (None: connected)
        self.handshakes: dict[str, Future[Any] | None] = {}
        self.failed_transfers: list[tuple[str, bool]] = []

    def connect(self, engine_id: str, ranks: int = 1, offset: float = 0.0) -> None:
        self._remote_agents[engine_id] = {r: f"{engine_id}-agent-{r}" for r in range(ranks)}
        self._engine_clock_offset[engine_id] = offset

    def _ensure_handshake(self, engine_id: str, *args: Any) -> Future[Any] | None:
        return self.handshakes.get(engine_id)

    def _mark_remote_engine_invalid(self, engine_id: str, now: float) -> None:
        self._invalid_remote_engines.add(engine_id)

    def _handle_failed_transfer(
        self, req_id: str, handle: Any, failures: Any, record_failed_transfer: bool = True
    ) -> Any:
        failures.add(req_id)
        self.failed_transfers.append((req_id, record_failed_transfer))
        return True

    def count(self, key: str) -> int:
        return sum(self.xfer_stats.data.get(key, []))
