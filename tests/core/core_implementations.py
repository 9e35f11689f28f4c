"""Both implementations of the lease core, each imported directly (not through its chooser), so
one test can run the Cython module and its pure-Python twin side by side."""

from __future__ import annotations

import importlib
import os
import types

import pytest

IMPLEMENTATIONS = ("cython", "python")


def load_core(name: str) -> types.SimpleNamespace:
    """The core classes of one implementation, imported directly (not via the chooser)."""
    if name == "python":
        lease = importlib.import_module("vllm_nixl_lease.prefill._lease_table_py")
        router = importlib.import_module("vllm_nixl_lease.prefill._notification_router_py")
        heartbeat = importlib.import_module("vllm_nixl_lease.decode._heartbeat_tracker_py")
        return types.SimpleNamespace(
            name=name,
            LeaseTable=lease.LeaseTable,
            NotificationRouter=router.NotificationRouter,
            HeartbeatTracker=heartbeat.HeartbeatTracker,
            encode_heartbeats=heartbeat.encode_heartbeats,
        )
    try:
        lease = importlib.import_module("vllm_nixl_lease.prefill._lease_table_c")
        router = importlib.import_module("vllm_nixl_lease.prefill._notification_router_c")
        heartbeat = importlib.import_module("vllm_nixl_lease.decode._heartbeat_tracker_c")
    except ImportError as exc:
        if os.environ.get("VLLM_NIXL_LEASE_REQUIRE_EXTENSIONS") == "1":
            raise
        pytest.skip(f"Cython extension not built: {exc}")
    return types.SimpleNamespace(
        name=name,
        LeaseTable=lease.LeaseTable,
        NotificationRouter=router.NotificationRouter,
        HeartbeatTracker=heartbeat.HeartbeatTracker,
        encode_heartbeats=heartbeat.encode_heartbeats,
    )
