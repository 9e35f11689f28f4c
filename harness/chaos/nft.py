"""Packet filters inside a host's network namespace (nftables): one direction
of a link, or a group of hosts cut off from the rest.

Each fault owns one table (``chaos_<fid>``), so overlapping faults on one host
never undo each other: removing a fault deletes its table only.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence

DIRECTIONS = ("in", "out", "both")
_HOOK = "type filter hook {} priority 0; policy accept;"


def unavailable_reason() -> str | None:
    if shutil.which("nft") is None:
        return "nft is not installed: `make system-deps` as root, or `sudo apt-get install -y nftables`"
    return None


def _nft(netns: str, script: str) -> None:
    proc = subprocess.run(
        ["ip", "netns", "exec", netns, "nft", "-f", "-"],
        input=script,
        capture_output=True,
        text=True,
        timeout=30,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"nft in {netns} failed ({proc.returncode}): {proc.stderr.strip()}\n{script}")


def block(netns: str, table: str, direction: str, peers: Sequence[str]) -> None:
    """Drop packets to (``out``), from (``in``) or both ways between this host and ``peers`` (IPv4)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction is one of {DIRECTIONS}, not {direction!r}")
    if not peers:
        raise ValueError("no peers to block")
    addrs = ", ".join(peers)
    chains = []
    if direction in ("out", "both"):
        chains.append(f"  chain out {{ {_HOOK.format('output')} ip daddr {{ {addrs} }} drop; }}")
    if direction in ("in", "both"):
        chains.append(f"  chain in {{ {_HOOK.format('input')} ip saddr {{ {addrs} }} drop; }}")
    _nft(netns, f"table inet {table} {{\n" + "\n".join(chains) + "\n}\n")


def unblock(netns: str, table: str) -> None:
    """Delete ``table`` (no error if it is gone)."""
    subprocess.run(
        ["ip", "netns", "exec", netns, "nft", "delete", "table", "inet", table],
        capture_output=True,
        text=True,
        timeout=30,
    )


def tables(netns: str) -> list[str]:
    proc = subprocess.run(
        ["ip", "netns", "exec", netns, "nft", "list", "tables"], capture_output=True, text=True, timeout=30
    )
    return [line.split()[-1] for line in proc.stdout.splitlines() if line.startswith("table")]
