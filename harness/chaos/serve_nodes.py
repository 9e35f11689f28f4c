"""The serve lane's fleet: 1 P and 2 D real `vllm serve` processes, each on its
own network-namespace host on one bridge, behind `vllm-router` in the root
namespace.

A ``ServeNode`` is "p0" or "d1" for the whole run, across SIGSTOPs, kills and
restarts; it offers the nemesis what a harness ``Node`` does (``state``,
``eng``, ``pids``, ``freeze``, ``thaw``, ``kill``, ``restart``).  A restart
keeps the node's host, ports and CPU; ``same_id`` keeps the connector's
engine id, otherwise the new process gets a new one.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from harness.procs import Managed, descendants, free_ports, signal_tree
from harness.serve import client
from harness.serve.assets import ensure_assets
from harness.serve.launcher import BUILD, LOGGING_CONFIG, VENV_CPU, PDConfig, router_argv, server

from .history import History
from .nodes import CRASH_FID_BASE, Node, last_fatal, rss_kb

ROLES = {"prefill": "P", "decode": "D"}
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # vLLM's name, then its old one
LEASES_ACTIVE = "vllm:nixl_lease_active"  # P, ours only
D_REQUESTS = {
    "requests_running": "vllm:num_requests_running",
    "requests_waiting": "vllm:num_requests_waiting",
}


class ServeNode:
    def __init__(
        self, hosts: Any, hist: History, cfg: PDConfig, name: str, role: str, host: str, cpu: int, conn: str
    ) -> None:
        self.hosts, self.hist, self.cfg = hosts, hist, cfg
        self.name, self.role, self.host, self.cpu, self.conn = name, role, host, cpu, conn
        self.kind = "prefill" if role == "P" else "decode"
        self.port, self.side = free_ports(2)
        self.eng: Managed | None = None
        self.engine_id = f"{name}-g0"
        self.gen = 0
        self.state = "down"  # up | stopped | down
        self.model_dir = ensure_assets(VENV_CPU / "bin" / "python", BUILD)  # cached after the first
        self.logging_cfg = cfg.log_dir / "logging.json"
        self.logging_cfg.write_text(json.dumps(LOGGING_CONFIG))

    @property
    def url(self) -> str:
        return f"http://{self.hosts.ip(self.host)}:{self.port}"

    def launch(self) -> None:
        """Start the server (returns at once; ``wait_up`` waits for its health)."""
        extra = ["--num-gpu-blocks-override", str(self.cfg.num_blocks)]
        log = self.cfg.log_dir / f"{self.name}-g{self.gen}.log"
        self.eng = server(
            self.cfg, self.kind, self.model_dir, self.logging_cfg, self.hosts.ip(self.host), self.port,
            self.side, self.cpu, extra, log, self.conn, (self.hosts, self.host), self.engine_id,
        )  # fmt: skip

    def wait_up(self, timeout: float) -> None:
        eng = self.eng
        assert eng is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not eng.alive():
                raise RuntimeError(f"{self.name} exited ({eng.popen.returncode}):\n{eng.log_tail(15)}")
            if client.healthy(self.url):
                self.state = "up"
                self._record(up=True)
                return
            time.sleep(1.0)
        raise TimeoutError(f"{self.name} not healthy after {timeout:.0f}s:\n{eng.log_tail(15)}")

    def _record(self, up: bool, t: float | None = None) -> None:
        self.hist.add(
            "engine", t=t, name=self.name, role=self.role, host=self.host, engine_id=self.engine_id,
            pid=self.eng.pid if self.eng else 0, gen=self.gen, up=up,
        )  # fmt: skip

    def pids(self) -> list[int]:
        """The server's whole tree: API server, engine core and its workers."""
        return [] if self.eng is None else [self.eng.pid, *descendants(self.eng.pid)]

    def freeze(self) -> None:
        assert self.eng is not None
        self.state = "stopped"
        signal_tree(self.eng.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        if self.eng is not None and self.state == "stopped":
            signal_tree(self.eng.pid, signal.SIGCONT)
            self.state = "up"

    def kill(self) -> None:
        """kill -9 of the whole tree."""
        self.state = "down"
        if self.eng is not None:
            down_at = self.hist.now()  # what the tree runs stops here, however long the reaping
            self.eng.kill()
            self._record(up=False, t=down_at)

    def restart(self, same_id: bool) -> None:
        if self.eng is not None and self.eng.alive():
            self.eng.kill()
        self.gen += 1
        if not same_id:
            self.engine_id = f"{self.name}-g{self.gen}"
        self.launch()
        self.wait_up(self.cfg.startup_timeout_s)

    def sizes(self, phase: str) -> None:
        """A ``sizes`` event: blocks in use (P: leases held, ours), RSS of the tree."""
        text = client.metrics_text(self.url, timeout=5.0) if self.state == "up" else ""
        sizes: dict[str, int] = {}
        if text:
            usage = next((client.metric_sum(text, n) for n in KV_USAGE if n in text), 0.0)
            sizes["kv_blocks_used"] = round(usage * self.cfg.num_blocks)
            if self.role == "P" and LEASES_ACTIVE in text:
                sizes["leases_active"] = round(client.metric_sum(text, LEASES_ACTIVE))
            if self.role == "D":  # a request never let go shows here, or in its blocks above
                for key, name in D_REQUESTS.items():
                    sizes[key] = round(client.metric_sum(text, name))
        rss = sum(rss_kb(p) for p in self.pids()) if self.state == "up" else 0
        self.hist.add(
            "sizes", engine=self.name, engine_id=self.engine_id, phase=phase, sizes=sizes, keys={}, rss_kb=rss
        )


class Router:
    """`vllm-router` in the root namespace, round robin over the fleet's P and Ds."""

    def __init__(self, nodes: list[ServeNode], log_dir: Path) -> None:
        self.port, prom = free_ports(2)
        ps = [n.url for n in nodes if n.role == "P"]
        ds = [n.url for n in nodes if n.role == "D"]
        self.proc = Managed(
            "router", router_argv(ps, ds, self.port, prom), dict(os.environ), log_dir / "router.log"
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_up(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.proc.alive():
                raise RuntimeError(f"router exited:\n{self.proc.log_tail(15)}")
            if client.healthy(self.url):
                return
            time.sleep(0.5)
        raise TimeoutError(f"router not healthy after {timeout:.0f}s")


class CrashWatch:
    """Servers that died with no fault killing them: each is a ``crash`` (its log's
    last fatal line) and a crash fault that heals once a restart under its engine
    id is up, as an orchestrator restarts a crashed pod."""

    def __init__(self, nodes: dict[str, ServeNode], hist: History) -> None:
        self.nodes, self.hist = nodes, hist
        self.threads: list[threading.Thread] = []

    def check(self) -> None:
        for n in self.nodes.values():
            eng = n.eng
            if n.state != "up" or eng is None or eng.alive():
                continue
            n.state = "down"
            fid = CRASH_FID_BASE + Node.crash_seq()
            why = last_fatal(str(eng.log_path))
            self.hist.add("crash", engine=n.name, engine_id=n.engine_id, pid=eng.pid, why=why)
            self.hist.add(
                "fault", fid=fid, kind="crash", hosts=[], engines=[n.name], until=None, detail={"why": why}
            )
            n._record(up=False)
            t = threading.Thread(target=self._restart, args=(n, fid), name=f"restart-{n.name}", daemon=True)
            self.threads.append(t)
            t.start()

    def _restart(self, n: ServeNode, fid: int) -> None:
        try:
            for _ in range(3):
                try:
                    n.restart(same_id=True)
                    return
                except Exception as exc:  # noqa: BLE001 - tried again, as a restart loop would
                    self.hist.add(
                        "error", engine=n.name, text=f"restart after crash failed: {str(exc)[-300:]}"
                    )
        finally:
            self.hist.add("heal", fid=fid)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.1, deadline - time.monotonic()))
