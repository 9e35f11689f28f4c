"""The serve lane's checker on synthetic histories: each serve rule passes a
clean history and fails the one built to break it (and says why)."""

from __future__ import annotations

from typing import Any

import pytest

from harness.chaos import serve_checker
from harness.chaos.progress import ServeTally


def _sizes(t: float, name: str, phase: str, blocks: int, leases: int | None, rss: int) -> dict[str, Any]:
    sizes = {"kv_blocks_used": blocks, **({"leases_active": leases} if leases is not None else {})}
    return {"t": t, "ev": "sizes", "engine": name, "engine_id": f"{name}-g0", "phase": phase,
            "sizes": sizes, "keys": {}, "rss_kb": rss}  # fmt: skip


def _answer(
    t: float, rid: str, status: int, equal: bool, d: str | None = None, error: str = ""
) -> list[dict[str, Any]]:
    return [
        {"t": t - 0.5, "ev": "routed", "id": rid, "prompt": 3, "burst": False, "probe": d is not None},
        {"t": t, "ev": "answer", "id": rid, "status": status, "equal": equal, "error": error,
         "elapsed_s": 0.5, "d": d},
    ]  # fmt: skip


def base() -> list[dict[str, Any]]:
    """1 P and 2 D; answers as P alone; both Ds probed after the final heal; quiet sizes."""
    ev: list[dict[str, Any]] = [
        {"t": 0.0, "ev": "run", "seed": 5, "lane": "serve", "bounds": {"recovery_s": 20.0}}
    ]
    for name, role, host in (("p0", "P", "p"), ("d0", "D", "d"), ("d1", "D", "e")):
        ev.append({"t": 0.1, "ev": "engine", "name": name, "role": role, "host": host,
                   "engine_id": f"{name}-g0", "pid": 1, "gen": 0, "up": True})  # fmt: skip
    ev += [_sizes(1.0, "p0", "warm", 0, 0, 1000), _sizes(1.0, "d0", "warm", 0, None, 1000)]
    ev.append({"t": 2.0, "ev": "phase", "name": "faults"})
    ev += _answer(5.0, "s1", 200, True)
    ev.append({"t": 6.0, "ev": "fault", "fid": 1, "kind": "partition", "hosts": ["d"], "engines": [],
               "until": 9.0, "detail": {}})  # fmt: skip
    ev += _answer(8.0, "s2", 0, False, error="TimeoutError: timed out")
    ev.append({"t": 9.0, "ev": "heal", "fid": 1})
    ev.append({"t": 30.0, "ev": "heal_all"})
    ev += _answer(32.0, "p1", 200, True, d="d0") + _answer(33.0, "p2", 200, True, d="d1")
    ev += [_sizes(60.0, "p0", "end", 0, 0, 1100), _sizes(60.0, "d0", "end", 0, None, 1200)]
    return sorted(ev, key=lambda e: e["t"])


def test_clean_history_passes_and_counts() -> None:
    res = serve_checker.check(base())
    assert res.ok, res.violations
    fig = res.figures
    assert (fig["requests"], fig["answers_ok"], fig["stale"], fig["timeouts"]) == (4, 3, 0, 1)
    assert fig["recovery_s"] == 3.0 and fig["leaks"] == 0 and fig["faults_by_kind"] == {"partition": 1}


def test_http_200_that_differs_from_p_alone_is_stale() -> None:
    ev = sorted(base() + _answer(7.0, "s9", 200, False), key=lambda e: e["t"])
    res = serve_checker.check(ev)
    assert [v.rule for v in res.violations] == ["stale"]
    assert "s9" in res.violations[0].what and res.figures["stale"] == 1
    assert "faults while in flight: #1 partition d" in res.violations[0].what


def test_an_error_is_not_stale() -> None:
    ev = sorted(base() + _answer(7.0, "s9", 500, False, error="HTTP 500"), key=lambda e: e["t"])
    res = serve_checker.check(ev)
    assert res.ok and res.figures["errors"] == {"500": 1}


def test_a_d_never_probed_correctly_after_the_heal_is_not_recovered() -> None:
    ev = [e for e in base() if e.get("d") != "d1"]  # d1's probe answer gone
    res = serve_checker.check(ev)
    assert [v.rule for v in res.violations] == ["recovery"] and "d1" in res.violations[0].what
    assert res.figures["wedged"] == ["d1"]


def test_a_probe_slower_than_the_bound_fails_recovery() -> None:
    ev = base()
    for e in ev:
        if e["ev"] == "answer" and e["id"] == "p2":
            e["t"] = 55.0  # 25 s after the heal, bound 20 s
    res = serve_checker.check(sorted(ev, key=lambda e: e["t"]))
    assert [v.rule for v in res.violations] == ["recovery"] and "took 25.0s" in res.violations[0].what


def test_a_killed_d_that_is_still_down_is_not_owed_a_probe() -> None:
    ev = [e for e in base() if e.get("d") != "d1"]
    ev.append({"t": 40.0, "ev": "engine", "name": "d1", "role": "D", "host": "e", "engine_id": "d1-g0",
               "pid": 1, "gen": 0, "up": False})  # fmt: skip
    assert serve_checker.check(sorted(ev, key=lambda e: e["t"])).ok


def test_p_holding_leases_or_blocks_at_the_end_is_a_leak() -> None:
    for blocks, leases in ((0, 3), (12, 0)):
        ev = [e for e in base() if not (e["ev"] == "sizes" and e["phase"] == "end" and e["engine"] == "p0")]
        ev.append(_sizes(60.0, "p0", "end", blocks, leases, 1100))
        res = serve_checker.check(sorted(ev, key=lambda e: e["t"]))
        assert [v.rule for v in res.violations] == ["leak"], (blocks, leases)
        assert "p0" in res.violations[0].what


def test_rss_past_the_factor_and_a_crash_are_violations() -> None:
    ev = base() + [_sizes(50.0, "d0", "run", 0, None, 2000)]
    ev.append(
        {"t": 20.0, "ev": "crash", "engine": "d1", "engine_id": "d1-g0", "pid": 1, "why": "EngineDeadError"}
    )
    res = serve_checker.check(sorted(ev, key=lambda e: e["t"]))
    assert sorted(v.rule for v in res.violations) == ["crash", "memory"]


def test_serve_tally_counts_answers() -> None:
    tally = ServeTally()
    for e in base():
        tally(e)
    assert (
        tally.n["requests"] == 4 and tally.n["ok"] == 3 and tally.n["failed"] == 1 and tally.n["stale"] == 0
    )
    assert "stale 0" in tally.line()


def test_timeline_draws_a_serve_history(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from harness.chaos import timeline

    events = base()
    events[0]["engines"] = {"p0": {"role": "P", "host": "p"}, "d0": {"role": "D", "host": "d"}}
    timeline.draw(events, serve_checker.check(events), tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 10_000


def test_second_reader_of_a_hedged_decode_step_answering_other_text_is_stale() -> None:
    ok = {"status": 200, "error": "", "elapsed_s": 1.0, "d": "d0"}
    ev = base() + [
        {
            "t": 10.0,
            "ev": "routed",
            "id": "s7",
            "prompt": 2,
            "burst": False,
            "probe": False,
            "hedge": ["d0", "d0"],
        },
        {"t": 11.0, "ev": "answer", "id": "s7", "copy": 0, "equal": True, **ok},
        {"t": 11.2, "ev": "answer", "id": "s7", "copy": 1, "equal": False, **ok},
    ]
    res = serve_checker.check(sorted(ev, key=lambda e: e["t"]))
    assert [v.rule for v in res.violations] == ["stale"]
    assert "s7 (hedged decode step on d0, submission 2 of 2, same D)" in res.violations[0].what
    assert res.figures["hedged"] == 1 and res.figures["unanswered"] == 0


def test_n2_answer_and_cancelled_client_are_named_and_counted() -> None:
    ev = base() + [
        {"t": 10.0, "ev": "routed", "id": "s8", "prompt": 2, "burst": False, "probe": False, "n": 2},
        {"t": 11.0, "ev": "answer", "id": "s8", "status": 200, "equal": False, "error": "", "elapsed_s": 1.0},
        {"t": 12.0, "ev": "routed", "id": "s9", "prompt": 2, "burst": False, "probe": False, "cancel_s": 0.3},
        {"t": 12.3, "ev": "answer", "id": "s9", "status": 0, "equal": False, "elapsed_s": 0.3,
         "error": "TimeoutError: timed out", "cancelled": True},
    ]  # fmt: skip
    res = serve_checker.check(sorted(ev, key=lambda e: e["t"]))
    assert [v.rule for v in res.violations] == [
        "stale"
    ] and "s8 (n=2: some choice differs)" in res.violations[0].what
    assert (res.figures["cancelled"], res.figures["timeouts"], res.figures["n2"]) == (1, 1, 1)


def test_d_holding_blocks_or_requests_after_the_heal_is_a_leak() -> None:
    ev = base()
    for e in ev:
        if e["ev"] == "sizes" and e["engine"] == "d0":
            e["sizes"]["requests_waiting"] = 0
            if e["phase"] == "end":
                e["sizes"].update(kv_blocks_used=24, requests_waiting=2)
    res = serve_checker.check(ev)
    assert {v.rule for v in res.violations} == {"leak"}
    assert sorted(res.figures["structures_grown"]) == ["d0 kv_blocks_used 0->24", "d0 requests_waiting 0->2"]
