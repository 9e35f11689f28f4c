"""The burst scenario's margin: the longest one lease waited for a heartbeat,
not the gap between any two heartbeat messages (ours paces a round's chunks
over the interval, so P hears something far more often than each lease is
renewed)."""

from __future__ import annotations

import pytest

pytest.importorskip("nixl")
from nixl_harness.burst import summarize  # noqa: E402
from nixl_harness.scenarios import d_id  # noqa: E402


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
