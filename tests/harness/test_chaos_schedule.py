"""The nemesis's plan: deterministic per seed, every kind early, overlapping,
within the horizon, and never two link faults on one host at once."""

from __future__ import annotations

from harness.chaos import schedule

LAYOUT = schedule.Layout(
    {"p0": ("P", "p"), "p1": ("P", "q"), "d0": ("D", "d"), "d1": ("D", "e"), "d2": ("D", "f")}
)


def test_same_seed_same_plan_other_seed_other_plan() -> None:
    a = schedule.plan(5, 120, LAYOUT)
    assert a == schedule.plan(5, 120, LAYOUT)
    assert a != schedule.plan(6, 120, LAYOUT)


def test_every_kind_ends_by_the_horizon_and_faults_overlap() -> None:
    for seed in range(20):
        plan = schedule.plan(seed, 120, LAYOUT)
        assert {f.kind for f in plan} == set(schedule.KINDS), seed
        assert all(0 < f.start < f.end <= 120 for f in plan)
        overlapping = sum(
            1 for a in plan for b in plan if a.fid < b.fid and a.start < b.end and b.start < a.end
        )
        assert overlapping > 0


def test_link_faults_never_overlap_on_a_host_and_a_role_keeps_a_free_engine() -> None:
    for seed in range(20):
        plan = schedule.plan(seed, 300, LAYOUT)
        links = [f for f in plan if f.kind in ("partition", "flap")]
        for a in links:
            for b in links:
                if a.fid < b.fid and a.hosts == b.hosts:
                    assert a.end <= b.start or b.end <= a.start, (a.describe(), b.describe())
        procs = [f for f in plan if f.kind in ("stop", "kill", "starve")]
        for f in procs:
            role = LAYOUT.engines[f.engines[0]][0]
            at_once = {
                g.engines[0]
                for g in procs
                if LAYOUT.engines[g.engines[0]][0] == role and g.start <= f.start < g.end
            }
            assert len(at_once) < len(LAYOUT.role(role)), (seed, f.describe())
