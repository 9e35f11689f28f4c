"""Shared fixtures: every core test runs against both implementations."""

from __future__ import annotations

import importlib
import os
import types

import pytest

import harness  # noqa: F401  (sets VLLM_TARGET_DEVICE before anything imports vLLM)

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


@pytest.fixture(params=IMPLEMENTATIONS)
def core(request: pytest.FixtureRequest) -> types.SimpleNamespace:
    return load_core(request.param)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch):
    """``time.perf_counter`` replaced by a hand-driven ``fake_clock.Clock``."""
    import time

    from harness.fake_clock import Clock

    c = Clock()
    monkeypatch.setattr(time, "perf_counter", c)
    return c


@pytest.fixture
def lease_logs(caplog: pytest.LogCaptureFixture):
    """caplog for our loggers: they hand records to the "vllm" logger, which
    vLLM may have configured not to propagate to the root (caplog's) handler."""
    import logging

    ours = logging.getLogger("vllm_nixl_lease")
    saved = ours.handlers, ours.level, ours.propagate
    # Only caplog's handler: the forwarder could reach it a second time via the root.
    ours.handlers, ours.propagate = [caplog.handler], False
    ours.setLevel(logging.DEBUG)
    try:
        yield caplog
    finally:
        ours.handlers, ours.propagate = saved[0], saved[2]
        ours.setLevel(saved[1])
