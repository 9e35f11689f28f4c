"""Both implementations of the lease core, each imported directly (not through its chooser), so
one test can run the Cython module and its pure-Python twin side by side."""

from __future__ import annotations

import importlib
import os
import types
from typing import NamedTuple

import pytest


class ViewFields(NamedTuple):
    """The adapter's ``NewView``, field for field (the cores read a view by position), without
    importing vLLM."""

    engine_id: str
    instance: str
    name: str
    deadline: float
    extension: float
    interval: float | None
    hello_version: int = 1


# Each implementation's module suffix: the Cython module and its twin share the stem.
MODULE_SUFFIX = {"cython": "_c", "python": "_py"}
IMPLEMENTATIONS = tuple(MODULE_SUFFIX)


def load_core(name: str) -> types.SimpleNamespace:
    """The core classes of one implementation, imported directly (not via the chooser).

    A missing Cython module skips the test unless VLLM_NIXL_LEASE_REQUIRE_EXTENSIONS=1;
    a missing twin is always an error."""
    suffix = MODULE_SUFFIX[name]
    try:
        lease = importlib.import_module(f"vllm_nixl_lease.prefill._lease_table{suffix}")
        router = importlib.import_module(f"vllm_nixl_lease.prefill._notification_router{suffix}")
        heartbeat = importlib.import_module(f"vllm_nixl_lease.decode._heartbeat_tracker{suffix}")
        intake = importlib.import_module(f"vllm_nixl_lease.decode._intake{suffix}")
        views = importlib.import_module(f"vllm_nixl_lease.decode._lease_views{suffix}")
        view_updates = importlib.import_module(f"vllm_nixl_lease.decode._view_updates{suffix}")
    except ImportError as exc:
        if name == "python" or os.environ.get("VLLM_NIXL_LEASE_REQUIRE_EXTENSIONS") == "1":
            raise
        pytest.skip(f"Cython extension not built: {exc}")
    return types.SimpleNamespace(
        name=name,
        LeaseTable=lease.LeaseTable,
        NotificationRouter=router.NotificationRouter,
        HeartbeatTracker=heartbeat.HeartbeatTracker,
        encode_heartbeats=heartbeat.encode_heartbeats,
        Intake=intake.Intake,
        LeaseViews=views.LeaseViews,
        ReadClaims=views.ReadClaims,  # the twin's is read_claims.py's
        pack_views=view_updates.pack_views,
        unpack_views=view_updates.unpack_views,
    )
