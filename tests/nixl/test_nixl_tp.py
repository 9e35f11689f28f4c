"""Heterogeneous TP over real NIXL: P with TP 2 (two worker processes) and D
with TP 1, and the reverse (P TP 1, D TP 2).

Run with ``-s`` (or ``-rP``) to see heartbeat counts per scenario.
"""

from __future__ import annotations

import pytest

pytest.importorskip("nixl")
from harness.nixl import Fleet
from harness.nixl import scenarios as sc


@pytest.mark.parametrize(
    "p_stock,d_stock",
    [
        pytest.param(False, False, id="ourP-ourD"),
        pytest.param(False, True, id="ourP-stockD"),
        pytest.param(True, False, id="stockP-ourD"),
    ],
)
def test_p_tp2_d_tp1_every_rank_heartbeated_and_freed_once(tmp_path, p_stock: bool, d_stock: bool) -> None:
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = sc.hetero_tp(fleet, p_stock, d_stock)
    reqs = out["p"]["reqs"]
    for r in out["ids"]:
        rec = reqs[r]
        assert rec["hb_ranks"] == {0, 1}, "a P rank holding blocks got no heartbeat"
        assert sorted(rec["sent_ranks"]) == [0, 1], "each P rank must free exactly once"
        assert rec["freed_reason"] == "read"
        assert sorted(rec["digest"]) == [0, 1]  # both KV heads, one per P rank
    assert sc.data_mismatches(out["p"], out["d"], out["ids"]) == []
    assert not out["p"]["errors"] and not out["d"]["errors"]


FLEETS = [
    pytest.param(False, False, id="ourP-ourD"),
    pytest.param(False, True, id="ourP-stockD"),
    pytest.param(True, False, id="stockP-ourD"),
]


@pytest.mark.parametrize("p_stock,d_stock", FLEETS)
def test_p_tp1_d_tp2_both_d_ranks_read_and_renew_p_frees_once(tmp_path, p_stock: bool, d_stock: bool) -> None:
    """Each D rank reads its KV head from P rank 0 and heartbeats it; P takes
    two completions ("<id>:2") and frees once; the queue outlives a lease."""
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = sc.hetero_tp_reverse(fleet, p_stock, d_stock)
    ids = out["ids"]
    assert out["held_s"] > sc.LEASE, "the requests did not wait past one lease"
    during = out["during"]["reqs"]
    assert not [r for r in ids if "freed_t" in during[r]], "a lease expired while D queued"
    reqs = out["p"]["reqs"]
    for r in ids:
        rec = reqs[r]
        assert len(rec["hb_agents"]) == 2, "both D ranks (agents) must heartbeat P rank 0"
        assert rec["sent_ranks"] == [0], "P must free each request exactly once"
        assert rec["freed_reason"] == "read"
        assert sorted(c for _, _, c in rec["completions"]) == ["2", "2"], rec["completions"]
        assert len({agent for _, agent, _ in rec["completions"]}) == 2
        d_rec = out["d"]["reqs"][sc.d_id(r)]
        assert d_rec["recv_ranks"] == {0, 1} and not d_rec["failed"]
    assert sc.data_mismatches(out["p"], out["d"], ids) == []
    assert sc.wrong_by_rank(out["p"], out["d"], ids, {0: [0], 1: [1]}) == {0: 0, 1: 0}
    assert sum(s.get("num_kv_expired_reqs", 0) for s in out["p_stats"]) == 0
    if not d_stock:
        assert [s.get("num_reads_fenced", 0) for s in out["d_stats"]] == [0, 0]
    if not (p_stock or d_stock):
        # Each D rank's agent said hello and got its own acknowledgements,
        # and they renewed its views while the requests queued.
        acks = [s.get("num_heartbeat_acks_recv", 0) for s in out["d_stats_during"]]
        renewed = [s.get("num_heartbeat_views_renewed", 0) for s in out["d_stats_during"]]
        assert min(acks) > 0 and min(renewed) > 0, (acks, renewed)
        assert sum(s.get("num_heartbeat_acks_sent", 0) for s in out["p_stats"]) > 0
    assert not out["p"]["errors"] and not out["d"]["errors"]
