"""P restarted with ``kill -9`` under the same engine id and side-channel port,
over real NIXL on loopback (``harness/nixl/restart.py``): the old requests
queued on D must never be read (the new P's blocks with the same ids hold
other requests' KV), and the new requests must be read correctly.

docs/PROTOCOL.md section 6 names these tests.  Run with ``-s`` to see the
counts and times.
"""

from __future__ import annotations

import pytest

pytest.importorskip("nixl")
from harness.nixl import Fleet, restart
from harness.nixl import scenarios as sc

pytestmark = pytest.mark.serial

# The new requests are read once D has noticed the restart (its heartbeat to
# the dead P fails), handshaken again and, with ours, had the new P's welcome
# prove the new instance: measured 2-4 s on loopback; the rest is slack for a
# loaded machine.
NEW_READ_BOUND_S = 15.0


def test_p_restarted_ours_old_requests_fenced_new_ones_read(tmp_path) -> None:
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = restart.p_restarted(fleet, p_stock=False, d_stock=False, new_p_stock=False)
    n = out["n"]
    assert out["same_blocks"], "the new P must grant its leases on the old requests' block ids"
    assert out["old"] == {"ended": n, "failed": n, "read_ok": 0, "wrong": 0}, out["old"]
    assert out["new"] == {"ended": n, "failed": 0, "read_ok": n, "wrong": 0}, out["new"]
    assert out["new_read_s"] is not None and out["new_read_s"] <= NEW_READ_BOUND_S
    assert out["new_p_freed_by"] == {"read": n, "expiry": 0}
    assert out["new_p_errors"] == [] and out["d_errors"] == []


def test_p_restarted_stock_both_sides_documented(tmp_path) -> None:
    """vLLM 0.33.0 on both sides, same scenario: stock D keeps the dead agent,
    so every load (old and new) fails and nothing stale is read; it never
    serves the restarted P again."""
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = restart.p_restarted(fleet, p_stock=True, d_stock=True, new_p_stock=True)
    n = out["n"]
    assert out["same_blocks"]
    assert out["old"]["wrong"] == 0 and out["new"]["wrong"] == 0
    assert out["old"] == {"ended": n, "failed": n, "read_ok": 0, "wrong": 0}, out["old"]
    assert out["new"]["read_ok"] == 0, out["new"]


def test_p_downgraded_to_stock_under_the_same_engine_id(tmp_path) -> None:
    """Ours on D; P restarted as stock under the same engine id: the stock P's
    steps never raise on what our D sends, the old requests are never read,
    the new ones (plain leases) are read correctly."""
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = restart.p_restarted(fleet, p_stock=False, d_stock=False, new_p_stock=True)
    n = out["n"]
    assert out["same_blocks"]
    assert out["new_p_errors"] == [], "the stock P's step raised:\n" + "\n".join(out["new_p_errors"][:1])
    assert out["old"] == {"ended": n, "failed": n, "read_ok": 0, "wrong": 0}, out["old"]
    assert out["new"] == {"ended": n, "failed": 0, "read_ok": n, "wrong": 0}, out["new"]
    assert out["new_read_s"] is not None and out["new_read_s"] <= NEW_READ_BOUND_S
    assert out["d_errors"] == []
