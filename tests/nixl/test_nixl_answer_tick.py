"""P answers on a tick (docs/PROTOCOL.md P3a, P3b), over real NIXL: one P (ours)
holds leases past the lease for 4 D engines (ours) that heartbeat them paced over the interval.

- P sends its answers in at most one step per answer tick (half the interval),
  counted by the connector (``num_answer_steps``), however many D engines pace
  their heartbeats over the interval;
- D's asking rule (D3b) ships off, so D asks in every heartbeat; P still
  answers them in at most one step per tick;
- nothing lapses meanwhile: no lease expires while its D heartbeats, every
  request is read (its view was proven by P's answers), and every read
  returns P's data.

A stock P sends no answers at all; it is what the other fleet tests compare
against (``test_nixl_fleet.py``).  Serial: five engine processes on two cores."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("nixl")
from harness.nixl import Fleet, pfleet
from harness.nixl import scenarios as sc

pytestmark = pytest.mark.serial

N_D = 4
LEASES = 200


def test_p_answers_on_its_tick(tmp_path) -> None:
    with Fleet(tmp_path, lease=sc.LEASE) as fleet:
        pf = pfleet.start(fleet, n_d=N_D, max_leases=LEASES, stock=False, observe_ids=True)
        pfleet.grow(pf, LEASES, spread_phases=True)  # each D's rounds at its own phase
        before, steps_before = sc.over_ranks(pf.p.stats(), "num_answer_steps"), pf.p.summary()["steps"]
        acks_before = sc.over_ranks(pf.p.stats(), "num_heartbeat_acks_sent")
        tagged_before = sc.over_ranks(pf.p.stats(), "num_tagged_heartbeats_recv")
        held = pfleet.hold(pf, sc.LEASE + 2)  # past one lease: every lease lived on renewals
        stats, steps = pf.p.stats(), pf.p.summary()["steps"] - steps_before
        answer_steps = sc.over_ranks(stats, "num_answer_steps") - before
        answered = sc.over_ranks(stats, "num_heartbeat_acks_sent") - acks_before
        tagged = sc.over_ranks(stats, "num_tagged_heartbeats_recv") - tagged_before
        out = pfleet.release_and_check(pf)
    tick = pf.heartbeat_interval / 2
    ticks = math.ceil(held["hold_s"] / tick) + 1
    print(
        f"P: {answer_steps} answer steps of {steps} steps in {held['hold_s']:.1f} s ({ticks} ticks); "
        f"D asked an answer in {answered} of {tagged} tagged heartbeats"
    )
    assert held["errors"] == [] and out["errors"] == []
    assert held["expired"] == 0 and held["d_silent"] == 0
    assert 0 < answer_steps <= ticks  # at most one sending step per tick, whatever the D count
    assert answer_steps < tagged  # one per heartbeat round would be one per D per interval
    assert answered > 0  # D asks in every heartbeat while D3b's rule is off (ASK_ONLY_WHEN_NEEDED)
    assert out["freed_by"] == {"read": LEASES}  # every request read: its view stayed proven
    assert out["wrong"] == 0  # nothing stale read
