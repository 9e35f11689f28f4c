"""How long after a network cut heals TCP moves data again (what UCX over TCP inherits).

Two network-namespace hosts (``harness.netns``); a sender on ``d`` writes 100 bytes every
100 ms to a receiver on ``p``; ``p`` drops everything from ``d`` for ``--cut-s`` seconds (an
input-chain drop, as ``make chaos``'s partitions and one-way cuts make), then heals.  Each
retransmission lost in the cut doubles the connection's retransmission timeout, and nothing
queued moves before the next one fires.  Prints, per setting of the sender's
``net.ipv4.tcp_rto_max_ms`` (Linux 6.15 or later), when the receiver got data again.

    .venv/bin/python -m tools.tcp_after_cut [--cut-s 14] [--rto-max-ms default 2000]

Root only.  Not part of ``make test`` (a tool for docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from harness import netns
from harness.chaos import nft

PORT = 9299
RECEIVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(); c, _ = s.accept()
while (d := c.recv(4096)):
    print(time.monotonic(), flush=True)
"""
SENDER = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    c.send(b"x" * 100); time.sleep(0.1)
"""


def one(cut_s: float, rto_max_ms: str) -> tuple[float, float]:
    """(seconds from the heal to the receiver's next data, the longest silence)."""
    with netns.TwoHosts(("p", "d")) as hosts:
        if rto_max_ms != "default":
            sysctl = ["sysctl", "-qw", f"net.ipv4.tcp_rto_max_ms={rto_max_ms}"]
            subprocess.run([*hosts.exec_prefix("d"), *sysctl], check=True)
        recv = subprocess.Popen(
            [*hosts.exec_prefix("p"), sys.executable, "-c", RECEIVER, hosts.ip("p"), str(PORT)],
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(0.5)
        send = subprocess.Popen(
            [*hosts.exec_prefix("d"), sys.executable, "-c", SENDER, hosts.ip("p"), str(PORT), str(cut_s + 60)]
        )
        time.sleep(3.0)
        table = f"cut_{hosts.token}"
        nft.block(hosts.netns("p"), table, "in", [hosts.ip("d")])
        time.sleep(cut_s)
        nft.unblock(hosts.netns("p"), table)
        t_heal = time.monotonic()
        send.wait()
        recv.wait(30)
        assert recv.stdout is not None
        times = [float(line) for line in recv.stdout.read().split()]
    after = next((t - t_heal for t in times if t > t_heal), float("nan"))
    silence = max((b - a for a, b in zip(times, times[1:], strict=False)), default=float("nan"))
    return after, silence


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cut-s", type=float, default=14.0)
    ap.add_argument("--rto-max-ms", nargs="+", default=["default", "2000"])
    args = ap.parse_args(argv)
    why = netns.unavailable_reason() or nft.unavailable_reason()
    if why:
        print(f"cannot run: {why}")
        return 2
    print(f"{'tcp_rto_max_ms':<16} {'cut s':>6} {'data again after heal s':>24} {'longest silence s':>18}")
    for setting in args.rto_max_ms:
        after, silence = one(args.cut_s, setting)
        print(f"{setting:<16} {args.cut_s:>6.1f} {after:>24.1f} {silence:>18.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
