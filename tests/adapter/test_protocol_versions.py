"""Version skew (docs/PROTOCOL.md section 6), through vLLM's real connector
classes with fake NIXL (``harness/upstream_fake.py``): our scheduler builds
the heartbeats and views from each request's params, our worker sends them.

- our D (version 2) with a version-1 P (unversioned: ``remote_lease_acks``,
  raw ``LHB:``/``LHELLO:``/``LACK:<seqs>``): plain views, only ``HB:``;
- a version-1 D with our P (version 2): our params advertise nothing a
  version-1 D takes for acknowledgements, our P extends on ``HB:``, and the
  raw version-1 messages a D that remembered an engine's capabilities would
  still send are counted, never applied, never raised on;
- our D with a P of an unknown newer version (``remote_lease_protocol`` > 2):
  a P without acknowledgements, exactly as version 1;
- version 3 (P's clock in its answers) with version 2 both ways: our P
  advertises ``remote_lease_protocol`` 2 and ``remote_lease_protocol_max`` 3,
  our D says hello 2 to a P without the key (today's version 2, which refuses
  any other) and 3 to one that takes it, and our P answers a version-2 D in
  version 2's exact form, which its strict parser takes.
"""

from __future__ import annotations

import concurrent.futures
import re
from types import SimpleNamespace

import pytest
from vllm_support import (
    Clock,
    fake_request,
    make_kv_cache_config,
    make_worker,
    p_step,
    remote_prefill_params,
    shared_vllm_config,
)

from vllm_nixl_lease._wire import (
    ESCAPE_PREFIX,
    LEASE_PROTOCOL_BASE,
    LEASE_PROTOCOL_VERSION,
    PARAM_LEASE_DEADLINE,
    PARAM_LEASE_EXTENSION,
    PARAM_LEASE_INSTANCE,
    PARAM_LEASE_INTERVAL,
    PARAM_LEASE_PROTOCOL,
    PARAM_LEASE_PROTOCOL_MAX,
    PARAM_LEASE_TAG,
    acked_heartbeat_message,
    heartbeat_message,
    hello_message,
    lease_terms,
    new_instance,
    parse_hello,
)
from vllm_nixl_lease.adapter.config import LeaseConfig
from vllm_nixl_lease.adapter.p_scheduler.lease_params import LeaseParams
from vllm_nixl_lease.adapter.schedulers import LeaseNixlPullConnectorScheduler
from vllm_nixl_lease.adapter.workers import LeaseNixlPullConnectorWorker

LEASE = 12  # extension 8, interval 2
EXT = 8.0
CONFIG = LeaseConfig.from_extra_config({"kv_lease_duration": LEASE})
# What a version-1 P of ours put in kv_transfer_params besides the deadline and extension.
V1_ACKS, V1_TAGS = "remote_lease_acks", "remote_lease_tags"
V1_TAG = "AAAAAAAAAAA"


@pytest.fixture(scope="module")
def scheduler_factory(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("versions")

    def make() -> LeaseNixlPullConnectorScheduler:
        from vllm.config import set_current_vllm_config

        vc = shared_vllm_config(root, {"kv_lease_duration": LEASE})
        with set_current_vllm_config(vc):
            return LeaseNixlPullConnectorScheduler(vc, "d-engine", make_kv_cache_config())

    return make


class OurD:
    """Our D: the real scheduler and pull worker, connected to engine "P1"."""

    def __init__(self, sched: LeaseNixlPullConnectorScheduler) -> None:
        self.sched = sched
        self.worker = make_worker(LeaseNixlPullConnectorWorker, LEASE)
        self.worker._remote_agents["P1"] = {(0, 0): b"p-agent-0"}
        self.worker._engine_clock_offset["P1"] = 0.0
        self.worker._ensure_handshake = lambda *a, **k: None

    def queue(self, local: str, params: dict) -> None:
        self.sched.on_new_request(fake_request(local, **params))

    def step(self) -> list[bytes]:
        """One scheduler + worker step; the messages the worker sent."""
        meta = self.sched.build_connector_meta(None)
        self.worker.read_fence.add_views(meta)
        self.worker.ack_requester.note_views(meta)
        self.worker.heartbeat_sender.send(meta)
        sent, self.worker.nixl_wrapper.sent = self.worker.nixl_wrapper.sent, []
        return [m for _, m in sent]

    def remaining(self, local: str, clock: Clock) -> float | None:
        return self.worker.read_fence.views.remaining(local, clock.now, 0.0)


def _v1_params(remote: str, clock: Clock) -> dict:
    params = remote_prefill_params("P1", remote)
    params.update(
        {
            PARAM_LEASE_DEADLINE: clock.now + 5,
            PARAM_LEASE_EXTENSION: EXT,
            V1_ACKS: True,
            V1_TAGS: True,
            PARAM_LEASE_TAG: V1_TAG,
        }
    )
    return params


def _newer_params(remote: str, clock: Clock) -> dict:
    """A future version of ours: everything version 2 has, another protocol number."""
    params = remote_prefill_params("P1", remote)
    LeaseParams(CONFIG).add(params, remote, clock.now + 5)
    params[PARAM_LEASE_PROTOCOL] = LEASE_PROTOCOL_VERSION + 1
    return params


def _plain_d_run(d: OurD, clock: Clock) -> tuple[list[bytes], float | None]:
    """Steps over three heartbeat intervals; every message sent, and the view's
    time left right after the last send."""
    sent: list[bytes] = []
    for _ in range(12):
        sent += d.step()
        clock.advance(0.5)
    return sent, d.remaining("d1", clock)


@pytest.mark.parametrize("skew", ["v1-P", "newer-P"])
def test_our_d_treats_an_older_or_newer_p_as_plain(scheduler_factory, clock: Clock, skew: str) -> None:
    """Plain: only upstream's ``HB:`` by P's request id, never a hello or
    anything behind the ``HB:,`` escape, and the view renews on D's own sends."""
    d = OurD(scheduler_factory())
    params = _v1_params("p-1", clock) if skew == "v1-P" else _newer_params("p-1", clock)
    terms = lease_terms(params)
    assert terms is not None and not terms.acknowledged and terms.instance == ""
    d.queue("d1", params)
    sent, left = _plain_d_run(d, clock)
    assert sent, "D never heartbeated"
    assert all(m == heartbeat_message(["p-1"]) for m in sent), sent
    assert not any(m.startswith(ESCAPE_PREFIX) for m in sent)
    # Renewed on send (the deadline in the params was 5 s ahead, 6 s ago).
    assert left is not None and left > 0
    assert not d.worker.read_fence.fenced("d1", _read("P1"))


def test_our_d_ignores_a_v1_ps_unversioned_answers(scheduler_factory, clock: Clock) -> None:
    """A version-1 P answers ``LACK:<seqs>`` (no instance): our D cannot parse
    it, counts it, renews nothing from it and never raises."""
    d = OurD(scheduler_factory())
    d.queue("d1", _v1_params("p-1", clock))
    d.step()
    stats = d.worker.xfer_stats.data
    before = d.remaining("d1", clock), sum(stats["num_heartbeat_views_renewed"])
    d.worker.nixl_wrapper.deliver("p-agent-0", b"LACK:1,2,3", b"LACK:1:p-1", b"LACK:")
    d.worker._get_new_notifs()
    assert (d.remaining("d1", clock), sum(stats["num_heartbeat_views_renewed"])) == before
    assert sum(stats["num_heartbeat_acks_recv"]) == 0
    assert sum(stats["num_malformed_notifs"]) == 3


def _read(engine: str) -> SimpleNamespace:
    return SimpleNamespace(remote=SimpleNamespace(engine_id=engine), local_block_ids=[[1]])


def test_our_p_advertises_nothing_a_v1_d_takes_for_acknowledgements(scheduler_factory, clock: Clock) -> None:
    """A version-1 D reads ``remote_lease_acks`` / ``remote_lease_tags``: our
    params carry neither, so it sends plain ``HB:``; and they say version 2."""
    params = remote_prefill_params("P1", "p-1")
    LeaseParams(CONFIG).add(params, "p-1", clock.now + 5)
    assert V1_ACKS not in params and V1_TAGS not in params
    assert params[PARAM_LEASE_PROTOCOL] == LEASE_PROTOCOL_BASE
    assert params[PARAM_LEASE_INTERVAL] == 2 and params[PARAM_LEASE_INSTANCE]


def _our_p(clock: Clock):  # type: ignore[no-untyped-def]
    p = make_worker(LeaseNixlPullConnectorWorker, LEASE)
    p.nixl_wrapper.name = "p-agent-0"
    p.lease_keeper.adopt_instance(SimpleNamespace(lease_instance=(new_instance(), b"k" * 16)))
    p.lease_keeper.deadlines["p-1"] = clock.now + 5.0
    return p


def test_our_p_extends_a_v1_ds_plain_heartbeat(clock: Clock) -> None:
    p = _our_p(clock)
    clock.advance(1)
    p.nixl_wrapper.deliver("v1-d-agent", heartbeat_message(["p-1"]))
    p_step(p)
    assert p.lease_keeper.table.deadline("p-1") == pytest.approx(clock.now + EXT)
    assert p.nixl_wrapper.sent == []  # a plain heartbeat gets no answer


def test_our_p_counts_and_never_applies_v1_raw_messages(clock: Clock) -> None:
    """A version-1 D that remembered this engine id as a version-1 P (before
    P was upgraded) still sends ``LHELLO:``/``LHB:``/``LHBT:`` without the
    escape: our P counts them as malformed, extends nothing, answers nothing."""
    p = _our_p(clock)
    deadline = p.lease_keeper.table.deadline("p-1")
    clock.advance(1)
    v1 = [b"LHELLO:" + b"QUFBQQ", b"LHB:1:p-1", b"LHBT:2:" + V1_TAG.encode(), b"LHB:3:p-1,p-2"]
    p.nixl_wrapper.deliver("v1-d-agent", *v1)
    done = p_step(p)
    assert done == set()
    assert p.lease_keeper.table.deadline("p-1") == deadline  # nothing extended
    assert p.nixl_wrapper.sent == []
    data = p.xfer_stats.data
    counted = sum(sum(data.get(k, [])) for k in ("num_malformed_notifs", "num_unknown_completions"))
    assert counted == len(v1)


def test_our_p_refuses_a_hello_of_a_newer_version(clock: Clock) -> None:
    """A newer D's hello (version 3) is refused, unanswered: that D then treats
    our P as one without acknowledgements."""
    p = _our_p(clock)
    newer = hello_message(1.0, b"md", "p-1", version=LEASE_PROTOCOL_VERSION + 1)  # names a lease held here
    p.nixl_wrapper.deliver("newer-d-agent", newer)
    p_step(p)
    assert p.nixl_wrapper.sent == []
    assert sum(p.xfer_stats.data["num_hellos_refused"]) == 1
    assert len(p.ack_answerer) == 0


# -- version 3 (P's clock in its answers) beside version 2 ----------------------------------
# Version 2's answer exactly as its strict parser (``parse_heartbeat_ack`` of today) takes it.
V2_ANSWER = re.compile(rb"LACK:[0-9a-f]{16}:(?:[0-9]{1,20}(?:,[0-9]{1,20})*)?(?::.*)?", re.DOTALL)


def test_our_p_advertises_version_2_and_the_newest_hello_it_takes(clock: Clock) -> None:
    params = remote_prefill_params("P1", "p-1")
    LeaseParams(CONFIG).add(params, "p-1", clock.now + 5)
    assert params[PARAM_LEASE_PROTOCOL] == LEASE_PROTOCOL_BASE == 2
    assert params[PARAM_LEASE_PROTOCOL_MAX] == LEASE_PROTOCOL_VERSION == 3


def _hello_version(d: OurD, params: dict, clock: Clock) -> int:
    d.queue("d1", params)
    for _ in range(4):
        for msg in d.step():
            hello = parse_hello(msg)
            if hello is not None:
                return hello.version
        clock.advance(0.5)
    raise AssertionError("D never said hello")


def test_our_d_says_hello_3_to_our_p(scheduler_factory, clock: Clock) -> None:
    params = remote_prefill_params("P1", "p-1")
    LeaseParams(CONFIG).add(params, "p-1", clock.now + 5)
    assert _hello_version(OurD(scheduler_factory()), params, clock) == 3


def test_our_d_says_hello_2_to_a_v2_p(scheduler_factory, clock: Clock) -> None:
    """The row of docs/PROTOCOL.md section 6 (ours v3, P ours v2)."""
    params = remote_prefill_params("P1", "p-1")
    LeaseParams(CONFIG).add(params, "p-1", clock.now + 5)
    del params[PARAM_LEASE_PROTOCOL_MAX]
    assert _hello_version(OurD(scheduler_factory()), params, clock) == 2


def test_our_d_says_hello_3_to_a_newer_p(scheduler_factory, clock: Clock) -> None:
    params = remote_prefill_params("P1", "p-1")
    LeaseParams(CONFIG).add(params, "p-1", clock.now + 5)
    params[PARAM_LEASE_PROTOCOL_MAX] = LEASE_PROTOCOL_VERSION + 1
    assert _hello_version(OurD(scheduler_factory()), params, clock) == 3


def _answers_to(p, agent: str, version: int) -> list[bytes]:  # type: ignore[no-untyped-def]
    """Hello (``version``), welcome, one acknowledged heartbeat of p-1: what P sent ``agent``."""
    p.nixl_wrapper.deliver(agent, hello_message(1.0, f"fake-md:{agent}".encode(), "p-1", version))
    p_step(p)
    concurrent.futures.wait([load for load, *_ in p.ack_answerer._loading.values()], timeout=60)
    p_step(p)
    p.nixl_wrapper.deliver(agent, acked_heartbeat_message(1, heartbeat_message(["p-1"])))
    p_step(p)
    sent = [m for to, m in p.nixl_wrapper.sent if to == agent]
    p.nixl_wrapper.sent = []
    return sent


def _scheduler_step(p, clock: Clock) -> None:  # type: ignore[no-untyped-def]
    """A P step whose metadata grants a lease: the worker sees the scheduler's clock."""
    from vllm_nixl_lease.adapter.metadata import LeaseConnectorMetadata

    meta = LeaseConnectorMetadata()
    meta.reqs_to_send = {"p-2": clock.now + 5.0}
    meta.scheduler_clock = clock.now
    p.start_load_kv(meta)


def test_our_p_answers_a_v2_d_without_a_clock(clock: Clock) -> None:
    """Today's version-2 D: welcomed and answered in version 2's form; a version-3
    D on the same P gets P's clock."""
    p = _our_p(clock)
    _scheduler_step(p, clock)
    assert p.ack_answerer._clock_shift is not None
    old = _answers_to(p, "v2-d-agent", 2)
    assert len(old) == 2 and all(V2_ANSWER.fullmatch(m) for m in old), old  # welcome, answer
    clock.advance(p.lease_config.answer_tick_s)  # P's next answer tick
    new = _answers_to(p, "v3-d-agent", 3)
    assert len(new) == 2 and b"@" not in new[0] and b"@" in new[1], new


def test_our_p_sends_no_clock_before_it_saw_the_schedulers(clock: Clock) -> None:
    p = _our_p(clock)
    assert all(V2_ANSWER.fullmatch(m) for m in _answers_to(p, "v3-d-agent", 3))
