"""Hypothesis stateful tests: the Cython core, the Python twin (and the Cython
core with forced hash collisions) and a brute-force model must agree exactly
on every random interleaving of grant/extend/release/pop/route, including the
edges: messages that are not bytes, message lists that are not lists, ``now``
values that are not finite times (same exception, nothing changed), long and
non-ASCII ids, and read counts that must not outlive their lease or batch
membership (the invariant compares every id's count with the model's).

Two groups run side by side, each against its own model: full 64-bit tags
with the default tombstone window and cap, and tags cut to 2 bits (so most
tags collide) with a short window and a cap of a few events (so tombstones
age out, overflow and make grants ambiguous within a few steps).  The tag
key is set, kept or changed (refused while leases are held) as a rule, and
the invariant compares ambiguity, live tombstones and overflows."""

from __future__ import annotations

import math

from core_implementations import load_core
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from reference_core import ReferenceRouter

from vllm_nixl_lease._wire import ESCAPE_PREFIX, heartbeat_message, heartbeat_payload
from vllm_nixl_lease.lease_tags import lease_tag

IDS = ["a", "b", "c:1", "réq", "x" * 40, "cmpl-7:0", "z", "ü" * 70, "y" * 90, "a,b"]
EXTENSION = 4.0
KEYS = [bytes(range(16)), bytes(range(1, 33))]
# (hash bits of the Cython twin(s), table options): each group has its own model
GROUPS = [
    ((("cython", 64), ("python", 64)), {}),
    ((("cython", 1), ("python", 64)), {"tag_bits": 2, "tombstone_s": 3.0, "max_tombstones": 5}),
]

id_st = st.sampled_from(IDS)
key_st = st.sampled_from(KEYS)
time_step = st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.5])
# 3.5: a heartbeat right after the grant gains 0.5 s, so "max(old, new)" is checked in two steps
deadline_offset = st.sampled_from([-1.0, 0.0, 1.0, 2.0, 3.5, 4.0, 7.5])
junk_st = st.one_of(
    st.binary(max_size=12),
    st.sampled_from([b"nocolon", b"x:y", b"a:0", b"a:-1", b":1", b"\xff:1", b"a:99999999999", b"PUSH_REG:z"]),
)
completion_st = st.builds(lambda r, n: f"{r}:{n}".encode(), id_st, st.integers(1, 3))
id_list_st = st.lists(
    st.one_of(id_st.map(str.encode), st.sampled_from([b"", b"\xff", b"unknown"])), max_size=6
)
hb_st = st.builds(heartbeat_message, id_list_st)
# the lease protocol's escape: never a heartbeat, whatever follows it
escape_st = st.one_of(
    st.just(ESCAPE_PREFIX),
    st.builds(lambda ids: ESCAPE_PREFIX + b"LHB:1," + b",".join(ids), id_list_st),
    st.sampled_from([ESCAPE_PREFIX + b"a:1", ESCAPE_PREFIX + b"\xff", b"HB:", b"HB:a,", b"HB:,,a"]),
)
acked_st = id_list_st.map(b",".join) | st.sampled_from([b"\xff,a", b"a,\xfe\xff,b", b"a,,b,"])
# LHBT: payloads: tags of known ids (under either key), of ids never granted, near-tags, junk
tagged_st = st.lists(
    st.one_of(
        st.builds(lease_tag, id_st, key_st),
        st.sampled_from([lease_tag("never", KEYS[0]), lease_tag("a", KEYS[0])[:-1] + "B", "", "x" * 11]),
        st.sampled_from(["AAAAAAAAAAA", "AAAAAAAAAAE", "AAAAAAAAAAI", "AAAAAAAAAAM"]),  # low digest bits 0..3
    ),
    max_size=6,
).map(lambda tags: ",".join(tags).encode()) | st.sampled_from([b"\xff", b"A,\xfe,B"])
not_bytes_st = st.sampled_from(["a:1", None, 7, 1.5, bytearray(b"a:1"), memoryview(b"b:1"), ["a:1"]])
message_st = st.one_of(completion_st, completion_st, hb_st, escape_st, junk_st, not_bytes_st)
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
        self.groups: list[tuple[ReferenceRouter, list]] = []
        for cores, options in GROUPS:
            routers = []
            for name, bits in cores:
                core = load_core(name)
                routers.append(
                    core.NotificationRouter(core.LeaseTable(EXTENSION, _hash_bits=bits, **options))
                )
            self.groups.append((ReferenceRouter(EXTENSION, **options), routers))

    def each(self, model_call, router_call, *args):
        """Call the model and every router of each group; all must agree."""
        for model, routers in self.groups:
            want = outcome(model_call(model), *args)
            assert [outcome(router_call(r), *args) for r in routers] == [want] * len(routers)

    @initialize(key=st.one_of(st.none(), key_st))
    def start(self, key):
        """Most runs start with the tag key set (as P's worker soon has it)."""
        if key is not None:
            self.set_tag_key(key)

    @rule(dt=time_step)
    def advance(self, dt):
        self.now += dt

    @rule(dt=time_step)
    def advance_table_clock(self, dt):
        """``pop_expired(now, 0)`` only moves the tables' clock (frees are dated with it)."""
        self.now += dt
        self.each(lambda m: m.pop_expired, lambda r: r.table.pop_expired, self.now, 0)

    @rule(key=key_st)
    def set_tag_key(self, key):
        """The same key again: nothing; another while leases are held: ValueError."""
        self.each(lambda m: m.set_tag_key, lambda r: r.table.set_tag_key, key)

    @rule(rid=id_st)
    def add_in_batch(self, rid):
        for model, routers in self.groups:
            model.in_batch.add(rid)
            for r in routers:
                r.add_in_batch(rid)

    @rule(rid=id_st)
    def discard_in_batch(self, rid):
        for model, routers in self.groups:
            model.discard_in_batch(rid)
            for r in routers:
                r.discard_in_batch(rid)

    @rule(rid=id_st, off=deadline_offset)
    def grant(self, rid, off):
        """The router's grant: a lease only for a request in a batch."""
        for model, routers in self.groups:
            want = rid in model.in_batch
            if want:
                model.grant(rid, self.now + off)
            assert [r.grant(rid, self.now + off) for r in routers] == [want] * len(routers)

    @rule(payload=hb_st)
    def extend(self, payload):
        self.each(
            lambda m: m.extend_counted, lambda r: r.table.extend_counted, heartbeat_payload(payload), self.now
        )

    @rule(payload=acked_st)
    def extend_acked(self, payload):
        self.each(lambda m: m.extend_acked, lambda r: r.table.extend_acked, payload, self.now)

    @rule(data=st.data())
    def extend_acked_held(self, data):
        """Ids of leases held now, some of them ambiguous: the answer lists exactly those."""
        held = sorted(self.groups[1][0].leases)
        names = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=3)) if held else []
        self.extend_acked(",".join(names).encode())

    @rule(payload=tagged_st)
    def extend_tagged(self, payload):
        self.each(lambda m: m.extend_tagged, lambda r: r.table.extend_tagged, payload, self.now)

    @rule(data=st.data())
    def extend_tagged_held(self, data):
        """Tags of leases held now: random payloads name a held lease too
        rarely for a wrong deadline (``max(old, now + extension)``) to show."""
        model = self.groups[0][0]
        held = sorted(r for r in model.leases if "," not in r)
        names = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=3)) if held else []
        key = model.key or KEYS[0]
        self.extend_tagged(",".join(lease_tag(r, key) for r in names).encode())

    @rule(rid=id_st)
    def release(self, rid):
        self.each(lambda m: m.router_release, lambda r: r.release, rid)

    @rule(rid=id_st, expected=st.integers(1, 3))
    def read(self, rid, expected):
        """One read completion on its own: partial counts (and leaks of them
        past release/discard) come up far more often than in random batches."""
        self.route({"d0": [f"{rid}:{expected}".encode()]})

    @rule(batch=batch_st, now=bad_now_st)
    def bad_now(self, batch, now):
        """Every entry point that takes ``now`` refuses a bad one alike and
        before changing anything (the invariant then checks nothing moved)."""
        calls = [
            (lambda m: m.route, lambda r: r.route, (batch, now)),
            (lambda m: m.expire, lambda r: r.expire, (now,)),
            (lambda m: m.pop_expired, lambda r: r.table.pop_expired, (now,)),
            (lambda m: m.extend_counted, lambda r: r.table.extend_counted, (b"a,b", now)),
            (lambda m: m.extend_acked, lambda r: r.table.extend_acked, (b"a,b", now)),
            (lambda m: m.extend_tagged, lambda r: r.table.extend_tagged, (b"AAAAAAAAAAA", now)),
        ]
        for model_fn, get, args in calls:
            for model, _ in self.groups:
                assert outcome(model_fn(model), *args)[1] is not None
            self.each(model_fn, get, *args)

    @rule(limit=limit_st)
    def pop_expired(self, limit):
        self.each(lambda m: m.pop_expired, lambda r: r.table.pop_expired, self.now, limit)

    @rule(limit=limit_st)
    def expire(self, limit):
        self.each(lambda m: m.expire, lambda r: r.expire, self.now, limit)

    @rule(rid=id_st, off=deadline_offset)
    def grant_on_table(self, rid, off):
        """A lease granted past the router (as ``ReqsToSendDict`` does for an
        id in no batch), whatever the id's batch membership."""
        for model, routers in self.groups:
            model.grant(rid, self.now + off)
            for r in routers:
                r.table.grant(rid, self.now + off)

    @rule(rids=st.lists(id_st, min_size=1, max_size=4), off=deadline_offset)
    def grant_several(self, rids, off):
        for rid in rids:
            self.grant_on_table(rid, off)

    @rule(rids=st.lists(id_st, min_size=1, max_size=4), off=deadline_offset)
    def churn(self, rids, off):
        """Grants and frees in quick succession: tombstones pile up, tags
        shared with a freed lease and ids used again become ambiguous, and
        the small group's cap overflows."""
        for rid in rids:
            self.grant_on_table(rid, off)
        for rid in rids[::2]:
            self.release(rid)

    @rule(batch=batch_st)
    def route(self, batch):
        for model, routers in self.groups:
            want = model.route(batch, self.now)
            for r in routers:
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
        for model, routers in self.groups:
            leases = {r: d for r, (d, _) in model.leases.items()}
            for r in routers:
                t = r.table
                assert len(t) == len(leases)
                assert {rid: t.deadline(rid) for rid in IDS if rid in t} == leases
                assert t.next_deadline() == model.next_deadline()
                assert sorted(t.ids()) == sorted(leases)
                assert r.in_batch_count() == len(model.in_batch)
                for rid in IDS:
                    assert r.received(rid) == model.counts.get(rid, 0)
                    assert r.is_in_batch(rid) == (rid in model.in_batch)
                    assert t.is_ambiguous(rid) == (rid in model.ambiguous)
                assert t.tombstones() == model.tombstones()
                assert t.tombstone_overflows == model.overflows


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
            msgs = [m for _, _, m, _ in chunks]
            ids = [i for m in msgs for i in heartbeat_payload(m).split(b",")]
            # each message's name count is the names it carries
            assert [n for _, _, _, n in chunks] == [heartbeat_payload(m).count(b",") + 1 for m in msgs]
            assert all(len(m) <= 24 for m in msgs)
            assert sorted(ids) == sorted({r for e, r in self.model.values() if e == engine})
        assert set(a) == {e for e, _ in self.model.values()}


TrackerAgreement.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
TestTrackerAgreement = TrackerAgreement.TestCase
