"""The end of a run, either lane: check the history, print the violations,
write ``summary.json`` and the timeline."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import checker, history, timeline


def finish(
    say: Callable[[str], None],
    workdir: Path,
    head: dict[str, Any],
    check: Callable[[list[dict[str, Any]]], checker.Result],
    nem_failed: list[str],
    wall_s: float,
) -> dict[str, Any]:
    """``head`` (seed, impl, lane, minutes, bounds, lease, ...) leads the summary."""
    events = history.read(workdir / "history.jsonl")
    res = check(events)
    for v in res.violations[:10]:
        say(checker.explain(v, events, res.faults, head.get("seed")))
    if len(res.violations) > 10:
        say(f"... and {len(res.violations) - 10} more violations (summary.json lists them)")
    summary = {
        **head,
        "wall_s": round(wall_s, 1),
        "ok": res.ok,
        "figures": res.figures,
        "violations": [{"rule": v.rule, "t": v.t, "what": v.what} for v in res.violations],
        "nemesis_errors": nem_failed,
    }
    (workdir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    try:
        timeline.draw(events, res, workdir / "timeline.png")
    except ImportError as exc:
        say(f"timeline not drawn: {exc}")
    return summary
