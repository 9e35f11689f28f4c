"""A clock offset measured once per connection goes stale
(drift over days, slewing).  Over real NIXL: P's clock jumps after the
handshake, and requests reach D only after P freed and reused their blocks,
so D's view of them is never renewed (``harness/nixl/clock_jump.py``).

- Ours (protocol version 3): D refreshed its offset from P's answers, the
  view ends with P's lease, every late READ is fenced: 0 stale.
- Our D with a P that advertises version 2 only (what 5ab44e2 did for every
  P: no clock in the answers): the handshake's offset is `jump` seconds
  stale and D reads the reused blocks -- the hole this closes, recorded.
- Stock on both sides: no view at all, D reads the reused blocks.
"""

from __future__ import annotations

import pytest

pytest.importorskip("nixl")
from harness.nixl import Fleet
from harness.nixl import scenarios as sc
from harness.nixl.clock_jump import clock_jump

pytestmark = pytest.mark.serial  # timed against the lease: needs the machine to itself


def _no_errors(out: dict) -> None:
    for rep in (out["p"], out["d"]):
        assert not rep["errors"], f"{rep['engine_id']} step errors:\n" + "\n".join(rep["errors"][:3])


def _p_freed_and_reused(out: dict) -> None:
    reqs = out["p_at_hand"]["reqs"]
    assert {reqs[r]["freed_reason"] for r in out["ids"]} == {"expiry"}, "P should have let every lease lapse"
    assert all(out["p"]["reqs"][r].get("delay_free") for r in out["reuse_ids"])


def test_refreshed_offset_fences_reads_after_ps_clock_moved(tmp_path) -> None:
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = clock_jump(fleet, p_stock=False, d_stock=False)
    _p_freed_and_reused(out)
    n = len(out["ids"])
    assert out["refreshes"] > 0, "D never refreshed its offset from P's answers"
    assert (out["stale"], out["fenced"], out["failed"]) == (0, n, n), out
    assert out["after_expiry"] == 0, "D read (and acknowledged) blocks after P freed them"
    _no_errors(out)


def test_handshake_offset_alone_reads_reused_blocks(tmp_path) -> None:
    """Our D, a P whose params say version 2 only: no clock in its answers, so
    D converts with the handshake's offset, `jump` seconds stale."""
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = clock_jump(fleet, p_stock=False, d_stock=False, refresh=False)
    _p_freed_and_reused(out)
    assert out["refreshes"] == 0
    assert out["fenced"] == 0 and out["stale"] == len(out["ids"]), out
    _no_errors(out)


def test_stock_reads_reused_blocks(tmp_path) -> None:
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = clock_jump(fleet, p_stock=True, d_stock=True)
    _p_freed_and_reused(out)
    assert out["fenced"] == 0 and out["stale"] == len(out["ids"]), out
