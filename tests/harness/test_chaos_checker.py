"""The chaos checker on synthetic histories: each rule passes a clean history
and fails the one history built to break it (and says why)."""

from __future__ import annotations

from typing import Any

import pytest

from harness.chaos import checker

EXT = 4.0


def base() -> list[dict[str, Any]]:
    """Two P and two D engines on their own hosts; one request per pair read after the final heal."""
    ev: list[dict[str, Any]] = [
        {"t": 0.0, "ev": "run", "seed": 7, "extension": EXT, "lease": 6, "bounds": {"recovery_s": 10.0}},
    ]
    for name, role, host in (("p0", "P", "p"), ("p1", "P", "q"), ("d0", "D", "d"), ("d1", "D", "e")):
        ev.append(
            {
                "t": 0.1,
                "ev": "engine",
                "name": name,
                "role": role,
                "host": host,
                "engine_id": name,
                "up": True,
            }
        )
    for name in ("p0", "p1", "d0", "d1"):
        ev.append(
            {
                "t": 1.0,
                "ev": "sizes",
                "engine": name,
                "engine_id": name,
                "phase": "warm",
                "sizes": {"worker._reqs_to_send": 0},
                "keys": {"worker._remote_agents": ["p0", "p1"]},
                "rss_kb": 1000,
            }
        )
    ev.append({"t": 2.0, "ev": "phase", "name": "faults"})
    ev.append({"t": 50.0, "ev": "heal_all"})
    n = 0
    for p in ("p0", "p1"):
        for d in ("d0", "d1"):
            n += 1
            rid = f"probe-{p}-{d}"
            ev += [
                {"t": 51.0, "ev": "request", "id": rid, "p": p, "d": d, "p_engine": p, "probe": True},
                {"t": 51.0, "ev": "written", "id": rid, "digest": f"x{n}"},
                {"t": 52.0, "ev": "read", "id": rid, "d": d, "failed": False, "digest": f"x{n}"},
                {"t": 52.1, "ev": "freed", "id": rid, "p": p, "reason": "read"},
            ]
    for name in ("p0", "p1", "d0", "d1"):
        ev.append(
            {
                "t": 60.0,
                "ev": "sizes",
                "engine": name,
                "engine_id": name,
                "phase": "end",
                "sizes": {"worker._reqs_to_send": 0},
                "keys": {"worker._remote_agents": ["p0", "p1"]},
                "rss_kb": 1100,
            }
        )
    return ev


def run(ev: list[dict[str, Any]]) -> checker.Result:
    return checker.check(sorted(ev, key=lambda e: e["t"]))


def rules(res: checker.Result) -> set[str]:
    return {v.rule for v in res.violations}


def request(rid: str, t: float, p: str = "p0", d: str = "d0") -> dict[str, Any]:
    return {"t": t, "ev": "request", "id": rid, "p": p, "d": d, "p_engine": p}


def test_clean_history_passes() -> None:
    res = run(base())
    assert res.ok, res.violations
    assert res.figures["recovery_s"] == pytest.approx(2.0)
    assert res.figures["reads_ok"] == 4 and res.figures["stale"] == 0


def test_stale_read_is_caught() -> None:
    ev = base() + [
        request("r1", 10.0),
        {"t": 10.0, "ev": "written", "id": "r1", "digest": "aaa"},
        {"t": 12.0, "ev": "read", "id": "r1", "d": "d0", "failed": False, "digest": "bbb"},
        {"t": 12.1, "ev": "freed", "id": "r1", "p": "p0", "reason": "read"},
    ]
    res = run(ev)
    assert rules(res) == {"stale"} and res.figures["stale"] == 1


def test_failed_load_with_other_data_is_a_fence_not_a_stale_read() -> None:
    ev = base() + [
        request("r1", 10.0),
        {"t": 10.0, "ev": "written", "id": "r1", "digest": "aaa"},
        {"t": 12.0, "ev": "read", "id": "r1", "d": "d0", "failed": True, "digest": ""},
        {"t": 12.1, "ev": "freed", "id": "r1", "p": "p0", "reason": "expiry"},
        {"t": 5.0, "ev": "fault", "fid": 1, "kind": "partition", "hosts": ["d"], "engines": []},
        {"t": 11.0, "ev": "heal", "fid": 1},
    ]
    res = run(ev)
    assert res.ok, res.violations
    assert res.figures["reads_failed"] == 1


def test_expiry_without_a_fault_is_premature() -> None:
    ev = base() + [request("r1", 10.0), {"t": 16.0, "ev": "freed", "id": "r1", "p": "p0", "reason": "expiry"}]
    res = run(ev)
    assert rules(res) == {"premature_expiry"}


def test_expiry_after_d_gave_the_request_up_is_not_premature() -> None:
    ev = base() + [
        request("r1", 10.0),
        {"t": 10.0, "ev": "written", "id": "r1", "digest": "aaa"},
        {"t": 12.0, "ev": "read", "id": "r1", "d": "d0", "failed": True, "digest": ""},
        {"t": 16.0, "ev": "freed", "id": "r1", "p": "p0", "reason": "expiry"},
    ]
    res = run(ev)
    assert res.ok, res.violations
    assert res.figures["expiries_allowed_by"] == {checker.GAVE_UP: 1}


def test_expiry_before_d_gave_the_request_up_is_premature() -> None:
    # P let it lapse first; D's load failed because of that: no excuse.
    ev = base() + [
        request("r1", 10.0),
        {"t": 10.0, "ev": "written", "id": "r1", "digest": "aaa"},
        {"t": 16.0, "ev": "freed", "id": "r1", "p": "p0", "reason": "expiry"},
        {"t": 17.0, "ev": "read", "id": "r1", "d": "d0", "failed": True, "digest": ""},
    ]
    res = run(ev)
    assert rules(res) == {"premature_expiry"}


def test_expiry_allowed_by_a_partition_names_it() -> None:
    ev = base() + [
        request("r1", 10.0),
        {"t": 11.0, "ev": "fault", "fid": 3, "kind": "partition", "hosts": ["d"], "engines": []},
        {"t": 17.0, "ev": "heal", "fid": 3},
        {"t": 16.0, "ev": "freed", "id": "r1", "p": "p0", "reason": "expiry"},
    ]
    res = run(ev)
    assert res.ok, res.violations
    assert res.figures["expiries_allowed_by"] == {"partition": 1}


def test_fault_on_another_pair_does_not_excuse_an_expiry() -> None:
    ev = base() + [
        request("r1", 10.0),  # p0 -> d0
        {"t": 11.0, "ev": "fault", "fid": 3, "kind": "stop", "hosts": [], "engines": ["d1"]},
        {"t": 17.0, "ev": "heal", "fid": 3},
        # Host "e" (d1) cut off: p0 (host p) and d0 (host d) still talk.
        {"t": 11.0, "ev": "fault", "fid": 4, "kind": "partition", "hosts": ["e"], "engines": []},
        {"t": 17.0, "ev": "heal", "fid": 4},
        {"t": 16.0, "ev": "freed", "id": "r1", "p": "p0", "reason": "expiry"},
    ]
    assert rules(run(ev)) == {"premature_expiry"}


def test_group_partition_with_both_ends_inside_does_not_excuse() -> None:
    ev = base() + [
        request("r1", 10.0),
        {"t": 11.0, "ev": "fault", "fid": 5, "kind": "partition_group", "hosts": ["p", "d"], "engines": []},
        {"t": 17.0, "ev": "heal", "fid": 5},
        {"t": 16.0, "ev": "freed", "id": "r1", "p": "p0", "reason": "expiry"},
    ]
    assert rules(run(ev)) == {"premature_expiry"}


def test_fault_healed_long_before_the_extension_does_not_excuse() -> None:
    ev = base() + [
        request("r1", 10.0),
        {"t": 10.5, "ev": "fault", "fid": 6, "kind": "stop", "hosts": [], "engines": ["d0"]},
        {"t": 11.0, "ev": "heal", "fid": 6},
        {"t": 30.0, "ev": "freed", "id": "r1", "p": "p0", "reason": "expiry"},
    ]
    assert rules(run(ev)) == {"premature_expiry"}


def test_long_cut_excuses_for_as_long_as_it_lasted_after_the_heal() -> None:
    # A 12 s one-way cut: TCP's retransmission timer has backed off about that long,
    # so what D sends after the heal may wait ~12 s more (chaos regression 3).
    cut = [
        {"t": 10.0, "ev": "fault", "fid": 7, "kind": "asym", "hosts": ["d"], "engines": []},
        {"t": 22.0, "ev": "heal", "fid": 7},
    ]
    excused = (
        base()
        + cut
        + [request("r1", 27.0), {"t": 33.0, "ev": "freed", "id": "r1", "p": "p0", "reason": "expiry"}]
    )
    res = run(excused)
    assert res.ok, res.violations
    assert res.figures["expiries_allowed_by"] == {"asym": 1}
    too_late = (
        base()
        + cut
        + [request("r2", 36.0), {"t": 42.0, "ev": "freed", "id": "r2", "p": "p0", "reason": "expiry"}]
    )
    assert rules(run(too_late)) == {"premature_expiry"}


def test_faults_in_a_row_settle_as_one_chain() -> None:
    # Two 4 s cuts 1 s apart and a stop right after: TCP never caught up, the chain
    # (10-21 s) settles for 11 s, although each fault alone settles for 3 s or 1 s.
    ev = base() + [
        {"t": 10.0, "ev": "fault", "fid": 8, "kind": "partition", "hosts": ["d"], "engines": []},
        {"t": 14.0, "ev": "heal", "fid": 8},
        {"t": 15.0, "ev": "fault", "fid": 9, "kind": "flap", "hosts": ["d"], "engines": []},
        {"t": 19.0, "ev": "heal", "fid": 9},
        {"t": 19.5, "ev": "fault", "fid": 10, "kind": "stop", "hosts": [], "engines": ["p0"]},
        {"t": 21.0, "ev": "heal", "fid": 10},
        request("r1", 22.0),
        {"t": 30.0, "ev": "freed", "id": "r1", "p": "p0", "reason": "expiry"},
    ]
    res = run(ev)
    assert res.ok, res.violations


def test_killed_d_excuses_its_leases_expiring_later() -> None:
    ev = base() + [
        request("r1", 10.0),
        {
            "t": 11.0,
            "ev": "fault",
            "fid": 7,
            "kind": "kill",
            "hosts": [],
            "engines": ["d0"],
            "detail": {"same_id": 1},
        },
        {"t": 12.0, "ev": "heal", "fid": 7},
        {"t": 30.0, "ev": "freed", "id": "r1", "p": "p0", "reason": "expiry"},
    ]
    res = run(ev)
    assert res.ok, res.violations
    assert res.figures["faults_by_kind"] == {"kill_same_id": 1}


def test_open_lease_at_the_end_is_a_leak() -> None:
    ev = base() + [request("r1", 10.0)]
    res = run(ev)
    assert rules(res) == {"leak"} and res.figures["leases_open"] == 1


def test_lease_of_a_killed_p_is_not_a_leak() -> None:
    ev = base() + [
        {"t": 9.0, "ev": "engine", "name": "p0", "role": "P", "host": "p", "engine_id": "p0", "up": True},
        request("r1", 10.0),
        {"t": 11.0, "ev": "engine", "name": "p0", "role": "P", "host": "p", "engine_id": "p0", "up": False},
        {
            "t": 14.0,
            "ev": "engine",
            "name": "p0",
            "role": "P",
            "host": "p",
            "engine_id": "p0-g1",
            "up": True,
            "gen": 1,
        },
    ]
    # The restarted P serves the probes and is the engine the D engines know at the end.
    for e in ev:
        if e["ev"] == "request" and e.get("probe") and e["p"] == "p0":
            e["p_engine"] = "p0-g1"
            e["p_gen"] = 1
        if e["ev"] == "sizes" and e["phase"] == "end":
            e["keys"] = {"worker._remote_agents": ["p0-g1", "p1"]}
    res = run(ev)
    assert "leak" not in rules(res), res.violations


def test_lease_of_a_p_restarted_under_the_same_id_is_not_the_new_process_leak() -> None:
    ev = base() + [
        request("r1", 10.0),  # granted by p0's first process (generation 0)
        {"t": 11.0, "ev": "engine", "name": "p0", "role": "P", "host": "p", "engine_id": "p0", "up": False},
        {
            "t": 14.0,
            "ev": "engine",
            "name": "p0",
            "role": "P",
            "host": "p",
            "engine_id": "p0",
            "up": True,
            "gen": 1,
        },
    ]
    for e in ev:
        if e["ev"] == "request" and e.get("probe") and e["p"] == "p0":
            e["p_gen"] = 1
    res = run(ev)
    assert res.ok, res.violations
    # The same lease granted by the live process is a leak.
    ev.append({**request("r2", 20.0), "p_gen": 1})
    assert rules(run(ev)) == {"leak"}


def test_structure_above_quiet_size_is_a_leak() -> None:
    ev = base()
    ev[-1]["sizes"] = {"worker._reqs_to_send": 3}
    res = run(ev)
    assert rules(res) == {"leak"} and res.figures["structures_grown"] == ["d1 worker._reqs_to_send 0->3"]


def test_state_for_a_dead_engine_id_is_a_leak() -> None:
    ev = base() + [
        {"t": 20.0, "ev": "engine", "name": "p1", "role": "P", "host": "q", "engine_id": "p1", "up": False},
        {"t": 22.0, "ev": "engine", "name": "p1", "role": "P", "host": "q", "engine_id": "p1-g1", "up": True},
    ]
    for e in ev:
        if e["ev"] == "request" and e.get("probe") and e["p"] == "p1":
            e["p_engine"] = "p1-g1"
    res = run(ev)
    assert rules(res) == {"leak"}
    assert any("p1" in s for s in res.figures["dead_engine_state"])


def test_pair_that_never_recovers_is_caught() -> None:
    ev = [e for e in base() if not (e.get("id") == "probe-p1-d1" and e["ev"] == "read")]
    ev.append({"t": 52.1, "ev": "freed", "id": "probe-p1-d1x", "p": "p1", "reason": "read"})
    res = run(ev)
    assert "recovery" in rules(res)
    assert res.figures["wedged"] == ["p1->d1"]


def test_slow_recovery_is_caught() -> None:
    ev = base()
    for e in ev:
        if e["ev"] == "read" and e["id"] == "probe-p0-d0":
            e["t"] = 65.0
    res = run(ev)
    assert rules(res) == {"recovery"}


def steps(t0: float, conn: list[float], pre: list[int] | None = None, name: str = "p0") -> dict[str, Any]:
    return {
        "t": t0,
        "ev": "steps",
        "engine": name,
        "start": [t0 + 0.02 * i for i in range(len(conn))],
        "conn": conn,
        "pre": pre or [0] * len(conn),
    }


def test_p_step_slowed_by_a_dead_peer_is_caught() -> None:
    ev = base() + [
        steps(3.0, [0.002] * 100),
        {"t": 10.0, "ev": "fault", "fid": 8, "kind": "stop", "hosts": [], "engines": ["d0"]},
        steps(10.5, [0.002, 0.150, 0.002]),
        {"t": 12.0, "ev": "heal", "fid": 8},
    ]
    res = run(ev)
    assert rules(res) == {"p_step"}
    assert res.figures["worst_p_step_gain_s"] == pytest.approx(0.148)


def test_p_step_slow_from_preemption_or_its_own_fault_is_not_counted() -> None:
    ev = base() + [
        steps(3.0, [0.002] * 100),
        {"t": 10.0, "ev": "fault", "fid": 8, "kind": "stop", "hosts": [], "engines": ["d0"]},
        steps(10.5, [0.002, 0.150, 0.002], pre=[0, 3, 0]),
        {"t": 12.0, "ev": "heal", "fid": 8},
        {"t": 20.0, "ev": "fault", "fid": 9, "kind": "starve", "hosts": [], "engines": ["p0"]},
        steps(20.5, [0.300]),
        {"t": 22.0, "ev": "heal", "fid": 9},
    ]
    res = run(ev)
    assert res.ok, res.violations
    assert res.figures["p_steps_preempted"] == 1


def test_memory_growth_past_the_factor_is_caught() -> None:
    ev = base() + [
        {
            "t": 30.0,
            "ev": "sizes",
            "engine": "d0",
            "engine_id": "d0",
            "phase": "run",
            "sizes": {},
            "keys": {},
            "rss_kb": 2000,
        },
    ]
    res = run(ev)
    assert rules(res) == {"memory"} and res.figures["max_rss_growth"] == pytest.approx(2.0)


def test_explain_names_seed_window_and_active_faults() -> None:
    ev = base() + [
        request("r1", 10.0),
        {"t": 10.0, "ev": "written", "id": "r1", "digest": "aaa"},
        {"t": 11.0, "ev": "fault", "fid": 2, "kind": "asym", "hosts": ["d"], "engines": []},
        {"t": 12.0, "ev": "read", "id": "r1", "d": "d0", "failed": False, "digest": "bbb"},
        {"t": 12.1, "ev": "freed", "id": "r1", "p": "p0", "reason": "read"},
        {"t": 14.0, "ev": "heal", "fid": 2},
    ]
    ev.sort(key=lambda e: e["t"])
    res = checker.check(ev)
    text = checker.explain(res.violations[0], ev, res.faults, seed=7)
    assert "seed 7" in text and "#2 asym" in text and "r1" in text


def test_crash_is_a_violation_and_excuses_the_dead_engines_expiries() -> None:
    ev = base() + [
        request("r1", 10.0),
        {"t": 11.0, "ev": "crash", "engine": "d0", "engine_id": "d0", "why": "ucp_request.inl:356 Fatal"},
        {"t": 11.0, "ev": "fault", "fid": 10001, "kind": "crash", "hosts": [], "engines": ["d0"]},
        {"t": 14.0, "ev": "heal", "fid": 10001},
        {"t": 30.0, "ev": "freed", "id": "r1", "p": "p0", "reason": "expiry"},
    ]
    res = run(ev)
    assert rules(res) == {"crash"}
    assert res.figures["crashes"] == ["d0 at 11.0s: ucp_request.inl:356 Fatal"]


# -- clients that cancel, second readers of one lease, D-side leaks --------------------------------


def held(free: int, unread: list[str] = (), recving: list[str] = (), aborted: int = 0) -> dict[str, Any]:
    return {
        "free_blocks": free, "unread": len(unread), "unread_ids": list(unread), "unread_aborted": aborted,
        "recving": len(recving), "recving_ids": list(recving), "queued": 0,
    }  # fmt: skip


def with_held(ev: list[dict[str, Any]], end_d1: dict[str, Any]) -> list[dict[str, Any]]:
    """``base`` with D's held figures: all free after warm-up; ``end_d1`` for d1 at the end."""
    for e in ev:
        if e["ev"] == "sizes" and e["engine"] in ("d0", "d1"):
            e["held"] = held(2047) if e["phase"] == "warm" or e["engine"] == "d0" else end_d1
    return ev


def dup_request(rid: str, t: float, d2: str = "d0") -> dict[str, Any]:
    return {**request(rid, t), "dup": {"d": d2, "wait_s": 0.5}}


def test_second_reader_of_freed_blocks_is_stale_and_says_who_freed_them() -> None:
    ev = base() + [
        dup_request("r1", 10.0),
        {"t": 10.0, "ev": "written", "id": "r1", "digest": "aaa"},
        {"t": 12.0, "ev": "read", "id": "r1", "d": "d0", "failed": False, "digest": "aaa"},
        {"t": 12.1, "ev": "freed", "id": "r1", "p": "p0", "reason": "read"},
        {"t": 12.5, "ev": "read", "id": "r1", "d": "d0", "failed": False, "digest": "bbb", "copy": 1},
    ]
    res = run(ev)
    assert rules(res) == {"stale"}
    assert res.figures["stale_second_reader"] == 1 and res.figures["dups"] == {"same_d": 1, "other_d": 0}
    (v,) = res.violations
    assert "r1 (second reader, on the same D) on d0" in v.what and "p0 freed it at 12.100s (read)" in v.what
    assert res.figures["second_reads_after_free"] == {"same_data": 0, "other_data": 1}


def test_second_reader_on_another_d_fenced_is_no_violation() -> None:
    ev = base() + [
        dup_request("r1", 10.0, d2="d1"),
        {"t": 10.0, "ev": "written", "id": "r1", "digest": "aaa"},
        {"t": 12.0, "ev": "read", "id": "r1", "d": "d0", "failed": False, "digest": "aaa"},
        {"t": 12.1, "ev": "freed", "id": "r1", "p": "p0", "reason": "read"},
        {"t": 12.5, "ev": "read", "id": "r1", "d": "d1", "failed": True, "digest": "", "copy": 1},
    ]
    res = run(ev)
    assert res.ok, res.violations
    assert res.figures["second_reads"] == {"ok": 0, "failed": 1}
    assert res.figures["dups"] == {"same_d": 0, "other_d": 1}


def test_cancelled_requests_load_with_other_data_is_counted_not_stale() -> None:
    ev = base() + [
        {**request("r1", 10.0), "abort_s": 0.5},
        {"t": 10.0, "ev": "written", "id": "r1", "digest": "aaa"},
        {"t": 10.5, "ev": "abort", "id": "r1", "copy": 0, "d": "d0", "d_gen": 0, "where": "admitted"},
        {"t": 12.0, "ev": "read", "id": "r1", "d": "d0", "failed": False, "digest": "bbb", "aborted": True},
        {"t": 12.1, "ev": "freed", "id": "r1", "p": "p0", "reason": "read"},
    ]
    res = run(ev)
    assert res.ok, res.violations
    assert res.figures["stale_after_abort"] == 1 and res.figures["aborts"] == {"admitted": 1}


def test_expiry_after_every_submission_gave_up_names_the_cancel() -> None:
    ev = base() + [
        dup_request("r1", 10.0),
        {"t": 11.0, "ev": "read", "id": "r1", "d": "d0", "failed": True, "digest": "", "copy": 1},
        {"t": 11.5, "ev": "abort", "id": "r1", "copy": 0, "d": "d0", "d_gen": 0, "where": "queued"},
        {"t": 16.0, "ev": "freed", "id": "r1", "p": "p0", "reason": "expiry"},
    ]
    res = run(ev)
    assert res.ok, res.violations
    assert res.figures["expiries_allowed_by"] == {"aborted on D": 1}


def test_expiry_while_a_second_submission_still_waits_is_premature() -> None:
    ev = base() + [
        dup_request("r1", 10.0),
        {"t": 11.0, "ev": "read", "id": "r1", "d": "d0", "failed": True, "digest": ""},
        {"t": 16.0, "ev": "freed", "id": "r1", "p": "p0", "reason": "expiry"},
    ]
    assert rules(run(ev)) == {"premature_expiry"}


def test_cancel_that_found_a_waiting_request_gone_does_not_give_it_up() -> None:
    ev = base() + [
        request("r1", 10.0),
        {"t": 11.0, "ev": "abort", "id": "r1", "copy": 0, "d": "d0", "d_gen": 0, "where": "gone"},
        {"t": 16.0, "ev": "freed", "id": "r1", "p": "p0", "reason": "expiry"},
    ]
    assert rules(run(ev)) == {"premature_expiry"}


def test_d_holding_blocks_after_the_heal_is_a_leak_with_ids() -> None:
    res = run(with_held(base(), held(2015, ["d-r1", "d-r2"], aborted=2)))
    assert rules(res) == {"leak"} and res.figures["d_blocks_not_free"] == {"d1": 32}
    (v,) = res.violations
    assert "d1 (d1): 32 KV blocks not free after the heal (free 2015, 2047 after warm-up)" in v.what
    assert "2 admitted loads never reported (2 of them cancelled): ['d-r1', 'd-r2']" in v.what


def test_pending_receives_after_the_heal_are_a_leak_with_ids() -> None:
    res = run(with_held(base(), held(2047, recving=["d-r3"])))
    assert rules(res) == {"leak"} and res.figures["d_leaks"] == 1
    assert "_recving_metadata holds 1 pending receives after the heal (0 after warm-up): ['d-r3']" in (
        res.violations[0].what
    )


def test_clean_d_at_the_end_is_no_leak() -> None:
    res = run(with_held(base(), held(2047)))
    assert res.ok, res.violations
    assert res.figures["checked_d_end"] and res.figures["d_leaks"] == 0


def test_cancel_of_an_admitted_request_never_reported_is_a_leak() -> None:
    abort = {"t": 11.0, "ev": "abort", "id": "r1", "copy": 0, "d": "d1", "d_gen": 0, "where": "admitted"}
    ev = base() + [{**request("r1", 10.0, d="d1"), "abort_s": 1.0}, abort]
    ev.append({"t": 12.0, "ev": "freed", "id": "r1", "p": "p0", "reason": "read"})
    res = run(ev)
    assert rules(res) == {"leak"} and res.figures["aborts_unreported"] == 1
    assert "r1 cancelled on d1 at 11.000s while admitted" in res.violations[0].what
    # Reported (failed or not) by the same process: no leak.
    reported = ev + [
        {"t": 11.5, "ev": "read", "id": "r1", "d": "d1", "failed": True, "digest": "", "aborted": True}
    ]
    assert run(reported).ok
    # That D process died since: its blocks went with it.
    restarted = [{**e, "gen": 1} if e["ev"] == "engine" and e["name"] == "d1" else e for e in ev]
    assert run(restarted).figures["aborts_unreported"] == 0


def test_progress_counts_a_cancelled_loads_other_data_apart_from_stale_reads() -> None:
    from harness.chaos.progress import Tally

    tally = Tally()
    for e in (
        {"t": 1.0, "ev": "written", "id": "r1", "digest": "aaa"},
        {"t": 2.0, "ev": "read", "id": "r1", "d": "d0", "failed": False, "digest": "bbb", "aborted": True},
        {"t": 2.0, "ev": "read", "id": "r1", "d": "d1", "failed": False, "digest": "bbb", "copy": 1},
    ):
        tally(e)
    assert (tally.n["after_abort"], tally.n["stale"]) == (1, 1)


def test_heals_past_their_planned_end_are_counted_kills_aside() -> None:
    def fault(t: float, fid: int, kind: str, until: float, **where: list[str]) -> dict[str, Any]:
        ev = {"t": t, "ev": "fault", "fid": fid, "kind": kind, "hosts": [], "engines": [], "until": until}
        return {**ev, **where}

    ev = base() + [
        fault(10.0, 3, "partition", 12.0, hosts=["d"]),
        {"t": 12.05, "ev": "heal", "fid": 3},  # on time
        fault(13.0, 4, "stop", 15.0, engines=["d1"]),
        {"t": 23.5, "ev": "heal", "fid": 4},  # the nemesis was starved
        fault(24.0, 5, "kill", 25.0, engines=["d1"]),
        {"t": 40.0, "ev": "heal", "fid": 5},  # a restart: not late
    ]
    fig = run(ev).figures
    assert fig["late_heals"] == 1 and fig["latest_heal_s"] == pytest.approx(8.5)
    assert run(base()).figures["late_heals"] == 0
