"""Aborts of READs D holds back for proof of their P process, over real NIXL.
Run with ``-s`` to see the counts and times.

Our P's hello handling is stopped (``EngineSpec.drop_hellos``, as in an
admission slower than the test), so our D never proves which P process its
connection reaches and parks every READ.  The client then aborts every request.
vLLM keeps an aborted request's KV blocks in WAITING_FOR_REMOTE_KVS until the
worker reports its load finished or failed: each parked READ must be reported
as a failed load exactly once, D's free blocks and upstream's
``_recving_metadata`` must return to their baseline, and the idle engine must
then be released by D's engine reaper.

Stock vLLM does not park READs (it reads at once, with no proof), so it has no
such leak: there is no stock run beside this one.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("nixl")
from harness.nixl import Fleet, wait_for
from harness.nixl import scenarios as sc
from harness.nixl.progress import PROGRESS_DELAY_US

pytestmark = pytest.mark.serial

N = 100
ENGINE_TTL_S = 4.0
SWEEP_S = 10.0  # D's engine reaper sweeps at most this often (forget_sweep_s)


def _recving_metadata(d) -> int:
    sizes: dict[str, int] = d.call("drain")["sizes"]["sizes"]
    return sizes["worker._recving_metadata"]


def test_aborted_parked_reads_are_reported_and_free_d_blocks(tmp_path) -> None:
    ttl = {"extra": {"engine_ttl": ENGINE_TTL_S}, "progress_delay_us": PROGRESS_DELAY_US}
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        p = fleet.start("P", "p", drop_hellos=True, **ttl)
        d = fleet.start("D", "d", **ttl)
        baseline = d.summary()["free_blocks"]
        assert _recving_metadata(d) == 0
        ids, params = sc.prefill(p, "parked", N)
        sc.hand_to_d(d, params, hold=False)
        wait_for(
            lambda: sc.over_ranks(d.stats(), "num_reads_waiting_proof") >= N,
            60,
            what=f"D parking {N} READs",
        )
        parked = d.summary()
        assert parked["free_blocks"] < baseline and parked["unread"] == N
        t_abort = time.monotonic()
        assert d.abort([sc.d_id(r) for r in ids]) == {sc.d_id(r): "admitted" for r in ids}
        done = wait_for(
            lambda: (s := d.summary())["free_blocks"] == baseline and s["unread"] == 0 and s,
            30,
            what="D's free blocks back to the baseline",
        )
        freed_s = time.monotonic() - t_abort
        rep = d.report()
        stats = d.stats()
        ended = [rep["reqs"][sc.d_id(r)] for r in ids]
        remaining = _recving_metadata(d)
        print(
            f"\n== {N} parked READs aborted: free blocks {done['free_blocks']} (baseline {baseline}) "
            f"{freed_s:.2f}s after the abort; reported failed {sum(bool(r.get('failed')) for r in ended)}, "
            f"parked dropped {sc.over_ranks(stats, 'num_reads_parked_dropped')}, "
            f"_recving_metadata {remaining}, READs posted {sum('read_ranks' in r for r in ended)}"
        )
        assert all(r.get("failed") and "read_t" in r for r in ended), "an aborted request was not reported"
        assert sc.over_ranks(stats, "num_reads_parked_dropped") == N
        assert remaining == 0
        assert rep["errors"] == []
        # Idle now: the reaper releases P's engine after engine_ttl (at its next sweep).
        engine_id = p.summary()["engine_id"]
        hellos_at_idle = p.report()["hellos_recv"]

        held: list[str] = []
        deadline = time.monotonic() + ENGINE_TTL_S + 2 * SWEEP_S
        while time.monotonic() < deadline:
            keys: dict[str, list[str]] = d.call("drain")["sizes"]["keys"]
            held = sorted(path for path, engines in keys.items() if engine_id in engines)
            if not held:
                break
            time.sleep(1.0)
        hellos = p.report()["hellos_recv"] - hellos_at_idle
        assert not held, f"D still holds state of the idle engine {engine_id} ({hellos} hellos since): {held}"
