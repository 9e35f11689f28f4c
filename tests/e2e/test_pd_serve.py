"""End-to-end: router -> P -> D with real `vllm serve` processes, for the stock connector and ours.

Every client call and wait has a hard timeout; the module fixture kills all servers by PID.
Timings are read from P's own log timestamps and metrics, not from the client's clock.
"""

from __future__ import annotations

import pytest

from harness.serve import scenarios
from harness.serve.launcher import PDCluster

from .conftest import CONNECTORS, LEASE_S, RESULTS

RECLAIM_SLACK_S = 2.0
N_QUEUED = 4  # requests queued on the blocked D
# The router must fail requests in flight on a killed D within this: no hang (its request timeout is
# 120 s). Usually 0.35-1.0 s; in 4 of 11 runs (3 stock, 1 ours) 8.5-12.4 s, each time within ~1 s
# after P expired the dead D's leases (lease 15 s, extension 10 s). Cause not found.
FAIL_FAST_S = 15.0


def test_greedy_output_through_router_equals_p_alone(pd: PDCluster) -> None:
    eq = scenarios.equality(pd)
    RESULTS[pd.cfg.connector]["outputs"] = [b for _, b in eq.pairs]
    RESULTS[pd.cfg.connector]["transfers"] = eq.transfers
    for alone, routed in eq.pairs:
        assert routed == alone
    assert eq.transfers >= len(eq.pairs), "D's metrics show no NIXL reads: was the KV really transferred?"


def test_overloaded_decode_keeps_leases_alive(pd: PDCluster) -> None:
    ov = scenarios.overload(pd, N_QUEUED, hold_s=LEASE_S * 1.3)
    RESULTS[pd.cfg.connector]["overload"] = {
        "n": N_QUEUED, "held_s": round(ov.held_s, 1), "wall_s": round(ov.wall_s, 1),
        "min_latency_s": round(ov.min_latency_s, 1), "heartbeats": ov.heartbeats,
        "max_heartbeat_gap_s": round(ov.max_hb_gap_s, 2), "expired": ov.expired,
    }  # fmt: skip
    failed = [r.error for r in ov.results if not r.ok]
    if pd.cfg.connector == "stock" and ov.expired:
        # Stock's defects are recorded for the comparison test, not failures of this project. Once
        # stock P has freed a queued lease, D's READ of it may fail or hang (HTTP 500, timeouts).
        pytest.xfail(f"stock P expired {ov.expired:.0f} queued lease(s) while D was alive "
                     f"(longest pause between heartbeats {ov.max_hb_gap_s:.1f}s); "
                     f"failed requests: {failed}")  # fmt: skip
    assert not failed, failed
    assert ov.min_latency_s > LEASE_S, "a request waited less than the lease: the test proves nothing"
    assert ov.expired == 0, (
        f"a lease expired on P while D was alive (longest heartbeat gap {ov.max_hb_gap_s:.1f}s)"
    )
    assert ov.notifs_after_expiry == 0
    assert ov.heartbeats > 0
    if pd.cfg.connector == "ours":  # ours on both sides: D names the leases by tag
        assert ov.tagged_heartbeats > 0, "P received no LHBT: heartbeat from our D"


def test_kill_decode_p_reclaims_and_serves_new_decode(pd: PDCluster) -> None:
    ext = scenarios.lease_extension(LEASE_S)
    # Kill once every queued lease has had a heartbeat past its initial deadline (lease - ext after
    # the grant), so each one ends at last heartbeat + ext.
    settle = (LEASE_S - ext) + scenarios.lease_interval(LEASE_S) + 2.5
    ours = pd.cfg.connector != "stock"
    # Ours: the new D loads our connector through the import hook under the stock name.
    rc = scenarios.kill_and_reclaim(
        pd, N_QUEUED, settle_s=settle, reclaim_window_s=ext + 12, restart_connector="hook", restart=ours
    )
    failed = [r for r in rc.results if not r.ok]
    RESULTS[pd.cfg.connector]["reclaim"] = {
        "queued": rc.n_queued, "leases_at_kill": rc.leases_at_kill,
        "reclaimed_metric": rc.expired_metric, "reclaim_after_last_hb_s": rc.reclaim_after_last_hb_s,
        "reclaim_after_kill_s": rc.reclaim_after_kill_s,
        "extension_s": ext, "inflight_failed": len(failed),
        "inflight_fail_after_kill_s": [round(r.t_end - rc.kill_ts, 2) for r in failed],
        "restart_s": round(rc.restart_s, 1),
    }  # fmt: skip
    if not ours and rc.notifs_after_expiry_before_kill:
        # Stock P freed leases of a live D and then got their READs' completions: stock's defect
        # (also what a stock overload run that expired leases leaves behind, read late by D).
        pytest.xfail(f"stock P received {rc.notifs_after_expiry_before_kill:.0f} read completion(s) "
                     "for leases it had already expired, before D was killed")  # fmt: skip
    assert rc.notifs_after_expiry_before_kill == 0
    assert len(failed) == N_QUEUED, "every queued request must fail once D is gone"
    for r in failed:
        assert r.status >= 500 or r.status == 0
    slowest = max(r.t_end - rc.kill_ts for r in failed)
    assert slowest < FAIL_FAST_S, "an in-flight request hung after D died"
    assert rc.p_healthy_after
    if not ours and rc.expired_metric < N_QUEUED:
        pytest.xfail(f"stock P reclaimed {rc.expired_metric:.0f} of {N_QUEUED} leases of a dead D "
                     f"within {ext + 12}s of the kill")  # fmt: skip
    assert rc.expired_metric == N_QUEUED, "P's metrics: not every queued lease was reclaimed"
    assert len(rc.expiries) == rc.expired_metric, "log and metrics disagree on reclaimed leases"
    assert rc.last_hb_ts is not None
    assert rc.reclaim_after_last_hb_s is not None
    # Not early (a lease must outlive its last heartbeat by the extension) and not late. Stock is
    # only measured: its leases can end on the initial deadline when heartbeats did not renew them.
    if ours:
        assert rc.leases_at_kill == N_QUEUED
        assert ext - 1.0 <= rc.reclaim_after_last_hb_s <= ext + RECLAIM_SLACK_S
        after = rc.after_restart
        assert after is not None, "P did not serve a new D after reclaiming"
        assert after.equal, "greedy output through the new D differs from P alone"
        assert after.transfers >= len(after.pairs)
        d_log = pd.decode.log_path.read_text(errors="replace")  # type: ignore[union-attr]
        assert "Creating v1 connector with name: LeaseNixlPullConnector" in d_log, "hook did not load ours"


def test_ours_matches_stock_and_reclaims_no_later() -> None:
    if "stock" not in RESULTS or len(RESULTS) < 2:
        pytest.skip(f"needs stock and ours in one run (PD_E2E_CONNECTORS={','.join(CONNECTORS)})")
    stock = RESULTS["stock"]
    for name in CONNECTORS:  # RESULTS also holds other modules' numbers (e.g. "fencing")
        if name == "stock" or name not in RESULTS:
            continue
        ours = RESULTS[name]
        assert ours.get("outputs") == stock.get("outputs")
        s_rc, o_rc = stock.get("reclaim"), ours.get("reclaim")
        assert isinstance(s_rc, dict) and isinstance(o_rc, dict)
        assert o_rc["reclaim_after_last_hb_s"] is not None
        if s_rc["reclaim_after_last_hb_s"] is not None:  # None: stock never reclaimed (worse)
            assert o_rc["reclaim_after_last_hb_s"] <= s_rc["reclaim_after_last_hb_s"] + 1.0
        s_ov, o_ov = stock.get("overload"), ours.get("overload")
        assert isinstance(s_ov, dict) and isinstance(o_ov, dict)
        assert o_ov["expired"] <= s_ov["expired"]
