"""The serve lane's checker: the harness checker's leak, memory and crash rules
(``checker``), its recovery rule over this lane's evidence, and beside them the
rules that only `vllm serve` histories need.

- **stale**: an ``answer`` with HTTP 200 whose text differs from P alone's (every
  choice of an n = 2 answer; each of a hedged decode step's two answers, the
  second reader of one lease).  A client that hung up (``cancelled``) is
  counted, not a timeout.
- **recovery** (``checker.check_recovery``, the one rule of both lanes, over D's
  answers): after the final heal, some D that is up served no probe correctly
  within ``recovery_s`` (a probe is attributed to the D whose finished-request
  counter moved).
- **leak** (``checker.check_leaks``): at the end, a ``sizes`` figure of an
  engine above its quiet value after warm-up: P's and D's KV blocks in use
  (ours and stock), D's running and waiting requests (a request cancelled while
  its load was parked, never reported, keeps its blocks, and vLLM counts it
  neither running nor waiting: the blocks show it), and P's active leases
  (ours; stock has no such count).
- **memory** and **crash**: as in the harness lane, over the servers' process trees.

Not checked here, and why: reads against a per-request pattern (a server's KV
is the model's, no pattern; a wrong read shows as a wrong answer instead),
premature expiries (P's log names vLLM's request ids, not the pair; the
expiries are counted) and P's step times (not exported by `vllm serve`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import checker
from .checker import Fault, Result, Violation

SERVE_BOUNDS = {**checker.DEFAULT_BOUNDS, "recovery_s": 90.0, "rss_factor": 1.5, "rss_warm_s": 30.0}


def check(events: list[dict[str, Any]], bounds: dict[str, float] | None = None) -> Result:
    run = next((e for e in events if e["ev"] == "run"), {})
    b = {**SERVE_BOUNDS, **run.get("bounds", {}), **(bounds or {})}
    engines = checker.EngineLifetimes(events)
    faults = checker.faults_of(events)
    violations: list[Violation] = []
    figures: dict[str, Any] = {"faults_by_kind": checker.by_kind(faults)}
    check_answers(events, faults, violations, figures)
    live_ds = {d: (d,) for d in engines.live("D")}
    checker.check_recovery(
        events, _first_answers_by_d(events), live_ds, "routed request", b, violations, figures
    )
    checker.check_leaks(events, {}, engines, violations, figures)
    checker.check_memory(events, engines, b, violations, figures)
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
    ok = stale = timeouts = cancelled = 0
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
            how = _how(req, e)
            violations.append(
                Violation(
                    "stale",
                    e["t"],
                    f"{e['id']}{how} (prompt {req.get('prompt')}, sent at {t0:.1f}s) answered 200,"
                    " not as P alone;"
                    f" faults while in flight: {', '.join(during) or 'none'}",
                )
            )
        elif e.get("cancelled"):
            cancelled += 1
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
        cancelled=cancelled,
        errors=dict(sorted(errors.items())),
        unanswered=len(sent) - len({e["id"] for e in events if e["ev"] == "answer"}),
        n2=sum(1 for r in sent.values() if r.get("n", 1) > 1),
        hedged=sum(1 for r in sent.values() if r.get("hedge")),
    )


def _how(req: dict[str, Any], answer: dict[str, Any]) -> str:
    """What kind of request a stale answer was: n = 2, or which reader of a hedged one."""
    if req.get("n", 1) > 1:
        return f" (n={req['n']}: some choice differs)"
    if req.get("hedge"):
        same = "same D" if len(set(req["hedge"])) == 1 else "two Ds"
        nth = answer.get("copy", 0) + 1  # by submission: which of the two read first is not known
        return f" (hedged decode step on {answer.get('d')}, submission {nth} of 2, {same})"
    return ""


def _first_answers_by_d(events: list[dict[str, Any]]) -> Callable[[float], dict[str, float]]:
    """The serve lane's evidence of recovery: per D, its first answer equal to P alone's after the heal."""

    def served_after(heal: float) -> dict[str, float]:
        first: dict[str, float] = {}
        for e in events:
            if e["ev"] == "answer" and e["t"] >= heal and e.get("d") and e["status"] == 200 and e["equal"]:
                first.setdefault(e["d"], e["t"] - heal)
        return first

    return served_after
