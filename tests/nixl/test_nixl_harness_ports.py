"""The harness itself: a side-channel port lost to another process fails the start fast.

vLLM's scheduler waits without a timeout for its handshake listener to bind;
when the bind fails the listener thread dies and the engine would hang.
"""

from __future__ import annotations

import signal
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


def test_signals_never_reach_a_process_that_took_over_a_dead_engines_pid(tmp_path) -> None:
    """The harness signals engines through a pidfd: once an engine has exited its pid may
    belong to another process (pids wrap within minutes when engines come and go: pid_max
    32768, ~53 threads per engine), which a bare ``os.kill(pid)`` would stop or kill; the chaos
    lane kills engines that may have crashed already."""
    from harness.nixl import Fleet

    with Fleet(str(tmp_path)) as fleet:
        p = fleet.start("P", "p")
        assert p.send_signal(0), "a live engine takes signals"
        p.kill()
        assert not p.proc.is_alive()
        assert not p.send_signal(signal.SIGKILL), "an exited engine's pid is never signalled"
        p.freeze()  # a no-op now, not a SIGSTOP to whoever holds the pid
