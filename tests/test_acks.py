"""Acknowledged heartbeats: D's views move only on P's answers (issue 12).

D's components (HeartbeatSender, AckRequester, ReadFence) and P's
(LeaseKeeper, AckAnswerer) run against two fakes of the upstream worker;
the test carries messages between them by hand, so it decides what a
partition holds back and when it is delivered.
"""

from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace

import pytest
from vllm_support import Clock

from harness.upstream_fake import FakeUpstreamWorker
from vllm_nixl_lease._wire import (
    ACK_HELLO_PREFIX,
    ACKED_HEARTBEAT_PREFIX,
    HEARTBEAT_ACK_PREFIX,
    PARAM_LEASE_ACKS,
    TAGGED_HEARTBEAT_PREFIX,
    acked_heartbeat_message,
    heartbeat_message,
    parse_heartbeat_ack,
    takes_tags,
)
from vllm_nixl_lease.lease_tags import lease_tag
from vllm_nixl_lease.vllm.config import LeaseConfig
from vllm_nixl_lease.vllm.d_scheduler.lease_view_collector import LeaseViewCollector
from vllm_nixl_lease.vllm.d_worker.ack_requester import AckRequester
from vllm_nixl_lease.vllm.d_worker.heartbeat_sender import HeartbeatSender
from vllm_nixl_lease.vllm.d_worker.read_fence import ReadFence
from vllm_nixl_lease.vllm.metadata import LEASE_HEARTBEATS_ATTR, LEASE_VIEWS_ATTR, EngineHeartbeats
from vllm_nixl_lease.vllm.p_scheduler.lease_params import add_lease_params
from vllm_nixl_lease.vllm.p_worker.ack_answerer import (
    MAX_NOT_EXTENDED_BYTES,
    MAX_PACED_ANSWERS_PER_STEP,
    MAX_SEQS_PER_ANSWER,
    AckAnswerer,
)
from vllm_nixl_lease.vllm.p_worker.lease_keeper import LeaseKeeper

CONFIG = LeaseConfig.from_extra_config({"kv_lease_duration": 12})  # extension 8, interval 2, margin 2
TAG_KEY = bytes(range(16))  # P's tag key (its scheduler draws one per instance)
EXT = CONFIG.lease_extension
READ = SimpleNamespace(remote=SimpleNamespace(engine_id="P"), local_block_ids=[[1]])


class Pair:
    """One P rank and one D rank, joined by a hand-carried network."""

    def __init__(self, clock: Clock, ranks: int = 1) -> None:
        self.clock = clock
        self.p = [FakeUpstreamWorker() for _ in range(ranks)]
        self.keepers, self.ackers = [], []
        for r, up in enumerate(self.p):
            up.nixl_wrapper.name = f"P-agent-{r}"
            keeper = LeaseKeeper(up, CONFIG)
            keeper.table.set_tag_key(TAG_KEY)
            self.keepers.append(keeper)
            self.ackers.append(AckAnswerer(up, keeper, forget_after_s=60))
        self.d = FakeUpstreamWorker()
        self.d.nixl_wrapper.name = "D-agent"
        self.d.connect("P", ranks=ranks)
        # As upstream keeps them: add_remote_agent's return value, bytes.
        self.d._remote_agents["P"] = {r: f"P-agent-{r}".encode() for r in range(ranks)}
        self.fence = ReadFence(self.d, CONFIG)
        self.acks = AckRequester(self.d, self.fence.views, rehello_s=4)
        self.sender = HeartbeatSender(self.d, 8192, self.fence.heartbeat_delivered, self.acks)

    def grant(self, p_id: str, d_id: str, acks: bool = True, tagged: bool = False) -> None:
        for keeper in self.keepers:
            keeper.deadlines[p_id] = self.clock.now + EXT
        params: dict = {"do_remote_prefill": True}
        add_lease_params(params, self.clock.now + EXT, EXT)
        if not acks:
            del params[PARAM_LEASE_ACKS]
        assert takes_tags(params) == acks
        collector = LeaseViewCollector(CONFIG, "pull")
        collector.add(d_id, "P", lease_tag(p_id, TAG_KEY) if tagged else p_id, params)
        meta = SimpleNamespace()
        collector.attach(meta)
        self.fence.add_views(meta)

    def d_heartbeat(self, *p_ids: str, tagged: bool = False) -> None:
        names = [lease_tag(p_id, TAG_KEY) for p_id in p_ids] if tagged else p_ids
        hb = EngineHeartbeats([heartbeat_message(names)], "10.0.0.1", 5600, len(self.p), tagged=tagged)
        self.sender.send(SimpleNamespace(**{LEASE_HEARTBEATS_ATTR: {"P": hb}}))

    def take_d_sends(self) -> list[tuple[str, bytes]]:
        sent, self.d.nixl_wrapper.sent = self.d.nixl_wrapper.sent, []
        return sent

    def p_step(self, held: list[tuple[str, bytes]]) -> None:
        """Deliver D's messages to the P ranks, step each (route, answer, expire)."""
        for r, (keeper, acker) in enumerate(zip(self.keepers, self.ackers, strict=True)):
            msgs = [m for agent, m in held if agent == f"P-agent-{r}".encode()]
            _, ack_messages = keeper.route({"D-agent": msgs} if msgs else {})
            acker.handle(ack_messages)
            settle(acker)
            acker.handle({})  # answers queued behind the hello go out now
            keeper.expire(set())

    def take_p_sends(self) -> list[tuple[str, bytes]]:
        out = []
        for up in self.p:
            out += [(up.nixl_wrapper.name, m) for _, m in up.nixl_wrapper.sent]
            up.nixl_wrapper.sent = []
        return out

    def d_receive(self, answers: list[tuple[str, bytes]]) -> None:
        by_agent: dict[str, list[bytes]] = {}
        for agent, msg in answers:
            by_agent.setdefault(agent, []).append(msg)
        self.acks.received(by_agent)

    def remaining(self, d_id: str) -> float:
        left = self.fence.views.remaining(d_id, self.clock.now, 0.0)
        assert left is not None
        return left


def settle(acker: AckAnswerer) -> None:
    concurrent.futures.wait(list(acker._loading.values()), timeout=5)


def test_view_moves_only_when_p_answers(clock: Clock) -> None:
    net = Pair(clock)
    net.grant("p1", "d1")
    clock.advance(3)
    net.d_heartbeat("p1")
    sent = net.take_d_sends()
    assert sent[0][1].startswith(ACK_HELLO_PREFIX) and sent[1][1].startswith(ACKED_HEARTBEAT_PREFIX)
    assert net.remaining("d1") == pytest.approx(EXT - 3)  # the send alone proves nothing
    clock.advance(1)
    net.p_step(sent)
    assert net.keepers[0].table.deadline("p1") == pytest.approx(clock.now + EXT)
    answers = net.take_p_sends()
    assert [parse_heartbeat_ack(m) for _, m in answers] == [([1], frozenset())]
    net.d_receive(answers)
    # Renewed from the send (D's clock), not from the answer's arrival.
    assert net.remaining("d1") == pytest.approx(EXT - 1)
    assert net.d.count("num_heartbeat_views_renewed") == 1
    assert net.p[0].count("num_heartbeat_acks_sent") == 1


def test_tagged_heartbeat_renews_on_both_sides(clock: Clock) -> None:
    net = Pair(clock, ranks=2)
    net.grant("p1", "d1", tagged=True)
    net.grant("p2", "d2", tagged=True)
    clock.advance(3)
    net.d_heartbeat("p1", "p2", tagged=True)
    sent = net.take_d_sends()
    beats = [m for _, m in sent if not m.startswith(ACK_HELLO_PREFIX)]
    tagged = heartbeat_message([lease_tag("p1", TAG_KEY), lease_tag("p2", TAG_KEY)])
    assert beats == [acked_heartbeat_message(1, tagged, tagged=True)] * 2  # one per P rank, 11 bytes a lease
    clock.advance(1)
    net.p_step(sent)
    for keeper in net.keepers:
        assert keeper.table.deadline("p1") == pytest.approx(clock.now + EXT)
        assert keeper.table.deadline("p2") == pytest.approx(clock.now + EXT)
    answers = net.take_p_sends()
    assert [parse_heartbeat_ack(m) for _, m in answers] == [([1], frozenset())] * 2
    net.d_receive(answers)
    assert net.remaining("d1") == pytest.approx(EXT - 1) and net.remaining("d2") == pytest.approx(EXT - 1)
    assert net.p[0].count("num_heartbeat_ids_recv") == 2 and net.p[0].count("num_heartbeat_ids_unknown") == 0
    assert net.p[0].count("num_tagged_heartbeats_recv") == 1


def test_tagged_heartbeat_never_renews_a_freed_lease(clock: Clock) -> None:
    """The partition of issue 12, by tag: P freed p1 while the heartbeat was held."""
    net = Pair(clock)
    net.grant("p1", "d1", tagged=True)
    net.grant("p2", "d2", tagged=True)
    clock.advance(2)
    held_at = clock.now
    net.d_heartbeat("p1", "p2", tagged=True)
    held = net.take_d_sends()
    clock.advance(EXT)
    net.keepers[0].deadlines["p2"] = clock.now + EXT
    net.p_step([])
    assert "p1" not in net.keepers[0].table
    clock.advance(1)
    net.p_step(held)
    answers = net.take_p_sends()
    assert [parse_heartbeat_ack(m) for _, m in answers] == [([1], frozenset({lease_tag("p1", TAG_KEY)}))]
    net.d_receive(answers)
    assert net.fence.fenced("d1", READ)
    assert net.remaining("d2") == pytest.approx(held_at + EXT - clock.now)
    assert net.p[0].count("num_heartbeat_ids_unknown") == 1


def test_tagged_heartbeat_never_claims_an_id_with_a_comma(clock: Clock) -> None:
    """A P id with ',' would be split by the core's payload API: its tag stays
    unindexed, so P answers "not extended" instead of claiming a renewal."""
    net = Pair(clock)
    net.grant("a,b", "d1", tagged=True)
    net.grant("p2", "d2", tagged=True)
    before = net.keepers[0].table.deadline("a,b")
    clock.advance(2)
    net.d_heartbeat("a,b", "p2", tagged=True)
    net.p_step(net.take_d_sends())
    assert net.keepers[0].table.deadline("a,b") == before
    answers = net.take_p_sends()
    assert [parse_heartbeat_ack(m) for _, m in answers] == [([1], frozenset({lease_tag("a,b", TAG_KEY)}))]
    net.d_receive(answers)
    assert net.remaining("d1") == pytest.approx(EXT - 2) and net.remaining("d2") == pytest.approx(EXT)


def test_read_completion_drops_the_tag_on_p(clock: Clock) -> None:
    net = Pair(clock)
    net.grant("p1", "d1", tagged=True)
    keeper = net.keepers[0]
    tag = lease_tag("p1", TAG_KEY)
    assert keeper.table.extend_tagged(tag.encode(), clock.now) == (1, 1, [])
    keeper.route({"D-agent": [b"p1:1"]})
    assert "p1" not in keeper.table
    assert keeper.table.extend_tagged(tag.encode(), clock.now) == (0, 1, [tag])


def test_hostile_tagged_heartbeats_are_counted_not_applied(clock: Clock) -> None:
    net = Pair(clock)
    net.grant("p1", "d1", tagged=True)
    keeper, acker, p = net.keepers[0], net.ackers[0], net.p[0]
    before = keeper.table.deadline("p1")
    clock.advance(1)
    hello = ACK_HELLO_PREFIX + b"fake-md:D-agent"
    lhbt = TAGGED_HEARTBEAT_PREFIX
    crafted = [lhbt, lhbt + b"x:" + lease_tag("p1", TAG_KEY).encode(), lhbt + b"2:\xff\xfe"]
    crafted.append(lhbt + b"3:p1,,zz," + b"A" * 5000)
    _, msgs = keeper.route({"D-agent": [hello, *crafted]})
    acker.handle(msgs)
    settle(acker)
    acker.handle({})
    assert keeper.table.deadline("p1") == before  # neither the raw id nor junk renews it
    assert p.count("num_malformed_notifs") == 2
    answers = [parse_heartbeat_ack(m) for _, m in p.nixl_wrapper.sent]
    assert answers == [([2, 3], None)]  # undecodable and oversized: none counts, no echo


def test_heartbeat_delivered_after_p_expired_never_renews(clock: Clock) -> None:
    """The partition of issue 12: the send returns, UCX holds the message, P
    frees the lease, the message arrives after the heal."""
    net = Pair(clock)
    net.grant("p1", "d1")
    net.grant("p2", "d2")
    clock.advance(2)
    net.d_heartbeat("p1", "p2")
    net.p_step(net.take_d_sends())
    net.d_receive(net.take_p_sends())
    clock.advance(2)
    held_at = clock.now
    net.d_heartbeat("p1", "p2")
    held = net.take_d_sends()  # cut: nothing reaches P
    clock.advance(EXT)
    net.keepers[0].deadlines["p2"] = clock.now + EXT  # stand-in for a heartbeat P did get for p2
    net.p_step([])
    assert "p1" not in net.keepers[0].table and "p2" in net.keepers[0].table
    clock.advance(1)  # heal
    net.p_step(held)
    answers = net.take_p_sends()
    assert [parse_heartbeat_ack(m) for _, m in answers] == [([2], frozenset({"p1"}))]
    net.d_receive(answers)
    assert net.remaining("d1") < net.fence.views.margin
    assert net.fence.fenced("d1", READ)
    # p2 was held: renewed, but only to the held send's time + extension.
    assert net.remaining("d2") == pytest.approx(held_at + EXT - clock.now)


def test_answers_from_every_rank_are_needed(clock: Clock) -> None:
    net = Pair(clock, ranks=2)
    net.grant("p1", "d1")
    clock.advance(3)
    net.d_heartbeat("p1")
    sent = net.take_d_sends()
    net.p_step(sent)
    answers = net.take_p_sends()
    assert len(answers) == 2
    net.d_receive(answers[:1])
    assert net.remaining("d1") == pytest.approx(EXT - 3)
    net.d_receive(answers[:1])  # a duplicate proves nothing more
    assert net.remaining("d1") == pytest.approx(EXT - 3)
    net.d_receive(answers[1:])
    assert net.remaining("d1") == pytest.approx(EXT)


def test_lost_answers_leave_the_view_and_d_says_hello_again(clock: Clock) -> None:
    net = Pair(clock)
    net.grant("p1", "d1")
    clock.advance(1)
    net.d_heartbeat("p1")
    net.p_step(net.take_d_sends())
    net.take_p_sends()  # lost
    assert net.remaining("d1") == pytest.approx(EXT - 1)
    clock.advance(2)
    net.d_heartbeat("p1")
    assert not net.take_d_sends()[0][1].startswith(ACK_HELLO_PREFIX)  # hello 3 s ago
    clock.advance(2)
    net.d_heartbeat("p1")
    assert net.take_d_sends()[0][1].startswith(ACK_HELLO_PREFIX)  # no answer for 4 s


def test_p_without_acks_keeps_renew_on_send_and_gets_plain_heartbeats(clock: Clock) -> None:
    net = Pair(clock)
    net.grant("p1", "d1", acks=False)
    clock.advance(3)
    net.d_heartbeat("p1")
    assert [m for _, m in net.take_d_sends()] == [heartbeat_message(["p1"])]
    assert net.remaining("d1") == pytest.approx(EXT)


def test_p_answers_a_hello_only_for_the_agent_that_sent_it(clock: Clock) -> None:
    net = Pair(clock)
    net.grant("p1", "d1")
    keeper, acker, p = net.keepers[0], net.ackers[0], net.p[0]
    forged = ACK_HELLO_PREFIX + b"fake-md:someone-else"
    _, msgs = keeper.route({"D-agent": [forged, acked_heartbeat_message(7, heartbeat_message(["p1"]))]})
    acker.handle(msgs)
    settle(acker)
    acker.handle({})
    assert p.nixl_wrapper.sent == [] and "someone-else" not in p.nixl_wrapper.loaded
    assert p.count("num_heartbeat_acks_dropped") == 1


def test_hostile_acked_heartbeats_are_bounded(clock: Clock) -> None:
    net = Pair(clock)
    net.grant("p1", "d1")
    keeper, acker, p = net.keepers[0], net.ackers[0], net.p[0]
    many = heartbeat_message([f"x{i:06d}" for i in range(2000)])
    hello = ACK_HELLO_PREFIX + b"fake-md:D-agent"
    lhb = ACKED_HEARTBEAT_PREFIX
    batch = [hello, lhb, lhb + b"x:p1", acked_heartbeat_message(3, many), lhb + b"4:\xff\xfe"]
    _, msgs = keeper.route({"D-agent": batch})
    acker.handle(msgs)
    settle(acker)
    acker.handle({})
    answers = [parse_heartbeat_ack(m) for _, m in p.nixl_wrapper.sent]
    assert answers == [([3, 4], None)]  # "none extended": too many ids / undecodable
    assert all(len(m) < MAX_NOT_EXTENDED_BYTES + 64 for _, m in p.nixl_wrapper.sent)
    assert p.count("num_malformed_notifs") == 2
    # D ignores malformed answers and answers to heartbeats it never sent.
    net.d_receive([("P-agent-0", HEARTBEAT_ACK_PREFIX + b"zz"), ("P-agent-0", HEARTBEAT_ACK_PREFIX + b"99")])
    assert net.d.count("num_malformed_notifs") == 1


def test_views_carry_the_ack_flag_from_p(clock: Clock) -> None:
    params: dict = {}
    add_lease_params(params, 10.0, EXT)
    assert params[PARAM_LEASE_ACKS] is True
    collector = LeaseViewCollector(CONFIG, "pull")
    collector.add("d1", "P", "p1", params)
    collector.add("d2", "P2", "p2", {**params, PARAM_LEASE_ACKS: "yes"})  # only True counts
    meta = SimpleNamespace()
    collector.attach(meta)
    assert {k: v[4] for k, v in getattr(meta, LEASE_VIEWS_ATTR).new.items()} == {"d1": True, "d2": False}


def test_one_answer_per_d_agent_per_step(clock: Clock) -> None:
    """A D heartbeating thousands of leases sends hundreds of LHB messages per
    interval; P answers them with a few sends, not one each."""
    net = Pair(clock)
    net.grant("p1", "d1")
    keeper, acker, p = net.keepers[0], net.ackers[0], net.p[0]
    n = MAX_SEQS_PER_ANSWER + 10
    batch = [ACK_HELLO_PREFIX + b"fake-md:D-agent"]
    batch += [acked_heartbeat_message(seq, heartbeat_message(["p1", f"gone{seq % 3}"])) for seq in range(n)]
    _, msgs = keeper.route({"D-agent": batch})
    acker.handle(msgs)
    settle(acker)
    acker.handle({})
    answers = [parse_heartbeat_ack(m) for _, m in p.nixl_wrapper.sent]
    assert [len(seqs) for seqs, _ in answers] == [MAX_SEQS_PER_ANSWER, 10]  # type: ignore[misc]
    assert all(missing == {"gone0", "gone1", "gone2"} for _, missing in answers)  # type: ignore[misc]
    assert p.count("num_heartbeat_acks_sent") == n


def hello_from(agent: str) -> bytes:
    return ACK_HELLO_PREFIX + f"fake-md:{agent}".encode()


def paced_acker(gap: float) -> tuple[LeaseKeeper, AckAnswerer, FakeUpstreamWorker]:
    p = FakeUpstreamWorker()
    keeper = LeaseKeeper(p, CONFIG)
    acker = AckAnswerer(p, keeper, forget_after_s=60, answer_gap_s=gap)
    keeper.deadlines["p1"] = 100.0
    return keeper, acker, p


def answered(p: FakeUpstreamWorker) -> dict[str, list]:
    out: dict[str, list] = {}
    for agent, msg in p.nixl_wrapper.sent:
        out.setdefault(agent, []).append(parse_heartbeat_ack(msg))
    p.nixl_wrapper.sent = []
    return out


def test_paced_answers_gather_heartbeats_over_steps(clock: Clock) -> None:
    """With a gap, P answers each D agent at most once per gap and at most
    MAX_PACED_ANSWERS_PER_STEP agents a step; the heartbeats in between share
    the next answer, and none waits past twice the gap."""
    gap = 1.0
    keeper, acker, p = paced_acker(gap)
    agents = [f"D{i}" for i in range(MAX_PACED_ANSWERS_PER_STEP + 1)]
    acker.handle(keeper.route({a: [hello_from(a)] for a in agents})[1])
    settle(acker)
    seq = iter(range(1, 1000))
    hb = acked_heartbeat_message

    def step(*senders: str) -> dict[str, list]:
        acker.handle(keeper.route({a: [hb(next(seq), heartbeat_message(["p1"]))] for a in senders})[1])
        return answered(p)

    # First step: every agent is due, but only the budget's worth are answered.
    first = step(*agents)
    assert sorted(first) == agents[:MAX_PACED_ANSWERS_PER_STEP]
    clock.advance(0.1)
    # The third agent is answered in the next step; the first two are not due.
    second = step(*agents)
    assert sorted(second) == [agents[-1]] and second[agents[-1]] == [([3, 6], frozenset())]
    # Heartbeats keep arriving: nobody is answered again before the gap ...
    clock.advance(0.5)
    assert step(*agents) == {}
    # ... the extension was applied at once regardless (P's lease never waits).
    assert keeper.table.deadline("p1") == pytest.approx(clock.now + EXT)
    # Past the gap the oldest two are answered, everything they sent at once.
    clock.advance(0.45)
    third = step()
    assert sorted(third) == agents[:2]
    assert third[agents[0]] == [([4, 7], frozenset())]
    assert p.count("num_heartbeat_acks_sent") == 8  # heartbeats 1-8; 9 waits for D2's gap
    assert p.count("num_heartbeat_acks_dropped") == 0


def test_overdue_answers_skip_the_step_budget(clock: Clock) -> None:
    """More agents due than the budget: the rest wait, but never past twice the gap."""
    keeper, acker, p = paced_acker(1.0)
    agents = [f"D{i}" for i in range(MAX_PACED_ANSWERS_PER_STEP + 3)]
    acker.handle(keeper.route({a: [hello_from(a)] for a in agents})[1])
    settle(acker)
    beats = {a: [acked_heartbeat_message(i, heartbeat_message(["p1"]))] for i, a in enumerate(agents)}
    acker.handle(keeper.route(beats)[1])
    assert sorted(answered(p)) == agents[:MAX_PACED_ANSWERS_PER_STEP]
    clock.advance(2.0)
    acker.handle({})
    assert sorted(answered(p)) == agents[MAX_PACED_ANSWERS_PER_STEP:]


def test_paced_answer_names_missing_ids_only_for_heartbeats_that_had_them(clock: Clock) -> None:
    keeper, acker, p = paced_acker(0.0)
    acker.handle(keeper.route({"D": [hello_from("D")]})[1])
    settle(acker)
    batch = [
        acked_heartbeat_message(1, heartbeat_message(["p1"])),
        acked_heartbeat_message(2, heartbeat_message(["p1", "gone"])),
        acked_heartbeat_message(3, heartbeat_message(["p1"])),
    ]
    acker.handle(keeper.route({"D": batch})[1])
    assert answered(p) == {"D": [([1, 3], frozenset()), ([2], frozenset({"gone"}))]}


def test_delayed_answer_renews_from_the_send(clock: Clock) -> None:
    """D renews from when it sent the heartbeat: an answer P held back for
    the gap proves as much as a prompt one."""
    net = Pair(clock)
    for r, up in enumerate(net.p):
        net.ackers[r] = AckAnswerer(up, net.keepers[r], forget_after_s=60, answer_gap_s=1.0)
    net.grant("p1", "d1")
    clock.advance(3)
    net.d_heartbeat("p1")
    sent = net.take_d_sends()
    net.p_step(sent)
    net.d_receive(net.take_p_sends())  # the first answer: the agent had none yet
    net.d_heartbeat("p1")
    sent = net.take_d_sends()
    clock.advance(0.2)
    net.p_step(sent)
    assert net.take_p_sends() == []  # inside the gap
    clock.advance(1.5)
    net.p_step([])
    answers = net.take_p_sends()
    net.d_receive(answers)
    assert [parse_heartbeat_ack(m) for _, m in answers] == [([2], frozenset())]
    assert net.remaining("d1") == pytest.approx(EXT - 1.7)
