"""Running counts for the progress lines: requests, reads (ok, failed, stale),
expiries, faults; fed every history event as it is written."""

from __future__ import annotations

from typing import Any


class Tally:
    def __init__(self) -> None:
        self.written: dict[str, str] = {}
        self.n = {
            "requests": 0,
            "reads_ok": 0,
            "reads_failed": 0,
            "stale": 0,
            "expiries": 0,
            "faults": 0,
            "errors": 0,
            "fenced": 0,
        }
        self._fenced: dict[tuple[str, str], int] = {}

    def __call__(self, e: dict[str, Any]) -> None:
        ev = e["ev"]
        n = self.n
        if ev == "request":
            n["requests"] += 1
        elif ev == "written":
            self.written[e["id"]] = e["digest"]
        elif ev == "read":
            if e["failed"]:
                n["reads_failed"] += 1
            elif self.written.get(e["id"]) == e["digest"]:
                n["reads_ok"] += 1
            else:
                n["stale"] += 1
        elif ev == "freed" and e["reason"] == "expiry":
            n["expiries"] += 1
        elif ev == "fault":
            n["faults"] += 1
        elif ev == "error":
            n["errors"] += 1
        elif ev == "stats":
            self._fenced[e["engine"], e["engine_id"]] = e["fenced"] + e["discarded"]
            n["fenced"] = sum(self._fenced.values())

    def line(self) -> str:
        n = self.n
        return (
            f"requests {n['requests']}, reads ok {n['reads_ok']} failed {n['reads_failed']} "
            f"(fenced {n['fenced']}) stale {n['stale']}, expiries {n['expiries']}, faults {n['faults']}, "
            f"errors {n['errors']}"
        )
