"""A rogue NIXL agent: loads P's agent metadata and sends it garbage.

It runs in its own process (a fork of the harness fork server) so a crash of
its UCX state cannot touch the test process.
"""

from __future__ import annotations

import os
import random
import time
import traceback
from typing import Any

from harness.procs import redirect_output
from vllm_nixl_lease._wire import HEARTBEAT_PREFIX as HB

from .fleet import context


def garbage(seed: int = 4) -> list[bytes]:
    """Every kind of malformed notification, plus ones that are well formed
    but name nothing P holds (they must be harmless too)."""
    rnd = random.Random(seed)
    out = [bytes(rnd.getrandbits(8) for _ in range(rnd.randint(1, 200))) for _ in range(20)]
    out += [
        b"\xff\xfe\xfd",  # not UTF-8
        HB + b"\xff\xfe",  # heartbeat with non-UTF-8 ids
        HB + b",".join(rnd.randbytes(8).hex().encode() for _ in range(50)),  # unknown ids
        HB + b",,,,",
        HB,
        b"x:y",  # completion with a non-integer count
        b"x:",
        b":",
        b"no-colon-at-all",
        b"ghost-request:1",  # well formed, unknown request
        b"ghost:-1",
        b"ghost:99999999999999999999999",
        HB + b"a" * (1 << 20),  # 1 MiB heartbeat
        b"z" * (1 << 20),  # 1 MiB of nothing
        b"",
    ]
    return out


def rogue_main(workdir: str, p_agent_metadata: bytes, rounds: int, pause_s: float, conn: Any) -> None:
    """Send ``garbage()`` ``rounds`` times to P, then report what was sent."""
    redirect_output(os.path.join(workdir, "rogue-agent.log"))
    try:
        from nixl._api import nixl_agent, nixl_agent_config

        agent = nixl_agent(f"rogue-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
        peer = agent.add_remote_agent(p_agent_metadata)
        peer = peer.decode() if isinstance(peer, bytes) else peer
        sent = failed = nbytes = 0
        for _ in range(rounds):
            for msg in garbage():
                try:
                    agent.send_notif(peer, msg)
                    sent += 1
                    nbytes += len(msg)
                except Exception:
                    failed += 1
            time.sleep(pause_s)
        conn.send(("ok", {"sent": sent, "failed": failed, "bytes": nbytes}))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    conn.recv()  # keep the agent alive until the test has looked at P


def run_rogue(workdir: str, p_agent_metadata: bytes, rounds: int = 5, pause_s: float = 0.2) -> Any:
    """Start the rogue; returns (process, pipe). ``finish_rogue`` collects it."""
    ctx = context()
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(
        target=rogue_main, args=(workdir, p_agent_metadata, rounds, pause_s, theirs), daemon=True
    )
    proc.start()
    theirs.close()
    return proc, mine


def agent_result(conn: Any, timeout: float, what: str) -> dict[str, Any]:
    """The ``("ok", payload)`` a child agent sends when it is done; its traceback raised otherwise."""
    if not conn.poll(timeout):
        raise TimeoutError(f"{what} did not finish")
    status, payload = conn.recv()
    if status != "ok":
        raise RuntimeError(payload)
    return payload


def finish_rogue(proc: Any, conn: Any, timeout: float = 60.0) -> dict[str, Any]:
    try:
        return agent_result(conn, timeout, "rogue agent")
    finally:
        try:
            conn.send("bye")
        except Exception:
            pass
        proc.join(5)
        if proc.is_alive():
            proc.kill()
