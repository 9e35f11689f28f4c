"""P killed (SIGKILL) under a D that holds its requests, over real NIXL.

Two phases of D's requests when P dies:

- ``queued``: they wait in D's queue (``hold=True``); D keeps heartbeating
  the dead P for ``release_after_s`` and is then let read;
- ``reading``: their READs are in flight.  P is SIGSTOPped, D admits the
  requests and posts the READs, which then wait on P (seen on loopback with
  UCX's default transports and with ``UCX_TLS=tcp``: none completes while P
  is stopped), then P is SIGKILLed.

The scenario watches D from the kill on (every ``SAMPLE_S``): its steps, the
heartbeat sends that raised, and when each load ended; the tests check that
D kept stepping, that every load ended failed (never with wrong data) and
that the failed sends did not storm.
"""

from __future__ import annotations

import re
import time
from typing import Any

from .fleet import EngineProcess, Fleet, wait_for
from .scenarios import LEASE, d_id, data_mismatches, hand_to_d, prefill, wait_freed, wait_loaded

TCP = {"UCX_TLS": "tcp"}
SAMPLE_S = 0.25
BASELINE_S = 10.0


def _warm_up(p: EngineProcess, d: EngineProcess) -> None:
    """One request end to end, so later READs need no handshake first (see
    ``partition.warm_up``): a READ in flight is then a READ, not a handshake."""
    ids, params = prefill(p, "warm", 1)
    hand_to_d(d, params, hold=False)
    wait_freed(p, ids, timeout=30)
    wait_loaded(d, ids, 30)


def _max_in_window(timeline: list[tuple[float, int]], window: float) -> int:
    """Largest increase of a cumulative count within any ``window`` seconds."""
    best = 0
    j = 0
    for t, count in timeline:
        while timeline[j][0] < t - window:
            j += 1
        best = max(best, count - timeline[j][1])
    return best


def _secs(value: float | None) -> str:
    return f"{value:.3f}s" if value is not None else "< 0.1s"


def _d_log_counts(path: str) -> dict[str, int]:
    text = open(path, errors="replace").read()
    patterns = {
        "lost_connection": r"Lost the NIXL connection to P engine",
        "invalidated": r"was invalidated; re-handshaking",
        "handshake_setup_failed": r"NIXL transfer failure: handshake_setup_failed",
        "request_handshake_failed": r"NIXL transfer failure: handshake_failed",
        "released": r"Released NIXL state for replaced or locally invalid",
    }
    return {k: len(re.findall(v, text)) for k, v in patterns.items()}


def _stop(d: EngineProcess, exit_wait_s: float = 15.0) -> dict[str, Any]:
    """Stop D and time it: the answer (connector shutdown), then the process exit."""
    t = time.monotonic()
    d.call("stop", timeout=30)
    t_answer = time.monotonic()
    d.proc.join(exit_wait_s)
    t_exit = time.monotonic()
    if d.proc.is_alive():
        d.proc.kill()
        d.proc.join(5)
    return {"d_stop_s": t_answer - t, "d_exit_s": t_exit - t_answer, "d_exitcode": d.proc.exitcode}


def p_killed(
    fleet: Fleet,
    p_stock: bool,
    d_stock: bool,
    phase: str,
    n: int = 4,
    release_after_s: float = 2 * LEASE,
    watch_s: float = 60.0,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    if phase not in ("queued", "reading"):
        raise ValueError(phase)
    p = fleet.start("P", "p", stock=p_stock, env=dict(env or {}))
    d = fleet.start("D", "d", stock=d_stock, env=dict(env or {}))
    _warm_up(p, d)
    ids, params = prefill(p, "pdead", n)
    hand_to_d(d, params, hold=True)
    wait_for(lambda: all(p.report()["reqs"][r].get("hb", 0) >= 2 for r in ids), 20, what="heartbeats on P")
    p_rep = p.report()  # what P wrote, per head
    admitted_before_kill = done_before_kill = 0
    if phase == "reading":
        p.freeze()
        d.release()

        def admitted() -> dict[str, Any] | None:
            rep = d.report()
            return rep if all("admitted_t" in rep["reqs"][d_id(r)] for r in ids) else None

        wait_for(admitted, 10, poll=0.05, what="D admitting the requests")
        time.sleep(0.3)  # the admitting step posts the READs
        posted = d.report()
        admitted_before_kill = sum("admitted_t" in posted["reqs"][d_id(r)] for r in ids)
        done_before_kill = sum("read_t" in posted["reqs"][d_id(r)] for r in ids)
    d_before = d.report()
    d_stats_before = d.stats()
    t_kill = p.kill()
    released_t = t_kill if phase == "reading" else None
    samples: list[dict[str, Any]] = []
    report_s: list[float] = []
    hb0 = d_before["hb_sent"]
    while True:
        t0 = time.monotonic()
        rep = d.report()  # a D that hangs fails here (no answer within 60 s)
        report_s.append(time.monotonic() - t0)
        done = sum("read_t" in rep["reqs"][d_id(r)] for r in ids)
        samples.append(
            {
                "t": t0 - t_kill,
                "steps": rep["steps"] - d_before["steps"],
                "hb_ok": rep["hb_sent"]["msgs"] - hb0["msgs"],
                "hb_failed": rep["hb_sent"]["failed"] - hb0["failed"],
                "done": done,
            }
        )
        if released_t is None and t0 - t_kill >= release_after_s:
            d.release()
            released_t = time.monotonic()
        if done == n and released_t is not None:
            break
        if t0 - t_kill > watch_s:
            break
        time.sleep(SAMPLE_S)
    t_end = time.monotonic()
    d_rep = d.report()
    d_stats = d.stats()
    ends = [d_rep["reqs"][d_id(r)]["read_t"] for r in ids if "read_t" in d_rep["reqs"][d_id(r)]]
    failed = sum(bool(d_rep["reqs"][d_id(r)].get("failed")) for r in ids)
    loaded = [r for r in ids if "read_t" in d_rep["reqs"][d_id(r)]]
    gaps = [g for t, g in d_rep["step_gaps"] if t >= t_kill]
    # The same measure before the kill, as a baseline on a shared machine.
    gaps_before = [g for t, g in d_rep["step_gaps"] if t_kill - BASELINE_S <= t < t_kill]
    slow = [s for t, s in d_rep["slow_steps"] if t >= t_kill]
    watched = t_end - t_kill
    hb_fail_line = [(s["t"], s["hb_failed"]) for s in samples]

    def stat(key: str, stats: list[dict[str, Any]]) -> int:
        return sum(s.get(key, 0) for s in stats)

    out = {
        "ids": ids,
        "phase": phase,
        "t_kill": t_kill,
        "admitted_before_kill": admitted_before_kill,
        "done_before_kill": done_before_kill,
        "released_after_kill_s": released_t - t_kill if released_t is not None else None,
        "loaded": len(loaded),
        "failed": failed,
        # A failed load may still hold P's bytes (a READ that landed but never
        # completed): count wrong data only among the loads D accepted.
        "wrong": len(
            data_mismatches(p_rep, d_rep, [r for r in loaded if not d_rep["reqs"][d_id(r)]["failed"]])
        ),
        "end_after_kill_s": (min(ends) - t_kill, max(ends) - t_kill) if ends else None,
        "end_after_release_s": (max(ends) - released_t) if ends and released_t is not None else None,
        "watched_s": watched,
        "steps_after_kill": d_rep["steps"] - d_before["steps"],
        # None: nothing over the harness's SLOW_S (0.1 s) was logged.
        "max_step_gap_s": max(gaps, default=None),
        "max_step_gap_before_s": max(gaps_before, default=None),
        "max_step_s": max(slow, default=None),
        "max_report_s": max(report_s),
        "hb_ok_after_kill": d_rep["hb_sent"]["msgs"] - hb0["msgs"],
        "hb_failed_after_kill": d_rep["hb_sent"]["failed"] - hb0["failed"],
        "hb_failed_max_per_s": _max_in_window(hb_fail_line, 1.0),
        "first_send_failure_s": next((t for t, failed in hb_fail_line if failed), None),
        "send_failures": stat("num_heartbeat_send_failures", d_stats)
        - stat("num_heartbeat_send_failures", d_stats_before),
        "failed_transfers": stat("num_failed_transfers", d_stats)
        - stat("num_failed_transfers", d_stats_before),
        "failed_handshakes": stat("num_failed_handshakes", d_stats)
        - stat("num_failed_handshakes", d_stats_before),
        "fenced": stat("num_reads_fenced", d_stats) - stat("num_reads_fenced", d_stats_before),
        "discarded": stat("num_reads_discarded", d_stats) - stat("num_reads_discarded", d_stats_before),
        "samples": samples,
        "d": d_rep,
        "d_stats": d_stats,
        "d_errors": d_rep["errors"],
        "d_log_counts": _d_log_counts(d.log),
        "d_log": d.log,
    }
    out.update(_stop(d))
    who = f"P {'stock' if p_stock else 'ours'}, D {'stock' if d_stock else 'ours'}"
    first_fail = "never" if out["first_send_failure_s"] is None else f"+{out['first_send_failure_s']:.2f}s"
    end = out["end_after_kill_s"]
    print(
        f"\n== P killed, D's requests {phase} ({who}; env {env or {}}): loads ended {len(loaded)}/{n} "
        f"({failed} failed, {out['wrong']} wrong) "
        + (f"+{end[0]:.2f}s..+{end[1]:.2f}s after the kill" if end else "never")
        + (
            f", released +{out['released_after_kill_s']:.1f}s"
            if phase == "queued" and out["released_after_kill_s"] is not None
            else f", {admitted_before_kill} admitted / {done_before_kill} read before the kill"
        )
        + f"; fenced {out['fenced']}, discarded {out['discarded']}, failed READs {out['failed_transfers']}, "
        f"failed handshakes {out['failed_handshakes']}"
    )
    print(
        f"   D over {watched:.1f}s after the kill: {out['steps_after_kill']} steps, largest gap between "
        f"steps {_secs(out['max_step_gap_s'])} ({_secs(out['max_step_gap_before_s'])} in the "
        f"{BASELINE_S:.0f}s before), longest step {_secs(out['max_step_s'])}, slowest report "
        f"{out['max_report_s']:.3f}s; stop answered in {out['d_stop_s']:.2f}s, process exited "
        f"{out['d_exit_s']:.2f}s after that (exit code {out['d_exitcode']})"
    )
    print(
        f"   heartbeat sends after the kill: {out['hb_ok_after_kill']} accepted, "
        f"{out['hb_failed_after_kill']} raised (at most {out['hb_failed_max_per_s']} in any 1 s, first "
        f"seen {first_fail}); "
        f"connector send failures {out['send_failures']}; D log: {out['d_log_counts']}"
    )
    return out
