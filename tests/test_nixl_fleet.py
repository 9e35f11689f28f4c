"""A small fleet over real NIXL: 4 P x 4 D engines in a full mesh, requests
queued on every D from every P past the lease (issue 11's scenarios at test
size; ``make bench-fleet`` runs them at scale).  Correctness only: no lease
expires while D heartbeats, every read returns P's data, every lease ends by
its read.  Serial: twelve processes on two cores."""

from __future__ import annotations

import pytest

pytest.importorskip("nixl")
from nixl_harness import Fleet  # noqa: E402
from nixl_harness import scenarios as sc  # noqa: E402
from nixl_harness.mesh import mesh  # noqa: E402

pytestmark = [pytest.mark.nixl, pytest.mark.serial]


def test_mesh_4p_4d_requests_outlive_the_lease(tmp_path) -> None:
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = mesh(fleet, n_p=4, n_d=4, per_pair=8)
    assert out["errors"] == []
    assert out["expired_while_held"] == 0
    assert out["freed_by"] == {"read": 4 * 4 * 8}
    assert out["wrong"] == 0
