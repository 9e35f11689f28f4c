"""Bugs `make chaos` found, each pinned by a deterministic test of its own (real
NIXL engines on loopback; no nemesis, no randomness).

1. P restarted under the same engine id (and side-channel port) while D had
   nothing queued for it: D's connection to that engine id still reached the
   dead process, proven as the old instance.  For the new instance's requests
   D then sent nothing (no heartbeat, no hello: "another P process runs
   there") and fenced every READ, so nothing ever failed on the dead
   connection and D never handshook again: the pair served no request until
   upstream evicted the idle engine.  Found by ``make chaos SEED=1``
   (``kill p0 same_id=1``): p0->d0 and p0->d1 wedged, every read fenced.
2. P killed and restarted under a new engine id (and port) while D had
   nothing queued for it: D kept the dead engine's connection, descriptors,
   clock offset and registration generation for ever.  Upstream evicts an
   engine idle past ``engine_ttl`` only when another engine handshakes, and
   in a settled fleet none does.  Found by ``make chaos SEED=7`` (d1 held
   ``p0``'s state at the end, 12 structures).
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("nixl")
from harness.nixl import Fleet
from harness.nixl import scenarios as sc

pytestmark = [pytest.mark.nixl, pytest.mark.serial]

RECOVERY_S = 30.0
ENGINE_TTL_S = 4.0


def _served(p, d, tag: str, timeout: float) -> tuple[bool, int]:
    """Requests from ``p`` to ``d`` one after another until one is read correctly;
    (served, loads that failed first)."""
    failed = 0
    deadline = time.monotonic() + timeout
    n = 0
    while time.monotonic() < deadline:
        n += 1
        ids, params = sc.prefill(p, f"{tag}{n}", 1)
        sc.hand_to_d(d, params, hold=False)
        d_rep = sc.wait_loaded(d, ids, 30)
        if not d_rep["reqs"][sc.d_id(ids[0])].get("failed"):
            p_rep = sc.wait_freed(p, ids, 30)
            assert sc.data_mismatches(p_rep, d_rep, ids) == [], "a read returned other data"
            return True, failed
        failed += 1
        time.sleep(0.5)
    return False, failed


def test_p_restarted_same_id_with_nothing_queued_on_d_is_served_again(tmp_path) -> None:
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        p = fleet.start("P", "p", engine_id="p-fixed")
        d = fleet.start("D", "d")
        ok, _ = _served(p, d, "before", 30)
        assert ok, "the pair never worked"
        port = p.spec.side_channel_port
        p.kill()
        time.sleep(1.0)
        p2 = fleet.start("P", "p", engine_id="p-fixed", side_channel_port=port)
        ok, failed = _served(p2, d, "after", RECOVERY_S)
    assert ok, f"D served nothing from the restarted P in {RECOVERY_S:.0f}s ({failed} loads failed)"


def test_p_gone_under_a_new_id_is_released_on_d(tmp_path) -> None:
    ttl = {"extra": {"engine_ttl": ENGINE_TTL_S}}
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        p = fleet.start("P", "p", engine_id="p-old", **ttl)
        d = fleet.start("D", "d", **ttl)
        assert _served(p, d, "before", 30)[0], "the pair never worked"
        p.kill()
        p_new = fleet.start("P", "p-new", engine_id="p-new", **ttl)
        assert _served(p_new, d, "after", RECOVERY_S)[0], "the new P was never served"
        # Nothing more handshakes: only D's own sweep (every 10 s here) can release p-old.
        deadline = time.monotonic() + ENGINE_TTL_S + 10.0 + 10.0
        held: list[str] = []
        while time.monotonic() < deadline:
            keys = d.call("drain")["sizes"]["keys"]
            held = sorted(path for path, ids in keys.items() if "p-old" in ids)
            if not held:
                break
            time.sleep(1.0)
        assert not held, f"D still holds state of the dead engine p-old: {held}"
