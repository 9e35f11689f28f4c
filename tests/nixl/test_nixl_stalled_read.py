"""The margin at completion (PROTOCOL 4.1), over real NIXL: a skewed clock and a stalled completion
(``harness/nixl/stalled_read.py``).  D posts its READs and stalls; P's clock
moves ahead by less than D's margin; P frees and reuses the blocks; the READs
then run on the reused blocks and complete while D's views have their margin
or less left.

- Ours: every such READ is discarded (a failed load), none returns the reused
  blocks.  On 5ab44e2, which discarded only READs seen complete after the view
  had ended, the same run kept them (measured: 4 of 4 stale).
- Stock keeps every one of them: stale, recorded.
"""

from __future__ import annotations

import pytest

pytest.importorskip("nixl")
from harness.nixl import Fleet
from harness.nixl import scenarios as sc
from harness.nixl.stalled_read import SKEW, stalled_read

pytestmark = pytest.mark.serial  # timed against P's lease: needs the machine to itself


def _p_freed_and_reused(out: dict) -> None:
    reqs = out["p_at_release"]["reqs"]
    assert {reqs[r]["freed_reason"] for r in out["ids"]} == {"expiry"}, "P should have let every lease lapse"
    assert all(out["p"]["reqs"][r].get("delay_free") for r in out["reuse_ids"])


def test_read_completing_within_the_margin_is_discarded(tmp_path) -> None:
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = stalled_read(fleet, p_stock=False, d_stock=False)
    _p_freed_and_reused(out)
    n = len(out["ids"])
    assert out["release_after_free_s"] < SKEW, (
        "the stall outlasted P's skew: the READs completed after D's views had ended, so the margin "
        "at completion went untested"
    )
    assert (out["stale"], out["discarded"], out["failed"]) == (0, n, n), out
    assert out["fenced"] == 0, "the READs were posted while their views were fresh"
    for rep in (out["p"], out["d"]):
        assert not rep["errors"], f"{rep['engine_id']} step errors:\n" + "\n".join(rep["errors"][:3])


def test_stock_keeps_the_read_and_returns_reused_blocks(tmp_path) -> None:
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = stalled_read(fleet, p_stock=True, d_stock=True)
    _p_freed_and_reused(out)
    assert out["failed"] == 0 and out["stale"] == len(out["ids"]), out
