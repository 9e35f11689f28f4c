"""Clients that cancel and second readers of one lease, as the checker sees them.

A request of the workload may carry ``abort_s`` (its client cancels it: an
``abort`` event says where D found it: "queued", "admitted" or "gone") and
``dup`` (its P params were submitted a second time: reads of that submission
carry ``copy`` 1).  Both read P's blocks under one lease, and P frees the lease
at the first completion, so a second reader that reads later reads freed
blocks unless D fences it: its read is judged like any other (a stale read).

- **given up**: D heartbeats a request only while some submission of it still
  waits; once every submission has failed its load or been cancelled, P can
  only let the lease lapse (an expiry then is no fault of the lease).
- **aborted reads**: a cancelled request's load that completes is thrown away
  by vLLM (the request is finished: its blocks are freed, never cached), so its
  data is counted (``stale_after_abort``) but is not a stale read; that it
  completes at all, and frees D's blocks, is the leak rule's (``d_leaks``).
"""

from __future__ import annotations

from typing import Any

ABORTED = "aborted on D"


def copies(req: dict[str, Any]) -> int:
    """How many submissions of ``req`` D got."""
    return 1 + ("dup" in req)


def given_up(
    events: list[dict[str, Any]], requests: dict[str, dict[str, Any]]
) -> dict[str, tuple[float, str | None]]:
    """Per request id: when its last submission still waiting gave up, and
    ``ABORTED`` if that was a cancel (None: a failed load).  The first failed
    load of a request submitted once, as before there were second submissions."""
    ended: dict[str, dict[int, tuple[float, str | None]]] = {}
    for e in events:
        if e["ev"] == "read" and e["failed"]:
            why = None
        elif e["ev"] == "abort" and e["where"] != "gone":
            why = ABORTED
        else:
            continue
        ended.setdefault(e["id"], {}).setdefault(e.get("copy", 0), (e["t"], why))
    out = {}
    for rid, by_copy in ended.items():
        req = requests.get(rid)
        if req is None or len(by_copy) < copies(req):
            continue
        out[rid] = max(by_copy.values(), key=lambda tw: tw[0])
    return out


def reader(e: dict[str, Any], requests: dict[str, dict[str, Any]]) -> str:
    """How a read event names its reader in a violation: the second submission says so."""
    if not e.get("copy"):
        return ""
    req = requests.get(e["id"], {})
    where = "on the same D" if req.get("d") == e["d"] else f"its first on {req.get('d')}"
    return f" (second reader, {where})"


def freed_before(e: dict[str, Any], freed: dict[str, dict[str, Any]]) -> str:
    """When and why P freed the lease, if before this read completed."""
    f = freed.get(e["id"])
    if f is None or f["t"] > e["t"]:
        return ""
    return f"; {f['p']} freed it at {f['t']:.3f}s ({f['reason']})"


def figures(events: list[dict[str, Any]], requests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The workload's cancels and second submissions, and what became of the second reads."""
    aborts: dict[str, int] = {}
    for e in events:
        if e["ev"] == "abort":
            aborts[e["where"]] = aborts.get(e["where"], 0) + 1
    dups = [r for r in requests.values() if "dup" in r]
    second = {"ok": 0, "failed": 0}
    written = {e["id"]: e["digest"] for e in events if e["ev"] == "written"}
    freed = {e["id"]: e["t"] for e in events if e["ev"] == "freed"}
    after_free = {"same_data": 0, "other_data": 0}
    for e in events:
        if e["ev"] == "read" and e.get("copy"):
            second["failed" if e["failed"] else "ok"] += 1
            if not e["failed"] and freed.get(e["id"], e["t"] + 1) <= e["t"]:
                after_free["same_data" if written.get(e["id"]) == e["digest"] else "other_data"] += 1
    return {
        "aborts": dict(sorted(aborts.items())),
        "dups": {
            "same_d": sum(1 for r in dups if r["dup"]["d"] == r["d"]),
            "other_d": sum(1 for r in dups if r["dup"]["d"] != r["d"]),
        },
        "second_reads": second,  # "ok": completed (judged stale or not by the read rule)
        # Second reads D accepted that completed after P had freed the lease: with other data a
        # stale read; with the same data posted before the free, or read before P reused the blocks.
        "second_reads_after_free": after_free,
    }
