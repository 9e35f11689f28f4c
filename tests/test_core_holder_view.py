"""D's conservative lease view (holder_view.py): unit tests and a property test
that the view never lets D read after P's real lease table has dropped the lease."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_nixl_lease.holder_view import HolderLeaseViews


def test_view_starts_at_the_reported_deadline_on_local_clock() -> None:
    views = HolderLeaseViews(margin=2.0)
    views.add("d1", "P", "p1", grantor_deadline=1030.0, extension=20.0)
    # P's clock runs 1000 s ahead of ours: its 1030 is our 30.
    assert views.remaining("d1", now=10.0, offset=1000.0) == pytest.approx(20.0)
    assert views.may_read("d1", now=27.9, offset=1000.0) is True
    assert views.may_read("d1", now=28.0, offset=1000.0) is False  # exactly the margin left: fenced
    assert views.may_read("unknown", now=0.0, offset=0.0) is None


def test_heartbeat_renews_only_while_the_view_has_more_than_the_margin() -> None:
    views = HolderLeaseViews(margin=2.0)
    views.add("d1", "P", "p1", 30.0, 20.0)
    views.add("d2", "P", "p2", 30.0, 20.0)
    assert views.heartbeat_sent("P", ["p1", "zzz"], offset=0.0, started=25.0, finished=25.5) == 1
    assert views.remaining("d1", 25.5, 0.0) == pytest.approx(19.5)  # 25 + 20, from the send's start
    assert views.remaining("d2", 25.5, 0.0) == pytest.approx(4.5)  # not in the message
    # Sent when d2's view had only 2 s left: it may arrive after P's sweep, so it does not count.
    assert views.heartbeat_sent("P", ["p2"], offset=0.0, started=27.9, finished=28.0) == 0
    assert views.may_read("d2", 28.0, 0.0) is False
    # A later heartbeat cannot revive a view that lapsed.
    assert views.heartbeat_sent("P", ["p2"], offset=0.0, started=29.0, finished=29.0) == 0


def test_heartbeat_never_moves_a_view_backwards() -> None:
    views = HolderLeaseViews(margin=1.0)
    views.add("d1", "P", "p1", 100.0, 4.0)
    views.heartbeat_sent("P", ["p1"], 0.0, 10.0, 10.0)
    assert views.remaining("d1", 10.0, 0.0) == pytest.approx(90.0)


def test_views_are_per_engine_and_dropped() -> None:
    views = HolderLeaseViews(margin=1.0)
    views.add("d1", "P1", "same", 10.0, 4.0)
    views.add("d2", "P2", "same", 10.0, 4.0)
    assert views.heartbeat_sent("P1", ["same"], 0.0, 8.0, 8.0) == 1
    assert views.remaining("d1", 8.0, 0.0) == pytest.approx(4.0)
    assert views.remaining("d2", 8.0, 0.0) == pytest.approx(2.0)
    assert views.drop("d1") and not views.drop("d1")
    assert views.heartbeat_sent("P1", ["same"], 0.0, 8.5, 8.5) == 0
    assert len(views) == 1 and "d2" in views and views.engine_of("d2") == "P2"
    # Re-adding an id replaces its view and its remote key.
    views.add("d2", "P3", "other", 50.0, 4.0)
    assert views.heartbeat_sent("P2", ["same"], 0.0, 9.0, 9.0) == 0
    assert views.remaining("d2", 0.0, 0.0) == pytest.approx(50.0)


@pytest.mark.parametrize(
    "deadline,extension",
    [(math.nan, 1.0), (math.inf, 1.0), (1.0, 0.0), (1.0, -1.0), (1.0, math.inf)],
)
def test_bad_lease_fields_raise(deadline: float, extension: float) -> None:
    with pytest.raises(ValueError):
        HolderLeaseViews(1.0).add("d1", "P", "p1", deadline, extension)


@pytest.mark.parametrize("margin", [-1.0, math.nan, math.inf])
def test_bad_margin_raises(margin: float) -> None:
    with pytest.raises(ValueError):
        HolderLeaseViews(margin)


@st.composite
def histories(draw: st.DrawFn) -> dict:
    duration = draw(st.floats(2.0, 60.0))
    extension = draw(st.floats(0.5, 1.0)) * duration
    margin = draw(st.floats(0.05, 0.9)) * extension
    # Clock offset (P minus D) and D's estimate of it: off by at most err_max.
    offset = draw(st.floats(-1e6, 1e6))
    err_max = draw(st.floats(0.0, 0.45)) * margin
    err = draw(st.floats(-err_max, err_max))
    events = []
    t = 0.0
    for _ in range(draw(st.integers(1, 40))):
        # Gaps up to 3 extensions: steady heartbeating, slow steps and long freezes.
        t += draw(st.floats(0.0, 3.0)) * extension * draw(st.sampled_from([0.05, 0.3, 1.0]))
        kind = draw(st.sampled_from(["hb", "hb", "read"]))
        send_time = draw(st.floats(0.0, 0.1)) * margin
        # Delivery delay below margin - |estimate error|: the assumption fencing rests on.
        delay = draw(st.floats(0.0, 0.999)) * (margin - abs(err))
        events.append((t, kind, send_time, delay))
    return dict(duration=duration, extension=extension, margin=margin, offset=offset, err=err, events=events)


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(h=histories())
def test_view_never_outlives_the_grantors_lease(core, h: dict) -> None:
    """P runs the real LeaseTable on its clock; D runs the view on its own.
    Whenever the view allows a read, P holds the lease (counting heartbeats in
    flight) for at least margin - |offset error| more."""
    ext, margin, offset, err = h["extension"], h["margin"], h["offset"], h["err"]
    p_table = core.LeaseTable(ext)
    p_table.grant("p1", offset + h["duration"])  # granted at D time 0, on P's clock
    views = HolderLeaseViews(margin)
    views.add("d1", "P", "p1", offset + h["duration"], ext)
    arrivals: list[float] = []  # D-clock arrival times of heartbeats still in flight
    for t, kind, send_time, delay in h["events"]:
        # Deliver every heartbeat that arrived by t, in order; P sweeps before it
        # applies one arriving exactly at the deadline (the strict reading).
        for a in sorted(x for x in arrivals if x <= t):
            p_table.pop_expired(a + offset)
            p_table.extend(b"p1", a + offset)  # a heartbeat payload (the ids after the prefix)
        arrivals = [x for x in arrivals if x > t]
        p_table.pop_expired(t + offset)
        if kind == "hb":
            finished = t + send_time
            views.heartbeat_sent("P", ["p1"], offset + err, t, finished)
            arrivals.append(t + delay + send_time * 0.5)  # left some time during the send
        elif views.may_read("d1", t, offset + err):
            p_deadline = p_table.deadline("p1")
            assert p_deadline is not None, "D would read a lease P already dropped"
            # Heartbeats still in flight extend it once they land (if before the deadline).
            for a in sorted(arrivals):
                if a + offset < p_deadline:
                    p_deadline = max(p_deadline, a + offset + ext)
            assert p_deadline - offset - t > margin - abs(err) - 1e-6
