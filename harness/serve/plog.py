"""Read lease events from a server log written with the launcher's logging config (epoch-ms prefix).

Both connectors' messages match: stock logs one "Heartbeat extended lease for request X" per id, ours
one "Heartbeat extended N of M lease(s)" per message; expiry is "Releasing expired KV blocks for
request X ..." in both (ours at debug level per id plus a warning summary).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

_TS = re.compile(r"^(\d{9,11}\.\d{3}) ")
_HB = re.compile(r"Heartbeat extended")
_EXPIRED = re.compile(r"Releasing expired KV blocks for request (\S+) which")


@dataclass
class LeaseEvents:
    heartbeats: list[float] = field(default_factory=list)  # wall times P extended >= 1 lease
    expiries: list[tuple[float, str]] = field(default_factory=list)  # (wall time, request id)

    def heartbeats_between(self, t0: float, t1: float) -> list[float]:
        return [t for t in self.heartbeats if t0 <= t <= t1]

    def last_heartbeat_before(self, t: float) -> float | None:
        before = [h for h in self.heartbeats if h <= t]
        return max(before) if before else None

    def expiries_after(self, t: float) -> list[tuple[float, str]]:
        return [e for e in self.expiries if e[0] >= t]

    def last_heartbeat_of_killed(self, kill_ts: float) -> float | None:
        """The last heartbeat P applied from a D killed at `kill_ts`: one D sent just before the
        kill can reach P just after it (seen: logged 3 ms later, making the reclaim look 2 s
        late), so this is the last one before P's first reclaim, not before the kill."""
        reclaims = self.expiries_after(kill_ts - 1)
        return self.last_heartbeat_before(min(t for t, _ in reclaims) if reclaims else kill_ts + 1.0)


def parse(path: Path) -> LeaseEvents:
    ev = LeaseEvents()
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ev
    for line in text.splitlines():
        m = _TS.match(line)
        if not m:
            continue
        ts = float(m.group(1))
        if _HB.search(line):
            ev.heartbeats.append(ts)
            continue
        e = _EXPIRED.search(line)
        if e:
            ev.expiries.append((ts, e.group(1)))
    return ev
