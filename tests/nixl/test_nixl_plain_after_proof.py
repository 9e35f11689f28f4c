"""Plain views after a proof (PROTOCOL D5b), over real NIXL: plain leases added after the first proof
(``harness/nixl/plain_after_proof.py``).  A version-1 P of ours granted the
old leases and died; a new P of ours runs under the same engine id and port,
and D has proven it before the old requests reach D.

- Ours: every old request is fenced (a failed load), none reads the new
  process's memory; the new requests read correctly.  On 5ab44e2 (plain views
  ended only when they existed at the proof) the old requests were read from
  the new process (measured: 4 of 4 wrong).
- A stock P's lease has no view on D; upgraded to ours under the same engine
  id, the new process answers as ours, so its grantor was another process:
  fenced too (before this fix: 4 of 4 read from the new process).
- Stock on both sides cannot tell the two processes apart (docs/PROTOCOL.md
  A7) and reads the old requests from the new one: recorded.
"""

from __future__ import annotations

import pytest

pytest.importorskip("nixl")
from harness.nixl import Fleet
from harness.nixl.plain_after_proof import plain_after_proof

pytestmark = pytest.mark.serial  # the old leases must still run when they reach D

# A lease long enough that the old ones are still running (by more than D's
# margin) after a P restart and D's first reads from the new process.
LEASE = 30


def test_plain_lease_after_proof_is_fenced(tmp_path) -> None:
    with Fleet(tmp_path, lease=LEASE) as fleet:
        out = plain_after_proof(fleet, old_stock=False, new_stock=False, d_stock=False)
    n = out["n"]
    assert out["same_blocks"] and out["old_plain"]
    assert out["old"] == {"ended": n, "failed": n, "read_ok": 0, "wrong": 0}, out["old"]
    assert out["new"] == {"ended": n, "failed": 0, "read_ok": n, "wrong": 0}, out["new"]
    assert out["fenced"] == n and out["d_errors"] == []


def test_stock_lease_after_an_upgrade_to_ours_is_fenced(tmp_path) -> None:
    with Fleet(tmp_path, lease=LEASE) as fleet:
        out = plain_after_proof(fleet, old_stock=True, new_stock=False, d_stock=False)
    n = out["n"]
    assert out["same_blocks"]
    assert out["old"] == {"ended": n, "failed": n, "read_ok": 0, "wrong": 0}, out["old"]
    assert out["new"] == {"ended": n, "failed": 0, "read_ok": n, "wrong": 0}, out["new"]
    assert out["fenced"] == n and out["d_errors"] == []


def test_stock_reads_the_old_leases_from_the_new_process(tmp_path) -> None:
    with Fleet(tmp_path, lease=LEASE) as fleet:
        out = plain_after_proof(fleet, old_stock=True, new_stock=True, d_stock=True)
    n = out["n"]
    assert out["same_blocks"]
    assert out["old"] == {"ended": n, "failed": 0, "read_ok": 0, "wrong": n}, out["old"]
