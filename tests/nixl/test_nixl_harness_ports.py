"""The harness itself: a side-channel port lost to another process fails the start fast.

vLLM's scheduler waits without a timeout for its handshake listener to bind;
when the bind fails the listener thread dies and the engine would hang.
"""

from __future__ import annotations

import socket
import time

import pytest

pytest.importorskip("nixl")
from harness.nixl import EngineProcess, EngineSpec, SidePortTaken


def test_taken_side_channel_port_fails_fast(tmp_path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        spec = EngineSpec(role="P", stock=False, workdir=str(tmp_path), side_channel_port=port, name="p")
        t0 = time.monotonic()
        with pytest.raises(SidePortTaken, match=str(port)):
            EngineProcess(spec)
        assert time.monotonic() - t0 < 60, "the start should fail, not hang until the 90 s timeout"
