"""A burst over real NIXL (issue 11): one D step admits 2000 requests of 16
KV blocks each while 500 more wait for D's blocks, all leased on one P and
queued for a whole lease first.  Ours spreads the READs over steps
(``read_pacer.py``) and heartbeats first; upstream posts every READ of the
step, then heartbeats.  Correctness is asserted for ours; upstream's lost
margin is the documented expected failure.  ``make bench-fleet`` runs 2000
and 5000 and prints the figures.  Serial: the burst needs both cores."""

from __future__ import annotations

import pytest

pytest.importorskip("nixl")
from nixl_harness import Fleet  # noqa: E402
from nixl_harness import scenarios as sc  # noqa: E402
from nixl_harness.burst import burst  # noqa: E402

pytestmark = [pytest.mark.nixl, pytest.mark.serial]

BURST, QUEUED, TOKENS = 2000, 500, 512


def test_burst_ours_keeps_every_lease_and_reads_right(tmp_path) -> None:
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = burst(fleet, BURST, QUEUED, stock=False, tokens=TOKENS)
    assert out["errors"] == []
    assert out["premature_expiries"] == 0
    assert out["wrong_reads"] == 0
    assert out["fenced_live"] == 0 and out["failed_loads"] == 0
    assert out["reads_carried"] > 0  # the burst did not fit one step's budget


@pytest.mark.xfail(
    reason="upstream posts all of a step's READs before its heartbeats: P's heartbeat gap is one "
    "interval plus the whole burst (3.3 s of the 4 s extension measured at this size), so a "
    "slightly larger burst or a slower host expires leases of requests D is about to read",
    strict=False,
)
def test_burst_stock_keeps_half_the_extension_as_margin(tmp_path) -> None:
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = burst(fleet, BURST, QUEUED, stock=True, tokens=TOKENS)
    assert out["errors"] == [] and out["wrong_reads"] == 0
    assert out["premature_expiries"] == 0
    assert out["max_hb_gap_s"] <= out["extension_s"] / 2
