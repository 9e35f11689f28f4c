"""The one recovery rule both chaos lanes' checkers call (``checker.check_recovery``),
on its own: each lane only supplies what counts as served and what must recover."""

from __future__ import annotations

from typing import Any

import pytest

from harness.chaos import checker

BOUNDS = {"recovery_s": 10.0}


def _judge(
    events: list[dict[str, Any]], first: dict[str, float]
) -> tuple[list[checker.Violation], dict[str, Any]]:
    violations: list[checker.Violation] = []
    figures: dict[str, Any] = {}
    expected = {"p0->d0": ("p0", "d0"), "p0->d1": ("p0", "d1")}
    checker.check_recovery(events, lambda heal: first, expected, "new request", BOUNDS, violations, figures)
    return violations, figures


def test_without_a_final_heal_there_is_nothing_to_recover_from() -> None:
    violations, figures = _judge([{"t": 0.0, "ev": "run"}], {})
    assert violations == [] and figures == {"recovery_s": None}


def test_each_expected_label_must_be_served_within_the_bound() -> None:
    heal = [{"t": 5.0, "ev": "heal_all"}]
    violations, figures = _judge(heal, {"p0->d0": 2.0, "p0->d1": 12.5})
    assert [(v.rule, v.t, v.engines) for v in violations] == [("recovery", 15.0, ("p0", "d1"))]
    assert "p0->d1 served no new request correctly within 10s" in violations[0].what
    assert "(took 12.5s)" in violations[0].what
    assert figures == {"recovery_s": 12.5, "wedged": ["p0->d1"], "tcp_wait_s": 0.0}


def test_a_label_never_served_is_wedged_and_says_so() -> None:
    violations, figures = _judge([{"t": 5.0, "ev": "heal_all"}], {"p0->d0": 1.0, "elsewhere": 0.5})
    assert [v.engines for v in violations] == [("p0", "d1")] and "took" not in violations[0].what
    assert figures == {"recovery_s": 1.0, "wedged": ["p0->d1"], "tcp_wait_s": 0.0}


def test_tcp_backoff_at_the_heal_extends_only_its_own_pairs_bound() -> None:
    """Nothing UCX queued moves before TCP's backed-off retransmission fires: D owes service
    from then on, so the pair's bound is the heal plus that wait plus ``recovery_s``."""
    events = [
        {"t": 5.0, "ev": "heal_all"},
        {"t": 5.1, "ev": "tcp_wait", "pair": "p0->d1", "backoffs": 7, "wait_s": 25.6},
    ]
    violations, figures = _judge(events, {"p0->d0": 12.0, "p0->d1": 35.0})
    assert [v.engines for v in violations] == [("p0", "d0")]
    assert figures["tcp_wait_s"] == 25.6 and figures["wedged"] == ["p0->d0"]
    violations, _ = _judge(events, {"p0->d0": 2.0, "p0->d1": 36.0})
    assert [(v.engines, v.t) for v in violations] == [(("p0", "d1"), pytest.approx(5.0 + 35.6))]
    assert "TCP's retransmissions due until 25.6s after the heal included" in violations[0].what


def test_a_pairs_latest_tcp_wait_counts() -> None:
    """The lane may record a pair's wait more than once (a retransmission after the heal lost
    too): the latest due moment bounds the pair."""
    events = [
        {"t": 5.0, "ev": "heal_all"},
        {"t": 9.0, "ev": "tcp_wait", "pair": "p0->d1", "backoffs": 7, "wait_s": 40.0},
        {"t": 9.1, "ev": "tcp_wait", "pair": "p0->d1", "backoffs": 6, "wait_s": 0.2},
    ]
    violations, figures = _judge(events, {"p0->d0": 1.0, "p0->d1": 45.0})
    assert violations == [] and figures["tcp_wait_s"] == 40.0
