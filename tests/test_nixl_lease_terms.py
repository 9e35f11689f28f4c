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


def test_p_stall_past_the_extension_expires_no_live_lease(tmp_path) -> None:
    lease = 6
    stop_s = default_lease_extension(lease) + 1.5  # past the 4 s extension
    with Fleet(tmp_path) as fleet:
        out = lease_terms.p_stalled(fleet, lease, stop_s)
    assert out["d_heartbeats_during_stop"] > 0, "D did not heartbeat while P was stopped"
    assert out["stalls_graced"] > 0, "P did not see its own stall"
    assert out["expired_while_held"] == [] and out["p_expired"] == 0
    assert out["freed_by"] == ["read"]
    assert (out["failed"], out["wrong"]) == (0, 0)
    assert out["errors"] == []
