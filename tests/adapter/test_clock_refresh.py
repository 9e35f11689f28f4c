"""Protocol version 3: D refreshes its clock offset from the clock P's answers
carry (docs/PROTOCOL.md section 4.3, ``ack_requester.py``, ``ack_answerer.py``).

The D and P components run against fakes of the upstream worker (``Pair`` of
``test_acks.py``), on one hand-driven clock, so the real offset is 0 and D's
handshake estimate can be set wrong at will: the skew a clock drifting for
days leaves behind.
"""

from __future__ import annotations

import math

import pytest
from test_acks import CONFIG, EXT, Pair, acks_of
from vllm_support import Clock

from vllm_nixl_lease._wire import (
    HEARTBEAT_ACK_PREFIX,
    heartbeat_ack_message,
    parse_acked_heartbeat,
    parse_hello,
)

STALE = -3.0  # D believes P's clock runs 3 s behind its own; it is the same clock


def ready(clock: Clock, observe: bool = True) -> Pair:
    """A proven pair whose D holds a stale offset; P's workers have seen the
    scheduler's clock (unless not ``observe``)."""
    net = Pair(clock)
    if observe:
        for acker in net.ackers:
            acker.observe_scheduler_clock(clock.now)  # one clock: the scheduler's shift is 0
    net.grant("p1", "d1")
    net.prove()
    net.d._engine_clock_offset["P"] = STALE
    return net


def left(net: Pair, d_id: str) -> float:
    remaining = net.views.remaining(d_id, net.clock.now, net.d._engine_clock_offset["P"])
    assert remaining is not None
    return remaining


def round_trip(net: Pair, there: float = 0.05, back: float = 0.05) -> list[bytes]:
    """One heartbeat of p1 and its answer, ``there`` and ``back`` seconds each way."""
    net.d_heartbeat("p1")
    sent = net.take_d_sends()
    net.clock.advance(there)
    net.p_step(sent)
    answers = net.take_p_sends()
    net.clock.advance(back)
    net.d_receive(answers)
    return [m for _, m in answers]


def test_hello_says_3_and_the_answer_carries_ps_clock(clock: Clock) -> None:
    net = Pair(clock)
    for acker in net.ackers:
        acker.observe_scheduler_clock(clock.now)
    net.grant("p1", "d1")
    net.d_heartbeat("p1")
    sent = net.take_d_sends()
    hello = parse_hello(sent[0][1])
    assert hello is not None and hello.version == 3
    net.p_step(sent)
    net.d_receive(net.take_p_sends())  # the welcome: proven
    net.d_step()
    net.take_d_sends()  # the heartbeat that waited for the proof, lost
    clock.advance(1)
    answers = round_trip(net, there=0.25)
    acks = [a for a in acks_of([("P-agent-0", m) for m in answers]) if a is not None and a.seqs]
    assert len(acks) == 1 and acks[0].clock == pytest.approx(clock.now - 0.05, abs=1e-6)


def test_a_stale_offset_is_replaced_by_the_answers_bound(clock: Clock) -> None:
    """With the stale offset a new view would end 3 s after P's lease; after one
    answer it ends before it, early by no more than the round trip."""
    net = ready(clock)
    net.grant("p2", "d2")
    assert left(net, "d2") == pytest.approx(EXT - STALE)  # outlives P's lease by 3 s
    clock.advance(1)
    round_trip(net, there=0.05, back=0.05)
    offset = net.d._engine_clock_offset["P"]
    assert 0.0 <= offset <= 0.1 + 1e-6  # never below the real 0; off by at most the round trip
    assert offset == pytest.approx(0.05, abs=1e-6)  # t_p - s: P read its clock on arrival
    assert net.d.count("num_clock_offset_refreshes") == 1
    # A view converted now takes the fresh offset: it ends before P's lease does.
    net.grant("p3", "d3")
    p_left = net.keepers[0].table.deadline("p3") - clock.now
    assert p_left - 0.1 <= left(net, "d3") <= p_left
    # d2 was converted before the refresh: it keeps its deadline (conversion happens once).
    assert left(net, "d2") == pytest.approx(EXT - STALE - 1.1)


def test_without_ps_clock_d_keeps_its_offset(clock: Clock) -> None:
    """A P worker that has not seen its scheduler's clock yet sends none."""
    net = ready(clock, observe=False)
    answers = round_trip(net)
    assert answers and all(b"@" not in m for m in answers)
    assert net.d._engine_clock_offset["P"] == STALE
    assert net.d.count("num_clock_offset_refreshes") == 0


def _two_heartbeats(net: Pair) -> list[tuple[int, float]]:
    """Two heartbeats of p1, 1 s apart, never delivered: their (seq, send time)."""
    out = []
    for _ in range(2):
        net.d_heartbeat("p1")
        for _agent, msg in net.take_d_sends():
            parsed = parse_acked_heartbeat(msg)
            if parsed is not None:
                out.append((parsed[0], net.clock.now))
        net.clock.advance(1)
    return out


def test_the_newest_measurement_wins_and_an_older_one_arriving_late_is_ignored(clock: Clock) -> None:
    net = ready(clock)
    (seq1, s1), (seq2, s2) = _two_heartbeats(net)
    instance = net.proc.instance
    newer = heartbeat_ack_message(instance, [seq2], clock=s2 + 0.2)
    older = heartbeat_ack_message(instance, [seq1], clock=s1 + 0.5)  # would give a larger bound
    net.d_receive([("P-agent-0", newer)])
    assert net.d._engine_clock_offset["P"] == pytest.approx(0.2, abs=1e-6)
    net.d_receive([("P-agent-0", older)])
    assert net.d._engine_clock_offset["P"] == pytest.approx(0.2, abs=1e-6)
    assert net.d.count("num_clock_offset_refreshes") == 1


def test_one_answer_to_several_heartbeats_measures_from_the_newest_send(clock: Clock) -> None:
    """Each acknowledged heartbeat reached P before ``t_p``: the newest send gives the tightest bound."""
    net = ready(clock)
    (seq1, _s1), (seq2, s2) = _two_heartbeats(net)
    net.d_receive([("P-agent-0", heartbeat_ack_message(net.proc.instance, [seq1, seq2], clock=s2 + 0.3))])
    assert net.d._engine_clock_offset["P"] == pytest.approx(0.3, abs=1e-6)


def test_a_clock_with_no_recorded_heartbeat_measures_nothing(clock: Clock) -> None:
    """Seqs D never sent that agent (forged, or pruned) cannot bound the offset."""
    net = ready(clock)
    net.d_receive([("P-agent-0", heartbeat_ack_message(net.proc.instance, [999], clock=1e6))])
    net.d_receive([("P-agent-0", heartbeat_ack_message(net.proc.instance, [], clock=1e6))])  # a welcome
    assert net.d._engine_clock_offset["P"] == STALE


def test_no_offset_is_written_for_a_connection_upstream_released(clock: Clock) -> None:
    """Upstream dropped the engine's offset (its clean-up): the next handshake measures one."""
    net = ready(clock)
    ((seq, s),) = _two_heartbeats(net)[:1]
    del net.d._engine_clock_offset["P"]
    net.d_receive([("P-agent-0", heartbeat_ack_message(net.proc.instance, [seq], clock=s + 0.1))])
    assert "P" not in net.d._engine_clock_offset


def test_an_answer_from_a_stranger_writes_no_offset(clock: Clock) -> None:
    net = ready(clock)
    ((seq, s),) = _two_heartbeats(net)[:1]
    net.d_receive([("rogue-agent", heartbeat_ack_message(net.proc.instance, [seq], clock=s + 50))])
    assert net.d._engine_clock_offset["P"] == STALE


def test_p_moves_its_clock_onto_the_schedulers_by_the_largest_shift(clock: Clock) -> None:
    """P's worker reports its arrival time plus the largest ``scheduler_clock -
    perf_counter()`` seen; readings that are not a positive finite float are ignored."""
    net = Pair(clock)
    acker = net.ackers[0]
    for reading in (0.0, None, math.nan, math.inf, -5.0, 7):  # 7: an int, not upstream's float
        acker.observe_scheduler_clock(reading)
    assert acker._clock_shift is None
    acker.observe_scheduler_clock(clock.now + 10.0)
    acker.observe_scheduler_clock(clock.now + 4.0)  # a later broadcast, read later: smaller
    assert acker._clock_shift == pytest.approx(10.0)
    net.grant("p1", "d1")
    net.prove()
    answers = round_trip(net, there=0.5)
    ack = [a for a in acks_of([("P-agent-0", m) for m in answers]) if a is not None and a.seqs][0]
    assert ack.clock == pytest.approx(clock.now - 0.05 + 10.0, abs=1e-6)
    assert all(m.startswith(HEARTBEAT_ACK_PREFIX) for m in answers)


def test_d_forgets_versions_and_measurements_with_their_views_and_connection(clock: Clock) -> None:
    """What the refresh keeps per engine and per P instance is pruned by the sweep."""
    net = ready(clock)
    round_trip(net)
    assert net.acks._offset_sent and net.acks._hello_versions
    net.views.drop("d1")
    del net.d._remote_agents["P"]
    clock.advance(CONFIG.forget_sweep_s + 1)
    net.d_receive([("P-agent-0", b"LACK:")])  # any message: a step that ages state
    assert net.acks._offset_sent == {} and net.acks._hello_versions == {}
