"""The one fake of vLLM's NIXL worker, shared by the unit tests and the benchmarks.

- ``FakeNixlWrapper``: NIXL's agent (notifications, agent metadata), in memory.
- ``FakeUpstreamWorker``: exactly what ``vllm_nixl_lease.adapter.upstream.UpstreamWorker``
  names, for unit tests of one adapter component with no vLLM worker at all.
- ``make_upstream_worker``: a real vLLM worker class (stock or ours) built the
  way vLLM's own unit tests build them, ``object.__new__`` plus the attributes
  the lease path and shutdown read, around a ``FakeNixlWrapper``.  Upstream's
  real methods (``_get_new_notifs``, ``_reap_expired_send_leases``,
  ``_send_heartbeats``, ``start_load_kv``, shutdown, ...) then run unchanged.

Import ``harness`` (which sets ``VLLM_TARGET_DEVICE=cpu``) before vLLM.
"""

from __future__ import annotations

import importlib
import queue
import threading
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from vllm_nixl_lease.adapter.stats import LeaseKVConnectorStats

NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"


class FakeNixlWrapper:
    """Hands out queued notifications; records (or only counts) sends; can fail sends."""

    def __init__(self, keep_sent: bool = True, name: str = "fake-agent") -> None:
        self.name = name
        self.loaded: set[str] = set()  # agents added by add_remote_agent
        self.inbox: dict[str, list[bytes]] = {}
        self.sent: list[tuple[str, bytes]] = []
        self.sent_bytes = 0
        self.fail_sends = 0
        self.fail_error: type[Exception] = RuntimeError
        self._keep_sent = keep_sent
        self.xfer_states: dict[Any, str] = {}
        self.refuse_release: set[Any] = set()
        self.released: list[Any] = []
        # Steps: the worker polls notifications once per step (get_new_notifs); a
        # step that calls send_notif at least once is a sending step.
        self.polls = 0
        self.send_steps = 0
        self._sent_in = -1  # the poll count when send_notif was last called

    def deliver(self, agent: str, *messages: bytes) -> None:
        self.inbox.setdefault(agent, []).extend(messages)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        self.polls += 1
        out, self.inbox = self.inbox, {}
        return out

    def send_notif(self, agent_name: str, notif_msg: bytes) -> None:
        if self._sent_in != self.polls:
            self._sent_in = self.polls
            self.send_steps += 1
        if self.fail_sends > 0:
            self.fail_sends -= 1
            raise self.fail_error("fake send failure")
        self.sent_bytes += len(notif_msg)
        if self._keep_sent:
            self.sent.append((agent_name, notif_msg))

    # Agent metadata: b"fake-md:<name>" stands for NIXL's connection info.
    def get_partial_agent_metadata(
        self, descs: Any, inc_conn_info: bool = False, backends: Any = ()
    ) -> bytes:
        return b"fake-md:" + self.name.encode()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        if not metadata.startswith(b"fake-md:"):
            raise ValueError("not agent metadata")
        name = metadata[len(b"fake-md:") :]
        self.loaded.add(name.decode())
        return name

    def remove_remote_agent(self, agent: str) -> None:
        # Agents a test connected by hand (``_remote_agents``) were never added here.
        self.loaded.discard(agent)

    def release_dlist_handle(self, handle: Any) -> None:
        pass

    # Transfers: a test sets ``xfer_states[handle]`` ("PROC", "DONE", "ERR");
    # a handle in ``refuse_release`` cannot be cancelled (NIXL raises).
    def check_xfer_state(self, handle: Any) -> str:
        return self.xfer_states.get(handle, "DONE")

    def get_xfer_telemetry(self, handle: Any) -> Any:
        return None

    def release_xfer_handle(self, handle: Any) -> None:
        if handle in self.refuse_release:
            raise RuntimeError("fake: transfer cannot be cancelled")
        self.released.append(handle)


def stock_worker_class(name: str = "NixlPullConnectorWorker") -> type:
    """One of vLLM's worker classes by name (``NixlPullConnectorWorker``, ``NixlPushConnectorWorker``,
    ``NixlBaseConnectorWorker``)."""
    module = {"NixlPullConnectorWorker": "pull_worker", "NixlPushConnectorWorker": "push_worker"}.get(
        name, "base_worker"
    )
    return getattr(importlib.import_module(f"{NIXL}.{module}"), name)


def make_upstream_worker(
    cls: type | None = None, lease_extension: float = 20, nixl: FakeNixlWrapper | None = None
) -> Any:
    """A worker of ``cls`` (a vLLM worker class or a subclass; default the pull worker)
    with just the state the lease path, heartbeats and stats read."""
    stats = importlib.import_module(f"{NIXL}.stats")
    w: Any = object.__new__(cls or stock_worker_class())
    w.nixl_wrapper = nixl if nixl is not None else FakeNixlWrapper()
    w.engine_id = "fake-engine"  # upstream's _log_failure names it
    w.tp_rank = 0
    w.world_size = 1
    w.pcp_rank = 0
    w.pcp_dcp_sharded = False
    w.transfer_topo = _FakeTopology()
    w._ready_requests = queue.Queue()
    w._reqs_to_send = {}
    w._reqs_to_process = set()
    w._replicated_pcp_done_sending = set()
    w._recving_metadata = {}
    w._recving_transfers = defaultdict(list)
    w.consumer_notification_counts_by_req = defaultdict(int)
    w.expected_consumer_notifications_by_req = {}
    w._lease_extension = lease_extension
    w.xfer_stats = stats.NixlKVConnectorStats()
    w._remote_agents = defaultdict(dict)
    w._engine_last_active = {}
    w._engine_clock_offset = {}
    w._engine_by_address = {}
    w._engine_ttl = 0
    w._handshake_lock = threading.RLock()
    w._handshake_futures = {}
    w._handshake_initiation_executor = ThreadPoolExecutor(1)
    w._hb_handshake_notif_only = False
    w._pending_completion_notifs = queue.Queue()
    w._push_writer_wake = threading.Event()
    # The push worker's WRITE bookkeeping (its get_transfer_results reads it).
    w._sending_transfers = defaultdict(list)
    w._send_failures = set()
    w._sending_transfers_lock = threading.Lock()
    w._evict_finished_inbox = queue.Queue()
    # Read by upstream's get_transfer_results (the whole step runs unchanged).
    w._failed_recv_reqs = queue.Queue()
    w._recv_failures = set()
    w._pending_recv_notifs = {}
    w.use_host_buffer = False
    w.use_mla = False
    w._is_hma_required = False
    w._has_mamba = False
    w.enable_permute_local_kv = False
    w.enable_heterogeneous_attn_post_process = False
    # Read by the stock __del__ -> shutdown path.
    w.src_xfer_handles_by_block_size = {}
    w.src_xfer_handles_by_tp_ratio = {}
    w._dram_src_handles_by_tp_ratio = {}
    w._dram_src_handles_by_block_size = {}
    w._kv_unregistered = True
    w._registered_descs = []
    # Read by _cleanup_remote_engine (shutdown, eviction, invalid engines).
    w.dst_xfer_side_handles = {}
    w._failed_remote_engines = set()
    w._invalid_remote_engines = set()
    w._invalid_engine_backoff = {}
    w._remote_registration_generations = {}
    for per_engine in (
        "kv_caches_base_addr",
        "dst_num_blocks",
        "dst_region_num_blocks",
        "dst_region_group_ids",
        "dst_uses_region_group_mapping",
        "dst_region_mem_types",
        "tp_mappings",
        "draft_tp_mappings",
    ):
        setattr(w, per_engine, {})
    return w


class _FakeTopology:
    """The slice of upstream's ``TransferTopology`` that engine clean-up calls."""

    def unregister_remote_engine(self, engine_id: str) -> None:
        pass


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
        self._invalid_engine_backoff: dict[str, tuple[float, float]] = {}
        self._recving_metadata: dict[str, Any] = {}
        self._handshake_futures: dict[str, Any] = {}
        self._handshake_lock = threading.RLock()
        self.evictions = 0
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

    def _evict_stale_engines(self) -> None:
        self.evictions += 1

    def _handle_failed_transfer(
        self, req_id: str, handle: Any, failures: Any, record_failed_transfer: bool = True
    ) -> Any:
        failures.add(req_id)
        self.failed_transfers.append((req_id, record_failed_transfer))
        return True

    def count(self, key: str) -> int:
        return sum(self.xfer_stats.data.get(key, []))
