"""Readers of one lease on several Ds (``kv_lease_claim_reads``; docs/PROTOCOL.md
rules P14 and D11): P frees a lease on a completion only when no other D agent
that claimed it remains a holder, and D reads only once P answered its claim
"held".  P's components (LeaseKeeper, AckAnswerer, ClaimGate) and D's
(AckRequester, ReadFence, ClaimRequester) run against fakes of the upstream
worker; messages are carried by hand."""

from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace
from typing import Any

import pytest

from harness.upstream_fake import FakeUpstreamWorker
from vllm_nixl_lease._wire import (
    CLAIM_HELLO_VERSION,
    ESCAPE_PREFIX,
    HELLO_KIND,
    LEASE_PROTOCOL_VERSION,
    PARAM_LEASE_PROTOCOL_MAX,
    acked_heartbeat_message,
    completion_message,
    heartbeat_message,
    hello_message,
    lease_terms,
    parse_acked_heartbeat,
    parse_heartbeat_ack,
    parse_hello,
)
from vllm_nixl_lease.adapter.config import LeaseConfig
from vllm_nixl_lease.adapter.d_scheduler.lease_view_collector import LeaseViewCollector
from vllm_nixl_lease.adapter.d_worker.ack_requester import PROVEN, AckRequester
from vllm_nixl_lease.adapter.d_worker.claim_requester import ClaimRequester
from vllm_nixl_lease.adapter.d_worker.read_fence import ReadFence
from vllm_nixl_lease.adapter.metadata import LEASE_INSTANCE_ATTR, LEASE_VIEWS_ATTR
from vllm_nixl_lease.adapter.p_scheduler.lease_params import LeaseParams
from vllm_nixl_lease.adapter.p_worker.ack_answerer import AckAnswerer
from vllm_nixl_lease.adapter.p_worker.lease_keeper import LeaseKeeper
from vllm_nixl_lease.decode.lease_views import LeaseViews
from vllm_nixl_lease.prefill import lease_holders

CLAIMS = LeaseConfig.from_extra_config({"kv_lease_duration": 12, "kv_lease_claim_reads": True})
PLAIN = LeaseConfig.from_extra_config({"kv_lease_duration": 12})  # extension 8, interval 2
EXT = CLAIMS.lease_extension
READ = SimpleNamespace(remote=SimpleNamespace(engine_id="P"), local_block_ids=[[1]])
HELLO = ESCAPE_PREFIX + HELLO_KIND


class POne:
    """One P engine of one rank (agent "P-agent-0")."""

    def __init__(  # type: ignore[no-untyped-def]
        self, clock, config: LeaseConfig = CLAIMS, params: LeaseParams | None = None, rank: int = 0
    ) -> None:
        self.clock = clock
        self.params = LeaseParams(config) if params is None else params  # another rank: its engine's
        self.instance = self.params.instance.instance
        self.up = FakeUpstreamWorker()
        self.agent = f"P-agent-{rank}"
        self.up.nixl_wrapper.name = self.agent
        self.keeper = LeaseKeeper(self.up, config)
        # What P's scheduler ships every rank (LeaseParams.attach ships it once per step)
        shipped = (self.params.instance.instance, self.params.instance.tag_key)
        self.keeper.adopt_instance(SimpleNamespace(**{LEASE_INSTANCE_ATTR: shipped}))
        self.acker = AckAnswerer(self.up, self.keeper, config)

    def grant(self, p_id: str) -> dict:
        self.keeper.deadlines[p_id] = self.clock.now + EXT
        params: dict = {"do_remote_prefill": True}
        self.params.add(params, p_id, self.clock.now + EXT)
        return params

    def step(self, msgs: dict[str, list[bytes]]) -> set[str]:
        """Route, answer and expire one step's notifications; the leases freed."""
        done, ack_messages = self.keeper.route(msgs)
        self.acker.handle(ack_messages)
        concurrent.futures.wait([load for load, *_ in self.acker._loading.values()], timeout=60)
        self.acker.handle({})
        self.keeper.expire(done)
        return done

    def sent(self) -> dict[str, list[bytes]]:
        out: dict[str, list[bytes]] = {}
        for to, msg in self.up.nixl_wrapper.sent:
            out.setdefault(to.decode() if isinstance(to, bytes) else to, []).append(msg)
        self.up.nixl_wrapper.sent = []
        return out

    def admit(self, agent: str, key: str, version: int = CLAIM_HELLO_VERSION) -> None:
        self.step({agent: [hello_message(2.0, f"fake-md:{agent}".encode(), key, version)]})
        assert self.sent().get(agent), f"{agent}'s hello was not welcomed"


def lhb(seq: int, *names: str) -> bytes:
    return acked_heartbeat_message(seq, heartbeat_message(list(names)))


def answers(msgs: list[bytes]) -> list[tuple[list[int], frozenset[str] | None]]:
    out = []
    for m in msgs:
        ack = parse_heartbeat_ack(m)
        assert ack is not None
        out.append((ack.seqs, ack.not_extended))
    return out


# -- P: holders -------------------------------------------------------------
def test_p_advertises_claims_only_with_the_setting(clock) -> None:  # type: ignore[no-untyped-def]
    assert POne(clock).grant("p1")[PARAM_LEASE_PROTOCOL_MAX] == CLAIM_HELLO_VERSION
    assert POne(clock, PLAIN).grant("p1")[PARAM_LEASE_PROTOCOL_MAX] == LEASE_PROTOCOL_VERSION


def test_p_keeps_a_lease_two_ds_claimed_until_both_finished(clock) -> None:  # type: ignore[no-untyped-def]
    p = POne(clock)
    p.grant("p1")
    for d in ("D1", "D2", "D3"):
        p.admit(d, "p1")
    p.step({"D1": [lhb(1, "p1")]})
    assert answers(p.sent()["D1"]) == [([1], frozenset())]  # a claim: answered in its step
    p.step({"D1": [lhb(2, "p1")]})
    assert answers(p.sent()["D1"]) == [([2], frozenset())]  # no claim: on the tick (due), which starts
    # D2's claim arrives before P's next answer tick: answered in its step all the same.
    p.step({"D2": [lhb(1, "p1")], "D1": [lhb(3, "p1")]})
    sent = p.sent()
    assert answers(sent["D2"]) == [([1], frozenset())]
    assert "D1" not in sent  # D1's third heartbeat claims nothing new: it waits for the tick
    clock.advance(CLAIMS.answer_tick_s)
    p.step({})
    assert answers(p.sent()["D1"]) == [([3], frozenset())]
    assert sorted(p.keeper.claims.holders.holders("p1")) == ["D1", "D2"]
    # D1 read it and finished: D2 still holds it, so P keeps the blocks.
    assert p.step({"D1": [completion_message("p1", 1)]}) == set()
    assert "p1" in p.keeper.table
    # D3 heartbeated nothing: its completion is ignored (counted) while D2 holds the lease.
    assert p.step({"D3": [completion_message("p1", 1)]}) == set()
    assert "p1" in p.keeper.table and p.up.count("num_completions_ignored_held") == 1
    # The last holder finishes: freed at once.
    assert p.step({"D2": [completion_message("p1", 1)]}) == {"p1"}
    assert "p1" not in p.keeper.table and not p.keeper.claims.holders
    assert p.up.count("num_claimed_leases_freed") == 1


def test_p_frees_a_lease_one_d_claimed_on_its_completion(clock) -> None:  # type: ignore[no-untyped-def]
    p = POne(clock)
    p.grant("p1")
    p.admit("D1", "p1")
    p.step({"D1": [lhb(1, "p1")]})
    assert p.step({"D1": [completion_message("p1", 1)]}) == {"p1"}
    assert not p.keeper.claims.holders


def test_a_claim_after_the_free_is_answered_not_held(clock) -> None:  # type: ignore[no-untyped-def]
    p = POne(clock)
    p.grant("p1")
    p.grant("p2")
    p.admit("D1", "p1")
    p.admit("D2", "p2")
    p.step({"D1": [lhb(1, "p1")]})
    assert p.step({"D1": [completion_message("p1", 1)]}) == {"p1"}
    p.sent()
    p.step({"D2": [lhb(1, "p1")]})
    assert answers(p.sent()["D2"]) == [([1], frozenset({"p1"}))]  # D2 must not read it


def test_a_version_3_agent_is_no_holder(clock) -> None:  # type: ignore[no-untyped-def]
    p = POne(clock)
    p.grant("p1")
    p.admit("D1", "p1")
    p.admit("D3", "p1", version=3)  # a D without the setting
    p.step({"D1": [lhb(1, "p1")], "D3": [lhb(1, "p1")]})
    assert p.keeper.claims.holders.holders("p1") == ["D1"]
    assert p.step({"D3": [completion_message("p1", 1)]}) == set()  # ignored while D1 holds it


def test_claims_past_the_cap_are_answered_not_held(clock, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(lease_holders, "MAX_HOLDERS_PER_LEASE", 2)
    p = POne(clock)
    p.grant("p1")
    sent = {}
    for d in ("D1", "D2", "D3"):
        p.admit(d, "p1")
        p.step({d: [lhb(1, "p1")]})
        sent.update(p.sent())
    assert answers(sent["D2"]) == [([1], frozenset())]
    assert answers(sent["D3"]) == [([1], frozenset({"p1"}))]
    assert p.up.count("num_claims_refused") == 1


def test_p_without_the_setting_refuses_claim_hellos_and_frees_on_any_completion(clock) -> None:  # type: ignore[no-untyped-def]
    p = POne(clock, PLAIN)
    p.grant("p1")
    p.step({"D1": [hello_message(2.0, b"fake-md:D1", "p1", CLAIM_HELLO_VERSION)]})
    assert p.up.count("num_hellos_refused") == 1 and not p.sent()
    assert p.keeper.claims is None
    p.admit("D1", "p1", version=LEASE_PROTOCOL_VERSION)
    p.step({"D1": [lhb(1, "p1")]})
    assert p.step({"D2": [completion_message("p1", 1)]}) == {"p1"}  # as before: the first frees


# -- D: claim, then read -------------------------------------------------------
class D:
    """One D rank reading from ``p`` (engine "P")."""

    def __init__(
        self, p: POne, config: LeaseConfig = CLAIMS, name: str = "D-agent", ranks: list[POne] | None = None
    ) -> None:
        self.p = p
        self.ranks = ranks or [p]  # P's TP ranks, ``p`` the first
        self.name = name
        self.up = FakeUpstreamWorker()
        self.up.nixl_wrapper.name = name
        self.up.connect("P", ranks=len(self.ranks))
        self.up._remote_agents["P"] = {r: rank.agent.encode() for r, rank in enumerate(self.ranks)}
        self.views = LeaseViews(config.lease_safety_margin)
        self.acks = AckRequester(self.up, self.views, config)
        self.fence = ReadFence(self.up, self.views, config, self.acks.proof)
        self.claims = ClaimRequester(self.up, self.views, self.acks, config)
        if self.claims.enabled:
            self.acks.on_proven = self.claims.proven
            self.fence.claim_wait = self.claims.waiting

    def view(self, d_id: str, params: dict) -> None:
        terms = lease_terms(params)
        assert terms is not None
        collector = LeaseViewCollector(CLAIMS, "pull")
        collector.add(d_id, "P", terms.instance, params["remote_request_id"], terms)
        meta = SimpleNamespace()
        collector.attach(meta)
        self.step_views(meta)

    def step_views(self, meta: object) -> None:
        """As the worker's ``start_load_kv``."""
        self.fence.add_views(meta)
        self.acks.note_views(meta)
        self.claims.note_views(meta)

    def to_p(self, rank: int = 0) -> list[bytes]:
        """D's messages to P's rank ``rank`` since the last call (taken off D's outbox)."""
        agent = self.ranks[rank].agent.encode()
        sent = self.up.nixl_wrapper.sent
        self.up.nixl_wrapper.sent = [(to, m) for to, m in sent if to != agent]
        return [m for to, m in sent if to == agent]

    def exchange(self, ranks: list[int] | None = None) -> None:
        """D's messages to each P rank, one step of it, its answers to D."""
        for r in range(len(self.ranks)) if ranks is None else ranks:
            rank = self.ranks[r]
            rank.step({self.name: self.to_p(r)})
            self.acks.received({rank.agent: rank.sent().get(self.name, [])})

    def prove(self) -> None:
        agents = list(self.up._remote_agents["P"].values())
        self.up.nixl_wrapper.sent = list(self.acks.hellos("P", self.p.instance, agents))
        self.exchange()
        assert self.acks.proof("P", self.p.instance) == PROVEN


def grant(p: POne, p_id: str, others: tuple[POne, ...] = ()) -> dict:
    params = p.grant(p_id)
    for rank in others:  # P's other ranks hold the lease too
        rank.keeper.deadlines[p_id] = p.clock.now + EXT
    params["remote_request_id"] = p_id
    return params


def test_d_reads_only_once_every_p_rank_answered_its_claim(clock) -> None:  # type: ignore[no-untyped-def]
    p0 = POne(clock)
    p1 = POne(clock, params=p0.params, rank=1)
    d = D(p0, ranks=[p0, p1])
    d.view("d0", grant(p0, "p0", (p1,)))
    d.prove()
    d.view("d1", grant(p0, "p1", (p1,)))
    d.exchange([0])  # rank 1's answer is late
    d.fence.take_parked()
    assert d.fence.fenced("d1", READ) and "d1" in d.fence.parked
    d.exchange([1])
    d.fence.take_parked()
    assert not d.fence.fenced("d1", READ)
    assert [r.keeper.claims.holders.holders("p1") for r in (p0, p1)] == [[d.name], [d.name]]


def test_d_reads_only_once_p_answered_its_claim_held(clock) -> None:  # type: ignore[no-untyped-def]
    p = POne(clock)
    d = D(p)
    d.view("d0", grant(p, "p0"))
    d.to_p()
    d.prove()
    d.view("d1", grant(p, "p1"))
    claim = d.to_p()  # sent in the step the view arrived
    assert len(claim) == 1 and parse_acked_heartbeat(claim[0])[1:] == (b"p1", False)
    assert d.fence.fenced("d1", READ) and "d1" in d.fence.parked  # waits for the answer
    assert d.up.count("num_reads_waiting_claim") == 1 and d.up.failed_transfers == []
    p.step({d.name: claim})
    d.acks.received({"P-agent-0": p.sent()[d.name]})
    d.fence.take_parked()
    assert not d.fence.fenced("d1", READ)  # claimed: read
    assert p.keeper.claims.holders.holders("p1") == [d.name]


def test_d_says_hello_4_only_with_the_setting(clock) -> None:  # type: ignore[no-untyped-def]
    p = POne(clock)
    for config, version in ((CLAIMS, CLAIM_HELLO_VERSION), (PLAIN, LEASE_PROTOCOL_VERSION)):
        d = D(p, config)
        d.view("d0", grant(p, f"p-{version}"))
        (hello,) = [m for _, m in d.acks.hellos("P", p.instance, [b"P-agent-0"])]
        parsed = parse_hello(hello)
        assert parsed is not None and parsed.version == version


def test_a_claim_answered_not_held_fences_the_read(clock) -> None:  # type: ignore[no-untyped-def]
    p = POne(clock)
    d = D(p)
    d.view("d0", grant(p, "p0"))
    d.prove()
    params = grant(p, "p1")
    p.admit("D-other", "p1")
    p.step({"D-other": [lhb(1, "p1")]})
    assert p.step({"D-other": [completion_message("p1", 1)]}) == {"p1"}  # another D read it first
    d.view("d1", params)
    d.exchange()  # the claim: not held
    assert d.up.count("num_reads_fenced_not_claimed") == 1
    d.fence.take_parked()
    assert d.fence.fenced("d1", READ) and "d1" not in d.fence.parked
    assert [r for r, _ in d.up.failed_transfers] == ["d1"]


def _d1_claimed_over_a_proven_connection(clock) -> tuple[POne, D, list[bytes]]:  # type: ignore[no-untyped-def]
    """D proven to reach P (through d0's lease), then d1's view arrives: its claim, taken off
    D's outbox (lost unless the test hands it to P)."""
    p = POne(clock)
    d = D(p)
    d.view("d0", grant(p, "p0"))
    d.prove()
    d.view("d1", grant(p, "p1"))
    return p, d, d.to_p()


def test_a_read_parked_for_its_claim_then_aborted_is_reported_failed(clock) -> None:  # type: ignore[no-untyped-def]
    _, d, _ = _d1_claimed_over_a_proven_connection(clock)  # the claim is lost
    assert d.fence.fenced("d1", READ) and "d1" in d.fence.parked
    dropped = SimpleNamespace(**{LEASE_VIEWS_ATTR: SimpleNamespace(new={}, dropped=["d1"], chunks={})})
    d.fence.drop_views(dropped)
    d.claims.note_views(dropped)
    assert [r for r, _ in d.up.failed_transfers] == ["d1"]
    assert not d.claims.waiting("d1", READ)  # forgotten with its view


def test_a_claim_never_answered_fences_the_read_once_its_view_runs_down(clock) -> None:  # type: ignore[no-untyped-def]
    """Seen in a 30-minute chaos run: claims lost under partitions (or their P gone) left READs
    parked for good, their blocks on D held and their requests heartbeated, so P's lease too."""
    _, d, _ = _d1_claimed_over_a_proven_connection(clock)  # lost, as every claim sent again
    assert d.fence.fenced("d1", READ) and "d1" in d.fence.parked
    waited = 0
    while d.fence.parked:  # each step, as the worker tries parked READs again
        clock.now += 1.0
        d.step_views(SimpleNamespace())
        d.to_p()
        for req_id, meta in d.fence.take_parked():
            d.fence.fenced(req_id, meta)
        waited += 1
        assert waited <= EXT, "a READ parked past its view's lease"
    # Fenced once its view had only the margin left, not before.
    assert waited >= EXT - CLAIMS.lease_safety_margin - 1, waited
    assert [r for r, _ in d.up.failed_transfers] == ["d1"]


def test_an_unanswered_claim_is_sent_again_after_a_heartbeat_interval(clock) -> None:  # type: ignore[no-untyped-def]
    p, d, claim = _d1_claimed_over_a_proven_connection(clock)
    assert len(claim) == 1  # lost
    clock.now += CLAIMS.heartbeat_interval / 2
    d.step_views(SimpleNamespace())
    assert d.to_p() == []  # not before an interval
    clock.now += CLAIMS.heartbeat_interval / 2
    d.step_views(SimpleNamespace())
    again = d.to_p()  # names d0's lease too: viewed before the proof, never claimed since
    assert len(again) == 1 and parse_acked_heartbeat(again[0])[1:] == (b"p0,p1", False)
    p.step({d.name: again})
    d.acks.received({"P-agent-0": p.sent()[d.name]})
    d.fence.take_parked()
    assert not d.fence.fenced("d1", READ) and d.up.failed_transfers == []  # claimed: read
    clock.now += CLAIMS.heartbeat_interval
    d.step_views(SimpleNamespace())
    assert d.to_p() == []  # claimed: never sent again


def test_an_idle_ds_unanswered_claims_age_out(clock) -> None:  # type: ignore[no-untyped-def]
    """Seen in a 10-minute chaos run: claims in flight stayed past the quiet phase on a D that
    got no new views, since they aged out only in a step that brought some."""
    _, d, _ = _d1_claimed_over_a_proven_connection(clock)  # lost
    dropped = SimpleNamespace(**{LEASE_VIEWS_ATTR: SimpleNamespace(new={}, dropped=["d0", "d1"], chunks={})})
    d.fence.drop_views(dropped)
    d.claims.note_views(dropped)
    assert len(d.claims) == 1  # the claim in flight
    clock.now += d.views.max_extension + 1.0
    d.claims.note_views(SimpleNamespace())  # an idle step: no views at all
    assert len(d.claims) == 0


def test_d_claims_nothing_from_a_p_without_the_setting(clock) -> None:  # type: ignore[no-untyped-def]
    p = POne(clock, PLAIN)
    d = D(p)
    d.view("d0", grant(p, "p0"))
    d.up.nixl_wrapper.sent = [(a, m) for a, m in d.acks.hellos("P", p.instance, [b"P-agent-0"])]
    d.exchange()
    d.view("d1", grant(p, "p1"))
    assert d.to_p() == []  # no claim: P would not answer it at once
    assert not d.fence.fenced("d1", READ)  # read as before


@pytest.mark.parametrize("config", [CLAIMS, PLAIN], ids=["claims", "plain"])
def test_the_setting_is_off_by_default_and_a_bool(config: LeaseConfig) -> None:
    assert config.claim_reads is (config is CLAIMS)
    assert LeaseConfig.from_extra_config({}).claim_reads is False


def test_an_idle_worker_still_ages_its_claims_out(clock) -> None:  # type: ignore[no-untyped-def]
    """Seen in `make test`'s 2-minute chaos run after the test above passed: the worker's
    idle-step shortcut (``_nothing_to_start``) skipped ``note_views`` altogether, so
    claims in flight on a D with nothing else to do stayed to the end of the run."""
    from tests.adapter.vllm_support import make_worker
    from vllm_nixl_lease.adapter.workers import LeaseNixlPullConnectorWorker

    worker = make_worker(LeaseNixlPullConnectorWorker, 12, {"kv_lease_claim_reads": True})
    claims = worker.claim_requester
    claims._sent[7] = ([("d0", "p0")], clock.now)  # a claim P never answered
    nothing: dict[str, Any] = {"reqs_to_recv": {}, "reqs_to_send": {}, "heartbeat_by_engine": {}}
    idle = SimpleNamespace(**nothing, reqs_in_batch=set(), reqs_not_processed=set())
    worker.start_load_kv(idle)
    assert len(claims) == 1  # young: kept
    clock.now += worker.read_fence.views.max_extension + 1.0
    worker.start_load_kv(idle)
    assert len(claims) == 0 and not claims.has_pending()
