"""D-side leaks: after the heal, what D holds for remote loads is back to its baseline.

Each harness D reports, with its sizes (``held`` of a ``sizes`` event, from
``Engine.d_held``): its free KV blocks, the requests it admitted whose load the
worker never reported (they keep their blocks: vLLM frees an admitted request's
blocks, aborted or not, only when the worker reports its load), and upstream's
pending receives (``_recving_metadata``).  At the end (``end`` sizes, taken in
the quiet after the heal, once every lease has ended) each live D must hold no
more than after warm-up: fewer free blocks, or more pending receives, is a
leak, named with counts and ids.  And each cancel that found its request
admitted must have been followed by that load's report on the same D process
(a READ parked for proof, then cancelled, and never posted nor failed, leaks
its blocks for good: a READ parked for proof and then aborted, before it was reported).

Findings are ``(what, engines)`` pairs; the checker makes them ``leak`` violations.
"""

from __future__ import annotations

from typing import Any

SHOWN_MAX = 20  # cancels listed (every one is counted)

Finding = tuple[str, tuple[str, ...]]


def _held(events: list[dict[str, Any]], phase: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for e in events:
        if e["ev"] == "sizes" and e.get("phase") == phase and e.get("held"):
            out[e["engine"]] = e
    return out


def d_leaks(
    events: list[dict[str, Any]], live_gen: dict[str, int | None]
) -> tuple[list[Finding], dict[str, Any]]:
    """Every D-side leak at the end (``live_gen``: each engine's live process generation) and the figures."""
    warm, end = _held(events, "warm"), _held(events, "end")
    found: list[Finding] = []
    not_free: dict[str, int] = {}
    for name, e in sorted(end.items()):
        base = warm.get(name)
        if base is None:
            continue
        now, then = e["held"], base["held"]
        lost = then["free_blocks"] - now["free_blocks"]
        if lost > 0:
            not_free[name] = lost
            found.append(
                (
                    f"{name} ({e.get('engine_id')}): {lost} KV blocks not free after the heal "
                    f"(free {now['free_blocks']}, {then['free_blocks']} after warm-up); "
                    f"{now['unread']} admitted loads never reported ({now['unread_aborted']} of them "
                    f"cancelled): {now['unread_ids']}",
                    (name,),
                )
            )
        if now["recving"] > then["recving"]:
            found.append(
                (
                    f"{name} ({e.get('engine_id')}): _recving_metadata holds {now['recving']} pending "
                    f"receives after the heal ({then['recving']} after warm-up): {now['recving_ids']}",
                    (name,),
                )
            )
    unreported = _aborts_unreported(events, live_gen)
    figures = {
        "d_leaks": len(found) + len(unreported),
        "d_blocks_not_free": not_free,
        "aborts_unreported": len(unreported),
        "checked_d_end": bool(end),
    }
    return found + unreported[:SHOWN_MAX], figures


def _aborts_unreported(events: list[dict[str, Any]], live_gen: dict[str, int | None]) -> list[Finding]:
    """Cancels that found their request admitted, on a D process still alive at the
    end, whose load that process never reported."""
    reported = {(e["id"], e.get("copy", 0), e["d"]) for e in events if e["ev"] == "read"}
    out: list[Finding] = []
    for e in events:
        if e["ev"] != "abort" or e["where"] != "admitted":
            continue
        if live_gen.get(e["d"]) != e.get("d_gen", 0):
            continue  # that D process died: its blocks went with it
        if (e["id"], e.get("copy", 0), e["d"]) in reported:
            continue
        copy = f" (copy {e['copy']})" if e.get("copy") else ""
        out.append(
            (
                f"{e['id']}{copy} cancelled on {e['d']} at {e['t']:.3f}s while admitted (its READ "
                f"parked or in flight): D never reported its load, so its KV blocks stay taken",
                (e["d"],),
            )
        )
    return out
