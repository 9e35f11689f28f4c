"""D's state and liveness over real NIXL on loopback (``harness/nixl/churn.py``).

- P restarted 20 times under fresh engine ids (vLLM's default) against one D:
  every structure of D's connector stays bounded once D's engine reaper has
  released the dead engines, and no dict keeps a dead engine's id.  (The same
  over 1,000 restarts runs through the adapter classes with fake NIXL:
  ``tests/adapter/test_d_engine_reaper.py``.)
- A slow admission: P holds back D's hellos for longer than the lease while D
  queues its requests; D's keep-alives hold P's leases (before, D sent P
  nothing until proven, and every lease expired).
- A notify-only completion (a full prefix-cache hit) of a request granted by a
  P that restarted under the same engine id, whose new process leased the
  same client-chosen id: ours withholds it, stock sends it to the new process,
  which frees its own lease (``harness/nixl/collide.py``).

Run with ``-s`` to see the numbers.
"""

from __future__ import annotations

import pytest

pytest.importorskip("nixl")
from harness.nixl import Fleet, churn, collide
from harness.nixl import scenarios as sc

pytestmark = pytest.mark.serial

RESTARTS = 20


def test_p_restarts_with_fresh_engine_ids_leave_d_bounded(tmp_path) -> None:
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = churn.restarts(fleet, RESTARTS)
    assert out["read"] == RESTARTS
    assert out["grown"] == {}, f"D structures that grew with P restarts: {out['grown']}"
    assert out["holding_engine_ids"] == {}, out["holding_engine_ids"]
    assert out["d_errors"] == []


def test_a_slow_admission_longer_than_the_lease_does_not_let_ps_leases_lapse(tmp_path) -> None:
    hold_s = 1.5 * sc.LEASE
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = churn.slow_admission(fleet, hold_s)
    assert out["hellos_held"] > 0, "P never held a hello back: the scenario proved nothing"
    assert out["expired_during_hold"] == 0, out
    assert out["min_heartbeats_per_lease"] >= 2, out
    assert out["p_errors"] == [] and out["d_errors"] == []


def test_a_completion_without_a_read_never_frees_a_restarted_ps_colliding_lease(tmp_path) -> None:
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = collide.completion_after_restart(fleet, stock=False)
    assert out["withheld"] >= 1, "D never withheld the completion: the scenario proved nothing"
    assert not out["freed_by_old_completion"] and out["new_read_ok"], out
    assert out["new_read_ok"] and out["new_p_freed_reason"] == "read", out
    assert out["d_errors"] == [] and out["new_p_errors"] == []


@pytest.mark.xfail(
    strict=True,
    reason="vLLM 0.33.0 sends a full prefix hit's <id>:<count> over whatever connection exists: "
    "after a restart under the same engine id it frees the new process's lease on a colliding id",
)
def test_stock_completion_without_a_read_frees_a_restarted_ps_colliding_lease(tmp_path) -> None:
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = collide.completion_after_restart(fleet, stock=True)
    assert not out["freed_by_old_completion"] and out["new_read_ok"], out
