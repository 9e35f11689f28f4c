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

from tools.pd.procs import free_ports, signal_tree

from .spec import EngineSpec

__all__ = ["Engine", "EngineError", "Fleet", "SidePortTaken", "free_ports", "wait_for"]

_CTX: Any = None


def context() -> Any:
    global _CTX
    if _CTX is None:
        from multiprocessing import forkserver

        ctx = mp.get_context("forkserver")
        # Preloaded in the fork server, so engines start without importing vLLM.
        ctx.set_forkserver_preload(["nixl_harness.preload"])
        # Python 3.11's fork server does not apply the parent's sys.path
        # before preloading (and swallows the ImportError): hand it ours.
        tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        repo_dir = os.path.dirname(tests_dir)  # for tools.pd.procs
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, repo_dir, old) if p)
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


# Engine-side marker of a lost port race (see engine.publish_handshakes).
PORT_TAKEN = "SIDE_CHANNEL_PORT_TAKEN"


class Engine:
    """Handle on one engine process."""

    def __init__(self, spec: EngineSpec, start_timeout: float = 90.0) -> None:
        from .engine import engine_main

        ctx = context()
        self.spec = spec
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_main, args=(spec, child), daemon=True)
        self.proc.start()
        child.close()
        try:
            self.info = self._reply(start_timeout, "start")
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
        return os.path.join(self.spec.workdir, f"{self.spec.name or self.spec.role}-engine.log")

    def call(self, cmd: str, timeout: float = 60.0, **kwargs: Any) -> Any:
        self.conn.send((cmd, kwargs))
        return self._reply(timeout, cmd)

    # convenience wrappers
    def prefill(self, ids: list[str], tokens: int = 64) -> dict[str, Any]:
        return self.call("prefill", ids=ids, tokens=tokens)

    def submit(self, items: list[tuple[str, dict[str, Any], int]], hold: bool = False) -> None:
        self.call("submit", items=items, hold=hold)

    def release(self, ids: list[str] | None = None) -> None:
        self.call("release", ids=ids)

    def report(self) -> dict[str, Any]:
        return self.call("report")

    def stats(self) -> list[dict[str, Any]]:
        return self.call("stats")

    def freeze(self) -> None:
        """SIGSTOP the engine and its TP ranks: a D whose forward loop stalls."""
        signal_tree(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        signal_tree(self.pid, signal.SIGCONT)

    def send_only(self, cmd: str, **kwargs: Any) -> None:
        """Queue a command (e.g. for a frozen engine); collect it with ``collect``."""
        self.conn.send((cmd, kwargs))

    def collect(self, cmd: str, timeout: float = 60.0) -> Any:
        return self._reply(timeout, cmd)

    def kill(self) -> float:
        """SIGKILL the engine (and, via the pipe EOF, its TP ranks); return when."""
        os.kill(self.pid, signal.SIGKILL)
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
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


class Fleet:
    """Engines of one scenario; ``with Fleet(tmp_path) as fleet:``.

    With ``hosts`` (a ``tools.netns.TwoHosts``, entered by the caller and
    closed after the fleet), ``start(..., host="p")`` runs an engine on that
    host: in its network namespace, reachable only over its veth.  The
    driver still talks to every engine over a pipe, which no partition cuts.
    """

    def __init__(self, workdir: str, lease: int = 6, hosts: Any = None) -> None:
        self.workdir = str(workdir)
        self.lease = lease
        self.hosts = hosts
        self.engines: list[Engine] = []

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

    def start(self, role: str, name: str, stock: bool = False, host: str | None = None, **kw: Any) -> Engine:
        kw.update(self._placement(host))
        # A port free when picked can be bound by someone else before the
        # engine's listener binds it; pick another and start again.
        for attempt in range(3):
            (port,) = free_ports(1)
            spec = EngineSpec(
                role=role,
                stock=stock,
                workdir=self.workdir,
                side_channel_port=port,
                lease=self.lease,
                name=name,
                **kw,
            )
            try:
                eng = Engine(spec)
            except SidePortTaken:
                if attempt == 2:
                    raise
                continue
            self.engines.append(eng)
            return eng
        raise AssertionError("unreachable")

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
