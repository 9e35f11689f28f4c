"""P aborted inside UCX when a D dies while its READs from P are in flight (seen in the
chaos runs; this tool reproduces it without vLLM).

Raw NIXL agents (no vLLM), UCX over TCP on loopback.  One P agent registers a
buffer and only serves; D agents, one after another, READ it in many
descriptors with several transfers in flight, and each D is SIGKILLed at a
random moment while reading.  Each round then checks whether P survived; a
dead P is counted with its exit status and restarted.

Over TCP a host-memory READ is UCX's software GET emulation ("get/am/bcopy"):
D sends a GET request per fragment and P answers from inside its progress
loop (``ucp_get_req_handler``), also for an endpoint that has already failed.
That answer's send error ends in ``ucs_fatal("unexpected error: ...")`` in
``ucp_request_try_send`` (or in the failed transport's stub), so P aborts.

    .venv/bin/python -m tools.ucx_get_abort [--rounds 12] [--block-kb 16] \
        [--blocks 4096] [--in-flight 4] [--stop-first] [--p-notifies] \
        [--threads 4] [--d-threads N] [--error-mode none|peer] [--json out.json]
    .venv/bin/python -m tools.ucx_get_abort --engines [--cut] [--rounds 12] \
        [--requests 16] [--tokens 1024] [--threads 4] [--d-threads N]

``--engines`` runs harness engines (vLLM's NIXL worker, our connector) instead
of raw agents; with ``--cut`` (root, ``harness.netns``) P and D run on two
network-namespace hosts and D is killed behind a cut of its host, then the
cut heals, as ``make chaos`` does.

Environment variables (``UCX_*``) pass through to both agents; ``UCX_TLS``
defaults to ``tcp``.  Not part of ``make test``: the abort is a race (rate in
docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import netns
from harness.nixl import scenarios as sc
from harness.nixl.fleet import Fleet, wait_for
from harness.nixl.progress import PROGRESS_DELAY_US, sleep_between_events

P_NOTIFY_PERIOD_S = 0.02
SETTLE_S = 1.5
CUT_BEFORE_KILL_S = 0.5
CUT_AFTER_KILL_S = 2.0
AFTER_HEAL_S = 4.0


def _agent(name: str, threads: int, error_mode: str | None) -> Any:
    sleep_between_events(PROGRESS_DELAY_US)
    from nixl._api import nixl_agent, nixl_agent_config

    params = {"num_threads": str(threads)}  # vLLM 0.33's nixl worker passes num_threads (4)
    if error_mode:
        params["ucx_error_handling_mode"] = error_mode
    agent = nixl_agent(name, nixl_agent_config(backends=[], capture_telemetry=True))
    agent.create_backend("UCX", params)
    return agent


def _serve_p(meta: Path, size_mb: int, notify: bool, threads: int, error_mode: str | None) -> None:
    """P: register a buffer, publish metadata, then only serve (and, with
    ``notify``, send a notification to every D it heard from, as our P's
    answerer does)."""
    import numpy as np

    agent = _agent("P", threads, error_mode)
    buf = np.ones(size_mb << 20, dtype=np.uint8)
    agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"))
    Path(f"{meta}.json").write_text(json.dumps({"addr": buf.ctypes.data, "bytes": buf.nbytes}))
    Path(f"{meta}.tmp").write_bytes(agent.get_agent_metadata())
    os.rename(f"{meta}.tmp", meta)
    peers: set[str] = set()
    while True:
        peers.update(agent.get_new_notifs())
        if notify:
            for peer in list(peers):
                try:
                    agent.send_notif(peer, b"n" * 64)
                except Exception:  # noqa: BLE001 - a dead D's agent: stop answering it
                    peers.discard(peer)
        time.sleep(P_NOTIFY_PERIOD_S)


def _read_d(
    meta: Path, name: str, block_kb: int, blocks: int, in_flight: int, threads: int, error_mode: str | None
) -> None:
    """D: READ ``blocks`` blocks of P's buffer per transfer, ``in_flight`` transfers
    at a time, for ever; prints READING once the first transfer completed
    (FAILED and exits if one ended otherwise)."""
    import numpy as np

    agent = _agent(name, threads, error_mode)
    info = json.loads(Path(f"{meta}.json").read_text())
    peer = agent.add_remote_agent(meta.read_bytes())
    size = block_kb << 10
    n = min(blocks, info["bytes"] // size)
    buf = np.zeros(n * size, dtype=np.uint8)
    agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"))
    local = agent.get_xfer_descs([(buf.ctypes.data + i * size, size, 0) for i in range(n)], "DRAM")
    remote = agent.get_xfer_descs([(info["addr"] + i * size, size, 0) for i in range(n)], "DRAM")
    agent.send_notif(peer, b"hello")
    handles: list[Any] = []
    done = 0
    while True:
        while len(handles) < in_flight:
            handle = agent.initialize_xfer("READ", local, remote, peer, b"r")
            agent.transfer(handle)
            handles.append(handle)
        for handle in list(handles):
            state = agent.check_xfer_state(handle)
            if state != "PROC":
                handles.remove(handle)
                handle.release()
                if state != "DONE":
                    print(f"FAILED {state}", flush=True)
                    return
                done += 1
                if done == 1:
                    print("READING", flush=True)
        time.sleep(0.001)


class _P:
    def __init__(self, cmd: list[str], env: dict[str, str], meta: Path, log: Path) -> None:
        for suffix in ("", ".json"):
            Path(f"{meta}{suffix}").unlink(missing_ok=True)
        self.proc = subprocess.Popen(cmd, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)
        while not meta.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"P exited ({self.proc.returncode}) before serving; see {log}")
            time.sleep(0.05)


def _fatal_lines(log: Path) -> list[str]:
    text = log.read_text(errors="replace") if log.exists() else ""
    return [ln.strip() for ln in text.splitlines() if "Fatal" in ln or "Assertion" in ln]


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    env = dict(os.environ, UCX_TLS=os.environ.get("UCX_TLS", "tcp"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path.cwd()), env.get("PYTHONPATH", "")]))
    meta, p_log, d_log = workdir / "p.meta", workdir / "p.log", workdir / "d.log"
    common = [str(args.threads), args.error_mode or ""]
    d_threads = str(args.threads if args.d_threads is None else args.d_threads)
    p_cmd = [
        sys.executable,
        "-m",
        "tools.ucx_get_abort",
        "--role",
        "p",
        str(meta),
        str(args.size_mb),
        "1" if args.p_notifies else "0",
        *common,
    ]
    p = _P(p_cmd, env, meta, p_log)
    deaths: list[dict[str, Any]] = []
    failed_reads: list[dict[str, Any]] = []  # rounds whose first READ did not complete
    t0 = time.monotonic()
    try:
        for i in range(args.rounds):
            d = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tools.ucx_get_abort",
                    "--role",
                    "d",
                    str(meta),
                    f"D{i}",
                    str(args.block_kb),
                    str(args.blocks),
                    str(args.in_flight),
                    d_threads,
                    args.error_mode or "",
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=d_log.open("ab"),
            )
            assert d.stdout is not None
            line = b""
            while not line.startswith((b"READING", b"FAILED")) and d.poll() is None:
                line = d.stdout.readline()
            reading = line.startswith(b"READING")
            if not reading:
                failed_reads.append({"round": i, "d_said": line.decode(errors="replace").strip()})
            time.sleep(random.uniform(0, args.kill_within_s))
            if args.stop_first:
                d.send_signal(signal.SIGSTOP)
                time.sleep(2.0)
            d.kill()
            d.wait()
            time.sleep(SETTLE_S)
            if p.proc.poll() is not None:
                deaths.append({"round": i, "returncode": p.proc.returncode, "d_was_reading": reading})
                p = _P(p_cmd, env, meta, p_log)
    finally:
        p.proc.kill()
        p.proc.wait()
    return {
        "rounds": args.rounds,
        "p_deaths": len(deaths),
        "deaths": deaths,
        "rounds_without_a_read": failed_reads,
        "p_fatal_lines": _fatal_lines(p_log),
        "wall_s": round(time.monotonic() - t0, 1),
        "ucx_tls": env["UCX_TLS"],
        "args": {k: v for k, v in vars(args).items() if k not in ("role", "role_args", "json", "workdir")},
    }


def run_engines(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The same with harness engines (vLLM's NIXL worker, our connector on both
    sides): a fresh D per round reads ``args.requests`` prefilled requests of
    ``args.tokens`` tokens each and is SIGKILLed while reading.  With
    ``args.cut`` P and D run on two network-namespace hosts and D is killed
    behind a cut of its host (link down ``CUT_BEFORE_KILL_S`` before the kill,
    healed ``CUT_AFTER_KILL_S`` after it), as in ``make chaos``."""
    env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    env.setdefault("UCX_TLS", "tcp")
    p_extra = {"num_threads": args.threads}  # vLLM's kv_connector_extra_config key
    d_extra = {"num_threads": args.threads if args.d_threads is None else args.d_threads}
    blocks = 16 + 4 * args.requests * (args.tokens // 32 + 1)  # rounds overlap unread leases
    common = {"env": env, "num_blocks": blocks, "progress_delay_us": PROGRESS_DELAY_US}
    deaths: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        hosts = stack.enter_context(netns.TwoHosts()) if args.cut else None
        fleet = stack.enter_context(Fleet(str(workdir), lease=sc.LEASE, hosts=hosts))
        p_host, d_host = ("p", "d") if hosts else (None, None)

        def start_p(gen: int) -> Any:
            return fleet.start("P", f"p{gen}", host=p_host, extra=p_extra, **common)

        p = start_p(0)
        for i in range(args.rounds):
            d = fleet.start("D", f"d{i}", host=d_host, extra=d_extra, **common)
            ids, params = sc.prefill(p, f"r{i}", args.requests, tokens=args.tokens)
            sc.hand_to_d(d, params, hold=False, tokens=args.tokens)

            def reading(d: Any = d, ids: list[str] = ids) -> bool:
                reqs = d.report()["reqs"]
                return any("admitted_t" in reqs[sc.d_id(r)] for r in ids)

            wait_for(reading, 30, poll=0.02, what="D posting its first READ")
            time.sleep(random.uniform(0, args.kill_within_s))
            if hosts:
                hosts.cut("d")
                time.sleep(CUT_BEFORE_KILL_S)
                d.kill()
                time.sleep(CUT_AFTER_KILL_S)
                hosts.heal("d")
                time.sleep(AFTER_HEAL_S)
            else:
                d.kill()
                time.sleep(SETTLE_S)
            if not p.proc.is_alive():
                deaths.append({"round": i, "returncode": p.proc.exitcode, "fatal": _fatal_lines(Path(p.log))})
                p = start_p(i + 1)
    return {
        "rounds": args.rounds,
        "p_deaths": len(deaths),
        "deaths": deaths,
        "wall_s": round(time.monotonic() - t0, 1),
        "ucx_tls": env["UCX_TLS"],
        "args": {k: v for k, v in vars(args).items() if k not in ("role", "role_args", "json", "workdir")},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--size-mb", type=int, default=64, help="P's registered buffer")
    ap.add_argument("--block-kb", type=int, default=16, help="bytes per READ descriptor")
    ap.add_argument("--blocks", type=int, default=4096, help="descriptors per transfer")
    ap.add_argument("--in-flight", type=int, default=4, help="transfers D keeps posted")
    ap.add_argument(
        "--kill-within-s",
        type=float,
        default=0.3,
        help="kill D within this long (uniform) after its first READ ended",
    )
    ap.add_argument("--stop-first", action="store_true", help="SIGSTOP D for 2 s before the SIGKILL")
    ap.add_argument("--p-notifies", action="store_true", help="P sends a notification to each D every 20 ms")
    ap.add_argument("--threads", type=int, default=4, help="NIXL UCX backend num_threads (vLLM: 4)")
    ap.add_argument("--d-threads", type=int, default=None, help="D's num_threads, if not --threads")
    ap.add_argument(
        "--error-mode",
        choices=["none", "peer"],
        default=None,
        help="NIXL's ucx_error_handling_mode, both agents (NIXL's default: peer)",
    )
    ap.add_argument("--engines", action="store_true", help="harness engines (vLLM) instead of raw agents")
    ap.add_argument("--cut", action="store_true", help="--engines: on two netns hosts, D killed behind a cut")
    ap.add_argument("--requests", type=int, default=16, help="--engines: requests D reads per round")
    ap.add_argument("--tokens", type=int, default=1024, help="--engines: tokens per request (32 per block)")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--workdir", type=Path, help="keep the processes' logs here (default: a temporary folder)"
    )
    ap.add_argument("--role", choices=["p", "d"], help=argparse.SUPPRESS)
    ap.add_argument("role_args", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "p":
        meta, size_mb, notify, threads, mode = args.role_args
        _serve_p(Path(meta), int(size_mb), notify == "1", int(threads), mode or None)
        return 0
    if args.role == "d":
        meta, name, block_kb, blocks, in_flight, threads, mode = args.role_args
        _read_d(Path(meta), name, int(block_kb), int(blocks), int(in_flight), int(threads), mode or None)
        return 0
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
        out = (run_engines if args.engines else run)(args, args.workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="ucx-get-abort-") as tmp:
            out = (run_engines if args.engines else run)(args, Path(tmp))
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
