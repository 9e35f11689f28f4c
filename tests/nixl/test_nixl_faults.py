"""Heartbeats bigger than one message, and a rogue NIXL agent, over real NIXL.

Run with ``-s`` (or ``-rP``) to see the numbers and what a stock P does.
"""

from __future__ import annotations

import pytest

pytest.importorskip("nixl")
from harness.nixl import Fleet
from harness.nixl import scenarios as sc


def test_thousands_of_queued_requests_renewed_in_bounded_messages(tmp_path) -> None:
    max_bytes = 1024
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = sc.big_heartbeats(fleet, n=2000, max_bytes=max_bytes)
    during = out["during"]["reqs"]
    ids = out["ids"]
    assert not [r for r in ids if "freed_t" in during[r]], "a lease expired while D was queueing"
    assert min(during[r]["hb"] for r in ids) >= 1, "a request was never renewed"
    assert out["d"]["hb_sent"]["max"] <= max_bytes
    assert max(out["hb_sizes"]) <= max_bytes
    # 2000 ids of ~26 bytes cannot fit one 1 KiB message: the split really happened.
    assert len(out["hb_sizes"]) > 2 * len(ids) * 26 // max_bytes
    reqs = out["p"]["reqs"]
    assert {reqs[r]["freed_reason"] for r in ids} == {"read"}
    assert sc.data_mismatches(out["p"], out["d"], ids) == []
    assert not out["p"]["errors"] and not out["d"]["errors"]


def test_rogue_agent_cannot_crash_our_p_or_free_live_leases(tmp_path) -> None:
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = sc.rogue_during_happy_path(fleet, p_stock=False)
    assert out["sent"]["sent"] > 0
    assert out["during"]["errors"] == []
    assert not [r for r in out["ids"] if "freed_t" in out["during"]["reqs"][r]], "a live lease was freed"
    assert sum(s.get("num_malformed_notifs", 0) for s in out["stats"]) > 0
    assert out["served"]
    reqs = out["p"]["reqs"]
    assert {reqs[r]["freed_reason"] for r in out["ids"]} == {"read"}
    assert sc.data_mismatches(out["p"], out["d"], out["ids"]) == []


def test_rogue_agent_raises_in_stock_p_steps(tmp_path) -> None:
    """What vLLM 0.33.0's P does with the same garbage, as docs/DESIGN.md states it: a malformed
    message raises mid-step (a decode or parse error; the rest of that batch is lost). If this
    fails, upstream changed and DESIGN.md's comparison must follow."""
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = sc.rogue_during_happy_path(fleet, p_stock=True)
    assert out["sent"]["sent"] > 0
    errors = out["during"]["errors"]
    assert errors, "stock P handled every malformed message without raising"
    kinds = {err.strip().splitlines()[-1].split(":")[0] for err in errors}
    assert kinds <= {"UnicodeDecodeError", "ValueError"}, kinds
