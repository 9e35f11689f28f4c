"""Lease scenarios between real P and D processes over NIXL/UCX (loopback, CPU KV).

Every scenario runs for each fleet: ours on both sides, our P with a stock
(vLLM 0.33.0) D, and a stock P with our D: wire compatibility is the contract.
Run with ``-s`` (or ``-rP``) to see the reclaim times and heartbeat counts.
"""

from __future__ import annotations

import pytest

pytest.importorskip("nixl")
from harness.nixl import Fleet
from harness.nixl import scenarios as sc

FLEETS = [
    pytest.param(False, False, id="ourP-ourD"),
    pytest.param(False, True, id="ourP-stockD"),
    pytest.param(True, False, id="stockP-ourD"),
]


def _no_errors(*reports: dict) -> None:
    for rep in reports:
        assert not rep["errors"], f"{rep['engine_id']} step errors:\n" + "\n".join(rep["errors"][:3])


@pytest.mark.parametrize("p_stock,d_stock", FLEETS)
def test_happy_path(tmp_path, p_stock: bool, d_stock: bool) -> None:
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = sc.happy_path(fleet, p_stock, d_stock)
    reqs = out["p"]["reqs"]
    assert {reqs[r]["freed_reason"] for r in out["ids"]} == {"read"}
    assert all(reqs[r]["sent_ranks"] == [0] for r in out["ids"]), "freed more than once"
    assert sc.data_mismatches(out["p"], out["d"], out["ids"]) == []
    assert sum(s.get("num_kv_expired_reqs", 0) for s in out["p_stats"]) == 0
    _no_errors(out["p"], out["d"])


@pytest.mark.parametrize("p_stock,d_stock", FLEETS)
def test_d_overloaded_requests_survive_three_leases(tmp_path, p_stock: bool, d_stock: bool) -> None:
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = sc.overloaded(fleet, p_stock, d_stock)
    during = out["during"]["reqs"]
    assert not [r for r in out["ids"] if "freed_t" in during[r]], "a lease expired while D was still queueing"
    # A heartbeat per second for 18 s; half of them is plenty of slack.
    assert min(during[r]["hb"] for r in out["ids"]) >= 3 * sc.LEASE // 2
    reqs = out["p"]["reqs"]
    assert {reqs[r]["freed_reason"] for r in out["ids"]} == {"read"}
    assert sc.data_mismatches(out["p"], out["d"], out["ids"]) == []
    _no_errors(out["p"], out["d"])
    added = [s["harness_agents_added"] for s in out["d_stats"]]
    print(f"D loaded P's NIXL agent {added} times (heartbeats first, then the READs)")
    if not d_stock:  # the READs used the connection the heartbeats made (vLLM 0.33's D makes a second)
        assert added == [1]


@pytest.mark.parametrize("p_stock,d_stock", FLEETS)
def test_d_killed_p_reclaims_after_extension_and_serves_new_d(tmp_path, p_stock: bool, d_stock: bool) -> None:
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = sc.d_killed(fleet, p_stock, d_stock)
    reqs = out["p"]["reqs"]
    for r in out["ids"]:
        rec = reqs[r]
        assert rec["freed_reason"] == "expiry"
        assert rec["freed_t"] > out["killed_t"]
        # deadline = max(grant + lease, last heartbeat + extension); P frees
        # on its first step at or after it.
        deadline = max(rec["finished_t"] + sc.LEASE, rec["hb_last_t"] + sc.EXTENSION)
        assert deadline - 0.1 <= rec["freed_t"] <= deadline + sc.STEP_SLACK, rec["freed_t"] - deadline
        assert rec["hb_last_t"] + sc.EXTENSION >= rec["finished_t"] + sc.LEASE, (
            "grant, not heartbeat, decided"
        )
    reqs2 = out["p2"]["reqs"]
    assert {reqs2[r]["freed_reason"] for r in out["ids2"]} == {"read"}
    assert sc.data_mismatches(out["p2"], out["d2"], out["ids2"]) == []
    _no_errors(out["p2"], out["d2"])


@pytest.mark.parametrize("p_stock", [pytest.param(False, id="ourP"), pytest.param(True, id="stockP")])
def test_request_never_handed_to_d_expires_at_grant_plus_lease(tmp_path, p_stock: bool) -> None:
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = sc.never_handed(fleet, p_stock)
    for r in out["ids"]:
        rec = out["p"]["reqs"][r]
        assert rec["freed_reason"] == "expiry"
        assert rec.get("hb", 0) == 0
        assert sc.LEASE - 0.1 <= rec["freed_t"] - rec["finished_t"] <= sc.LEASE + sc.STEP_SLACK
    _no_errors(out["p"])


def _frozen_counts(out: dict) -> tuple[int, int, int]:
    ids, d_reqs = out["ids"], out["d"]["reqs"]
    failed = sum(bool(d_reqs[sc.d_id(r)].get("failed")) for r in ids)
    after = sum(s.get("num_notifications_after_expiry", 0) for s in out["p_stats"])
    fenced = sum(s.get("num_reads_fenced", 0) for s in out["d_stats"])
    return failed, after, fenced


def _assert_p_expired_and_reused(out: dict) -> None:
    reqs = out["p_at_thaw"]["reqs"]
    assert {reqs[r]["freed_reason"] for r in out["ids"]} == {"expiry"}, "P should have let every lease lapse"
    assert all(out["p"]["reqs"][r].get("delay_free") for r in out["reuse_ids"])


@pytest.mark.parametrize(
    "p_skew,d_skew",
    [pytest.param(0.0, 0.0, id="same-clock"), pytest.param(3600.0, -1800.0, id="skewed-clocks")],
)
def test_frozen_d_never_reads_freed_blocks(tmp_path, p_skew: float, d_skew: float) -> None:
    """Our P and D: D stalls past its view of the lease, P frees and reuses the
    blocks; on resume D fences every read (a failed load, recomputed by vLLM)."""
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = sc.d_frozen(fleet, p_stock=False, d_stock=False, p_skew=p_skew, d_skew=d_skew)
    _assert_p_expired_and_reused(out)
    failed, after, fenced = _frozen_counts(out)
    n = len(out["ids"])
    assert (failed, fenced) == (n, n), "every pending read must be fenced and reported as a failed load"
    assert after == 0, "D read (and acknowledged) blocks after P freed them"
    _no_errors(out["p"], out["d"])


def test_frozen_stock_d_reads_freed_blocks(tmp_path) -> None:
    """What vLLM 0.33.0's D does in the same situation (our P, so the hazard is
    not ours): it reads the reused blocks and gets other requests' KV. Proves the
    scenario really creates the hazard the fencing test guards against."""
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = sc.d_frozen(fleet, p_stock=False, d_stock=True)
    _assert_p_expired_and_reused(out)
    failed, after, fenced = _frozen_counts(out)
    assert failed == 0 and fenced == 0
    assert after == len(out["ids"]), "P should count every late read"
    assert sc.data_mismatches(out["p"], out["d"], out["ids"]), "stock D read the blocks before reuse?"


def test_frozen_d_with_stock_p_reads_as_upstream(tmp_path) -> None:
    """A stock P reports no deadline: our D says so once and does not fence."""
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = sc.d_frozen(fleet, p_stock=True, d_stock=False)
    _assert_p_expired_and_reused(out)
    failed, after, fenced = _frozen_counts(out)
    assert failed == 0 and fenced == 0 and after == len(out["ids"])
    assert out["d_log"].count("reports no lease deadline") == 1
