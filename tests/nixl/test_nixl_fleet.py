"""Small fleets over real NIXL (the fleet bench's scenarios at test size; ``make
bench-fleet`` runs them at scale):

- 4 P x 4 D engines in a full mesh, requests queued on every D from every P
  past the lease;
- 1 P x 4 D holding 2000 leases past the lease, heartbeated by the D engines;
- 1 D x 8 P: D holds 800 requests from eight P engines past the lease and
  heartbeats each P its share.

Correctness only: no lease expires while D heartbeats, every read returns P's
data, every lease ends by its read.  Serial: up to twelve processes on two cores."""

from __future__ import annotations

import pytest

pytest.importorskip("nixl")
from harness.nixl import Fleet, dfleet, pfleet
from harness.nixl import scenarios as sc
from harness.nixl.mesh import mesh

pytestmark = pytest.mark.serial


def test_mesh_4p_4d_requests_outlive_the_lease(tmp_path) -> None:
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = mesh(fleet, n_p=4, n_d=4, per_pair=8)
    assert out["errors"] == []
    assert out["expired_while_held"] == 0
    assert out["freed_by"] == {"read": 4 * 4 * 8}
    assert out["wrong"] == 0


def test_p_fleet_1p_4d_2000_leases_outlive_the_lease(tmp_path) -> None:
    leases = 2000
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        pf = pfleet.start(fleet, n_d=4, max_leases=leases, stock=False, observe_ids=True)
        pfleet.grow(pf, leases)
        held = pfleet.hold(pf, sc.LEASE + 2)  # past one lease: every lease lived on renewals
        out = pfleet.release_and_check(pf)
    assert held["errors"] == [] and out["errors"] == []
    assert held["d_silent"] == 0  # every D heartbeated P while holding its share
    assert held["live"] == leases
    # No lease expired while its D was alive and heartbeating: all were freed by their read.
    assert out["freed_by"] == {"read": leases}
    assert out["wrong"] == 0


def test_d_fleet_1d_8p_800_leases_outlive_the_lease(tmp_path) -> None:
    leases = 800
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        df = dfleet.start(fleet, n_p=8, max_leases=leases, stock=False, observe_ids=True)
        dfleet.grow(df, leases)
        held = dfleet.hold(df, sc.LEASE + 2)  # past one lease: every lease lived on renewals
        out = dfleet.release_and_check(df)
    assert held["errors"] == [] and out["errors"] == []
    assert held["expired"] == 0 and held["hb_msgs"] > 0
    assert out["freed_by"] == {"read": leases}
    assert out["wrong"] == 0
