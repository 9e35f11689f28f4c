"""CPU starvation of one host's processes: a cgroup (v1 ``cpu`` controller)
with a CFS quota of a few percent of one core.

The processes keep running, only slowly: steps, heartbeats and replies all lag,
as on a host whose cores another tenant took.  Undo moves them back to the
cgroup they came from and removes ours.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


def unavailable_reason() -> str | None:
    if not (ROOT / "cgroup.procs").exists():
        return f"no cgroup v1 cpu controller at {ROOT}"
    if not os.access(ROOT, os.W_OK):
        return f"{ROOT} is not writable (needs root)"
    return None


def _origin(pid: int) -> Path:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return ROOT / path.lstrip("/")
    return ROOT


class Starvation:
    """``with`` or ``start``/``stop``: ``pids`` get ``share`` of one core (0.03: 3%)."""

    def __init__(self, name: str, pids: list[int], share: float) -> None:
        self.path = ROOT / name
        self.pids = list(pids)
        self.share = share
        self.origins: dict[int, Path] = {}

    def start(self) -> None:
        self.path.mkdir(exist_ok=True)
        (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (self.path / "cpu.cfs_quota_us").write_text(str(max(1000, int(PERIOD_US * self.share))))
        for pid in self.pids:
            try:
                self.origins[pid] = _origin(pid)
                (self.path / "cgroup.procs").write_text(str(pid))
            except (OSError, ValueError):
                pass  # the process is gone (killed): nothing to starve

    def stop(self) -> None:
        for pid, origin in self.origins.items():
            try:
                (origin / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass
        left = []
        try:
            left = [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            pass
        for pid in left:  # threads or children that joined later
            try:
                (ROOT / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass
        try:
            self.path.rmdir()
        except OSError:
            pass
