"""Hypothesis stateful tests: the Cython core, the Python twin (and the Cython
core with forced hash collisions) and a brute-force model must agree exactly
on every random interleaving of grant/extend/release/pop/route, including the
edges: messages that are not bytes, message lists that are not lists, ``now``
values that are not finite times (same exception, nothing changed), long and
non-ASCII ids, and read counts that must not outlive their lease or batch
membership (the invariant compares every id's count with the model's)."""

from __future__ import annotations

import math

from conftest import load_core
from core_model import ModelRouter
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vllm_nixl_lease._wire import heartbeat_message, heartbeat_payload
from vllm_nixl_lease.lease_tags import lease_tag

IDS = ["a", "b", "c:1", "réq", "x" * 40, "cmpl-7:0", "z", "ü" * 70, "y" * 90]
EXTENSION = 4.0

id_st = st.sampled_from(IDS)
time_step = st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.5])
# 3.5: a heartbeat right after the grant gains 0.5 s, so "max(old, new)" is checked in two steps
deadline_offset = st.sampled_from([-1.0, 0.0, 1.0, 2.0, 3.5, 4.0, 7.5])
junk_st = st.one_of(
    st.binary(max_size=12),
    st.sampled_from([b"nocolon", b"x:y", b"a:0", b"a:-1", b":1", b"\xff:1", b"a:99999999999", b"PUSH_REG:z"]),
)
completion_st = st.builds(lambda r, n: f"{r}:{n}".encode(), id_st, st.integers(1, 3))
hb_st = st.builds(
    heartbeat_message,
    st.lists(st.one_of(id_st.map(str.encode), st.sampled_from([b"", b"\xff", b"unknown"])), max_size=6),
)
# LHBT: payloads: tags of known ids, tags of ids never granted, near-tags, junk
tagged_st = st.lists(
    st.one_of(
        id_st.map(lease_tag),
        st.sampled_from([lease_tag("never"), lease_tag("a")[:-1] + "B", "", "x" * 11, "AAAAAAAAAAA"]),
    ),
    max_size=6,
).map(lambda tags: ",".join(tags).encode()) | st.sampled_from([b"\xff", b"A,\xfe,B"])
not_bytes_st = st.sampled_from(["a:1", None, 7, 1.5, bytearray(b"a:1"), memoryview(b"b:1"), ["a:1"]])
message_st = st.one_of(completion_st, completion_st, hb_st, junk_st, not_bytes_st)
messages_st = st.one_of(
    st.lists(message_st, max_size=6),
    st.lists(message_st, max_size=3).map(tuple),
    st.sampled_from([None, b"a:1", "a:1", 3]),
)
batch_st = st.dictionaries(st.sampled_from(["d0", "d1"]), messages_st, max_size=2)
limit_st = st.one_of(st.none(), st.integers(0, 3), st.sampled_from([-1, True, 1.5, "2", 2**70]))
bad_now_st = st.sampled_from([None, "5", b"5", math.nan, math.inf, -math.inf, 10**400, -(10**400), [1.0]])


def outcome(fn, *args):
    """(result, None) or (None, exception type): what a call did."""
    try:
        return fn(*args), None
    except Exception as exc:  # noqa: BLE001 - the type is what is compared
        return None, type(exc)


class CoreAgreement(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.model = ModelRouter(EXTENSION)
        self.routers = []
        for name, bits in (("cython", 64), ("cython", 1), ("python", 64)):
            core = load_core(name)
            self.routers.append(core.NotificationRouter(core.LeaseTable(EXTENSION, _hash_bits=bits)))

    @rule(dt=time_step)
    def advance(self, dt):
        self.now += dt

    @rule(rid=id_st)
    def add_in_batch(self, rid):
        self.model.in_batch.add(rid)
        for r in self.routers:
            r.add_in_batch(rid)

    @rule(rid=id_st)
    def discard_in_batch(self, rid):
        self.model.discard_in_batch(rid)
        for r in self.routers:
            r.discard_in_batch(rid)

    @rule(rid=id_st, off=deadline_offset)
    def grant(self, rid, off):
        """The router's grant: a lease only for a request in a batch."""
        want = rid in self.model.in_batch
        if want:
            self.model.grant(rid, self.now + off)
        assert [r.grant(rid, self.now + off) for r in self.routers] == [want] * 3

    @rule(payload=hb_st)
    def extend(self, payload):
        want = self.model.extend_counted(heartbeat_payload(payload), self.now)
        assert [r.table.extend_counted(heartbeat_payload(payload), self.now) for r in self.routers] == [
            want
        ] * 3

    @rule(payload=tagged_st)
    def extend_tagged(self, payload):
        want = self.model.extend_tagged(payload, self.now)
        assert [r.table.extend_tagged(payload, self.now) for r in self.routers] == [want] * 3

    @rule(data=st.data())
    def extend_tagged_held(self, data):
        """Tags of leases held now: random payloads name a held lease too
        rarely for a wrong deadline (``max(old, now + extension)``) to show."""
        held = sorted(self.model.leases)
        names = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=3)) if held else []
        self.extend_tagged(",".join(lease_tag(r) for r in names).encode())

    @rule(rid=id_st)
    def release(self, rid):
        want = self.model.router_release(rid)
        assert [r.release(rid) for r in self.routers] == [want] * 3

    @rule(rid=id_st, expected=st.integers(1, 3))
    def read(self, rid, expected):
        """One read completion on its own: partial counts (and leaks of them
        past release/discard) come up far more often than in random batches."""
        self.route({"d0": [f"{rid}:{expected}".encode()]})

    @rule(batch=batch_st, now=bad_now_st)
    def bad_now(self, batch, now):
        """Every entry point that takes ``now`` refuses a bad one alike and
        before changing anything (the invariant then checks nothing moved)."""
        m = self.model
        calls = [
            (m.route, lambda r: r.route, (batch, now)),
            (m.expire, lambda r: r.expire, (now,)),
            (m.pop_expired, lambda r: r.table.pop_expired, (now,)),
            (m.extend_counted, lambda r: r.table.extend_counted, (b"a,b", now)),
        ]
        for model_fn, get, args in calls:
            want = outcome(model_fn, *args)
            assert want[1] is not None
            assert [outcome(get(r), *args) for r in self.routers] == [want] * 3

    @rule(limit=limit_st)
    def pop_expired(self, limit):
        want = outcome(self.model.pop_expired, self.now, limit)
        assert [outcome(r.table.pop_expired, self.now, limit) for r in self.routers] == [want] * 3

    @rule(limit=limit_st)
    def expire(self, limit):
        want = outcome(self.model.expire, self.now, limit)
        assert [outcome(r.expire, self.now, limit) for r in self.routers] == [want] * 3

    @rule(rid=id_st, off=deadline_offset)
    def grant_on_table(self, rid, off):
        """A lease granted past the router (as ``ReqsToSendDict`` does for an
        id in no batch), whatever the id's batch membership."""
        self.model.grant(rid, self.now + off)
        for r in self.routers:
            r.table.grant(rid, self.now + off)

    @rule(batch=batch_st)
    def route(self, batch):
        want = self.model.route(batch, self.now)
        for r in self.routers:
            res = r.route(batch, self.now)
            assert res.unknown == len(want["unknown"])
            got = {
                "completed": res.completed,
                "hb": [res.heartbeat_messages, res.heartbeat_ids, res.extended],
                "unknown": res.unknown_sample + want["unknown"][3:],
                "malformed": res.malformed,
                "passthrough": res.passthrough,
            }
            assert got == want

    @precondition(lambda self: True)
    @invariant()
    def same_state(self):
        leases = {r: d for r, (d, _) in self.model.leases.items()}
        for r in self.routers:
            t = r.table
            assert len(t) == len(leases)
            assert {rid: t.deadline(rid) for rid in IDS if rid in t} == leases
            assert t.next_deadline() == self.model.next_deadline()
            assert sorted(t.ids()) == sorted(leases)
            assert r.in_batch_count() == len(self.model.in_batch)
            for rid in IDS:
                assert r.received(rid) == self.model.counts.get(rid, 0)
                assert r.is_in_batch(rid) == (rid in self.model.in_batch)


CoreAgreement.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestCoreAgreement = CoreAgreement.TestCase


class TrackerAgreement(RuleBasedStateMachine):
    """Both trackers emit identical messages; a set model checks the content.
    With interval 0 every ``poll_paced_chunks`` call sends every chunk."""

    def __init__(self) -> None:
        super().__init__()
        names = ("cython", "python")
        self.trackers = [load_core(n).HeartbeatTracker(0.0, max_message_bytes=24) for n in names]
        self.model: dict[str, tuple[str, bytes]] = {}

    @rule(local=st.integers(0, 30), engine=st.sampled_from(["E0", "E1"]), remote=st.integers(0, 40))
    def track(self, local, engine, remote):
        rid = f"r{remote:0{remote % 7 + 1}d}"
        self.model[f"l{local}"] = (engine, rid.encode())
        for t in self.trackers:
            t.track(f"l{local}", engine, rid)

    @rule(local=st.integers(0, 30))
    def untrack(self, local):
        want = self.model.pop(f"l{local}", None) is not None
        assert [t.untrack(f"l{local}") for t in self.trackers] == [want, want]

    @invariant()
    def same_messages(self):
        a, b = (t.poll_paced_chunks(0.0) for t in self.trackers)
        assert a == b  # same chunks (keys, versions), same bytes, same order
        for engine, chunks in a.items():
            msgs = [m for _, _, m in chunks]
            ids = [i for m in msgs for i in heartbeat_payload(m).split(b",")]
            assert all(len(m) <= 24 for m in msgs)
            assert sorted(ids) == sorted({r for e, r in self.model.values() if e == engine})
        assert set(a) == {e for e, _ in self.model.values()}


TrackerAgreement.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
TestTrackerAgreement = TrackerAgreement.TestCase
