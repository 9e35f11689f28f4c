"""Heterogeneous TP over real NIXL: P with TP 2 (two worker processes), D with TP 1.

Run with ``-s`` (or ``-rP``) to see heartbeat counts per scenario.
"""

from __future__ import annotations

import pytest

pytest.importorskip("nixl")
from nixl_harness import Fleet  # noqa: E402
from nixl_harness import scenarios as sc  # noqa: E402

pytestmark = pytest.mark.nixl


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
