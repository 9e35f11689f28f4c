"""Acknowledged heartbeats (ack_ledger.py + lease_views.py) under adversarial
delivery: arbitrary delays, partitions that release a burst at the heal,
duplicated and lost messages both ways, several P ranks.

The property: D's view of a lease never ends later than P's real lease on any
rank -- while P holds it, and after P has freed it.  P is the real lease core
(both implementations); the network is a hypothesis-driven schedule.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_nixl_lease._wire import (
    acked_heartbeat_message,
    heartbeat_ack_message,
    heartbeat_message,
    parse_acked_heartbeat,
    parse_heartbeat_ack,
)
from vllm_nixl_lease.decode.ack_ledger import AckLedger, Proven

EXT = 8.0
IDS = ["p0", "p1", "p2"]
INSTANCE = "0123456789abcdef"


def test_answer_proves_only_ids_every_rank_held() -> None:
    ledger = AckLedger()
    seq = ledger.open("P", ["r0", "r1"], b"a,b,c", started=5.0)
    assert ledger.answered("r0", seq, frozenset({"b"})) is None
    assert ledger.answered("r0", seq, frozenset()) is None  # repeated: ignored
    proven = ledger.answered("r1", seq, frozenset({"c"}))
    assert proven is not None and (proven.engine_id, proven.remote_ids, proven.started) == ("P", ["a"], 5.0)
    assert ledger.answered("r1", seq, frozenset()) is None and not len(ledger)


def test_none_extended_and_pruning() -> None:
    ledger = AckLedger()
    s1 = ledger.open("P", ["r0"], b"a", started=1.0)
    s2 = ledger.open("P", ["r0"], b"a", started=2.0)
    s3 = ledger.open("P", ["r0"], b"a", started=3.0)
    proven = ledger.answered("r0", s2, None)
    assert proven is not None and proven.remote_ids == []
    assert ledger.prune(sent_before=2.5) == 1  # s1 gone, s3 kept
    assert ledger.answered("r0", s1, frozenset()) is None
    assert ledger.answered("r0", s3, frozenset()).remote_ids == ["a"]  # type: ignore[union-attr]


def test_wire_round_trip() -> None:
    msg = acked_heartbeat_message(42, heartbeat_message(["a:1", "b"]))
    assert msg == b"HB:,LHB:42,a:1,b" and parse_acked_heartbeat(msg) == (42, b"a:1,b", False)
    tagged = acked_heartbeat_message(43, heartbeat_message(["AAAAAAAAAAA"]), tagged=True)
    assert tagged == b"HB:,LHBT:43,AAAAAAAAAAA"
    assert parse_acked_heartbeat(tagged) == (43, b"AAAAAAAAAAA", True)
    i = INSTANCE
    assert parse_heartbeat_ack(heartbeat_ack_message(i, [7])) == (i, [7], frozenset(), None)
    assert parse_heartbeat_ack(heartbeat_ack_message(i, [7, 9], b"x,y")) == (
        i,
        [7, 9],
        frozenset({"x", "y"}),
        None,
    )
    assert parse_heartbeat_ack(heartbeat_ack_message(i, [7], b"*")) == (i, [7], None, None)
    assert parse_heartbeat_ack(heartbeat_ack_message(i, [])) == (i, [], frozenset(), None)  # the welcome
    for bad in (b"HB:,LHB:", b"HB:,LHB:x,a", b"HB:,LHB:-1,a", b"HB:,LHB:1" + b"0" * 20 + b",a", b"LHB:7:a"):
        assert parse_acked_heartbeat(bad) is None
    lack = b"LACK:" + i.encode()
    for bad in (b"LACK:", b"LACK:x", lack, lack + b":x", lack + b":1,,2", lack + b":1,x:a", lack + b"::a"):
        assert parse_heartbeat_ack(bad) is None
    assert parse_heartbeat_ack(b"LACK:" + i.upper().encode() + b":1") is None  # instances are lowercase
    assert parse_heartbeat_ack(lack + b":3:\xff") == (i, [3], None, None)


# One step of the world: ("hb", ids) D sends a heartbeat now; ("tick", dt)
# time passes, P steps (applies what arrived, answers, sweeps), D takes
# what arrived.  Each message gets a fate: a delay, or lost; some are doubled.
fates = st.one_of(st.none(), st.floats(0.0, 3 * EXT, allow_nan=False))
actions = st.one_of(
    st.tuples(st.just("hb"), st.lists(st.sampled_from(IDS), min_size=1, max_size=3, unique=True)),
    st.tuples(st.just("tick"), st.floats(0.05, EXT, allow_nan=False)),
    st.tuples(st.just("cut"), st.floats(0.5, 3 * EXT, allow_nan=False)),
)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    ranks=st.integers(1, 2),
    script=st.lists(actions, max_size=40),
    delays=st.lists(fates, min_size=1, max_size=60),
    doubled=st.lists(st.booleans(), min_size=1, max_size=60),
)
def test_view_never_outlives_p_under_any_delivery(core, ranks, script, delays, doubled) -> None:
    tables = [core.LeaseTable(EXT) for _ in range(ranks)]
    agents = [f"r{r}" for r in range(ranks)]
    for table in tables:
        for p_id in IDS:
            table.grant(p_id, EXT)  # granted at t=0, as reported to D
    ended: list[dict[str, float]] = [{} for _ in range(ranks)]  # rank -> id -> deadline P freed it at
    ledger = AckLedger()
    views = core.LeaseViews(margin=0.0)
    for p_id in IDS:
        views.add(f"d-{p_id}", "P", p_id, EXT, EXT, INSTANCE)
    to_p: list[tuple[float, int, bytes]] = []  # (arrival, rank, message)
    to_d: list[tuple[float, str, bytes]] = []
    now = 0.0
    cut_until = 0.0
    fate_i = 0

    def fate(sent: float) -> list[float]:
        nonlocal fate_i
        delay, twice = delays[fate_i % len(delays)], doubled[fate_i % len(doubled)]
        fate_i += 1
        if delay is None:
            return []
        arrival = max(sent + delay, cut_until)  # a cut holds messages until the heal
        return [arrival, arrival + delay] if twice else [arrival]

    for action, arg in script:
        if action == "cut":
            cut_until = now + arg
        elif action == "hb":
            payload = ",".join(arg).encode()
            seq = ledger.open("P", agents, payload, now, instance=INSTANCE)
            for rank in range(ranks):
                msg = acked_heartbeat_message(seq, b"HB:" + payload)
                to_p += [(t, rank, msg) for t in fate(now)]
        else:
            now += arg
            # P: apply what arrived (in arrival order), answer once per
            # rank listing every heartbeat (as AckAnswerer does), then sweep.
            arrived = sorted(m for m in to_p if m[0] <= now)
            to_p = [m for m in to_p if m[0] > now]
            answered: dict[int, tuple[list[int], set[str]]] = {}
            for _, rank, msg in arrived:
                parsed = parse_acked_heartbeat(msg)
                assert parsed is not None
                seq, payload, _ = parsed
                table = tables[rank]
                table.extend_counted(payload, now)
                seqs, missing = answered.setdefault(rank, ([], set()))
                seqs.append(seq)
                missing.update(i for i in payload.decode().split(",") if i not in table)
            for rank, (seqs, missing) in answered.items():
                answer = heartbeat_ack_message(INSTANCE, seqs, ",".join(sorted(missing)).encode())
                to_d += [(t, agents[rank], answer) for t in fate(now)]
            for rank, table in enumerate(tables):
                deadlines = {p_id: table.deadline(p_id) for p_id in IDS if p_id in table}
                for p_id in table.pop_expired(now):
                    ended[rank][p_id] = deadlines[p_id]
            # D: take the answers that arrived.
            arrived_d = sorted(m for m in to_d if m[0] <= now)
            to_d = [m for m in to_d if m[0] > now]
            for _, agent, answer in arrived_d:
                parsed_ack = parse_heartbeat_ack(answer)
                assert parsed_ack is not None
                for seq in parsed_ack.seqs:
                    proven = ledger.answered(agent, seq, parsed_ack.not_extended, parsed_ack.instance)
                    if proven is not None:
                        views.heartbeat_acked(
                            proven.engine_id, proven.instance, proven.remote_ids, 0.0, proven.started, now
                        )
            ledger.prune(now - EXT)
        # The property, after every action.
        for p_id in IDS:
            view_end = views.remaining(f"d-{p_id}", 0.0, 0.0)
            assert view_end is not None
            for rank, table in enumerate(tables):
                p_end = table.deadline(p_id) if p_id in table else ended[rank][p_id]
                assert view_end <= p_end + 1e-9, (p_id, rank, view_end, p_end, now)


@pytest.mark.parametrize("ranks", [1, 3])
def test_steady_answers_keep_the_view_alive(core, ranks: int) -> None:
    """The other half: with answers flowing, a view never lapses while P holds the lease."""
    tables = [core.LeaseTable(EXT) for _ in range(ranks)]
    agents = [f"r{r}" for r in range(ranks)]
    for table in tables:
        table.grant("p0", EXT)
    ledger, views = AckLedger(), core.LeaseViews(margin=2.0)
    views.add("d0", "P", "p0", EXT, EXT, INSTANCE)
    now = 0.0
    for _ in range(100):
        seq = ledger.open("P", agents, b"p0", now, instance=INSTANCE)
        now += 0.3  # one-way delay
        for table in tables:
            table.extend_counted(b"p0", now)
        now += 0.3
        for agent in agents:
            proven = ledger.answered(agent, seq, frozenset(), INSTANCE)
        assert proven is not None
        views.heartbeat_acked("P", INSTANCE, proven.remote_ids, 0.0, proven.started, now)
        now += 1.4  # the rest of a 2 s interval
        assert views.may_read("d0", now, 0.0)


def test_renew_on_send_breaks_under_a_partition(core) -> None:
    """Why acknowledgements: the same partition defeats the renew-on-send rule
    that a P without acknowledgements still gets (lease_views.heartbeat_sent)."""
    table = core.LeaseTable(EXT)
    table.grant("p0", EXT)
    on_send, on_ack = core.LeaseViews(margin=2.0), core.LeaseViews(margin=2.0)
    on_send.add("d0", "P", "p0", EXT, EXT)
    on_ack.add("d0", "P", "p0", EXT, EXT, INSTANCE)
    ledger = AckLedger()
    # t=5: D's send returns (3 s > margin left), but the link is down until t=20.
    on_send.heartbeat_sent("P", ["p0"], 0.0, started=5.0, finished=5.0)
    seq = ledger.open("P", ["r0"], b"p0", 5.0, instance=INSTANCE)
    assert table.pop_expired(9.0) == ["p0"]  # P frees the blocks at its deadline, 8
    table.extend_counted(b"p0", 20.0)  # the heal: the heartbeat arrives, too late
    proven = ledger.answered("r0", seq, frozenset({"p0"}), INSTANCE)  # P: "p0 was not held"
    assert proven is not None
    on_ack.heartbeat_acked("P", INSTANCE, proven.remote_ids, 0.0, proven.started, 20.0)
    assert on_send.may_read("d0", 10.0, 0.0) is True  # would read freed blocks
    assert on_ack.may_read("d0", 10.0, 0.0) is False  # fenced


def test_chunk_heartbeat_proves_its_chunk_not_a_list() -> None:
    ledger = AckLedger()
    seq = ledger.open("P", ["r0", "r1"], b"a,b,c", started=5.0, chunk=(4, 9))
    assert ledger.answered("r0", seq, frozenset({"b"})) is None
    proven = ledger.answered("r1", seq, frozenset())
    assert proven == Proven("P", [], 5.0, (4, 9), frozenset({"b"}), count=3)
    seq = ledger.open("P", ["r0"], b"a", started=6.0, chunk=(4, 10))
    assert ledger.answered("r0", seq, None) == Proven("P", [], 6.0)  # "none extended": renews nothing


def test_an_answer_from_another_p_process_proves_nothing() -> None:
    ledger = AckLedger()
    seq = ledger.open("P", ["r0"], b"a", started=5.0, instance=INSTANCE)
    proven = ledger.answered("r0", seq, frozenset(), "fedcba9876543210")
    assert proven == Proven("P", [], 5.0, instance=INSTANCE)  # nothing named as held
