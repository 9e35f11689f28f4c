"""Fixtures shared by every test folder (each folder's own conftest.py marks and equips its tests)."""

from __future__ import annotations

import pytest

import harness  # noqa: F401  (sets VLLM_TARGET_DEVICE before anything imports vLLM)


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
