"""The harness's processes: the children it starts (own process group, killed by PID, reaped with a
timeout), the ports they listen on, their process trees, and where each one's output goes.

Shared by the NIXL harness (``harness.nixl``: engine processes and the agents beside them) and the
`vllm serve` harness (``harness.serve``); a leaf, so both import it without importing each other.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

_LIVE: list[Managed] = []

# What a process that lost the race for its side-channel port reports (an engine's handshake listener
# could not bind): the parent then retries on another port rather than failing the scenario.
PORT_TAKEN = "SIDE_CHANNEL_PORT_TAKEN"


def log(msg: str) -> None:
    """One line of a harness process's own log, with when (monotonic) and which process."""
    print(f"[harness {time.monotonic():.3f} pid {os.getpid()}] {msg}", flush=True)


def redirect_output(log_path: str) -> None:
    """Send this process's stdout and stderr (file descriptors too) to ``log_path``, appending.

    vLLM and UCX log a lot, from C as well as Python; one file per process keeps it for post-mortems.
    """
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    # No `vllm serve` here to configure logging: INFO and up from vLLM and
    # from us (forwarded to the "vllm" logger) into this log, as a server logs.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True)


def free_ports(n: int) -> list[int]:
    """`n` distinct ports that are free now, below the kernel's ephemeral range.

    Ports from the ephemeral range (what bind(0) hands out) get taken again by the servers' own
    outgoing ZMQ/NIXL/gloo sockets before the server binds its listener (seen: EADDRINUSE).
    """
    lo, _hi = _ephemeral_range()
    rng = random.Random()
    out: list[int] = []
    while len(out) < n:
        port = rng.randrange(max(1024, lo - 12000), lo)
        if port in out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        out.append(port)
    return out


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def _try(fn: Callable[..., object], *args: object) -> bool:
    try:
        fn(*args)
    except OSError:  # not permitted (nice < 0 without CAP_SYS_NICE) or no such CPU: run unpinned
        return False
    return True


def raise_own_priority(nice: int) -> bool:
    """Set every thread of this process to `nice` if that is a higher priority than now.

    Linux keeps nice per thread and a child inherits it from the thread that forks it, so the
    servers and router started afterwards run at exactly the driver's priority. Raising the servers
    alone starved the driver: where nice applies across processes (no autogroup) and the driver runs
    at low priority, the spinning servers held both cores and one client thread took ~57 s to start.
    """
    ok = True
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.getpriority(os.PRIO_PROCESS, int(tid)) > nice:
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except OSError:  # not permitted (no CAP_SYS_NICE) or the thread ended: keep what it has
            ok = False
    return ok


def _proc_stats() -> Iterator[tuple[int, str, list[bytes]]]:
    """(pid, command name, the /proc/PID/stat fields after the name) of every live process."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        # The command name may contain spaces and parentheses: split after the last ')'.
        name = stat[stat.find(b"(") + 1 : stat.rfind(b")")].decode(errors="replace")
        yield int(entry), name, stat[stat.rfind(b")") + 2 :].split()


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for pid, _name, fields in _proc_stats():
        kids.setdefault(int(fields[1]), []).append(pid)
    return kids


def busiest(window_s: float = 0.5, top: int = 8) -> str:
    """The machine's busiest processes over `window_s` (pid, nice, % of a core, name): put in a
    failure message, it shows starvation or another job's load that a client timeout hides."""

    def sample() -> dict[int, tuple[int, int, str]]:
        # utime + stime (clock ticks), nice
        return {pid: (int(f[11]) + int(f[12]), int(f[16]), name) for pid, name, f in _proc_stats()}

    a = sample()
    time.sleep(window_s)
    b = sample()
    hz = os.sysconf("SC_CLK_TCK")
    rows = sorted(
        ((b[p][0] - a[p][0]) * 100 / hz / window_s, p, b[p][1], b[p][2]) for p in b if p in a
    )  # fmt: skip
    return "\n".join(f"  pid {p:>7} nice {ni:>3} {cpu:5.0f}% {name}" for cpu, p, ni, name in rows[::-1][:top])


def descendants(pid: int) -> list[int]:
    """All live descendants of `pid` (children first found by parent links in /proc)."""
    kids = _children_map()
    out, todo = [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def signal_tree(pid: int, sig: int) -> None:
    """Send `sig` to `pid` and all its descendants; one that has exited meanwhile is skipped."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


class Managed:
    """A child started in its own session, with stdout+stderr going to `log_path`."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        cpus: set[int] | None = None,
    ) -> None:
        self.name = name
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in kill()
        self.popen = subprocess.Popen(
            list(argv),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: one killpg reaches engine core and workers
        )
        self.pid = self.popen.pid
        _LIVE.append(self)
        # Set right after exec, before the interpreter has imported anything or spawned its engine
        # and worker processes, which inherit it. Not a preexec_fn: callers have threads running.
        # Priority is inherited from the caller (raise_own_priority), never raised above it.
        self.pinned = _try(os.sched_setaffinity, self.pid, cpus) if cpus else False

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 15.0) -> float:
        """Signal the whole tree (group + stray descendants); reap; return the wall time of the kill."""
        victims = descendants(self.pid)
        t_kill = time.time()
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in victims:  # children that left the group (setsid) still go
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            if sig != signal.SIGKILL:
                return self.kill(signal.SIGKILL, timeout)
        self._log.close()
        if self in _LIVE:
            _LIVE.remove(self)
        return t_kill

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL whatever is left after `grace` seconds."""
        if not self.alive():
            self.kill(signal.SIGKILL, timeout=grace)
            return
        victims = descendants(self.pid)
        try:
            os.killpg(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.kill(signal.SIGKILL)

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


def kill_all() -> None:
    """Kill every child still registered (atexit / signal safety net)."""
    for m in list(_LIVE):
        try:
            m.kill(signal.SIGKILL, timeout=5.0)
        except Exception:  # noqa: BLE001 - best effort at exit, keep killing the rest
            pass


def _on_signal(signum: int, _frame: object) -> None:
    kill_all()
    raise SystemExit(128 + signum)


atexit.register(kill_all)


def install_signal_handlers() -> None:
    """SIGTERM/SIGHUP kill our children too (SIGINT already raises KeyboardInterrupt -> atexit)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)


def _main_thread_stat(pid: int) -> list[str] | None:
    """The /proc stat fields after the command name of `pid`'s main thread (None: gone)."""
    try:
        return Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def snapshot(pid: int, stack_lines: int = 24) -> str:
    """What `pid`'s tree is doing now, for a failure message: per process its name, its main
    thread's CPU use over one second (where vLLM steps, not NIXL's progress threads) and where
    that thread waits in the kernel.  A vLLM engine and its worker spin on sched_yield while they
    wait for each other; a step stuck in a blocking call shows little CPU and a futex wait.
    With py-spy installed (the test extras), the Python stack of each engine's and worker's
    main thread follows, cut to `stack_lines` lines."""
    pids = [pid, *descendants(pid)]
    before = {p: _main_thread_stat(p) for p in pids}
    time.sleep(1.0)
    # Every second sample now, before any py-spy dump: each window is the same 1 s.
    after = {p: _main_thread_stat(p) for p in pids}
    hz = os.sysconf("SC_CLK_TCK")
    pyspy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    out = []
    for p in pids:
        b, a = before[p], after[p]
        try:
            comm = Path(f"/proc/{p}/comm").read_text().strip()
            wchan = Path(f"/proc/{p}/task/{p}/wchan").read_text().strip() or "-"
        except OSError:
            continue
        if a is None:
            continue
        # utime + stime, in clock ticks
        busy = f"{(int(a[11]) + int(a[12]) - int(b[11]) - int(b[12])) / hz:.2f}" if b else "?"
        out.append(f"{p} {comm}: {busy} CPU s in 1 s, state {a[0]}, wchan {wchan}")
        if pyspy and ("Worker" in comm or "Engine" in comm):
            out.extend("    " + line for line in _main_stack(pyspy, p)[:stack_lines])
    return "\n".join(out)


def _main_stack(pyspy: str, pid: int) -> list[str]:
    """`py-spy dump` of `pid`, its main thread only (the first thread py-spy prints)."""
    try:
        r = subprocess.run([pyspy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [f"py-spy: {e}"]
    lines, threads = [], 0
    for line in r.stdout.splitlines():
        if line.startswith("Thread "):
            threads += 1
            if threads > 1:
                break
        if threads:
            lines.append(line.rstrip()[:200])
    return lines or [f"py-spy: {(r.stderr or r.stdout).strip()[:200]}"]
