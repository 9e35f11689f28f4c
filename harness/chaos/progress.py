"""Running counts for the progress lines, fed every history event as it is
written.  P's record of what it wrote and D's record of what it read arrive
from different engines in either order: a read is judged once both are in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# (the read event, "ok" | "failed" | "stale" | "after_abort": a cancelled request's load of other
# data, thrown away by vLLM, not a stale read: see ``readers``)
Verdict = Callable[[dict[str, Any], str], None]


class Reads:
    """Judges each read against P's digest, whichever of the two events comes first."""

    def __init__(self, on_verdict: Verdict) -> None:
        self.written: dict[str, str] = {}
        self.waiting: dict[str, dict[str, Any]] = {}
        self.on_verdict = on_verdict

    def __call__(self, e: dict[str, Any]) -> None:
        if e["ev"] == "written":
            self.written[e["id"]] = e["digest"]
            read = self.waiting.pop(e["id"], None)
            if read is not None:
                self._judge(read)
        elif e["ev"] == "read":
            if e["failed"] or e["id"] in self.written:
                self._judge(e)
            else:
                self.waiting[e["id"]] = e

    def _judge(self, read: dict[str, Any]) -> None:
        if read["failed"]:
            self.on_verdict(read, "failed")
        elif self.written.get(read["id"]) == read["digest"]:
            self.on_verdict(read, "ok")
        else:
            self.on_verdict(read, "after_abort" if read.get("aborted") else "stale")


class Tally:
    def __init__(self) -> None:
        self.n = {
            "requests": 0,
            "reads_ok": 0,
            "reads_failed": 0,
            "stale": 0,
            "after_abort": 0,
            "expiries": 0,
            "faults": 0,
            "errors": 0,
            "fenced": 0,
        }
        self._fenced: dict[tuple[str, str], int] = {}
        self.reads = Reads(self._verdict)

    def _verdict(self, read: dict[str, Any], verdict: str) -> None:
        self.n["reads_" + verdict if verdict in ("ok", "failed") else verdict] += 1

    def __call__(self, e: dict[str, Any]) -> None:
        ev = e["ev"]
        n = self.n
        self.reads(e)
        if ev == "request":
            n["requests"] += 1
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
            f"(fenced or discarded {n['fenced']}) stale {n['stale']}, expiries {n['expiries']}, "
            f"faults {n['faults']}, errors {n['errors']}"
        )


class ServeTally:
    """Running counts of the serve lane's routed answers (``answer`` events)."""

    def __init__(self) -> None:
        self.n = {"requests": 0, "ok": 0, "stale": 0, "failed": 0, "faults": 0, "expiries": 0}

    def __call__(self, e: dict[str, Any]) -> None:
        ev, n = e["ev"], self.n
        if ev == "routed":
            n["requests"] += 1
        elif ev == "answer":
            n["ok" if e["equal"] else "stale" if e["status"] == 200 else "failed"] += 1
        elif ev == "fault":
            n["faults"] += 1
        elif ev == "freed" and e["reason"] == "expiry":
            n["expiries"] += 1

    def line(self) -> str:
        n = self.n
        return (
            f"routed {n['requests']}, answers as P alone {n['ok']}, stale {n['stale']}, "
            f"failed or timed out {n['failed']}, faults {n['faults']}"
        )
