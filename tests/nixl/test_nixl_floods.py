"""Floods of our protocol's messages over real NIXL (``harness/nixl/floods.py``):
against our P while a real D heartbeats requests queued on it, and a rogue P
answering our D.  Run with ``-s`` to see memory, step times and counts.

Bounds (what a flood must never cost): P's resident memory stays flat, no P step's connector
work (CPU time outside NIXL's own notification calls, less GC pauses) grows
by more than 5 ms over the quiet baseline's worst step, and the real D keeps
its views (0 needless fences, every read correct).
"""

from __future__ import annotations

import pytest

pytest.importorskip("nixl")
from harness.nixl import Fleet, floods
from harness.nixl import scenarios as sc

pytestmark = pytest.mark.serial

STEP_GROWTH_S = 0.005
# Flat: P keeps none of what the floods sent (26 MiB in all, 20 of it in 1 MB
# hellos); the allocator keeps a few MiB of freed buffers (measured +4 to +8
# MiB over all floods).
RSS_GROWTH_BYTES = 16 << 20

PLANS = [
    # 10,000 hellos from 16 agents: half name a lease P holds (a fleet member
    # that saw real params), half a key P never issued.
    {"kind": "hellos", "agents": 16, "count": 10_000, "keys": ["LIVE", "no-such-lease"]},
    {"kind": "big_hellos", "count": 20, "size": 1 << 20},  # 20 hellos of 1 MB
    {"kind": "malformed_hellos", "count": 50},  # 50 rounds of every malformed form
    # 100k tags P never issued, named by an admitted agent in D-sized LHBT:
    # messages over one interval, as a D with 100k queued requests would.
    {"kind": "missing_tags", "count": 100_000, "max_bytes": 32768, "pace_s": 1.0},
]


def test_floods_against_our_p_keep_memory_steps_and_real_views(tmp_path) -> None:
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = floods.floods_on_p(fleet, PLANS)
    base = out["baseline"]
    for res in out["floods"]:
        assert res["sent"]["sent"] > 0 and res["sent"]["failed"] == 0, res
        assert res["rss_growth"] <= RSS_GROWTH_BYTES, res
        # The connector's own code; NIXL's copy of a 1 MB notification is stock's cost too.
        assert res["max_outside_nixl_s"] <= base["max_outside_nixl_s"] + STEP_GROWTH_S, (res, base)
    by_kind = {res["kind"]: res for res in out["floods"]}
    # Every hello naming a key P never issued is refused, and past one per agent
    # per step the rest are counted before they are parsed.
    assert by_kind["hellos"]["refused"] >= 5_000
    assert by_kind["hellos"]["sent"]["welcomes"] <= 2 * 16 * 10  # one per agent per answer gap at most
    big = by_kind["big_hellos"]
    assert big["malformed"] + big["refused"] == 20 and big["sent"]["answers"] == 0, big
    bad = by_kind["malformed_hellos"]
    rounds, per_round = 50, len(floods.malformed_hellos(b"", "k"))
    # Each is counted malformed or refused, except that one hello (version 2,
    # a live key, metadata that is not NIXL's) may be admitted and fail to load.
    assert rounds * (per_round - 1) <= bad["malformed"] + bad["refused"] <= rounds * per_round, bad
    assert bad["sent"]["answers"] == 0
    tags = by_kind["missing_tags"]["sent"]
    assert tags["longest_answer"] <= 4096 + 256, "an answer grew past its bound"
    assert out["rss_growth_total"] <= RSS_GROWTH_BYTES
    assert out["expired_while_flooded"] == []
    assert (out["fenced"], out["failed"], out["wrong"]) == (0, 0, [])
    assert set(out["freed_by"].values()) == {"read"}
    assert out["p_errors"] == [] and out["d_errors"] == []


def test_rogue_p_answers_never_renew_our_d(tmp_path) -> None:
    """A rogue agent answers our D with ``LACK:`` for the real P's instance and
    a forged one while the real P is stopped: D ignores every answer (not from
    an agent of its connection), its views lapse and every read fails: fenced, or,
    once the real P's silence made D release the connection (PROTOCOL D2a),
    refused by upstream as a read of a released engine."""
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        out = floods.rogue_p_answers_d(fleet)
    n = len(out["ids"])
    assert out["sent"]["sent"] > 0 and out["sent"]["failed"] == 0
    assert out["ignored"] == out["sent"]["sent"]
    assert (out["loaded"], out["failed"]) == (n, n)
    assert out["fenced"] == n or out["released"] > 0, out
    assert out["d_errors"] == []
