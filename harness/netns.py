"""Two hosts on one machine: network namespaces joined by a bridge.

``TwoHosts`` builds, for one test, a private layer-2 network::

    root namespace (the test driver)          namespace "p"       namespace "d"
      bridge  10.X.Y.1/24  --- veth ----------- 10.X.Y.2/24
                           --- veth --------------------------------- 10.X.Y.3/24

Each host is a network namespace with ``lo`` up and one end of a veth pair
(an address on a private /24 chosen not to clash with any address or route
in use); the other end is a port of a bridge in the root namespace, which
also has an address, so the driver reaches both hosts and the hosts reach
each other.  A partition is made on the bridge side of a host's veth:

- ``cut(host)`` / ``heal(host)``: link down / up of the bridge-side end.  The
  host's own interface stays administratively up but loses its carrier, so
  packets are dropped silently, as with a pulled cable: TCP (and UCX over it)
  sees no error, only missing acknowledgements, and retransmits.
- ``detach(host)`` / ``attach(host)``: take the port off the bridge (the link
  stays up; frames reach a port that forwards nowhere).
- ``flap`` / ``flapping``: cut and heal periodically.

Processes join a host with ``exec_prefix(host)`` (``ip netns exec``) or, for
a Python process that must stay a child of the driver (a fork), with
``enter_netns(name)``: setns(2) plus a private mount namespace with a fresh
``/sys``, as ``ip netns exec`` does (UCX lists TCP devices from
``/sys/class/net``, which otherwise still shows the root namespace's).

Names encode the creating pid and a per-process counter, so parallel tests
never collide and ``sweep_stale()`` can remove what a killed test left
behind.  Interface names stay within Linux's 15 characters.

Needs root and iproute2; ``unavailable_reason()`` says why it cannot work
here, for ``pytest.skip``.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import ipaddress
import itertools
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType

__all__ = [
    "TwoHosts",
    "enter_netns",
    "sweep_stale",
    "unavailable_reason",
]

# Interface names: "nl<pid>x<n><suffix>", suffix "br" (bridge), "<h>r" (bridge
# side of host h's veth), "<h>n" (namespace side).  Namespaces: "nlease-<pid>x<n>-<host>".
_IF_RE = re.compile(r"^nl(\d+)x([0-9a-z]+)(br|[a-z][rn])$")
_NS_RE = re.compile(r"^nlease-(\d+)x([0-9a-z]+)-[a-z]$")
_IFNAMSIZ = 15
_LOCK_PATH = "/tmp/vllm-nixl-lease-netns.lock"
_COUNTER = itertools.count()

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_REC = 0x4000
MS_SLAVE = 1 << 19
MNT_DETACH = 2


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _networks_in_use() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network with an address or a route on this machine (root namespace)."""
    nets: list[ipaddress.IPv4Network] = []
    for line in _ip("-o", "-4", "addr").stdout.splitlines():
        m = re.search(r"inet (\S+)", line)
        if m:
            nets.append(ipaddress.IPv4Interface(m.group(1)).network)
    for line in _ip("-4", "route", "show", "table", "all").stdout.splitlines():
        dest = line.split()[0] if line.split() else ""
        if dest in ("default", "broadcast", "local", "unreachable", "blackhole", "prohibit"):
            dest = line.split()[1] if len(line.split()) > 1 else ""
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.IPv4Network(dest, strict=False))
    return nets


def _pick_subnet(rng: random.Random) -> ipaddress.IPv4Network:
    used = _networks_in_use()
    for _ in range(1000):
        net = ipaddress.IPv4Network(f"10.{rng.randrange(64, 255)}.{rng.randrange(1, 255)}.0/24")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise RuntimeError("no free 10.x.y.0/24 subnet found")


# -- joining a namespace from Python --------------------------------------------
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def enter_netns(name: str, remount_sys: bool = True) -> None:
    """Move the calling thread (call it while the process has one thread) into
    network namespace ``name`` (as created by ``ip netns add``).

    setns(2) with CLONE_NEWNET changes only the calling thread; threads started
    later inherit it, threads started earlier stay where they were.  With
    ``remount_sys`` the process also gets a private mount namespace whose
    ``/sys`` shows the new network namespace (UCX lists its TCP devices from
    ``/sys/class/net``), exactly what ``ip netns exec`` sets up.
    """
    libc = _libc()
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(libc.setns(fd, CLONE_NEWNET), f"setns({name})")
    finally:
        os.close(fd)
    if not remount_sys:
        return
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    # Our mounts must not propagate back to the root mount namespace.
    _check(libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None), "mount --make-rslave /")
    _check(libc.umount2(b"/sys", MNT_DETACH), "umount /sys")
    _check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs /sys")


# -- availability and stale sweeping ----------------------------------------------
@functools.cache
def unavailable_reason() -> str | None:
    """Why ``TwoHosts`` cannot work here, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (euid is not 0)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    try:
        with TwoHosts(names=("p",)) as hosts:
            probe = subprocess.run(
                [*hosts.exec_prefix("p"), "ip", "-o", "link", "show", hosts.iface("p")],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if probe.returncode != 0:
                return f"`ip netns exec` does not work: {probe.stderr.strip()}"
            # enter_netns in a child: setns + a private /sys must both work.
            code = (
                "import sys, os; from harness.netns import enter_netns; "
                "enter_netns(sys.argv[1]); print(' '.join(sorted(os.listdir('/sys/class/net'))))"
            )
            # ``python -c`` imports from its working directory: the repository root.
            repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            child = subprocess.run(
                [sys.executable, "-c", code, hosts.netns("p")],
                cwd=repo,
                capture_output=True,
                text=True,
                timeout=30,
            )
            if child.returncode != 0 or hosts.iface("p") not in child.stdout.split():
                return f"setns/sysfs remount does not work: {child.stderr.strip()[-300:]}"
    except Exception as exc:  # noqa: BLE001 - any failure is the reason
        return f"cannot build namespaces, veths and a bridge: {exc}"
    return None


def sweep_stale() -> list[str]:
    """Delete namespaces and interfaces whose creating process is gone; return their names."""
    removed = []
    for line in _ip("-o", "link", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        m = _IF_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            if _ip("link", "del", name, check=False).returncode == 0:
                removed.append(name)
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NS_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            if _ip("netns", "del", name, check=False).returncode == 0:
                removed.append(name)
    return removed


# -- the two hosts ------------------------------------------------------------------
@dataclass(frozen=True)
class Host:
    name: str  # "p", "d": one lowercase letter
    netns: str
    iface: str  # namespace side of the veth (UCX_NET_DEVICES)
    port: str  # bridge side of the veth (what cut/detach act on)
    ip: str


def _ss_seconds(text: str) -> float:
    """``ss -o``'s timer value in seconds.  ss writes minutes, then seconds, then three-digit
    milliseconds: "1min4sec", "12sec", "880ms", and "2.820ms" for 2 s 820 ms (not 2.82 ms)."""
    m = re.fullmatch(r"(?:(\d+)min)?(?:(\d+)(?:sec|\.))?(?:(\d+)ms)?", text.strip())
    if m is None or not text.strip():
        raise ValueError(f"not an ss timer: {text!r}")
    minutes, seconds, millis = (int(g) if g else 0 for g in m.groups())
    return minutes * 60.0 + seconds + millis / 1000.0


class TwoHosts:
    """Hosts (network namespaces) on one bridge; ``with TwoHosts() as hosts:``.

    Everything is deleted on exit, also after an exception; construction that
    fails half-way deletes what it made.
    """

    def __init__(self, names: Sequence[str] = ("p", "d")) -> None:
        for n in names:
            if not re.fullmatch(r"[a-z]", n):
                raise ValueError(f"host names are one lowercase letter, not {n!r}")
        if len(set(names)) != len(names):
            raise ValueError("host names must be distinct")
        self.token = f"{os.getpid()}x{_base36(next(_COUNTER))}"
        self.bridge = f"nl{self.token}br"
        assert len(self.bridge) <= _IFNAMSIZ and len(f"nl{self.token}pr") <= _IFNAMSIZ, self.token
        self.subnet: ipaddress.IPv4Network | None = None
        self.hosts: dict[str, Host] = {}
        self._names = tuple(names)
        self._flappers: list[Flapper] = []
        self._lock = threading.Lock()  # cut/heal from a flapper thread and the test

    # -- lifecycle
    def __enter__(self) -> TwoHosts:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _create(self) -> None:
        sweep_stale()
        # One creator at a time picks a subnet and claims it (the bridge's address),
        # so two parallel tests never pick the same /24.
        with open(_LOCK_PATH, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.subnet = _pick_subnet(random.Random())
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.subnet[1]}/{self.subnet.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        for i, name in enumerate(self._names):
            host = Host(
                name=name,
                netns=f"nlease-{self.token}-{name}",
                iface=f"nl{self.token}{name}n",
                port=f"nl{self.token}{name}r",
                ip=str(self.subnet[2 + i]),
            )
            self.hosts[name] = host
            _ip("netns", "add", host.netns)
            _ip("link", "add", host.port, "type", "veth", "peer", "name", host.iface)
            _ip("link", "set", host.iface, "netns", host.netns)
            _ip("link", "set", host.port, "master", self.bridge)
            _ip("link", "set", host.port, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip("-n", host.netns, "addr", "add", f"{host.ip}/{self.subnet.prefixlen}", "dev", host.iface)
            _ip("-n", host.netns, "link", "set", host.iface, "up")

    def close(self) -> None:
        """Delete everything this instance made (idempotent, never raises)."""
        for f in self._flappers:
            with contextlib.suppress(Exception):
                f.stop()
        self._flappers.clear()
        for host in self.hosts.values():
            # Deleting one end deletes the pair (even if the namespace lives on
            # because a process is still inside it).
            _ip("link", "del", host.port, check=False)
            _ip("netns", "del", host.netns, check=False)
        # Namespaces created before a failure but not yet in self.hosts.
        for name in self._names:
            _ip("netns", "del", f"nlease-{self.token}-{name}", check=False)
        _ip("link", "del", self.bridge, check=False)

    def leftovers(self) -> list[str]:
        """Names of this instance's namespaces and interfaces that still exist."""
        out = []
        links = _ip("-o", "link", check=False).stdout
        out += [n for n in re.findall(r"^\d+: ([^:@]+)", links, re.M) if n.startswith(f"nl{self.token}")]
        out += [
            n
            for n in _ip("netns", "list", check=False).stdout.split()
            if n.startswith(f"nlease-{self.token}-")
        ]
        return out

    # -- facts
    def host(self, name: str) -> Host:
        return self.hosts[name]

    def ip(self, name: str) -> str:
        """The host's address (reachable from the root namespace and the other hosts)."""
        return self.hosts[name].ip

    def iface(self, name: str) -> str:
        """The host's network interface, inside its namespace."""
        return self.hosts[name].iface

    def netns(self, name: str) -> str:
        return self.hosts[name].netns

    @property
    def driver_ip(self) -> str:
        """The root namespace's address on the bridge."""
        assert self.subnet is not None
        return str(self.subnet[1])

    def _ss(self, name: str, peer: str, flags: str) -> str:
        """``ss``'s TCP sockets on host ``name`` towards host ``peer``, without the header."""
        return subprocess.run(
            [*self.exec_prefix(name), "ss", flags, "dst", self.ip(peer)],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout

    def tcp_backoff(self, name: str, peer: str) -> tuple[int, float]:
        """The most backed-off TCP connection from host ``name`` to host ``peer``:
        (its retransmission backoff count, its retransmission timeout in s);
        (0, 0.0) when no connection waits for a retransmission."""
        out = self._ss(name, peer, "-tinH")
        worst = (0, 0.0)
        for m in re.finditer(r"\brto:(\d+(?:\.\d+)?) backoff:(\d+)", out):
            worst = max(worst, (int(m.group(2)), float(m.group(1)) / 1000))
        return worst

    def tcp_wait(
        self, name: str, peer: str, pids: Collection[int], seen: list[str] | None = None
    ) -> tuple[int, float]:
        """The longest wait for a retransmission among the TCP connections from host ``name``
        to host ``peer`` that processes ``pids`` own: (that connection's backoff count, seconds
        until its retransmission timer fires); (0, 0.0) when none waits."""
        out = self._ss(name, peer, "-tinpoH")
        worst = (0, 0.0)
        for sock in re.split(r"\n(?=\S)", out):  # a socket: its line, then indented details
            owners = {int(p) for p in re.findall(r"pid=(\d+)", sock)}
            timer = re.search(r"timer:\(on,([^,]+),\d+\)", sock)
            backoff = re.search(r"\bbackoff:(\d+)", sock)
            if owners & set(pids) and timer and backoff:
                if seen is not None:  # the raw socket, for whoever must explain a wait
                    seen.append(sock)
                seconds = _ss_seconds(timer.group(1))
                if seconds >= worst[1]:  # the longest wait, not the most backoffs
                    worst = (int(backoff.group(1)), seconds)
        return worst

    def exec_prefix(self, name: str) -> list[str]:
        """Prefix a command line with this to run it on host ``name``."""
        return ["ip", "netns", "exec", self.netns(name)]

    def enter(self, name: str) -> None:
        """Move the current process (before it starts threads) onto host ``name``."""
        enter_netns(self.netns(name))

    # -- faults
    def cut(self, name: str) -> None:
        """Partition host ``name``: its link loses carrier; packets are dropped silently."""
        with self._lock:
            _ip("link", "set", self.hosts[name].port, "down")

    def heal(self, name: str) -> None:
        with self._lock:
            _ip("link", "set", self.hosts[name].port, "up")

    def detach(self, name: str) -> None:
        """Take host ``name``'s port off the bridge (its link stays up)."""
        with self._lock:
            _ip("link", "set", self.hosts[name].port, "nomaster")

    def attach(self, name: str) -> None:
        with self._lock:
            _ip("link", "set", self.hosts[name].port, "master", self.bridge)
            _ip("link", "set", self.hosts[name].port, "up")

    @contextlib.contextmanager
    def partitioned(self, name: str) -> Iterator[None]:
        """Cut host ``name`` for the duration of the ``with`` block."""
        self.cut(name)
        try:
            yield
        finally:
            self.heal(name)

    def flapping(self, name: str, down_s: float, up_s: float) -> Flapper:
        """Start cutting and healing host ``name`` in a thread (down first); ``.stop()`` heals."""
        f = Flapper(self, name, down_s, up_s)
        self._flappers.append(f)
        f.start()
        return f

    def flap(self, name: str, down_s: float, up_s: float, duration: float) -> Flapper:
        """Flap host ``name`` for ``duration`` seconds (blocking); returns the stopped flapper."""
        f = self.flapping(name, down_s, up_s)
        time.sleep(duration)
        f.stop()
        return f


class Flapper:
    """Cuts and heals one host periodically until stopped; records when."""

    def __init__(self, hosts: TwoHosts, name: str, down_s: float, up_s: float) -> None:
        self.hosts, self.name, self.down_s, self.up_s = hosts, name, down_s, up_s
        self.events: list[tuple[float, str]] = []  # (time.monotonic(), "cut" | "heal")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"flap-{name}", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.hosts.cut(self.name)
                self.events.append((time.monotonic(), "cut"))
                self._stop.wait(self.down_s)
                self.hosts.heal(self.name)
                self.events.append((time.monotonic(), "heal"))
                self._stop.wait(self.up_s)
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self.error = exc

    def stop(self) -> None:
        """Stop flapping and leave the link up."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)
        with contextlib.suppress(Exception):
            self.hosts.heal(self.name)
        if self.error is not None:
            raise RuntimeError(f"flapping {self.name} failed") from self.error

    @property
    def cuts(self) -> int:
        return sum(1 for _, what in self.events if what == "cut")
