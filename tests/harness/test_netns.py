"""harness.netns: two hosts on one machine, and the faults it makes (needs root)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time

import pytest

from harness import netns
from harness.procs import free_ports

_reason = netns.unavailable_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=f"network namespaces unavailable: {_reason}")

ECHO = """
import socket, sys
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], int(sys.argv[2])))
srv.listen(8)
print("ready", flush=True)
while True:
    conn, _ = srv.accept()
    with conn:
        while data := conn.recv(4096):
            conn.sendall(data)
"""

CONNECT = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as s:
    s.sendall(b"ping")
    print(s.recv(4).decode())
"""


def _echo_server(hosts: netns.TwoHosts, host: str, port: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [*hosts.exec_prefix(host), sys.executable, "-c", ECHO, hosts.ip(host), str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _ping(ip: str, port: int, timeout: float = 2.0) -> str:
    with socket.create_connection((ip, port), timeout=timeout) as s:
        s.sendall(b"ping")
        return s.recv(4).decode()


def _unreachable(ip: str, port: int) -> bool:
    try:
        _ping(ip, port, timeout=1.0)
    except OSError:
        return True
    return False


def test_hosts_reach_each_other_and_the_driver() -> None:
    (port,) = free_ports(1)
    with netns.TwoHosts() as hosts:
        assert hosts.ip("p") != hosts.ip("d") and hosts.driver_ip not in (hosts.ip("p"), hosts.ip("d"))
        assert all(len(n) <= 15 for n in (hosts.bridge, hosts.iface("p"), hosts.host("p").port))
        server = _echo_server(hosts, "p", port)
        try:
            assert _ping(hosts.ip("p"), port) == "ping"  # root namespace -> p
            out = subprocess.run(
                [*hosts.exec_prefix("d"), sys.executable, "-c", CONNECT, hosts.ip("p"), str(port)],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert out.stdout.strip() == "ping", out.stderr  # d -> p across the bridge
        finally:
            server.kill()
            server.wait()


@pytest.mark.parametrize("fault", ["cut", "detach"])
def test_fault_blocks_new_and_established_connections_until_healed(fault: str) -> None:
    (port,) = free_ports(1)
    with netns.TwoHosts() as hosts:
        server = _echo_server(hosts, "p", port)
        try:
            conn = socket.create_connection((hosts.ip("p"), port), timeout=2)
            conn.sendall(b"ping")
            assert conn.recv(4) == b"ping"
            getattr(hosts, fault)("p")
            assert _unreachable(hosts.ip("p"), port), "a new connection got through the partition"
            conn.settimeout(1.0)
            conn.sendall(b"late")  # TCP queues it and retransmits
            with pytest.raises(TimeoutError):
                conn.recv(4)
            {"cut": hosts.heal, "detach": hosts.attach}[fault]("p")
            conn.settimeout(30)  # delivered by a retransmission after the heal
            assert conn.recv(4) == b"late"
            conn.close()  # the echo server serves one connection at a time
            assert _ping(hosts.ip("p"), port, timeout=10) == "ping"
        finally:
            server.kill()
            server.wait()


def test_flapping_alternates_and_ends_healed() -> None:
    (port,) = free_ports(1)
    with netns.TwoHosts() as hosts:
        server = _echo_server(hosts, "p", port)
        try:
            flapper = hosts.flap("p", down_s=0.3, up_s=0.3, duration=1.0)
            kinds = [what for _, what in flapper.events]
            assert kinds[0] == "cut" and flapper.cuts >= 2
            assert all(a != b for a, b in zip(kinds, kinds[1:], strict=False)), kinds
            assert _ping(hosts.ip("p"), port, timeout=10) == "ping"
        finally:
            server.kill()
            server.wait()


def _child_enters(name: str, iface: str, ip: str, conn: mp.connection.Connection) -> None:
    netns.enter_netns(name)
    with socket.socket() as s:
        s.bind((ip, 0))  # the host's address exists only in its namespace
    conn.send(sorted(os.listdir("/sys/class/net")))


def test_enter_netns_moves_a_forked_child_and_its_sysfs() -> None:
    with netns.TwoHosts() as hosts:
        parent, child = mp.get_context("fork").Pipe()
        proc = mp.get_context("fork").Process(
            target=_child_enters, args=(hosts.netns("d"), hosts.iface("d"), hosts.ip("d"), child)
        )
        proc.start()
        assert parent.poll(30)
        assert parent.recv() == sorted(["lo", hosts.iface("d")])
        proc.join(10)
        assert proc.exitcode == 0
        # The driver stayed in the root namespace with its own /sys.
        assert hosts.bridge in os.listdir("/sys/class/net")


def test_cleanup_leaves_nothing_even_after_an_exception() -> None:
    hosts = netns.TwoHosts()
    with pytest.raises(RuntimeError, match="boom"):
        with hosts:
            # The bridge, two bridge-side veth ends (the others are inside the namespaces), two namespaces.
            assert len(hosts.leftovers()) == 5, hosts.leftovers()
            raise RuntimeError("boom")
    assert hosts.leftovers() == []


STALE = """
import os
from harness.netns import TwoHosts
h = TwoHosts().__enter__()
print(h.token, flush=True)
os._exit(0)  # dies without cleaning up
"""


# Serial: every TwoHosts sweeps on creation, so a parallel test's could remove these first.
@pytest.mark.serial
def test_sweep_stale_removes_what_a_dead_process_left() -> None:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", STALE], cwd=repo, capture_output=True, text=True, timeout=60)
    token = out.stdout.strip()
    assert token, out.stderr
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"nl{token}br" in links
    removed = netns.sweep_stale()
    assert f"nl{token}br" in removed and f"nlease-{token}-p" in removed
    time.sleep(0.1)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert token not in links and token not in spaces


def test_ss_timer_values_read_as_seconds() -> None:
    assert netns._ss_seconds("880ms") == pytest.approx(0.88)
    assert netns._ss_seconds("12sec") == 12.0
    assert netns._ss_seconds("1min4sec") == 64.0
    # ss's own format for 2 s 820 ms: seconds, a dot, then the milliseconds with "ms".
    assert netns._ss_seconds("2.820ms") == pytest.approx(2.82)
    assert netns._ss_seconds("036ms") == pytest.approx(0.036)
    assert netns._ss_seconds("1min") == 60.0
    with pytest.raises(ValueError):
        netns._ss_seconds("soon")


SS_TWO_BACKED_OFF = (
    'ESTAB 0 40 10.0.0.2:40000 10.0.0.1:5000 users:(("python",pid=11,fd=3)) timer:(on,21sec,8)\n'
    "\t cubic rto:25600 backoff:7 rtt:0.1/0.05\n"
    'ESTAB 0 40 10.0.0.2:40002 10.0.0.1:5002 users:(("python",pid=11,fd=4)) timer:(on,3.050ms,9)\n'
    "\t cubic rto:51200 backoff:8 rtt:0.1/0.05\n"
    'ESTAB 0 40 10.0.0.2:40004 10.0.0.1:5004 users:(("python",pid=12,fd=5)) timer:(on,50sec,9)\n'
    "\t cubic rto:51200 backoff:8 rtt:0.1/0.05\n"
)


def test_tcp_wait_is_the_longest_wait_not_the_most_backoffs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection backed off more may be about to retransmit; another may wait much longer:
    the pair waits for the latter (and another process's connection is not the pair's)."""
    hosts = netns.TwoHosts()  # nothing is made before ``with``
    monkeypatch.setattr(hosts, "_ss", lambda name, peer, flags: SS_TWO_BACKED_OFF)
    assert hosts.tcp_wait("d", "p", [11]) == (7, 21.0)  # not the 3.05 s of the backoff-8 one
    assert hosts.tcp_wait("d", "p", [11, 12]) == (8, 50.0)
    assert hosts.tcp_wait("d", "p", [13]) == (0, 0.0)


SENDER = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
print("connected", flush=True)
for _ in range(200):
    c.sendall(b"x"); time.sleep(0.05)
"""


def test_tcp_wait_sees_a_backed_off_retransmission_of_the_given_processes_only() -> None:
    """What the chaos lane's recovery rule allows a pair after the heal: the wait for the next
    retransmission of a connection its engines own, backed off by a cut."""
    (port,) = free_ports(1)
    with netns.TwoHosts() as hosts:
        server = _echo_server(hosts, "p", port)
        sender = subprocess.Popen(
            [*hosts.exec_prefix("d"), sys.executable, "-c", SENDER, hosts.ip("p"), str(port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert sender.stdout is not None and sender.stdout.readline().strip() == "connected"
            assert hosts.tcp_wait("d", "p", [sender.pid]) == (0, 0.0)
            hosts.cut("p")
            deadline = time.monotonic() + 20
            while (wait := hosts.tcp_wait("d", "p", [sender.pid]))[0] < 3 and time.monotonic() < deadline:
                time.sleep(0.1)
            backoffs, seconds = wait
            assert backoffs >= 3 and 0 < seconds <= 0.2 * 2 ** (backoffs + 1), wait
            assert hosts.tcp_wait("d", "p", [server.pid]) == (0, 0.0), "another process's wait"
        finally:
            hosts.heal("p")
            for proc in (sender, server):
                proc.kill()
                proc.wait()
