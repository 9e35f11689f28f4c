"""Network partitions between P and D on two hosts of one machine.

P and D run in their own network namespaces joined by a bridge
(``harness.netns``); UCX uses TCP over the veths only, so a cut really stops
heartbeats and READs.  Each scenario runs stock/stock and ours/ours.  Run with
``-s`` to see the numbers.  Needs root (skipped with the reason otherwise).
"""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("nixl")
from harness import netns
from harness.nixl import Fleet
from harness.nixl import partition as pt
from harness.nixl import scenarios as sc

_reason = netns.unavailable_reason()
pytestmark = [
    # Timing matters here (TCP retransmissions, lease deadlines): one at a time.
    pytest.mark.serial,
    pytest.mark.skipif(_reason is not None, reason=f"network namespaces unavailable: {_reason}"),
]

PAIRS = [pytest.param(False, False, id="ours"), pytest.param(True, True, id="stock")]


def _no_errors(*reports: dict) -> None:
    for rep in reports:
        assert not rep["errors"], f"{rep['engine_id']} step errors:\n" + "\n".join(rep["errors"][:3])


def test_engines_on_hosts_talk_tcp_over_their_veths(tmp_path) -> None:
    """The harness places P (TP 2) and D on two hosts; a cut stops a READ on
    an established UCX connection and the heal lets it finish (no shared
    memory path bypasses the network)."""
    with netns.TwoHosts() as hosts, Fleet(tmp_path, lease=sc.LEASE, hosts=hosts) as fleet:
        p = fleet.start("P", "p", host="p", tp_size=2, kv_heads=2)
        d = fleet.start("D", "d", host="d", kv_heads=2)
        p_ns, d_ns = p.info["net_ns"], d.info["net_ns"]
        assert len(set(p_ns)) == 1 and len(p_ns) == 2, f"TP ranks must share P's namespace: {p_ns}"
        assert p_ns[0] != d_ns[0]
        assert os.readlink("/proc/self/ns/net") not in (p_ns[0], d_ns[0])
        pt.warm_up(p, d)
        ids, params = sc.prefill(p, "veth", 1)
        sc.hand_to_d(d, params, hold=True)
        hosts.cut("d")
        try:
            d.release()
            time.sleep(2.0)
            assert "read_t" not in d.report()["reqs"][sc.d_id(ids[0])], "a READ crossed a cut link"
            assert pt.notifs_between(p.report(), time.monotonic() - 1.5) == [], "P got a notification"
        finally:
            hosts.heal("d")
        p_rep = sc.wait_freed(p, ids, timeout=30)
        d_rep = d.report()
        assert p_rep["reqs"][ids[0]]["freed_reason"] == "read"
        assert sc.data_mismatches(p_rep, d_rep, ids) == []
        _no_errors(p_rep, d_rep)


@pytest.mark.parametrize("p_stock,d_stock", PAIRS)
def test_short_partition_expires_and_fences_nothing(tmp_path, p_stock: bool, d_stock: bool) -> None:
    with netns.TwoHosts() as hosts, Fleet(tmp_path, lease=sc.LEASE, hosts=hosts) as fleet:
        out = pt.short_partition(fleet, hosts, p_stock, d_stock, cut_s=2.0, offset=0.5)
    assert out["hb_failed_in_cut"] == 0 and out["p_notifs_in_cut"] == 0
    assert out["expired"] == 0 and out["p_expired_total"] == 0, "a lease lapsed during a short partition"
    assert out["fenced"] == 0 and out["failed"] == 0
    assert out["wrong"] == 0
    _no_errors(out["p"], out["d"])


# Offsets after P takes in a heartbeat, as fractions of the 1 s interval: 0.9
# cuts just before the next heartbeat (where stock's vllm serve read 8 of 8 wrong).
OFFSETS = [0.1, 0.5, 0.9]


@pytest.mark.parametrize("offset", OFFSETS)
def test_partition_past_lease_ours_never_reads_reused_blocks(tmp_path, offset: float) -> None:
    """UCX accepts (queues) heartbeats during the cut and delivers them after the heal;
    D renews its views only on P's acknowledgements, so it fences every read."""
    with netns.TwoHosts() as hosts, Fleet(tmp_path, lease=sc.LEASE, hosts=hosts) as fleet:
        out = pt.partition_past_lease(fleet, hosts, False, False, offset=offset * pt.INTERVAL)
    n = len(out["ids"])
    assert out["expired"] == n, "P should have let every lease lapse"
    assert out["wrong"] == 0, f"{out['wrong']}/{n} reads returned other requests' KV"
    assert (out["fenced"], out["failed"]) == (n, n), "every pending read must be fenced"
    assert out["after_expiry"] == 0


def test_partition_past_lease_d_tp2_ours_never_reads_reused_blocks_on_either_rank(tmp_path) -> None:
    """P TP 1, D TP 2 (each D rank reads its KV head from P rank 0 and keeps its
    own acknowledged view): after a cut past the lease and P's reuse, both D
    ranks fence (or discard) every read."""
    with netns.TwoHosts() as hosts, Fleet(tmp_path, lease=sc.LEASE, hosts=hosts) as fleet:
        out = pt.partition_past_lease(fleet, hosts, False, False, offset=0.9 * pt.INTERVAL, d_tp=2)
    n = len(out["ids"])
    assert out["expired"] == n, "P should have let every lease lapse"
    assert out["wrong_by_rank"] == {0: 0, 1: 0}, "a D rank read other requests' KV"
    assert out["wrong"] == 0 and out["failed"] == n
    assert out["failed_by_rank"] == [n, n], "each D rank must fail every load"
    stopped = [f + x for f, x in zip(out["fenced_by_rank"], out["discarded_by_rank"], strict=True)]
    assert stopped == [n, n], f"fenced {out['fenced_by_rank']}, discarded {out['discarded_by_rank']}"
    assert out["after_expiry"] == 0
    _no_errors(out["p"], out["d"])


@pytest.mark.parametrize("offset", OFFSETS[-1:])  # one phase is enough to document it
def test_partition_past_lease_stock_reads_reused_blocks(tmp_path, offset: float) -> None:
    """Stock P/D: after the heal D reads the reused blocks (what the fence is for)."""
    with netns.TwoHosts() as hosts, Fleet(tmp_path, lease=sc.LEASE, hosts=hosts) as fleet:
        out = pt.partition_past_lease(fleet, hosts, True, True, offset=offset * pt.INTERVAL)
    n = len(out["ids"])
    assert out["expired"] == n
    assert out["fenced"] == 0 and out["failed"] == 0
    assert out["wrong"] == n, "stock D read the blocks before they were reused?"


def test_read_in_flight_across_partition_ours_never_returns_reused_blocks(tmp_path) -> None:
    """A READ posted just before the cut runs after the heal on reused blocks; D sees it
    complete after its view ended and discards it (a failed load)."""
    with netns.TwoHosts() as hosts, Fleet(tmp_path, lease=sc.LEASE, hosts=hosts) as fleet:
        out = pt.read_in_flight(fleet, hosts, False, False)
    n = len(out["ids"])
    assert out["expired"] == n and out["read_done_in_cut"] == 0
    assert out["wrong"] == 0, f"{out['wrong']}/{n} reads returned other requests' KV"
    assert out["failed"] == n, "every read that completed after P's lease lapsed must fail the load"


def test_read_in_flight_across_partition_stock_returns_reused_blocks(tmp_path) -> None:
    with netns.TwoHosts() as hosts, Fleet(tmp_path, lease=sc.LEASE, hosts=hosts) as fleet:
        out = pt.read_in_flight(fleet, hosts, True, True)
    n = len(out["ids"])
    assert out["expired"] == n and out["read_done_in_cut"] == 0
    assert out["failed"] == 0 and out["wrong"] == n


# Ours only in CI (time): stock/stock measured the same way showed 0 early expiries,
# 0 stuck leases, longest heartbeat gap 2.05 s (README "Faults").
@pytest.mark.parametrize("p_stock,d_stock", PAIRS[:1])
def test_flapping_link_expires_nothing_early_and_strands_nothing(
    tmp_path, p_stock: bool, d_stock: bool
) -> None:
    with netns.TwoHosts() as hosts, Fleet(tmp_path, lease=sc.LEASE, hosts=hosts) as fleet:
        # Down 1 s, not 1.5 s: after a heal, TCP resends queued heartbeats at its next
        # (exponentially backed off) retransmission, up to ~1.5 s later after a 1.5 s cut,
        # which with the heartbeat phase can use up the whole 4 s extension.
        out = pt.flapping_link(fleet, hosts, p_stock, d_stock, down_s=1.0, up_s=1.5, duration=30.0)
    assert out["stuck"] == [], "leases neither read nor expired after the link settled"
    assert out["premature"] == [], "a lease lapsed while heartbeats got through between cuts"
    assert out["wrong"] == 0
    _no_errors(out["p"], out["d"])


# UCX's TCP timeouts shortened so a 20 s partition breaks the connection (with the
# defaults -- keepalive idle 10 s, interval 2 s, system user timeout -- 60 s did not).
SHORT_UCX_TIMEOUTS = {
    "UCX_TCP_USER_TIMEOUT": "5s",
    "UCX_TCP_KEEPIDLE": "2s",
    "UCX_TCP_KEEPINTVL": "1s",
    "UCX_TCP_KEEPCNT": "3",
    "UCX_KEEPALIVE_INTERVAL": "2s",
}


NO_RECOVERY = (
    "stock: once UCX reports NIXL_ERR_REMOTE_DISCONNECT, D keeps the dead remote agent: every later "
    "heartbeat and READ to that P fails until the engine is evicted (ours releases it and handshakes again)"
)


@pytest.mark.parametrize("p_stock,d_stock", PAIRS)
def test_partition_past_ucx_timeouts_reads_nothing_wrong_and_recovers(
    tmp_path, p_stock: bool, d_stock: bool
) -> None:
    with netns.TwoHosts() as hosts, Fleet(tmp_path, lease=sc.LEASE, hosts=hosts) as fleet:
        out = pt.partition_past_connection_timeout(
            fleet, hosts, p_stock, d_stock, cut_s=20.0, env=SHORT_UCX_TIMEOUTS
        )
    # The connection broke: UCX failed D's sends, or (ours on both sides) D released it first,
    # P having answered nothing for reconnect_after_s (PROTOCOL D2a).
    broke = out["hb_failed_in_cut"] > 0 or out["released_silent"] > 0
    assert broke, "the connection did not break: nothing tested"
    assert out["old_loaded"] and out["old_failed"] == len(out["ids"]), "a lapsed lease was read"
    recovered = out["new_heartbeated"] and out["new_read_ok"]
    if p_stock and not recovered:
        pytest.xfail(NO_RECOVERY)
    assert recovered, "after the heal a new request must be heartbeated and read correctly"
