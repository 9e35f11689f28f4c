"""One stand-in for the state of vLLM's NIXL worker, shared by the differential
tests, the connector tests and the benchmark.

Workers are built the way vLLM's own unit tests build them: ``object.__new__``
plus the attributes the lease path reads, with a fake NIXL wrapper.  Upstream's
real methods (``_get_new_notifs``, ``_reap_expired_send_leases``,
``_send_heartbeats``, ``start_load_kv``, ...) then run unchanged on them.
Set ``VLLM_TARGET_DEVICE=cpu`` before calling (vLLM's CUDA wheel needs it).
"""

from __future__ import annotations

import importlib
import queue
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

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

    def deliver(self, agent: str, *messages: bytes) -> None:
        self.inbox.setdefault(agent, []).extend(messages)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        out, self.inbox = self.inbox, {}
        return out

    def send_notif(self, agent_name: str, notif_msg: bytes) -> None:
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
        self.loaded.remove(agent)


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
    w = object.__new__(cls or stock_worker_class())
    w.nixl_wrapper = nixl if nixl is not None else FakeNixlWrapper()
    w.tp_rank = 0
    w.world_size = 1
    w.pcp_rank = 0
    w.pcp_dcp_sharded = False
    w.transfer_topo = object()
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
    # Read by the stock __del__ -> shutdown path.
    w.src_xfer_handles_by_block_size = {}
    w.src_xfer_handles_by_tp_ratio = {}
    w._dram_src_handles_by_tp_ratio = {}
    w._dram_src_handles_by_block_size = {}
    w._kv_unregistered = True
    w._registered_descs = []
    return w
