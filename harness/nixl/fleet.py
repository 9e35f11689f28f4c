"""Parent side: start engines, talk to them, always clean up.

Engines are started from a ``forkserver`` that has imported vLLM once
(~20 s of CPU here); each engine is then a cheap fork of it.  Every wait has
a timeout; ``Fleet.__exit__`` stops engines politely and SIGKILLs whatever
does not stop.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

from harness.procs import PORT_TAKEN, free_ports, signal_tree

from .spec import EngineSpec

__all__ = ["EngineError", "EngineProcess", "Fleet", "SidePortTaken", "wait_for"]

_CTX: Any = None


def context() -> Any:
    global _CTX
    if _CTX is None:
        from multiprocessing import forkserver

        ctx = mp.get_context("forkserver")
        # Preloaded in the fork server, so engines start without importing vLLM.
        ctx.set_forkserver_preload(["harness.nixl.preload"])
        # Python 3.11's fork server does not inherit the parent's import path
        # before preloading (and swallows the ImportError): put the repository
        # root, which holds ``harness``, on the fork server's PYTHONPATH.
        repo_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (repo_dir, old) if p)
        try:
            forkserver.ensure_running()
        finally:
            if old is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = old
        _CTX = ctx
    return _CTX


class EngineError(RuntimeError):
    pass


class SidePortTaken(EngineError):
    """The handshake listener could not bind its port: another process took it first."""


class EngineProcess:
    """The parent's handle on one harness engine process (``engine.engine_main`` runs in it)."""

    def __init__(self, spec: EngineSpec, start_timeout: float = 90.0, wait: bool = True) -> None:
        """Fork the engine; with ``wait`` (default) return once it is ready,
        else call ``wait_started`` (several engines then start side by side)."""
        # Here, not at the top: engine imports torch and vLLM, which the test
        # process never needs (the fork server preloads them for the engines).
        from .engine import engine_main

        ctx = context()
        self.spec = spec
        self.start_timeout = start_timeout
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_main, args=(spec, child), daemon=True)
        self.proc.start()
        # Signals go through a pidfd: once the engine has exited (a crash, a kill) its pid can
        # be another process's, and a bare os.kill(pid) would stop or kill that one instead
        # (pids wrap within minutes when engines start and stop all the time).
        assert self.proc.pid is not None
        self._pidfd = os.pidfd_open(self.proc.pid)
        child.close()
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        try:
            self.info = self._reply(self.start_timeout, "start")
        except BaseException:
            self.proc.kill()  # never leave a half-started engine behind
            self.proc.join(5)
            raise
        self.engine_id: str = self.info["engine_id"]
        self.pid: int = self.info["pid"]

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def _reply(self, timeout: float, what: str) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(
                f"{self.spec.name}: no answer to {what!r} within {timeout}s; log tail:\n{self.log_tail()}"
            )
        try:
            status, payload = self.conn.recv()
        except EOFError as exc:
            raise EngineError(f"{self.spec.name} died during {what!r}; see {self.log}") from exc
        if status != "ok":
            if PORT_TAKEN in str(payload):
                raise SidePortTaken(f"{self.spec.name}: {payload.strip().splitlines()[-1]}")
            raise EngineError(f"{self.spec.name} failed {what!r}:\n{payload}")
        return payload

    @property
    def log(self) -> str:
        return self.spec.log_path("engine")

    def call(self, cmd: str, timeout: float = 60.0, **kwargs: Any) -> Any:
        self.conn.send((cmd, kwargs))
        return self._reply(timeout, cmd)

    # convenience wrappers
    def prefill(self, ids: list[str], tokens: int = 64) -> dict[str, Any]:
        return self.call("prefill", ids=ids, tokens=tokens)

    def submit(
        self,
        items: list[tuple[str, dict[str, Any], int]],
        hold: bool = False,
        cached: list[str] | None = None,
    ) -> None:
        self.call("submit", items=items, hold=hold, cached=cached)

    def release(self, ids: list[str] | None = None) -> None:
        self.call("release", ids=ids)

    def abort(self, ids: list[str]) -> dict[str, str]:
        """D: the client cancels ``ids`` (``Engine.abort``): id -> "queued", "admitted" or "gone"."""
        return self.call("abort", ids=ids)

    def report(self) -> dict[str, Any]:
        return self.call("report")

    def stats(self) -> list[dict[str, Any]]:
        return self.call("stats")

    def summary(self) -> dict[str, Any]:
        """Counts only (``report`` without the per-request records): cheap at 100k requests."""
        return self.call("summary")

    def timings(self) -> dict[str, Any]:
        """Per-step and per-heartbeat-message records since the last call (then forgotten)."""
        return self.call("timings")

    def snapshot_deadlines(self) -> dict[str, Any]:
        """P: note every lease's deadline now; later frees by expiry are measured against them."""
        return self.call("snapshot_deadlines")

    def skew_clock(self, seconds: float) -> float:
        """Move the engine's ``time.perf_counter`` by ``seconds`` from now on (TP 1)."""
        return float(self.call("skew_clock", seconds=seconds))

    def send_signal(self, sig: int, tree: bool = False) -> bool:
        """Send ``sig`` to the engine (with ``tree``, then to its TP ranks too); False if it has
        exited.  Never reaches a process that took over the engine's pid."""
        try:
            signal.pidfd_send_signal(self._pidfd, sig)
        except (ProcessLookupError, OSError):
            return False
        if tree:
            signal_tree(self.pid, sig)  # the engine was alive just now: its children are its own
        return True

    def freeze(self) -> None:
        """SIGSTOP the engine and its TP ranks: a D whose forward loop stalls."""
        self.send_signal(signal.SIGSTOP, tree=True)

    def thaw(self) -> None:
        self.send_signal(signal.SIGCONT, tree=True)

    def send_only(self, cmd: str, **kwargs: Any) -> None:
        """Queue a command (e.g. for a frozen engine); collect it with ``collect``."""
        self.conn.send((cmd, kwargs))

    def collect(self, cmd: str, timeout: float = 60.0) -> Any:
        return self._reply(timeout, cmd)

    def kill(self) -> float:
        """SIGKILL the engine (and, via the pipe EOF, its TP ranks); return when."""
        self.send_signal(signal.SIGKILL)
        t = time.monotonic()
        self.proc.join(10)
        return t

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop", {}))
                self._reply(5, "stop")
            except Exception:
                pass
            self.proc.join(2)
        if self.proc.is_alive():
            self.send_signal(signal.SIGKILL)
            self.proc.join(5)
        self.conn.close()
        os.close(self._pidfd)


class Fleet:
    """Engines of one scenario; ``with Fleet(tmp_path) as fleet:``.

    With ``hosts`` (a ``harness.netns.TwoHosts``, entered by the caller and
    closed after the fleet), ``start(..., host="p")`` runs an engine on that
    host: in its network namespace, reachable only over its veth.  The
    driver still talks to every engine over a pipe, which no partition cuts.
    """

    def __init__(self, workdir: str, lease: int = 6, hosts: Any = None) -> None:
        self.workdir = str(workdir)
        self.lease = lease
        self.hosts = hosts
        self.engines: list[EngineProcess] = []

    def _placement(self, host: str | None) -> dict[str, str]:
        if host is None:
            return {}
        if self.hosts is None:
            raise ValueError("Fleet(hosts=...) is needed to place an engine on a host")
        return {
            "netns": self.hosts.netns(host),
            "host_ip": self.hosts.ip(host),
            "net_device": self.hosts.iface(host),
        }

    def start(
        self, role: str, name: str, stock: bool = False, host: str | None = None, **kw: Any
    ) -> EngineProcess:
        """One engine, ready when this returns (``start_many`` of one, with its port-race retries)."""
        (eng,) = self.start_many([(role, name, {**kw, "host": host})], stock=stock, start_timeout=90.0)
        return eng

    def start_many(
        self,
        engines: list[tuple[str, str, dict[str, Any]]],
        stock: bool = False,
        start_timeout: float = 240.0,
    ) -> list[EngineProcess]:
        """Start ``(role, name, EngineSpec fields)`` engines side by side; return them in order.
        A ``side_channel_port`` among the fields is kept (a restart under the same
        address); every other engine gets a free one.

        Safe to overlap: every engine gets its own side-channel port (picked
        together, so distinct), its own dist-init file and KV cache; only the
        fork server is shared, and it forks one child at a time.  A port free
        when picked can be bound by someone else before the engine's listener
        binds it: a lost race restarts just that engine on a new port."""
        specs = []
        fixed: set[int] = set()  # engines that must take the port they were given (a restart)
        for i, ((role, name, kw), port) in enumerate(zip(engines, free_ports(len(engines)), strict=True)):
            kw = dict(kw)
            if "side_channel_port" in kw:
                port = kw.pop("side_channel_port")
                fixed.add(i)
            kw.update(self._placement(kw.pop("host", None)))
            specs.append(
                EngineSpec(
                    role=role,
                    stock=stock,
                    workdir=self.workdir,
                    side_channel_port=port,
                    lease=self.lease,
                    name=name,
                    **kw,
                )
            )
        out: list[EngineProcess | None] = [None] * len(specs)
        launched: list[EngineProcess] = []
        try:
            todo = list(range(len(specs)))
            for attempt in range(3):
                pending = [(i, EngineProcess(specs[i], start_timeout, wait=False)) for i in todo]
                launched.extend(eng for _, eng in pending)
                todo = []
                for i, eng in pending:
                    try:
                        eng.wait_started()
                    except SidePortTaken:
                        if attempt == 2 or i in fixed:
                            raise
                        (port,) = free_ports(1)
                        specs[i].side_channel_port = port
                        todo.append(i)
                        continue
                    out[i] = eng
                    self.engines.append(eng)
                if not todo:
                    break
        except BaseException:
            for eng in launched:  # never leave a half-started fleet behind
                if eng not in self.engines and eng.proc.is_alive():
                    eng.proc.kill()
                    eng.proc.join(5)
            raise
        return [eng for eng in out if eng is not None]

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: Any) -> None:
        for eng in self.engines:
            try:
                eng.close()
            except Exception:
                if eng.proc.is_alive():
                    eng.proc.kill()


def wait_for(pred: Any, timeout: float, poll: float = 0.2, what: str = "condition") -> Any:
    """Poll ``pred`` until it returns a truthy value; raise on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout}s")
        time.sleep(poll)
