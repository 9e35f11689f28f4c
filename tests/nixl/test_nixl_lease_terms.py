"""Lease terms over real NIXL (``harness/nixl/lease_terms.py``): P and D with
different ``kv_lease_duration`` (D's margin follows what P advertises), and
P's own stall (SIGSTOP past the extension) while D heartbeats.  Ours on both
sides.  Run with ``-s`` to see the counts.
"""

from __future__ import annotations

import pytest

pytest.importorskip("nixl")
from harness.nixl import Fleet, lease_terms
from vllm_nixl_lease._wire import default_lease_extension

pytestmark = pytest.mark.serial

LEASE = 6  # extension 4, interval 1; P's stall bound 2 s


@pytest.mark.parametrize(
    "p_lease,d_lease", [pytest.param(6, 12, id="D-2x-P"), pytest.param(12, 6, id="P-2x-D")]
)
def test_mismatched_durations_never_fence_needlessly(tmp_path, p_lease: int, d_lease: int) -> None:
    with Fleet(tmp_path) as fleet:
        out = lease_terms.mismatched_durations(fleet, p_lease, d_lease)
    assert out["min_hb"] >= 2, "the leases were never renewed: the scenario proved nothing"
    assert out["expired_while_held"] == []
    assert (out["fenced"], out["discarded"], out["failed"], out["wrong"]) == (0, 0, 0, 0)
    assert out["freed_by"] == ["read"]
    assert out["errors"] == []


@pytest.mark.parametrize(
    "stop_s",
    [
        # Past P's stall bound (half the extension) but within the extension:
        # D's views outlive the stop, so nothing is fenced either.
        pytest.param(default_lease_extension(LEASE) - 1.0, id="within-extension"),
        # Past the extension: no answer reached D for longer than an
        # extension, so D's views lapse (by design a lapsed view never
        # revives) and D fences its reads; P still expires none of them.
        pytest.param(default_lease_extension(LEASE) + 1.5, id="past-extension"),
    ],
)
def test_p_stall_expires_no_live_lease(tmp_path, stop_s: float) -> None:
    with Fleet(tmp_path) as fleet:
        out = lease_terms.p_stalled(fleet, LEASE, stop_s)
    n = len(out["ids"])
    assert out["d_heartbeats_during_stop"] > 0, "D did not heartbeat while P was stopped"
    assert out["stalls_graced"] > 0, "P did not see its own stall"
    assert out["expired_while_held"] == []
    assert out["wrong"] == 0
    if stop_s < default_lease_extension(LEASE):
        assert (out["fenced"], out["failed"]) == (0, 0)
        assert out["freed_by"] == ["read"]
    else:
        assert out["fenced"] == out["failed"] == n
    assert out["errors"] == []
