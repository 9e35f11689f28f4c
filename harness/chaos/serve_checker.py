"""The serve lane's checker: the harness checker's leak, memory and crash rules
(``checker``), and beside them the rules that only `vllm serve` histories need.

- **stale**: an ``answer`` with HTTP 200 whose text differs from P alone's.
- **recovery**: after the final heal, some D that is up served no probe
  correctly within ``recovery_s`` (a probe is attributed to the D whose
  finished-request counter moved).
- **leak** (``checker.check_leaks``): at the end, a ``sizes`` figure of an
  engine above its quiet value after warm-up: P's KV blocks in use (ours and
  stock) and P's active leases (ours; stock has no such count).
- **memory** and **crash**: as in the harness lane, over the servers' process trees.

Not checked here, and why: reads against a per-request pattern (a server's KV
is the model's, no pattern; a wrong read shows as a wrong answer instead),
premature expiries (P's log names vLLM's request ids, not the pair; the
expiries are counted) and P's step times (not exported by `vllm serve`).
"""

from __future__ import annotations

from typing import Any

from . import checker
from .checker import Fault, Result, Violation

SERVE_BOUNDS = {**checker.DEFAULT_BOUNDS, "recovery_s": 90.0, "rss_factor": 1.5, "rss_warm_s": 30.0}


def check(events: list[dict[str, Any]], bounds: dict[str, float] | None = None) -> Result:
    run = next((e for e in events if e["ev"] == "run"), {})
    b = {**SERVE_BOUNDS, **run.get("bounds", {}), **(bounds or {})}
    fleet = checker.Fleet(events)
    faults = checker.faults_of(events)
    violations: list[Violation] = []
    figures: dict[str, Any] = {"faults_by_kind": checker.by_kind(faults)}
    check_answers(events, faults, violations, figures)
    check_recovery(events, fleet, b, violations, figures)
    checker.check_leaks(events, {}, fleet, violations, figures)
    checker.check_memory(events, fleet, b, violations, figures)
    checker.check_crashes(events, violations, figures)
    figures["expiries"] = sum(1 for e in events if e["ev"] == "freed" and e["reason"] == "expiry")
    figures["violations"] = len(violations)
    return Result(violations=sorted(violations, key=lambda v: v.t), figures=figures, faults=faults)


def check_answers(
    events: list[dict[str, Any]], faults: list[Fault], violations: list[Violation], figures: dict[str, Any]
) -> None:
    """Stale answers, each with the faults in force while it was in flight (the
    moment it was answered may be after they healed)."""
    sent = {e["id"]: e for e in events if e["ev"] == "routed"}
    ok = stale = timeouts = 0
    errors: dict[str, int] = {}
    for e in events:
        if e["ev"] != "answer":
            continue
        if e["status"] == 200 and e["equal"]:
            ok += 1
        elif e["status"] == 200:
            stale += 1
            req = sent.get(e["id"], {})
            t0 = req.get("t", e["t"])
            during = [f.label() for f in faults if f.start <= e["t"] and f.end >= t0]
            violations.append(
                Violation(
                    "stale",
                    e["t"],
                    f"{e['id']} (prompt {req.get('prompt')}, sent at {t0:.1f}s) answered 200, not as P alone;"
                    f" faults while in flight: {', '.join(during) or 'none'}",
                )
            )
        elif e["status"] == 0 and "timed out" in e.get("error", ""):
            timeouts += 1
        else:
            key = str(e["status"]) if e["status"] else "no answer"
            errors[key] = errors.get(key, 0) + 1
    figures.update(
        requests=len(sent),
        answers_ok=ok,
        stale=stale,
        timeouts=timeouts,
        errors=dict(sorted(errors.items())),
        unanswered=len(sent) - sum(1 for e in events if e["ev"] == "answer"),
    )


def check_recovery(
    events: list[dict[str, Any]],
    fleet: checker.Fleet,
    b: dict[str, float],
    violations: list[Violation],
    figures: dict[str, Any],
) -> None:
    heal = next((e["t"] for e in events if e["ev"] == "heal_all"), None)
    if heal is None:
        figures["recovery_s"] = None
        return
    first: dict[str, float] = {}
    for e in events:
        if e["ev"] == "answer" and e["t"] >= heal and e.get("d") and e["status"] == 200 and e["equal"]:
            first.setdefault(e["d"], e["t"] - heal)
    wedged = []
    for d in fleet.live("D"):
        took = first.get(d)
        if took is None or took > b["recovery_s"]:
            wedged.append(d)
            late = "" if took is None else f" (took {took:.1f}s)"
            violations.append(
                Violation(
                    "recovery",
                    heal + b["recovery_s"],
                    f"{d} served no routed request correctly within {b['recovery_s']:.0f}s "
                    f"of the final heal{late}",
                    (d,),
                )
            )
    figures.update(recovery_s=round(max(first.values(), default=0.0), 3), wedged=wedged)
