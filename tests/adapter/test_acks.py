"""Acknowledged heartbeats, protocol version 2 (docs/PROTOCOL.md): D's views
move only on P's answers, and D reads a P instance's blocks only over a
connection that P's own answers proved reaches that instance.

D's components (HeartbeatSender, AckRequester, ReadFence) and P's
(LeaseKeeper, AckAnswerer) run against fakes of the upstream worker; the
test carries messages between them by hand, so it decides what a partition
holds back, when it is delivered, and when a P restarts.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import replace
from types import SimpleNamespace

import pytest
from vllm_support import Clock

from harness.upstream_fake import FakeUpstreamWorker
from vllm_nixl_lease._wire import (
    ESCAPE_PREFIX,
    HEARTBEAT_ACK_PREFIX,
    HELLO_KIND,
    LEASE_PROTOCOL_VERSION,
    PARAM_LEASE_INSTANCE,
    PARAM_LEASE_PROTOCOL,
    PARAM_LEASE_TAG,
    TAGGED_HEARTBEAT_KIND,
    HeartbeatAck,
    acked_heartbeat_message,
    heartbeat_ack_message,
    heartbeat_message,
    hello_message,
    keepalive_message,
    lease_terms,
    parse_acked_heartbeat,
    parse_heartbeat_ack,
)
from vllm_nixl_lease.adapter.config import LeaseConfig
from vllm_nixl_lease.adapter.d_scheduler.lease_view_collector import LeaseViewCollector
from vllm_nixl_lease.adapter.d_worker import ack_requester
from vllm_nixl_lease.adapter.d_worker.ack_requester import OTHER, PENDING, PROVEN, AckRequester
from vllm_nixl_lease.adapter.d_worker.heartbeat_sender import HeartbeatSender
from vllm_nixl_lease.adapter.d_worker.read_fence import ReadFence
from vllm_nixl_lease.adapter.metadata import (
    LEASE_HEARTBEATS_ATTR,
    LEASE_VIEWS_ATTR,
    EngineHeartbeats,
    LeaseViewUpdates,
    NewView,
)
from vllm_nixl_lease.adapter.p_scheduler.lease_params import LeaseParams
from vllm_nixl_lease.adapter.p_worker.ack_answerer import (
    MAX_AGENT_LOADS,
    MAX_ANSWERS_PER_STEP,
    MAX_NOT_EXTENDED_BYTES,
    MAX_SEQS_PER_ANSWER,
    AckAnswerer,
)
from vllm_nixl_lease.adapter.p_worker.lease_keeper import LeaseKeeper
from vllm_nixl_lease.decode.lease_views import LeaseViews

CONFIG = LeaseConfig.from_extra_config({"kv_lease_duration": 12})  # extension 8, interval 2, margin 2
EXT = CONFIG.lease_extension
READ = SimpleNamespace(remote=SimpleNamespace(engine_id="P"), local_block_ids=[[1]])
HELLO = ESCAPE_PREFIX + HELLO_KIND


def hello(agent: str, key: str, version: int = LEASE_PROTOCOL_VERSION) -> bytes:
    return hello_message(2.0, f"fake-md:{agent}".encode(), key, version)


class PProcess:
    """One P engine process: its scheduler's lease params and its TP ranks."""

    def __init__(self, ranks: int, name: str, config: LeaseConfig = CONFIG) -> None:
        self.params = LeaseParams(config)
        self.instance = self.params.instance.instance
        self.p = [FakeUpstreamWorker() for _ in range(ranks)]
        self.agents = [f"{name}-agent-{r}" for r in range(ranks)]
        self.keepers: list[LeaseKeeper] = []
        self.ackers: list[AckAnswerer] = []
        meta = SimpleNamespace()
        self.params.attach(meta)
        for up, agent in zip(self.p, self.agents, strict=True):
            up.nixl_wrapper.name = agent
            keeper = LeaseKeeper(up, config)
            keeper.adopt_instance(meta)
            self.keepers.append(keeper)
            self.ackers.append(AckAnswerer(up, keeper, config))


class Pair:
    """P ranks (one engine, "P") and one D rank, joined by a hand-carried network.
    ``one_call``: the fence judges a READ over a proven connection in one call into
    the core, as the worker builds it (``the_fence_both_ways`` runs each test both ways)."""

    one_call = True

    def __init__(self, clock: Clock, ranks: int = 1, config: LeaseConfig = CONFIG) -> None:
        self.clock = clock
        self.config = config
        self.proc = PProcess(ranks, "P", config)
        self.d = FakeUpstreamWorker()
        self.d.nixl_wrapper.name = "D-agent"
        self.connect(self.proc)
        self.views = LeaseViews(config.lease_safety_margin)
        self.acks = AckRequester(self.d, self.views, config)
        proven = self.acks.proven_agents if self.one_call else None
        self.fence = ReadFence(self.d, self.views, config, self.acks.proof, proven_agents=proven)
        self.sender = HeartbeatSender(self.d, 8192, self.fence.heartbeat_delivered, self.acks)
        self.names: dict[str, str] = {}  # P id -> the name D heartbeats it by

    # P and D as upstream connects them
    def connect(self, proc: PProcess) -> None:
        """D's (new) connection to engine "P" reaches ``proc``: upstream's handshake."""
        self.d.connect("P", ranks=len(proc.p))
        # As upstream keeps them: add_remote_agent's return value, bytes.
        self.d._remote_agents["P"] = {r: a.encode() for r, a in enumerate(proc.agents)}

    @property
    def keepers(self) -> list[LeaseKeeper]:
        return self.proc.keepers

    @property
    def ackers(self) -> list[AckAnswerer]:
        return self.proc.ackers

    @property
    def p(self) -> list[FakeUpstreamWorker]:
        return self.proc.p

    def grant(
        self,
        p_id: str,
        d_id: str,
        plain: bool = False,
        tagged: bool = False,
        chunk: tuple[int, int] | None = None,
    ) -> dict:
        for keeper in self.keepers:
            keeper.deadlines[p_id] = self.clock.now + EXT
        params: dict = {"do_remote_prefill": True}
        self.proc.params.add(params, p_id, self.clock.now + EXT)
        if plain:
            del params[PARAM_LEASE_PROTOCOL]
        terms = lease_terms(params)
        assert terms is not None and terms.acknowledged == (not plain)
        name = terms.tag if tagged and terms.tag else p_id
        self.names[p_id] = name
        collector = LeaseViewCollector(self.config, "pull")
        collector.add(d_id, "P", terms.instance, name, terms, chunk)
        meta = SimpleNamespace()
        collector.attach(meta)
        self.fence.add_views(meta)
        self.acks.note_views(meta)  # as the worker's start_load_kv: the hello version
        return params

    def d_heartbeat(
        self,
        *p_ids: str,
        tagged: bool = False,
        instance: str | None = None,
        chunk: tuple[int, int] | None = None,
    ) -> None:
        names = [self.names[p_id] for p_id in p_ids]
        inst = self.proc.instance if instance is None else instance
        hb = EngineHeartbeats(
            "P", [heartbeat_message(names)], "10.0.0.1", 5600, len(self.p), instance=inst, tagged=tagged
        )
        if chunk is not None:  # one tracker chunk: its answer renews the chunk's views
            hb = replace(hb, chunks=[chunk], counts=[len(names)])
        self.sender.send(SimpleNamespace(**{LEASE_HEARTBEATS_ATTR: {f"g-{inst}": hb}}))

    def d_step(self) -> None:
        """A D step with no new heartbeat tick (what waited on proof goes out)."""
        self.sender.send(SimpleNamespace(**{LEASE_HEARTBEATS_ATTR: {}}))

    def take_d_sends(self) -> list[tuple[str, bytes]]:
        sent, self.d.nixl_wrapper.sent = self.d.nixl_wrapper.sent, []
        return sent

    def p_step(self, held: list[tuple[str, bytes]]) -> None:
        """Deliver D's messages to the P ranks, step each (route, answer, expire)."""
        for agent, keeper, acker in zip(self.proc.agents, self.keepers, self.ackers, strict=True):
            msgs = [m for to, m in held if to == agent.encode()]
            _, ack_messages = keeper.route({"D-agent": msgs} if msgs else {})
            acker.handle(ack_messages)
            settle(acker)
            acker.handle({})  # the welcome and answers queued behind the hello go out now
            keeper.expire(set())

    def p_idle(self, seconds: float) -> None:
        """P steps on with nothing arriving, for ``seconds`` (a jump would be P's own stall)."""
        end = self.clock.now + seconds
        while self.clock.now < end:
            self.clock.advance(min(1.0, end - self.clock.now))
            self.p_step([])

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

    def prove(self) -> None:
        """Hello, welcome: D's connection is proven to reach this P process."""
        agents = list(self.d._remote_agents["P"].values())
        self.p_step(self.acks.hellos("P", self.proc.instance, agents))
        self.d_receive(self.take_p_sends())
        assert self.acks.proof("P", self.proc.instance) == PROVEN

    def remaining(self, d_id: str) -> float:
        left = self.fence.views.remaining(d_id, self.clock.now, 0.0)
        assert left is not None
        return left


def settle(acker: AckAnswerer) -> None:
    concurrent.futures.wait([load for load, *_ in acker._loading.values()], timeout=60)


def acks_of(sent: list[tuple[str, bytes]]) -> list[HeartbeatAck | None]:
    return [parse_heartbeat_ack(m) for _, m in sent]


def test_view_moves_only_when_p_answers(clock: Clock) -> None:
    net = Pair(clock)
    net.grant("p1", "d1")
    clock.advance(3)
    net.d_heartbeat("p1")
    sent = net.take_d_sends()
    # Not proven yet: the hello, and the tick as a keep-alive (plain HB:, no seq);
    # the acknowledged heartbeat waits for the welcome.
    assert [m[: len(HELLO)] for _, m in sent] == [HELLO, b"HB:p1"]
    net.p_step(sent)
    assert net.keepers[0].deadlines["p1"] == pytest.approx(clock.now + EXT)  # P extended it
    assert net.remaining("d1") == pytest.approx(EXT - 3)  # the keep-alive renews no view
    welcome = net.take_p_sends()
    assert acks_of(welcome) == [HeartbeatAck(net.proc.instance, [], frozenset())]
    net.d_receive(welcome)
    net.d_step()  # the heartbeat that waited goes out now
    sent = net.take_d_sends()
    assert [m for _, m in sent] == [acked_heartbeat_message(1, heartbeat_message(["p1"]))]
    assert net.remaining("d1") == pytest.approx(EXT - 3)  # the send alone proves nothing
    clock.advance(1)
    net.p_step(sent)
    assert net.keepers[0].table.deadline("p1") == pytest.approx(clock.now + EXT)
    answers = net.take_p_sends()
    assert acks_of(answers) == [HeartbeatAck(net.proc.instance, [1], frozenset())]
    net.d_receive(answers)
    # Renewed from the send (D's clock), not from the answer's arrival.
    assert net.remaining("d1") == pytest.approx(EXT - 1)
    assert net.d.count("num_heartbeat_views_renewed") == 1
    assert net.p[0].count("num_heartbeat_acks_sent") == 1


def test_unproven_keepalives_hold_ps_leases_through_a_slow_admission_and_renew_no_view(clock: Clock) -> None:
    # P takes longer than the lease to welcome D (many agents loading, a TP=8 P's
    # eight welcomes): every tick still extends P's leases; only answers move D's views.
    net = Pair(clock)
    net.grant("p1", "d1", tagged=True)
    tag = net.names["p1"]
    for _ in range(3):  # three ticks, 3 x 4 s: longer than the lease (EXT)
        clock.advance(4)
        net.d_heartbeat("p1", tagged=True)
        net.d_step()  # a step without a tick: the waiting group is not sent again
        sent = net.take_d_sends()
        beats = [m for _, m in sent if not m.startswith(HELLO)]
        assert beats == [keepalive_message(heartbeat_message([tag]), tagged=True)]
        # P's hello handling is held back: the hellos are not delivered, the keep-alives are.
        net.p_step([(a, m) for a, m in sent if not m.startswith(HELLO)])
        assert net.keepers[0].deadlines["p1"] == pytest.approx(clock.now + EXT)
    assert net.take_p_sends() == []  # no answer to a keep-alive from an agent P did not admit
    assert net.remaining("d1") < 0  # D's view was never renewed: its READ stays fenced
    assert net.acks.proof("P", net.proc.instance) == PENDING


def test_a_group_waiting_for_proof_is_dropped_once_its_views_are_gone(clock: Clock) -> None:
    net = Pair(clock)
    net.grant("p1", "d1")
    net.d_heartbeat("p1")
    assert set(net.sender.awaiting_proof) == {f"g-{net.proc.instance}"}
    net.fence.drop_views(SimpleNamespace(**{LEASE_VIEWS_ATTR: SimpleNamespace(dropped=["d1"])}))
    net.take_d_sends()
    net.d_step()
    assert net.sender.awaiting_proof == {} and net.take_d_sends() == []


def test_a_read_waits_for_the_proof_of_its_p_process(clock: Clock) -> None:
    net = Pair(clock)
    net.grant("p1", "d1")
    assert net.fence.fenced("d1", READ) and "d1" in net.fence.parked  # waits, not failed
    assert net.d.failed_transfers == []
    assert net.d.count("num_reads_waiting_proof") == 1
    assert [r for r, _ in net.fence.take_parked()] == ["d1"]
    assert net.fence.fenced("d1", READ)  # still waiting: counted once, not once per step
    assert net.d.count("num_reads_waiting_proof") == 1
    net.prove()
    assert [r for r, _ in net.fence.take_parked()] == ["d1"]
    assert not net.fence.fenced("d1", READ)


def test_tagged_heartbeat_renews_on_both_sides(clock: Clock) -> None:
    net = Pair(clock, ranks=2)
    params = net.grant("p1", "d1", tagged=True)
    net.grant("p2", "d2", tagged=True)
    tag1, tag2 = net.names["p1"], net.names["p2"]
    assert tag1 == params[PARAM_LEASE_TAG] and len(tag1) == 11
    net.prove()
    clock.advance(3)
    net.d_heartbeat("p1", "p2", tagged=True)
    sent = net.take_d_sends()
    beats = [m for _, m in sent if not m.startswith(HELLO)]
    assert beats == [acked_heartbeat_message(1, heartbeat_message([tag1, tag2]), tagged=True)] * 2
    clock.advance(1)
    net.p_step(sent)
    for keeper in net.keepers:
        assert keeper.table.deadline("p1") == pytest.approx(clock.now + EXT)
        assert keeper.table.deadline("p2") == pytest.approx(clock.now + EXT)
    answers = net.take_p_sends()
    assert acks_of(answers) == [HeartbeatAck(net.proc.instance, [1], frozenset())] * 2
    net.d_receive(answers)
    assert net.remaining("d1") == pytest.approx(EXT - 1) and net.remaining("d2") == pytest.approx(EXT - 1)
    assert net.p[0].count("num_heartbeat_ids_recv") == 2 and net.p[0].count("num_heartbeat_ids_unknown") == 0
    assert net.p[0].count("num_tagged_heartbeats_recv") == 1


def test_tags_are_keyed_per_p_process(clock: Clock) -> None:
    """Nobody can aim tags: the same id gets another tag from another P process."""
    a, b = PProcess(1, "A"), PProcess(1, "B")
    pa: dict = {}
    pb: dict = {}
    a.params.add(pa, "req-1", 1.0)
    b.params.add(pb, "req-1", 1.0)
    assert pa[PARAM_LEASE_TAG] != pb[PARAM_LEASE_TAG]
    assert pa[PARAM_LEASE_INSTANCE] != pb[PARAM_LEASE_INSTANCE]


def test_tagged_heartbeat_never_renews_a_freed_lease(clock: Clock) -> None:
    """A partition held the heartbeat while P freed p1: the answer ends d1's view."""
    net = Pair(clock)
    net.grant("p1", "d1", tagged=True)
    net.grant("p2", "d2", tagged=True)
    net.prove()
    clock.advance(2)
    held_at = clock.now
    net.d_heartbeat("p1", "p2", tagged=True)
    held = net.take_d_sends()
    net.keepers[0].deadlines["p2"] = clock.now + 3 * EXT  # stand-in for heartbeats P did get for p2
    net.p_idle(EXT)
    assert "p1" not in net.keepers[0].table
    clock.advance(1)
    net.p_step(held)
    answers = net.take_p_sends()
    assert acks_of(answers) == [HeartbeatAck(net.proc.instance, [1], frozenset({net.names["p1"]}))]
    net.d_receive(answers)
    assert net.fence.fenced("d1", READ)
    # d2's send was held past the extension: its answer came too late to renew anything.
    assert net.remaining("d2") < 0
    assert net.p[0].count("num_heartbeat_ids_unknown") == 1
    del held_at


def test_not_extended_ends_the_view_at_once(clock: Clock) -> None:
    net = Pair(clock)
    net.grant("p1", "d1")
    net.prove()
    del net.keepers[0].deadlines["p1"]  # P freed it (a read completion from another D, say)
    clock.advance(1)
    net.d_heartbeat("p1")
    net.p_step(net.take_d_sends())
    net.d_receive(net.take_p_sends())
    assert net.remaining("d1") < 0  # ended, not merely unrenewed
    assert net.fence.fenced("d1", READ)


def test_lapsed_view_never_revives(clock: Clock) -> None:
    """An answer to a heartbeat sent after the view lapsed renews nothing,
    whatever P says: another lease may hold the name by then."""
    net = Pair(clock)
    net.grant("p1", "d1")
    net.prove()
    clock.advance(EXT + 0.5)  # the view lapsed: D sent nothing in time
    net.keepers[0].deadlines["p1"] = clock.now + EXT  # P holds *a* lease under that id now
    net.d_heartbeat("p1")
    net.p_step(net.take_d_sends())
    answers = net.take_p_sends()
    assert acks_of(answers)[0].not_extended == frozenset()  # type: ignore[union-attr]
    net.d_receive(answers)
    assert net.remaining("d1") < 0


def test_id_with_a_comma_is_never_claimed(clock: Clock) -> None:
    """A P id with ',' would be split by the core's payload API: its tag stays
    unindexed, so P answers "not extended" instead of claiming a renewal."""
    net = Pair(clock)
    net.grant("a,b", "d1", tagged=True)
    net.grant("p2", "d2", tagged=True)
    net.prove()
    before = net.keepers[0].table.deadline("a,b")
    clock.advance(2)
    net.d_heartbeat("a,b", "p2", tagged=True)
    net.p_step(net.take_d_sends())
    assert net.keepers[0].table.deadline("a,b") == before
    answers = net.take_p_sends()
    assert acks_of(answers) == [HeartbeatAck(net.proc.instance, [1], frozenset({net.names["a,b"]}))]
    net.d_receive(answers)
    assert net.remaining("d1") < 0 and net.remaining("d2") == pytest.approx(EXT)


def test_read_completion_drops_the_tag_on_p(clock: Clock) -> None:
    net = Pair(clock)
    net.grant("p1", "d1", tagged=True)
    keeper = net.keepers[0]
    tag = net.names["p1"]
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
    lhbt = ESCAPE_PREFIX + TAGGED_HEARTBEAT_KIND
    crafted = [lhbt, lhbt + b"x," + net.names["p1"].encode(), lhbt + b"2,\xff\xfe"]
    crafted.append(lhbt + b"3,p1,,zz," + b"A" * 5000)
    _, msgs = keeper.route({"D-agent": [hello("D-agent", net.names["p1"]), *crafted]})
    acker.handle(msgs)
    settle(acker)
    acker.handle({})
    assert keeper.table.deadline("p1") == before  # neither the raw id nor junk renews it
    assert p.count("num_malformed_notifs") == 2
    answers = acks_of(p.nixl_wrapper.sent)
    # The welcome, then: undecodable and oversized, none counts, no echo.
    instance = net.proc.instance
    assert answers == [HeartbeatAck(instance, [], frozenset()), HeartbeatAck(instance, [2, 3], None)]


def test_heartbeat_delivered_after_p_expired_never_renews(clock: Clock) -> None:
    """A partition: the send returns, UCX holds the message, P frees the
    lease, the message arrives after the heal."""
    net = Pair(clock)
    net.grant("p1", "d1")
    net.grant("p2", "d2")
    net.prove()
    clock.advance(2)
    net.d_heartbeat("p1", "p2")
    net.p_step(net.take_d_sends())
    net.d_receive(net.take_p_sends())
    clock.advance(2)
    net.d_heartbeat("p1", "p2")
    held = net.take_d_sends()  # cut: nothing reaches P
    clock.advance(EXT - 1)
    net.keepers[0].deadlines["p2"] = clock.now + EXT  # stand-in for a heartbeat P did get for p2
    net.keepers[0].deadlines.pop("p1")  # and p1 expired
    clock.advance(0.5)  # heal
    net.p_step(held)
    answers = net.take_p_sends()
    assert acks_of(answers) == [HeartbeatAck(net.proc.instance, [2], frozenset({"p1"}))]
    net.d_receive(answers)
    assert net.fence.fenced("d1", READ)
    # p2 was held: renewed, but only to the held send's time + extension.
    assert net.remaining("d2") == pytest.approx(0.5)


def test_answers_from_every_rank_are_needed(clock: Clock) -> None:
    net = Pair(clock, ranks=2)
    net.grant("p1", "d1")
    net.prove()
    clock.advance(3)
    net.d_heartbeat("p1")
    net.p_step(net.take_d_sends())
    answers = net.take_p_sends()
    assert len(answers) == 2
    net.d_receive(answers[:1])
    assert net.remaining("d1") == pytest.approx(EXT - 3)
    net.d_receive(answers[:1])  # a duplicate proves nothing more
    assert net.remaining("d1") == pytest.approx(EXT - 3)
    net.d_receive(answers[1:])
    assert net.remaining("d1") == pytest.approx(EXT)


def test_proof_needs_every_rank(clock: Clock) -> None:
    net = Pair(clock, ranks=2)
    net.grant("p1", "d1")
    net.d_heartbeat("p1")
    net.p_step(net.take_d_sends())
    welcomes = net.take_p_sends()
    net.d_receive(welcomes[:1])
    assert net.acks.proof("P", net.proc.instance) == PENDING
    net.d_receive(welcomes[1:])
    assert net.acks.proof("P", net.proc.instance) == PROVEN


def test_lost_answers_leave_the_view_and_d_says_hello_again(clock: Clock) -> None:
    net = Pair(clock)
    net.grant("p1", "d1")
    net.prove()
    clock.advance(1)
    net.d_heartbeat("p1")
    net.p_step(net.take_d_sends())
    net.take_p_sends()  # lost
    assert net.remaining("d1") == pytest.approx(EXT - 1)
    clock.advance(2)
    net.d_heartbeat("p1")
    assert not net.take_d_sends()[0][1].startswith(HELLO)  # answered 3 s ago
    clock.advance(CONFIG.rehello_after_s)
    net.d_heartbeat("p1")
    assert net.take_d_sends()[0][1].startswith(HELLO)  # silent past rehello_after_s


def test_plain_p_keeps_renew_on_send_and_gets_plain_heartbeats(clock: Clock) -> None:
    net = Pair(clock)
    net.grant("p1", "d1", plain=True)
    clock.advance(3)
    net.d_heartbeat("p1", instance="")
    assert [m for _, m in net.take_d_sends()] == [heartbeat_message(["p1"])]
    assert net.remaining("d1") == pytest.approx(EXT)
    assert not net.fence.fenced("d1", READ)  # no proof needed from a plain P


def test_plain_view_ends_when_its_connection_is_replaced(clock: Clock) -> None:
    net = Pair(clock)
    net.grant("p1", "d1", plain=True)
    assert not net.fence.fenced("d1", READ)  # bound to this connection
    net.connect(PProcess(1, "Q"))  # upstream handshook again: another process may answer
    assert net.fence.fenced("d1", READ)


def test_restarted_p_under_the_same_engine_id_is_never_read(clock: Clock) -> None:
    """P killed and restarted under its engine id: D's old views end the
    moment the new process proves itself, and are fenced, never read."""
    net = Pair(clock)
    net.grant("p1", "d1")
    net.grant("p2", "d2")
    net.prove()
    old = net.proc
    new = PProcess(1, "P-restarted")
    net.proc = new
    net.connect(new)  # D's heartbeat failed, upstream released P, D handshook again
    assert net.acks.proof("P", old.instance) == PENDING
    assert net.fence.fenced("d1", READ) and "d1" in net.fence.parked  # waits: which process is it?
    # The new P grants a lease on the same request id; its params name the new instance.
    net.grant("p1", "d3")
    net.d_heartbeat("p1", instance=old.instance)  # the old requests' tick: a hello only ...
    net.p_step(net.take_d_sends())
    assert net.take_p_sends() == [] and new.p[0].count("num_hellos_refused") == 1  # ... naming no lease here
    net.d_heartbeat("p1", instance=new.instance)  # the new request's group says hello too
    net.p_step(net.take_d_sends())
    net.d_receive(net.take_p_sends())  # the new process's welcome
    assert net.acks.proof("P", old.instance) == OTHER
    assert net.acks.proof("P", new.instance) == PROVEN
    assert net.d.count("num_views_ended") == 2
    assert [r for r, _ in net.fence.take_parked()] == ["d1"]
    assert net.fence.fenced("d1", READ) and net.fence.fenced("d2", READ)
    assert [r for r, _ in net.d.failed_transfers] == ["d1", "d2"]  # fenced: recomputed, never read
    assert not net.fence.fenced("d3", READ)  # the new process's lease reads normally
    # The old instance's heartbeats are never sent to the new process.
    net.sender.awaiting_proof.clear()
    net.d_heartbeat("p2", instance=old.instance)
    assert net.take_d_sends() == []


def test_hello_needs_a_lease_held_here(clock: Clock) -> None:
    net = Pair(clock)
    keeper, acker, p = net.keepers[0], net.ackers[0], net.p[0]
    keeper.deadlines["p1"] = clock.now + EXT
    _, msgs = keeper.route({"rogue": [hello("rogue", "AAAAAAAAAAA"), hello("rogue2", "nope")]})
    acker.handle(msgs)
    assert len(acker) == 0 and p.nixl_wrapper.loaded == set()
    assert p.count("num_hellos_refused") == 2
    # A newer version is refused too (D then treats P as one without answers).
    _, msgs = keeper.route({"D": [hello("D", "p1", version=LEASE_PROTOCOL_VERSION + 1)]})
    acker.handle(msgs)
    assert len(acker) == 0 and p.count("num_hellos_refused") == 3


@pytest.mark.parametrize("p_id", ["abcdEFGH-_1", "AAAAAAAAAAA"])
def test_a_request_id_shaped_like_a_tag_is_a_hello_key(clock: Clock, p_id: str) -> None:
    # Any 11 base64url characters are a valid request id (a client-chosen one, or
    # vLLM's with randomization off): a D naming leases by id says hello with it.
    net = Pair(clock)
    net.grant(p_id, "d1")
    assert net.names[p_id] == p_id
    net.prove()  # welcomed: P looked the key up as an id once no tag matched
    assert net.p[0].count("num_hellos_refused") == 0


def test_hello_flood_is_bounded(clock: Clock) -> None:
    net = Pair(clock)
    keeper, acker, p = net.keepers[0], net.ackers[0], net.p[0]
    keeper.deadlines["p1"] = clock.now + EXT
    oversized = hello("big", "p1")[:-2] + b"A" * 5000 + b":p1"
    flood = {f"D{i}": [hello(f"D{i}", "p1")] for i in range(3 * MAX_AGENT_LOADS)}
    flood["big"] = [oversized]
    acker._executor = None
    keeper_msgs = keeper.route(flood)[1]
    acker.handle(keeper_msgs)
    assert len(acker._loading) == MAX_AGENT_LOADS  # the rest wait for their next hello
    assert p.count("num_hellos_refused") == 2 * MAX_AGENT_LOADS
    assert p.count("num_malformed_notifs") == 1  # the oversized one


def test_repeated_hellos_cost_one_parse_per_step_and_one_welcome_per_gap(clock: Clock) -> None:
    """An agent that repeats its hello (a flood, or a D that lacks proof) gets
    one hello handled per step and one welcome per welcome gap, not one each."""
    from vllm_nixl_lease.adapter.p_worker.ack_answerer import MAX_WELCOME_GAP_S

    net = Pair(clock)
    keeper, acker, p = net.keepers[0], net.ackers[0], net.p[0]
    keeper.deadlines["p1"] = clock.now + EXT
    acker.handle(keeper.route({"D": [hello("D", "p1")] * 50})[1])
    assert p.count("num_hellos_refused") == 49  # one handled, the rest counted
    settle(acker)
    acker.handle({})
    assert len(net.take_p_sends()) == 1  # the welcome once loaded
    for _ in range(3):  # again within the gap: no second welcome
        acker.handle(keeper.route({"D": [hello("D", "p1")]})[1])
    assert net.take_p_sends() == []
    clock.advance(min(CONFIG.answer_gap_s, MAX_WELCOME_GAP_S))
    acker.handle(keeper.route({"D": [hello("D", "p1")]})[1])
    assert acks_of(net.take_p_sends()) == [HeartbeatAck(net.proc.instance, [], frozenset())]


def test_least_useful_agent_is_evicted_first(clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_nixl_lease.adapter.p_worker import ack_answerer

    monkeypatch.setattr(ack_answerer, "MAX_AGENTS", 2)
    net = Pair(clock)
    keeper, acker, p = net.keepers[0], net.ackers[0], net.p[0]
    keeper.deadlines["p1"] = clock.now + 100
    for agent in ("real", "idle"):
        acker.handle(keeper.route({agent: [hello(agent, "p1")]})[1])
        settle(acker)
        acker.handle({})
    clock.advance(1)
    acker.handle(keeper.route({"real": [acked_heartbeat_message(1, heartbeat_message(["p1"]))]})[1])
    clock.advance(1)
    acker.handle(keeper.route({"third": [hello("third", "p1")]})[1])
    settle(acker)
    acker.handle({})
    assert set(acker._agents) == {"real", "third"}
    assert p.count("num_ack_agents_evicted") == 1


def test_p_answers_a_hello_only_for_the_agent_that_sent_it(clock: Clock) -> None:
    net = Pair(clock)
    net.grant("p1", "d1")
    keeper, acker, p = net.keepers[0], net.ackers[0], net.p[0]
    forged = hello("someone-else", "p1")
    _, msgs = keeper.route({"D-agent": [forged, acked_heartbeat_message(7, heartbeat_message(["p1"]))]})
    acker.handle(msgs)
    settle(acker)
    acker.handle({})
    assert p.nixl_wrapper.sent == [] and "someone-else" not in p.nixl_wrapper.loaded
    assert p.count("num_heartbeat_acks_dropped") == 1


def test_rogue_answers_are_ignored_by_d(clock: Clock) -> None:
    """A rogue P (an agent of no connection D reads over) answering LACK: proves nothing."""
    net = Pair(clock)
    net.grant("p1", "d1")
    forged = heartbeat_ack_message(net.proc.instance, [])
    net.d_receive([("rogue-agent", forged), ("rogue-agent", heartbeat_ack_message("0" * 16, [1]))])
    assert net.acks.proof("P", net.proc.instance) == PENDING
    assert net.d.count("num_heartbeat_acks_ignored") == 2
    net.d_receive([("P-agent-0", HEARTBEAT_ACK_PREFIX + b"zz"), ("P-agent-0", b"LACK:" + b"1" * 16 + b":99")])
    assert net.d.count("num_malformed_notifs") == 1  # the answer to an unknown seq is merely unused
    assert net.d.count("num_heartbeat_acks_recv") == 1


def test_a_remembered_rehandshake_is_forgotten_after_its_connection_is_gone(clock: Clock) -> None:
    """D releases a connection proven to reach another P process once per
    (engine, instance) a minute.  When that connection is gone by then (upstream
    evicted the idle engine), D's steps with no message must still forget it."""
    from vllm_nixl_lease.adapter.d_worker.ack_requester import REHANDSHAKE_ONCE_PER_S

    net = Pair(clock)
    net.grant("p1", "d1")
    net.prove()
    net.fence.views.drop("d1")  # D holds no lease of the process the connection reaches ...
    net.acks.other_instance("P", "f" * 16)  # ... but leases of another one: released, remembered
    assert set(net.acks.rehandshaken) == {"P"}
    del net.d._remote_agents["P"]  # the engine evicted: no agent left to hear from
    clock.advance(net.config.forget_sweep_s + 0.1)
    net.d_receive([])  # the sweep forgets the agents; the re-handshake is still recent
    assert net.acks.agents_known() == 0 and set(net.acks.rehandshaken) == {"P"} and not net.acks.idle()
    clock.advance(REHANDSHAKE_ONCE_PER_S)
    net.d_receive([])
    assert net.acks.rehandshaken == {} and net.acks.idle()


def test_steps_with_no_answer_age_the_ledger_on_a_cadence(clock: Clock) -> None:
    """P went silent: D's steps with no message prune the heartbeats no answer
    could still renew from, at most every interval / 4 (not every step), so
    the ledger stays bounded by the extension's worth of sends."""
    net = Pair(clock)
    net.grant("p1", "d1")
    net.prove()
    every = CONFIG.heartbeat_interval / 4
    prunes: list[float] = []
    prune = net.acks.ledger.prune
    net.acks.ledger.prune = lambda before: prunes.append(clock.now) or prune(before)  # type: ignore[method-assign]
    sent_at: list[float] = []
    for _ in range(200):  # 40 s of 0.2 s steps, a heartbeat every interval
        if not sent_at or clock.now - sent_at[-1] >= CONFIG.heartbeat_interval:
            net.d_heartbeat("p1")
            net.take_d_sends()  # lost: P never answers
            sent_at.append(clock.now)
        net.d_receive([])
        clock.advance(0.2)
        # What a prune at most `every` ago keeps: the sends of the last extension and that cadence.
        horizon = clock.now - EXT - every - 0.2
        assert len(net.acks.ledger) <= sum(t >= horizon for t in sent_at)
    assert len(sent_at) > len(net.acks.ledger) > 0
    assert len(prunes) <= 40 / every + 1  # not on each of the 200 steps
    before = len(net.acks.ledger)
    clock.advance(EXT + 0.1)  # every heartbeat now older than an answer could use
    net.d_receive([])
    assert before and not len(net.acks.ledger)


def test_answer_from_an_agent_of_a_replaced_connection_is_ignored(clock: Clock) -> None:
    """D remembers which engine each P agent belongs to; once upstream replaced
    the connection, a late answer from the old process's agent proves nothing."""
    net = Pair(clock)
    net.grant("p1", "d1")
    net.prove()  # the old agent is remembered as engine P's
    old = net.proc
    net.proc = PProcess(1, "P-restarted")
    net.connect(net.proc)
    net.d_receive([(old.agents[0], heartbeat_ack_message(old.instance, []))])
    assert net.d.count("num_heartbeat_acks_ignored") == 1
    assert net.acks.proof("P", old.instance) == PENDING


def test_stranger_answers_look_up_the_connections_once_per_step(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flood of answers from agents of no connection rebuilds D's map of
    agents to engines at most once per step, not once per message."""
    net = Pair(clock)
    net.grant("p1", "d1")
    net.prove()
    built = []
    real = net.acks._engines_by_agent
    monkeypatch.setattr(net.acks, "_engines_by_agent", lambda: built.append(1) or real())
    forged = heartbeat_ack_message(net.proc.instance, [])
    net.d_receive([(f"rogue-{i}", forged) for i in range(100)] + [("P-agent-0", forged)])
    assert len(built) == 1
    assert net.d.count("num_heartbeat_acks_ignored") == 100
    assert net.acks.proof("P", net.proc.instance) == PROVEN


def test_hostile_acked_heartbeats_are_bounded(clock: Clock) -> None:
    net = Pair(clock)
    net.grant("p1", "d1")
    keeper, acker, p = net.keepers[0], net.ackers[0], net.p[0]
    many = heartbeat_message([f"x{i:06d}" for i in range(2000)])
    lhb = acked_heartbeat_message(0, b"HB:")[: -len(b"0,")]
    batch = [hello("D-agent", "p1"), lhb, lhb + b"x,p1", acked_heartbeat_message(3, many)]
    batch.append(lhb + b"4,\xff\xfe")
    _, msgs = keeper.route({"D-agent": batch})
    acker.handle(msgs)
    settle(acker)
    acker.handle({})
    answers = acks_of(p.nixl_wrapper.sent)
    assert answers[1:] == [HeartbeatAck(net.proc.instance, [3, 4], None)]  # too many names / undecodable
    assert all(len(m) < MAX_NOT_EXTENDED_BYTES + 64 for _, m in p.nixl_wrapper.sent)
    assert p.count("num_malformed_notifs") == 2


def test_views_carry_the_terms_from_p(clock: Clock) -> None:
    proc = PProcess(1, "P")
    params: dict = {}
    proc.params.add(params, "p1", 10.0)
    collector = LeaseViewCollector(CONFIG, "pull")
    for local, extra in (("d1", {}), ("d2", {PARAM_LEASE_PROTOCOL: 99}), ("d3", {PARAM_LEASE_INSTANCE: "x"})):
        terms = collector.terms_of(local, "P", {**params, **extra})
        assert terms is not None
        collector.add(local, "P", terms.instance, "p1", terms)
    meta = SimpleNamespace()
    collector.attach(meta)
    new = getattr(meta, LEASE_VIEWS_ATTR).new
    # Only version 2 with a well-formed instance is acknowledged; others are plain.
    assert {k: v.instance for k, v in new.items()} == {"d1": proc.instance, "d2": "", "d3": ""}
    assert new["d1"].interval == CONFIG.heartbeat_interval


def test_margin_follows_the_terms_p_advertised() -> None:
    """P's extension shorter than D's config would make D's own margin fence
    every read near the end; the view's margin follows P's terms instead."""
    d_config = LeaseConfig.from_extra_config({"kv_lease_duration": 24})  # D: margin 4, interval 4
    fence = ReadFence(FakeUpstreamWorker(), LeaseViews(d_config.lease_safety_margin), d_config)
    p_terms = NewView("P", "i" * 16, "p1", 0.0, extension=8.0, interval=2.0)
    assert _added_margin(fence, "d1", p_terms) == pytest.approx((8 - 4 - 1) / 2)
    same = NewView("P", "i" * 16, "p1", 0.0, extension=16.0, interval=4.0)
    assert _added_margin(fence, "d2", same) == pytest.approx(d_config.lease_safety_margin)


def test_one_answer_per_d_agent_per_step(clock: Clock) -> None:
    """A D heartbeating thousands of leases sends hundreds of LHB messages per
    interval; P answers them with a few sends, not one each."""
    net = Pair(clock)
    net.grant("p1", "d1")
    keeper, acker, p = net.keepers[0], net.ackers[0], net.p[0]
    n = MAX_SEQS_PER_ANSWER + 10
    batch = [hello("D-agent", "p1")]
    batch += [
        acked_heartbeat_message(seq, heartbeat_message(["p1", f"gone{seq % 3}"])) for seq in range(1, n + 1)
    ]
    _, msgs = keeper.route({"D-agent": batch})
    acker.handle(msgs)
    settle(acker)
    acker.handle({})
    answers = acks_of(p.nixl_wrapper.sent)[1:]
    assert [len(a.seqs) for a in answers] == [MAX_SEQS_PER_ANSWER, 10]  # type: ignore[union-attr]
    assert all(a.not_extended == {"gone0", "gone1", "gone2"} for a in answers)  # type: ignore[union-attr]
    assert p.count("num_heartbeat_acks_sent") == n


def paced_acker(gap: float) -> tuple[LeaseKeeper, AckAnswerer, FakeUpstreamWorker]:
    config = LeaseConfig.from_extra_config({"kv_lease_duration": 12, "heartbeat_interval": 4 * gap or 1e-9})
    proc = PProcess(1, "P", config)
    keeper, acker, p = proc.keepers[0], proc.ackers[0], proc.p[0]
    keeper.deadlines["p1"] = 100.0
    return keeper, acker, p


def answered(p: FakeUpstreamWorker) -> dict[str, list]:
    out: dict[str, list] = {}
    for agent, msg in p.nixl_wrapper.sent:
        ack = parse_heartbeat_ack(msg)
        if ack is not None and ack.seqs:  # welcomes aside
            out.setdefault(agent, []).append((ack.seqs, ack.not_extended))
    p.nixl_wrapper.sent = []
    return out


def loaded_agents(keeper: LeaseKeeper, acker: AckAnswerer, p: FakeUpstreamWorker, agents: list[str]) -> None:
    for start in range(0, len(agents), MAX_AGENT_LOADS):
        acker.handle(keeper.route({a: [hello(a, "p1")] for a in agents[start : start + MAX_AGENT_LOADS]})[1])
        settle(acker)
        acker.handle({})
    assert len(acker) == len(agents)
    answered(p)  # the welcomes


def test_p_answers_on_a_tick_every_waiting_agent_in_one_step(clock: Clock) -> None:
    """D engines pace their heartbeats over the interval; P answers every agent
    with heartbeats waiting in one step per tick (half the interval), the
    heartbeats in between sharing the next answer, and extends each at once."""
    keeper, acker, p = paced_acker(1.0)  # interval 4: a tick every 2 s
    agents = [f"D{i}" for i in range(8)]
    loaded_agents(keeper, acker, p, agents)
    seq = iter(range(1, 1000))
    sending_steps = steps = 0
    got: dict[str, list] = {}
    for step in range(400):  # 8 s of 20 ms steps: each D heartbeats in its own step of each interval
        senders = [a for k, a in enumerate(agents) if step % 200 == 25 * k]
        beats = {a: [acked_heartbeat_message(next(seq), heartbeat_message(["p1"]))] for a in senders}
        acker.handle(keeper.route(beats)[1])
        if senders:
            assert keeper.table.deadline("p1") == pytest.approx(clock.now + EXT)  # never waits
        sent = answered(p)
        steps += 1
        sending_steps += bool(sent)
        for agent, answers in sent.items():
            got.setdefault(agent, []).extend(answers)
        clock.advance(0.02)
    ticks = 8 / 2
    assert sending_steps <= ticks + 1  # the first heartbeat is answered at once
    assert sorted(got) == agents  # every agent was answered
    clock.advance(2)
    acker.handle({})  # the next tick answers what arrived after the last one
    assert p.count("num_heartbeat_acks_sent") == 16
    assert p.count("num_heartbeat_acks_dropped") == 0


def test_an_answer_waits_at_most_one_tick(clock: Clock) -> None:
    keeper, acker, p = paced_acker(1.0)
    loaded_agents(keeper, acker, p, ["D0", "D1"])
    hb = acked_heartbeat_message
    acker.handle(keeper.route({"D0": [hb(1, heartbeat_message(["p1"]))]})[1])
    assert answered(p) == {"D0": [([1], frozenset())]}  # the tick was due: at once
    clock.advance(0.1)
    acker.handle(keeper.route({"D1": [hb(2, heartbeat_message(["p1"]))]})[1])
    clock.advance(1.8)
    acker.handle(keeper.route({"D0": [hb(3, heartbeat_message(["p1"]))]})[1])
    assert answered(p) == {}  # inside the tick
    clock.advance(0.1)
    acker.handle({})  # the tick: both, in this step
    assert answered(p) == {"D1": [([2], frozenset())], "D0": [([3], frozenset())]}


def test_a_tick_over_the_cap_spills_into_the_next_steps(clock: Clock) -> None:
    """More agents waiting than one step answers: the rest go in the next steps."""
    keeper, acker, p = paced_acker(1.0)
    agents = [f"D{i}" for i in range(MAX_ANSWERS_PER_STEP + 3)]
    loaded_agents(keeper, acker, p, agents)
    beats = {a: [acked_heartbeat_message(i + 1, heartbeat_message(["p1"]))] for i, a in enumerate(agents)}
    acker.handle(keeper.route(beats)[1])
    assert sorted(answered(p)) == sorted(agents[:MAX_ANSWERS_PER_STEP])
    clock.advance(0.02)
    acker.handle({})
    assert sorted(answered(p)) == sorted(agents[MAX_ANSWERS_PER_STEP:])
    clock.advance(0.02)
    acker.handle(keeper.route({agents[0]: [acked_heartbeat_message(999, heartbeat_message(["p1"]))]})[1])
    assert answered(p) == {}  # the next tick is 2 s after the spill's end


def test_p_extends_but_never_answers_a_heartbeat_that_wants_no_answer(clock: Clock) -> None:
    """Sequence number 0 (KEEPALIVE_SEQ): D's views are long, it asks for no answer."""
    keeper, acker, p = paced_acker(0.0)
    loaded_agents(keeper, acker, p, ["D"])
    clock.advance(5)
    acker.handle(keeper.route({"D": [acked_heartbeat_message(0, heartbeat_message(["p1"]))]})[1])
    clock.advance(5)
    acker.handle({})
    assert answered(p) == {}
    assert keeper.table.deadline("p1") == pytest.approx(clock.now - 5 + EXT)
    assert p.count("num_heartbeat_acks_dropped") == 0
    # From an agent P never admitted: extended, and not counted as a dropped answer either.
    acker.handle(keeper.route({"stranger": [acked_heartbeat_message(0, heartbeat_message(["p1"]))]})[1])
    assert answered(p) == {} and p.count("num_heartbeat_acks_dropped") == 0


def test_paced_answer_names_missing_ids_only_for_heartbeats_that_had_them(clock: Clock) -> None:
    keeper, acker, p = paced_acker(0.0)
    acker.handle(keeper.route({"D": [hello("D", "p1")]})[1])
    settle(acker)
    acker.handle({})
    answered(p)
    batch = [
        acked_heartbeat_message(1, heartbeat_message(["p1"])),
        acked_heartbeat_message(2, heartbeat_message(["p1", "gone"])),
        acked_heartbeat_message(3, heartbeat_message(["p1"])),
    ]
    acker.handle(keeper.route({"D": batch})[1])
    assert answered(p) == {"D": [([1, 3], frozenset()), ([2], frozenset({"gone"}))]}


def test_delayed_answer_renews_from_the_send(clock: Clock) -> None:
    """D renews from when it sent the heartbeat: an answer P held back for
    its tick proves as much as a prompt one."""
    config = LeaseConfig.from_extra_config({"kv_lease_duration": 12, "heartbeat_interval": 4.0})
    net = Pair(clock, config=config)
    net.grant("p1", "d1")
    net.prove()
    clock.advance(3)
    net.d_heartbeat("p1")
    net.p_step(net.take_d_sends())
    net.d_receive(net.take_p_sends())  # the first answer: the agent had none yet
    net.d_heartbeat("p1")
    sent = net.take_d_sends()
    clock.advance(0.2)
    net.p_step(sent)
    assert net.take_p_sends() == []  # inside the tick (half the interval: 2 s)
    clock.advance(1.85)
    net.p_step([])
    answers = net.take_p_sends()
    net.d_receive(answers)
    got = [(a.seqs, a.not_extended) for a in acks_of(answers)]  # type: ignore[union-attr]
    assert got == [([2], frozenset())]
    assert net.remaining("d1") == pytest.approx(EXT - 2.05)


def test_p_stall_waits_for_the_heartbeats_sent_meanwhile(clock: Clock) -> None:
    """P itself stopped past the extension: the leases that fell due during
    the stall wait one heartbeat interval, so D's heartbeat, drained late, saves them."""
    proc = PProcess(1, "P")
    keeper = proc.keepers[0]
    keeper.deadlines["p1"] = clock.now + EXT
    done: set[str] = set()
    keeper.expire(done)
    clock.advance(EXT + 1)  # P frozen
    keeper.expire(done)  # the first step after the stall: nothing expires yet
    assert done == set() and "p1" in keeper.table
    assert proc.p[0].count("num_stalls_graced") == 1
    keeper.route({"D": [heartbeat_message(["p1"])]})  # D's heartbeat, drained now
    clock.advance(keeper.grace_s + 0.1)
    keeper.expire(done)
    assert done == set()  # renewed by the heartbeat
    for _ in range(int(EXT) + 1):  # P steps on; D is silent now
        clock.advance(1)
        keeper.expire(done)
    assert done == {"p1"}  # a lease D stopped renewing still expires


def test_our_messages_never_raise_in_a_stock_p(clock: Clock) -> None:
    """Downgrade: a stock P under the engine id D knew as ours parses every
    message of ours as a heartbeat (the HB:, escape) and never raises."""
    from harness.upstream_fake import make_upstream_worker, stock_worker_class

    w = make_upstream_worker(stock_worker_class())
    w._reqs_to_send["p1"] = clock.now + EXT
    w._reqs_to_process.add("p1")
    w.nixl_wrapper.deliver(
        "D",
        hello("D", "AAAAAAAAAAA"),
        acked_heartbeat_message(5, heartbeat_message(["p1", "x"])),
        acked_heartbeat_message(6, heartbeat_message(["AAAAAAAAAAA"]), tagged=True),
    )
    clock.advance(2)
    assert w._get_new_notifs() == set()
    assert w._reqs_to_send["p1"] == pytest.approx(clock.now + w._lease_extension)  # LHB: is a heartbeat to it


# -- notify-only completions, bound to the lease's P process -----------------
NOTIFY = SimpleNamespace(remote=SimpleNamespace(engine_id="P"), local_block_ids=[[]], awaiting_kvs=True)


def test_a_completion_without_a_read_goes_only_over_a_connection_proven_to_its_process(clock: Clock) -> None:
    """A full prefix-cache hit or an abort's cleanup only notifies P ``<id>:<count>``,
    which frees the lease: after a P restart under the same engine id it must not
    reach the new process, where a lease may share the (client-chosen) id."""
    net = Pair(clock)
    net.grant("p1", "d1")
    net.grant("p2", "d2")
    net.prove()
    assert not net.fence.fenced("d1", NOTIFY)  # proven: upstream sends it
    old = net.proc
    net.proc = PProcess(1, "P-restarted")
    net.connect(net.proc)  # D handshook again: the new connection proves nothing yet
    assert net.fence.fenced("d2", NOTIFY)  # withheld, not parked, not failed
    assert "d2" not in net.fence.parked and net.d.failed_transfers == []
    assert net.d.count("num_completions_withheld") == 1
    assert "d2" in net.d._recving_transfers  # reported as loaded: its KV is local (as upstream)
    net.grant("p2", "d3")  # the new process leases the same id
    net.d_heartbeat("p2", instance=net.proc.instance)
    net.p_step(net.take_d_sends())
    net.d_receive(net.take_p_sends())
    assert net.acks.proof("P", old.instance) == OTHER
    assert net.fence.fenced("d2", NOTIFY)  # proven another process: still withheld
    assert net.d.count("num_completions_withheld") == 2
    assert not net.fence.fenced("d3", NOTIFY)  # the new process's own lease: sent


def test_a_completion_of_a_plain_view_goes_only_over_its_bound_connection(clock: Clock) -> None:
    net = Pair(clock)
    net.grant("p1", "d1", plain=True)
    net.grant("p2", "d2", plain=True)
    assert not net.fence.fenced("d1", READ)  # binds d1's view to this connection
    net.connect(PProcess(1, "P-restarted"))
    assert net.fence.fenced("d1", NOTIFY)
    assert net.d.count("num_completions_withheld") == 1
    assert not net.fence.fenced("d2", NOTIFY)  # first use: bound to the current connection


def test_a_completion_of_an_ended_view_is_withheld(clock: Clock) -> None:
    net = Pair(clock)
    net.grant("p1", "d1")
    net.prove()
    clock.advance(EXT)  # never renewed: lapsed, P may have freed it and granted the id again
    assert net.fence.fenced("d1", NOTIFY)
    assert net.d.count("num_completions_withheld") == 1


def asked_seqs(sent: list[tuple[str, bytes]]) -> list[int]:
    """The sequence numbers of D's acknowledged heartbeats (0: no answer wanted)."""
    return [parsed[0] for _, m in sent if (parsed := parse_acked_heartbeat(m)) is not None]


def chunk_ticks(net: Pair, ticks: int, deliver: bool = True) -> list[int]:
    """D heartbeats chunk 1 every interval, P steps, D takes the answers; the seq of each tick."""
    seqs = []
    for _ in range(ticks):
        net.d_heartbeat("p1", chunk=(1, 1))
        sent = net.take_d_sends()
        assert all(not m.startswith(HELLO) for _, m in sent)  # nobody silent: no hello again
        seqs += asked_seqs(sent)
        left = net.remaining("d1")
        assert left > net.fence.views.margin_of("d1")  # type: ignore[operator]
        if deliver:
            net.p_step(sent)
            net.d_receive(net.take_p_sends())
        net.clock.advance(CONFIG.heartbeat_interval)
    return seqs


@pytest.fixture(autouse=True, params=["one call", "the long way"])
def the_fence_both_ways(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test with the fence's one-call judgement (``LeaseViews.admit_proven``) and
    without it (``ReadFence._verdict`` alone): both must fence alike."""
    monkeypatch.setattr(Pair, "one_call", request.param == "one call")


@pytest.fixture
def ask_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """D3b's asking rule, which the code ships off (``ack_requester.ASK_ONLY_WHEN_NEEDED``)."""
    monkeypatch.setattr(ack_requester, "ASK_ONLY_WHEN_NEEDED", True)


def test_d_asks_for_an_answer_only_when_its_chunks_renewal_ends_soon(clock: Clock, ask_rule: None) -> None:
    """D3b: the first heartbeat asks (the view waits for its first answer); then
    D asks only once the latest renewal ends within ask_within (margin 2 +
    interval 2 + half P's interval 1 + a round trip 0.25 = 5.25 s): every other
    interval, with an extension of 8.  The views never come near their margin,
    and P sends nothing for the heartbeats that ask nothing (seq 0)."""
    net = Pair(clock)
    net.grant("p1", "d1", chunk=(1, 1))
    net.prove()
    p = net.p[0]
    assert chunk_ticks(net, 8) == [1, 0, 2, 0, 3, 0, 4, 0]
    assert p.count("num_heartbeat_acks_sent") == 4
    assert p.count("num_heartbeat_msgs_recv") + p.count("num_tagged_heartbeats_recv") >= 8  # all extend
    assert net.keepers[0].table.deadline("p1") == pytest.approx(clock.now - 2 + EXT)


def test_d_always_asks_while_a_read_waits_for_proof(clock: Clock, ask_rule: None) -> None:
    net = Pair(clock)
    net.grant("p1", "d1", chunk=(1, 1))
    net.prove()
    net.acks.reads_waiting = lambda engine_id: engine_id == "P"
    assert chunk_ticks(net, 4) == [1, 2, 3, 4]


def test_d_asks_every_tick_of_a_message_of_no_chunk(clock: Clock, ask_rule: None) -> None:
    """Per-name messages (no tracker chunk) keep asking every time."""
    net = Pair(clock)
    net.grant("p1", "d1")
    net.prove()
    seqs = []
    for _ in range(4):
        net.d_heartbeat("p1")
        sent = net.take_d_sends()
        seqs += asked_seqs(sent)
        net.p_step(sent)
        net.d_receive(net.take_p_sends())
        clock.advance(CONFIG.heartbeat_interval)
    assert seqs == [1, 2, 3, 4]


def test_an_unanswered_ask_makes_d_say_hello_again(clock: Clock, ask_rule: None) -> None:
    """Silence counts from the first ask P left unanswered, not from the last
    answer: heartbeats that ask nothing leave P silent on purpose."""
    net = Pair(clock)
    net.grant("p1", "d1", chunk=(1, 1))
    net.prove()
    assert chunk_ticks(net, 2) == [1, 0]  # answered at t=0; t=2 asks nothing
    # t=4: D asks; P forgot D (or the answer is lost): no answer comes.
    net.d_heartbeat("p1", chunk=(1, 1))
    assert asked_seqs(net.take_d_sends()) == [2]
    clock.advance(CONFIG.rehello_after_s - 0.1)
    net.d_heartbeat("p1", chunk=(1, 1))
    assert all(not m.startswith(HELLO) for _, m in net.take_d_sends())
    clock.advance(0.1)
    net.d_heartbeat("p1", chunk=(1, 1))
    assert any(m.startswith(HELLO) for _, m in net.take_d_sends())


def test_an_answer_to_seq_0_from_a_p_of_before_renews_nothing(clock: Clock, ask_rule: None) -> None:
    """A version-2 P of before this rule answers the heartbeats that ask nothing
    (seq 0); D ignores those answers: no view moves, nothing is malformed."""
    net = Pair(clock)
    net.grant("p1", "d1", chunk=(1, 1))
    net.prove()
    assert chunk_ticks(net, 2) == [1, 0]
    left = net.remaining("d1")
    net.d_receive([("P-agent-0", heartbeat_ack_message(net.proc.instance, [0]))])
    assert net.remaining("d1") == pytest.approx(left)
    assert net.d.count("num_malformed_notifs") == 0 and net.d.count("num_heartbeat_views_renewed") == 1


def _added_margin(fence: ReadFence, local_id: str, view: NewView) -> float:
    """The margin the fence gives a view shipped to it (``ReadFence.add_views``)."""
    fence.add_views(SimpleNamespace(**{LEASE_VIEWS_ATTR: LeaseViewUpdates({local_id: view}, [])}))
    margin = fence.views.margin_of(local_id)
    assert margin is not None
    return margin


def test_a_proven_connection_silent_past_reconnect_after_is_released_once_per_silence(clock: Clock) -> None:
    """D2a: after a partition UCX can leave a connection half-open (P's sends to D fail, D's
    arrive nowhere).  A P rank that owes answers ``reconnect_after_s`` old gets its connection
    released (upstream's invalid-engine path), and the next release needs as long a silence."""
    net = Pair(clock)
    net.grant("p1", "d1")
    net.prove()
    after = net.config.reconnect_after_s
    assert after == max(2 * net.config.rehello_after_s, EXT)
    # Answered every interval: never released, however long it runs.
    for _ in range(int(3 * after / net.config.heartbeat_interval)):
        net.d_heartbeat("p1")
        net.p_step(net.take_d_sends())
        net.d_receive(net.take_p_sends())
        clock.advance(net.config.heartbeat_interval)
    assert net.d._invalid_remote_engines == set()
    # Then D's sends arrive nowhere: released once the oldest unanswered ask is that old.
    silent_from = clock.now
    while clock.now - silent_from < after:
        assert net.d._invalid_remote_engines == set(), clock.now - silent_from
        net.d_heartbeat("p1")
        net.take_d_sends()
        clock.advance(net.config.heartbeat_interval)
    net.d_heartbeat("p1")
    assert net.d._invalid_remote_engines == {"P"}
    assert net.d.count("num_connections_released_silent") == 1
    # What the agents owed is forgotten: the next silence is counted afresh.
    net.take_d_sends()
    clock.advance(after - net.config.heartbeat_interval)
    net.d_heartbeat("p1")
    assert net.d.count("num_connections_released_silent") == 1


def test_a_connection_never_asked_is_never_released_as_silent(clock: Clock) -> None:
    """Not proven yet (hellos and keep-alives only, nothing asked): no answer is owed."""
    net = Pair(clock)
    net.grant("p1", "d1")
    for _ in range(int(3 * net.config.reconnect_after_s)):
        net.d_heartbeat("p1")
        net.take_d_sends()
        clock.advance(1.0)
    assert net.d._invalid_remote_engines == set()
    assert net.d.count("num_connections_released_silent") == 0
