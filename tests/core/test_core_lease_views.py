"""D's conservative lease view (lease_views.py): unit tests and a property test
that the view never lets D read after P's real lease table has dropped the lease."""

from __future__ import annotations

import math

import pytest
from core_implementations import ViewFields as NewView
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_nixl_lease._wire import heartbeat_payload

INSTANCE = "0123456789abcdef"


def test_view_starts_at_the_reported_deadline_on_local_clock(core) -> None:
    views = core.LeaseViews(margin=2.0)
    views.add("d1", "P", "p1", grantor_deadline=1030.0, extension=20.0)
    # P's clock runs 1000 s ahead of ours: its 1030 is our 30.
    assert views.remaining("d1", now=10.0, offset=1000.0) == pytest.approx(20.0)
    assert views.may_read("d1", now=27.9, offset=1000.0) is True
    assert views.may_read("d1", now=28.0, offset=1000.0) is False  # exactly the margin left: fenced
    assert views.may_read("unknown", now=0.0, offset=0.0) is None


def test_heartbeat_renews_only_while_the_view_has_more_than_the_margin(core) -> None:
    views = core.LeaseViews(margin=2.0)
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


def test_heartbeat_never_moves_a_view_backwards(core) -> None:
    views = core.LeaseViews(margin=1.0)
    views.add("d1", "P", "p1", 100.0, 4.0)
    views.heartbeat_sent("P", ["p1"], 0.0, 10.0, 10.0)
    assert views.remaining("d1", 10.0, 0.0) == pytest.approx(90.0)


def test_views_are_per_engine_and_dropped(core) -> None:
    views = core.LeaseViews(margin=1.0)
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
def test_bad_lease_fields_raise(core, deadline: float, extension: float) -> None:
    with pytest.raises(ValueError):
        core.LeaseViews(1.0).add("d1", "P", "p1", deadline, extension)


@pytest.mark.parametrize("margin", [-1.0, math.nan, math.inf])
def test_bad_margin_raises(core, margin: float) -> None:
    with pytest.raises(ValueError):
        core.LeaseViews(margin)


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
    views = core.LeaseViews(margin)
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


# -- renewal per heartbeat chunk, driven through the real tracker -----------
def _chunk_renewal_run(core, seed: int, disown: bool, clean: bool) -> int:
    """Random tracking, re-adds (resets), removals and paced sends through a
    real ``HeartbeatTracker``; P's answers arrive late, out of order, some
    lost, some disowning names (unless ``clean``).  A model renews a view only
    from an answer naming it to a message built after the view was added,
    sent while the view was alive and younger than the extension when it
    arrives; a disowned name ends its view.  Checked every step: no view is
    ever later than the model (safety); in a clean run, exactly the model.
    Returns how many answers renewed something."""
    import random

    rng = random.Random(seed)
    ext = 20.0
    hb = core.HeartbeatTracker(1.0, max_message_bytes=60)
    views = core.LeaseViews(margin=0.0)
    live: dict[str, tuple[str, str, int]] = {}  # local -> (engine, remote, generation)
    model: dict[str, float] = {}  # local -> deadline the model allows
    gen = 0
    in_flight: list[tuple[int, str, int, int, float, set[tuple[str, int]], set[str]]] = []
    now, n, useful = 0.0, 0, 0
    for step in range(400):
        for _ in range(rng.randrange(3)):  # arrivals (some on a P id already tracked)
            engine = f"P{rng.randrange(2)}"
            same = [v for v in live.values() if v[0] == engine]
            remote = rng.choice(same)[1] if same and rng.random() < 0.2 else f"r{n}"
            local = f"l{n}"
            n += 1
            hb.track(local, engine, remote)
            gen += 1
            live[local] = (engine, remote, gen)
            views.add(local, engine, remote, now + 5.0, ext, INSTANCE, chunk=hb.chunk_of(local))
            model[local] = now + 5.0
        if live and rng.random() < 0.3:  # a reset: the same request tracked and viewed again
            local = rng.choice(sorted(live))
            engine, remote, _ = live[local]
            hb.track(local, engine, remote)
            gen += 1
            live[local] = (engine, remote, gen)
            views.add(local, engine, remote, now + 5.0, ext, INSTANCE, chunk=hb.chunk_of(local))
            model[local] = now + 5.0
        for _ in range(rng.randrange(3)):  # departures
            if live:
                local = rng.choice(sorted(live))
                repacks = hb.repacks
                hb.untrack(local)
                views.drop(local)
                del live[local], model[local]
                if hb.repacks != repacks:  # what the scheduler ships (rechunk)
                    for other in live:
                        views.move_to_chunk(other, hb.chunk_of(other), 0.0)
        for engine, sent in hb.poll_paced_chunks(now).items():
            for key, version, msg, _ in sent:
                named = set(heartbeat_payload(msg).decode().split(","))
                covered = {(loc, g) for loc, (e, r, g) in live.items() if e == engine and r in named}
                refused = {r for r in named if disown and rng.random() < 0.1}
                delay = 1 if clean else rng.randrange(4)
                in_flight.append((step + delay, engine, key, version, now, covered, refused))
        if not clean:
            rng.shuffle(in_flight)
        keep = []
        for item in in_flight:
            due, engine, key, version, started, covered, refused = item
            if due > step:
                keep.append(item)
                continue
            if not clean and rng.random() < 0.1:
                continue  # lost
            views.chunk_acked(engine, INSTANCE, key, version, started, refused, 0.0, now)
            for loc, g in covered:
                entry = live.get(loc)
                if entry is None or entry[2] != g:
                    continue
                if entry[1] in refused:
                    model[loc] = -math.inf
                elif started < model[loc] and started + ext > now:
                    if started + ext > model[loc]:
                        useful += 1
                    model[loc] = max(model[loc], started + ext)
        in_flight = keep
        exact = clean and hb.repacks == 0
        for loc in live:
            got = views.remaining(loc, now, 0.0) + now
            assert got <= model[loc] + 1e-9, (seed, step, loc, got, model[loc])
            if exact:
                assert got == pytest.approx(model[loc]), (seed, step, loc, got, model[loc])
        now += rng.choice((0.05, 0.2, 0.5))
    return useful


@pytest.mark.parametrize("seed", range(16))
@pytest.mark.parametrize("disown,clean", [(False, False), (True, False), (False, True)])
def test_chunk_answers_renew_only_what_they_prove(core, seed: int, disown: bool, clean: bool) -> None:
    assert _chunk_renewal_run(core, seed, disown, clean) > 50  # the answers did renew views


def test_chunk_answer_guards(core) -> None:
    views = core.LeaseViews(margin=0.0)
    views.add("a", "P", "ra", 10.0, 20.0, INSTANCE, chunk=(7, 3))
    views.add("b", "P", "rb", 10.0, 20.0, INSTANCE, chunk=(7, 5))  # joined after version 4
    views.chunk_acked("P", INSTANCE, 7, 4, started=5.0, offset=0.0)
    assert views.remaining("a", 0.0, 0.0) == pytest.approx(25.0)
    assert views.remaining("b", 0.0, 0.0) == pytest.approx(10.0)  # not in that message
    views.add("a", "P", "ra", 6.0, 20.0, INSTANCE, chunk=(7, 6))  # reset
    assert views.remaining("a", 0.0, 0.0) == pytest.approx(6.0)  # the old answer does not apply
    views.chunk_acked("P", INSTANCE, 7, 6, started=8.0, not_extended=["ra"], offset=0.0)
    assert views.remaining("a", 0.0, 0.0) == -math.inf  # disowned: ended at once
    assert views.remaining("b", 0.0, 0.0) == pytest.approx(28.0)
    views.chunk_acked("P", INSTANCE, 7, 6, started=7.0, offset=0.0)  # older send, answered late
    assert views.remaining("b", 0.0, 0.0) == pytest.approx(28.0)
    views.add("c", "P", "rc", 10.0, 20.0, chunk=(7, 1))  # a plain P does not answer: not renewed
    assert views.remaining("c", 0.0, 0.0) == pytest.approx(10.0)
    views.chunk_acked("P", INSTANCE, 7, 7, started=27.0, offset=0.0, now=27.0)  # the chain goes on
    assert views.remaining("b", 0.0, 0.0) == pytest.approx(47.0)
    views.chunk_acked("P", INSTANCE, 7, 7, started=50.0, offset=0.0, now=50.0)  # after b lapsed (47)
    assert views.remaining("b", 0.0, 0.0) == pytest.approx(47.0)  # a lapsed view never revives
    assert views.prune_chunk_acks(sent_before=100.0) == 1


def test_chunk_renewed_until_is_what_its_latest_answer_proved(core) -> None:
    """D3b's question: until when the chunk's latest answer renewed its views
    (None while a view waits for its first answer, or no answer is kept)."""
    views = core.LeaseViews(margin=0.0)
    assert views.chunk_renewed_until("P", 7) is None
    views.add("a", "P", "ra", 10.0, 20.0, INSTANCE, chunk=(7, 3))
    assert views.chunk_renewed_until("P", 7) is None  # a waits for its first answer
    views.chunk_acked("P", INSTANCE, 7, 3, started=5.0, offset=0.0)
    assert views.chunk_renewed_until("P", 7) == pytest.approx(25.0)
    views.add("b", "P", "rb", 30.0, 12.0, INSTANCE, chunk=(7, 4))  # a shorter extension joins
    assert views.chunk_renewed_until("P", 7) is None
    views.chunk_acked("P", INSTANCE, 7, 4, started=9.0, offset=0.0)
    assert views.chunk_renewed_until("P", 7) == pytest.approx(21.0)  # the shortest extension
    views.prune_chunk_acks(sent_before=10.0)
    assert views.chunk_renewed_until("P", 7) is None  # forgotten: ask


def test_first_answer_after_the_view_lapsed_ends_it(core) -> None:
    views = core.LeaseViews(margin=0.0)
    views.add("a", "P", "ra", 10.0, 20.0, INSTANCE, chunk=(7, 1))
    views.chunk_acked("P", INSTANCE, 7, 1, started=12.0, offset=0.0, now=12.0)
    assert views.remaining("a", 0.0, 0.0) == -math.inf


def test_answers_too_old_to_renew_are_ignored(core) -> None:
    views = core.LeaseViews(margin=0.0)
    views.add("a", "P", "ra", 10.0, 20.0, INSTANCE)
    assert views.heartbeat_acked("P", INSTANCE, ["ra"], 0.0, started=5.0, now=26.0) == 0  # 5 + 20 <= 26
    assert views.heartbeat_acked("P", INSTANCE, ["ra"], 0.0, started=5.0, now=24.0) == 1
    assert views.remaining("a", 0.0, 0.0) == pytest.approx(25.0)


def test_another_process_proven_ends_the_old_views(core) -> None:
    views = core.LeaseViews(margin=0.0)
    views.add("a", "P", "ra", 10.0, 20.0, INSTANCE)
    views.add("b", "P", "rb", 10.0, 20.0)  # plain
    views.add("c", "Q", "rc", 10.0, 20.0, INSTANCE)
    assert views.instance_proven("P", INSTANCE) == 1  # the plain view of P ends
    assert views.instance_proven("P", INSTANCE) == 0
    assert views.instance_proven("P", "fedcba9876543210") == 1
    assert views.remaining("a", 0.0, 0.0) == views.remaining("b", 0.0, 0.0) == -math.inf
    assert views.remaining("c", 0.0, 0.0) == pytest.approx(10.0)
    # A view of the old process that arrives late is not read: D asks for its
    # proof before every read (the read fence), which the connection no longer gives.
    views.add("d", "P", "rd", 10.0, 20.0, INSTANCE)
    assert views.any_name("P", INSTANCE) == "rd" and views.any_name("Q", "x") is None


# -- bounds under P restarts -------------------------------------------------
def test_an_extension_above_the_cap_is_clamped_which_only_shortens_the_view(core) -> None:
    views = core.LeaseViews(margin=2.0, extension_cap=60.0)
    assert views.add("d1", "P", "p1", 30.0, 1e9, INSTANCE) is True  # P's terms: absurd
    assert views.add("d2", "P", "p2", 30.0, 20.0, INSTANCE) is False
    assert views.max_extension == 60.0  # bounds how long D keeps unanswered sends
    assert views.remaining("d1", 0.0, 0.0) == pytest.approx(30.0)  # P's deadline itself is kept
    views.heartbeat_acked("P", INSTANCE, ["p1", "p2"], offset=0.0, started=10.0, now=11.0)
    assert views.remaining("d1", 11.0, 0.0) == pytest.approx(59.0)  # 10 + 60, not 10 + 1e9
    assert views.remaining("d2", 11.0, 0.0) == pytest.approx(19.0)
    with pytest.raises(ValueError):
        core.LeaseViews(margin=1.0, extension_cap=0.0)


def test_forget_engines_drops_per_engine_state_of_engines_gone_and_viewless(core) -> None:
    views = core.LeaseViews(margin=1.0)
    for i in range(1000):  # P restarted 1,000 times, a fresh engine id each time
        engine = f"P-{i}"
        views.add(f"d{i}", engine, "p", 30.0, 20.0, INSTANCE, chunk=(1, 1))
        views.instance_proven(engine, INSTANCE)
        views.chunk_acked(engine, INSTANCE, 1, 1, 5.0, offset=0.0, now=6.0)
        if i < 999:
            views.drop(f"d{i}")
    assert views.engines_known() == 1000
    # Connected to the last three; the last one still has a view.
    assert views.forget_engines({"P-997", "P-998", "P-999"}) == 997
    assert views.engines_known() == 3
    assert views.forget_engines(set()) == 2  # P-999 is kept: D still views a lease of it
    assert views.engines_known() == 1 and "d999" in views
    assert views.remaining("d999", 6.0, 0.0) == pytest.approx(24.0)  # its view stands


@pytest.mark.parametrize(
    "given,kept",
    [
        (None, 2.0),
        (1.5, 1.5),
        (2.0, 2.0),
        (3.0, 2.0),
        (0.0, 0.0),
        (-1.0, 0.0),
        (math.nan, 0.0),
        (math.inf, 2.0),
    ],
)
def test_a_views_margin_is_the_given_one_within_zero_and_the_most(
    core, given: float | None, kept: float
) -> None:
    """``min(margin, max(0.0, given))``, NaN included (``max`` keeps its first argument)."""
    views = core.LeaseViews(margin=2.0)
    views.add("d1", "P", "p1", 30.0, 20.0, margin=given)
    assert views.margin_of("d1") == kept == min(2.0, max(0.0, 2.0 if given is None else given))


def test_deadline_of_and_left_and_margin_read_what_remaining_and_margin_of_read(core) -> None:
    views = core.LeaseViews(margin=2.0)
    views.add("d1", "P", "p1", grantor_deadline=1030.0, extension=20.0, margin=1.0)
    assert views.deadline_of("unknown", 1000.0) is None
    assert views.left_and_margin("unknown", 10.0, {"P": 1000.0}) is None
    assert views.left_and_margin("d1", 10.0, {}) is None  # no offset: nothing converted
    assert views.deadline_of("d1", 1000.0) == 30.0  # converted with this offset, and kept
    assert views.left_and_margin("d1", 10.0, {"P": 0.0}) == (20.0, 1.0)
    assert views.remaining("d1", 10.0, 5.0) == 20.0
    assert views.end("P", "", ["p1"]) == 1
    assert views.deadline_of("d1", 1000.0) == -math.inf
    assert views.left_and_margin("d1", 10.0, {"P": 1000.0}) == (-math.inf, 1.0)


def test_a_view_added_with_its_chunk_waits_for_that_chunks_first_answer(core) -> None:
    """Added with a chunk (acknowledged): its first answer renews it, as ``move_to_chunk`` would."""
    views = core.LeaseViews(margin=1.0)
    views.add("d1", "P", "p1", 30.0, 20.0, instance="i1", chunk=(7, 3))
    views.add("d2", "P", "p2", 30.0, 20.0, chunk=(7, 3))  # plain: waits for no answer
    assert views.chunk_renewed_until("P", 7) is None
    views.chunk_acked("P", "i1", 7, 3, started=25.0, offset=0.0, now=25.5)
    assert views.remaining("d1", 25.0, 0.0) == pytest.approx(20.0)
    assert views.chunk_renewed_until("P", 7) == pytest.approx(45.0)
    assert views.drop("d1") and views.drop("d2") and len(views) == 0


def test_views_still_waiting_after_an_answer_leave_the_chunks_list_when_dropped_or_moved(core) -> None:
    """An answer older than a view's joining leaves it waiting; dropping or moving that
    view later takes it off the chunk's list, and the last one off ends the wait."""
    views = core.LeaseViews(margin=1.0)
    views.add("d1", "P", "p1", 30.0, 20.0, instance="i1", chunk=(7, 1))
    views.add("d2", "P", "p2", 30.0, 20.0, instance="i1", chunk=(7, 5))
    views.add("d3", "P", "p3", 30.0, 20.0, instance="i1", chunk=(7, 6))
    views.chunk_acked("P", "i1", 7, 3, started=25.0, offset=0.0, now=25.5)  # d1 answered
    assert views.chunk_renewed_until("P", 7) is None  # d2 and d3 still wait
    assert views.drop("d2")
    assert views.move_to_chunk("d3", (8, 9), 0.0)
    assert views.chunk_renewed_until("P", 7) == pytest.approx(45.0)
    assert views.chunk_renewed_until("P", 8) is None  # d3 waits there now
    views.chunk_acked("P", "i1", 8, 9, started=26.0, offset=0.0, now=26.5)
    assert views.chunk_renewed_until("P", 8) == pytest.approx(46.0)
    assert views.drop("d1") and views.drop("d3") and len(views) == 0


def test_note_terms_keeps_versions_and_terms_and_reports_each_change(core) -> None:
    base, newest = 2, 4
    new = {
        "plain": NewView("P0", "", "p0", 10.0, 6.0, 1.0, 5),  # a plain P: changes nothing
        "a": NewView("P1", INSTANCE, "p1", 10.0, 6.0, 1.0, 3),
        "b": NewView("P1", INSTANCE, "p2", 10.0, 6.0, 1.0, 9),  # over the newest: capped
        "c": NewView("P2", "fedcba9876543210", "p3", 10.0, 8.0, None, base),  # base: no version
        "d": NewView("P1", INSTANCE, "p4", 10.0, 7.0, 1.0, 3),  # P1's terms change again
    }
    versions: dict[tuple[str, str], int] = {("P2", "fedcba9876543210"): 3}
    terms: dict[str, tuple[float, float | None]] = {"P2": (8.0, None)}
    changed = core.LeaseViews.note_terms(new, versions, terms, base, newest)
    assert changed == [("P1", 6.0, 1.0), ("P1", 7.0, 1.0)]
    assert versions == {("P1", INSTANCE): 3, ("P2", "fedcba9876543210"): 3}
    assert terms == {"P1": (7.0, 1.0), "P2": (8.0, None)}
    # The same views again: P1's alternate, P2's match what was kept.
    assert core.LeaseViews.note_terms(new, versions, terms, base, newest) == [
        ("P1", 6.0, 1.0),
        ("P1", 7.0, 1.0),
    ]
    assert core.LeaseViews.note_terms({"d": new["d"]}, versions, terms, base, newest) == []


def test_note_terms_compares_terms_as_tuples_do(core) -> None:
    """A change is what ``(extension, interval) != terms[engine]`` says: an int
    equal to the float is no change, the very same NaN object is none either,
    another NaN is one (``nan != nan``), and a value kept in another shape is one."""
    nan = float("nan")
    terms: dict[str, object] = {"P1": (6.0, 1.0), "P2": (8.0, nan), "P3": (8.0, nan), "P4": [8.0, None]}
    new = {
        "a": NewView("P1", INSTANCE, "p1", 10.0, 6, 1, 2),
        "b": NewView("P2", INSTANCE, "p2", 10.0, 8.0, nan, 2),
        "c": NewView("P3", INSTANCE, "p3", 10.0, 8.0, float("nan"), 2),
        "d": NewView("P4", INSTANCE, "p4", 10.0, 8.0, None, 2),
    }
    changed = core.LeaseViews.note_terms(new, {}, terms, 2, 4)
    assert [engine for engine, _, _ in changed] == ["P3", "P4"]
    assert terms["P1"] == (6.0, 1.0) and type(terms["P1"][0]) is float  # kept, not rewritten
    assert terms["P4"] == (8.0, None)
