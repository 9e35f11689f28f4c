"""The burst scenario's margin: the longest one lease waited for a heartbeat,
not the gap between any two heartbeat messages (ours paces a round's chunks
over the interval, so P hears something far more often than each lease is
renewed)."""

from __future__ import annotations

import pytest

pytest.importorskip("nixl")
from harness.nixl.burst import summarize
from harness.nixl.scenarios import d_id


def test_lease_gap_is_per_lease_and_runs_until_the_free() -> None:
    # Two leases heartbeated by alternating chunks: P hears one every 0.5 s,
    # each lease every 1.0 s; "b" then waits 1.6 s more until its read frees it.
    p_reqs = {
        "a": {"hb_max_gap": 1.0, "hb_last_t": 12.0, "freed_t": 12.3, "freed_reason": "read", "digest": "x"},
        "b": {"hb_max_gap": 1.0, "hb_last_t": 11.5, "freed_t": 13.1, "freed_reason": "read", "digest": "y"},
        "c": {"freed_t": 10.2, "freed_reason": "read", "digest": "z"},  # read before any heartbeat
    }
    p_rep = {"reqs": p_reqs, "hb_arrivals": [10.0, 10.5, 11.0, 11.5, 12.0], "errors": []}
    d_rep = {
        "reqs": {d_id(r): {"read_t": rec["freed_t"], "digest": rec["digest"]} for r, rec in p_reqs.items()},
        "max_step_s": 0.1,
        "slow_phases": [],
        "errors": [],
    }
    out = summarize(p_rep, d_rep, list(p_reqs), [], 3, 0, False, 6.0, 9.0)
    assert out["max_hb_gap_s"] == 1.1  # 12.0 -> the last free at 13.1
    assert out["max_lease_gap_s"] == 1.6  # "b": 11.5 -> 13.1
    assert out["premature_expiries"] == 0 and out["wrong_reads"] == 0


def test_a_load_given_up_while_p_still_held_the_lease_is_fenced_live() -> None:
    # "a": D gave its load up at 11.0, P expired the lease only at 12.0 (D had
    # stopped heartbeating it): P held it when D fenced.  "b": P expired it
    # first and D failed the load after: a premature expiry, not a live fence.
    p_reqs = {
        "a": {"granted_t": 9.0, "hb_first_t": 9.2, "hb_last_t": 10.9, "freed_t": 12.0},
        "b": {"granted_t": 9.0, "hb_first_t": 9.5, "hb_last_t": 10.0, "freed_t": 11.1},
    }
    for rec in p_reqs.values():
        rec["freed_reason"] = "expiry"
    p_rep = {"reqs": p_reqs, "hb_arrivals": [9.2, 9.5, 10.0, 10.9], "errors": []}
    d_rep = {
        "reqs": {d_id("a"): {"read_t": 11.0, "failed": True}, d_id("b"): {"read_t": 11.5, "failed": True}},
        "max_step_s": 0.1,
        "slow_phases": [],
        "errors": [],
    }
    out = summarize(p_rep, d_rep, ["a", "b"], [], 2, 0, False, 2.0, 9.0)
    assert out["fenced_live"] == 1 and out["failed_loads"] == 2 and out["premature_expiries"] == 2
    assert out["max_first_hb_s"] == 0.5  # "b": granted at 9.0, first named at 9.5
