"""The Cython LeaseViews against its pure-Python twin: seeded random sequences
of every public operation, on small pools of ids, engines, instances, names
and chunks (so views share leases, chunks and engines), with the clock moving
both ways and now and then a bad value.  Both must answer every call alike,
raise alike, and end in the same state."""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import pytest
from core_implementations import ViewFields as Terms
from core_implementations import load_core

ENGINES = ("P0", "P1", "P2")
INSTANCES = ("", "i0", "i1")
NAMES = tuple(f"n{i}" for i in range(6))
LOCAL_IDS = tuple(f"d{i}" for i in range(12))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _ops(rng: random.Random, t: list[float]) -> list[tuple[str, Callable[[Any], Any]]]:
    """One random operation, as a name and a function of a LeaseViews (the same
    arguments for both implementations)."""
    t[0] += rng.choice((0.0, 0.1, 0.5, 2.0, 7.0, -0.3))  # D's clock (an odd step back too)
    now = t[0]
    lid = rng.choice(LOCAL_IDS)
    engine, instance, name = rng.choice(ENGINES), rng.choice(INSTANCES), rng.choice(NAMES)
    offset = rng.choice((0.0, 0.0, 1000.0, -3.5))
    chunk = (rng.randrange(3), rng.randrange(5))
    deadline = offset + now + rng.choice((-1.0, 0.5, 3.0, 10.0, 40.0))
    extension = rng.choice((1.0, 5.0, 8.0, 30.0, 100.0))
    if rng.random() < 0.02:
        deadline = rng.choice((math.nan, math.inf))
    if rng.random() < 0.02:
        extension = rng.choice((0.0, -1.0, math.nan))
    names = rng.sample(NAMES, rng.randrange(4))
    margin = rng.choice((None, 0.0, 0.5, 1.5, 9.0, -1.0))
    choice = rng.randrange(26)
    # Every draw happens here: each function runs twice, once per implementation.
    if choice < 5:
        in_chunk = chunk if rng.random() < 0.7 else None
        return [("add", lambda v: v.add(lid, engine, name, deadline, extension, instance, in_chunk, margin))]
    if choice == 5:
        return [("drop", lambda v: v.drop(lid))]
    if choice == 6:
        dropped = rng.sample(LOCAL_IDS, rng.randrange(4))
        return [("drop_all", lambda v: v.drop_all(dropped))]
    if choice == 7:
        new = {}
        for local_id in rng.sample(LOCAL_IDS, rng.randrange(4)):
            terms = Terms(
                rng.choice(ENGINES),
                rng.choice(INSTANCES),
                rng.choice(NAMES),
                offset + now + rng.choice((1.0, 10.0, 30.0)),
                rng.choice((2.0, 8.0, 30.0)),
                rng.choice((None, 1.0, 4.0)),
                rng.choice((1, 2, 3, 4, 5)),
            )
            if rng.random() < 0.3:  # as the metadata unpickles them: without Terms.__new__
                terms = tuple.__new__(Terms, tuple(terms))
            new[local_id] = terms
        chunks = {
            local_id: (rng.randrange(3), rng.randrange(5))
            for local_id in rng.sample(LOCAL_IDS, rng.randrange(6))
            if local_id in new or rng.random() < 0.8
        }
        offsets = {e: offset for e in ENGINES if rng.random() < 0.7}
        if rng.random() < 0.2:  # mappings that are not dicts (the Cython module copies them)
            new, chunks = MappingProxyType(new), MappingProxyType(chunks)  # type: ignore[assignment]
        d_interval, floor = rng.choice((1.0, 2.0)), rng.choice((0.1, 0.5))
        # note_terms' tables as the ack requester left them: some versions and terms known already
        versions0 = {(e, i): rng.choice((3, 4)) for e in ENGINES for i in INSTANCES[1:] if rng.random() < 0.3}
        terms0 = {e: (rng.choice((2.0, 8.0)), rng.choice((None, 1.0))) for e in ENGINES if rng.random() < 0.5}

        def note_terms(v: Any) -> tuple[Any, ...]:
            versions, terms = dict(versions0), dict(terms0)
            return v.note_terms(new, versions, terms, 2, 4), versions, terms

        return [
            ("add_views", lambda v: v.add_views(new, chunks, d_interval, floor, offsets)),
            ("note_terms", note_terms),
        ]
    if choice == 8:
        return [("heartbeat_sent", lambda v: v.heartbeat_sent(engine, names, offset, now - 0.2, now))]
    if choice == 9:
        sent = now - 1.0
        return [("heartbeat_acked", lambda v: v.heartbeat_acked(engine, instance, names, offset, sent, now))]
    if choice == 10:
        key, version = chunk
        off = None if rng.random() < 0.2 else offset
        refused = rng.sample(NAMES, rng.randrange(2))
        started = now - rng.choice((0.0, 0.5, 3.0, 20.0))
        return [
            (
                "chunk_acked",
                lambda v: v.chunk_acked(engine, instance or "i0", key, version, started, refused, off, now),
            )
        ]
    if choice == 11:
        return [("chunk_renewed_until", lambda v: v.chunk_renewed_until(engine, chunk[0]))]
    if choice == 12:
        return [("end", lambda v: v.end(engine, instance, names))]
    if choice == 13:
        off = None if rng.random() < 0.3 else offset
        return [("move_to_chunk", lambda v: v.move_to_chunk(lid, chunk, off))]
    if choice == 14:
        proven = rng.choice(INSTANCES[1:])
        return [("instance_proven", lambda v: v.instance_proven(engine, proven))]
    if choice == 15:
        before = now - rng.choice((0.0, 10.0))
        return [("prune_chunk_acks", lambda v: v.prune_chunk_acks(before))]
    if choice == 16:
        keep = rng.sample(ENGINES, rng.randrange(3))
        return [("forget_engines", lambda v: v.forget_engines(keep))]
    if choice == 17:
        return [("prune_claims", lambda v: v.prune_claims(now))]
    if choice == 18:
        unviewed = (engine, name) if rng.random() < 0.5 else None
        off = None if rng.random() < 0.2 else offset
        return [("claim_read", lambda v: v.claim_read(lid, now, off, unviewed))]
    if choice == 19:
        return [("admit_read", lambda v: v.admit_read(lid, now, offset))]
    if choice == 20:
        done = set(rng.sample(LOCAL_IDS, rng.randrange(5)))
        failed = set(rng.sample(LOCAL_IDS, rng.randrange(2)))
        posted_items = {i: now + rng.choice((-5.0, 0.5, 5.0)) for i in rng.sample(LOCAL_IDS, 4)}
        offsets: Any = {e: offset for e in ENGINES if rng.random() < 0.8}
        if rng.random() < 0.3:  # any mapping, not only upstream's dict (the Cython core's other path)
            offsets = MappingProxyType(offsets)

        def late(v: Any) -> tuple[list[str], dict[str, float]]:
            posted = dict(posted_items)
            return sorted(v.late_reads(done, failed, posted, now, offsets)), posted

        return [("late_reads", late)]
    if choice == 21:
        return [("may_wait", lambda v: v.may_wait(lid, now, offset))]
    if choice == 22:
        return [("terms_margin", lambda v: v.terms_margin(extension, 1.0, 2.0))]
    if choice == 23:
        # A connection's agents (upstream keeps bytes names), and what each answered as.
        named = rng.sample(("a0", b"a1", "a2"), rng.randrange(3))
        agents: dict[str, Any] = {
            e: {(0, k): a for k, a in enumerate(named)} for e in ENGINES if rng.random() < 0.9
        }
        if rng.random() < 0.2:  # a connection that is not a dict (the Cython module copies it)
            agents = {e: MappingProxyType(c) for e, c in agents.items()}
        proven = {a: rng.choice(INSTANCES[1:]) for a in ("a0", "a1", "a2") if rng.random() < 0.85}
        offsets = {e: offset for e in ENGINES if rng.random() < 0.8}
        return [("admit_proven", lambda v: v.admit_proven(lid, now, engine, agents, offsets, proven))]
    if choice == 24:
        dropped = rng.sample(LOCAL_IDS, rng.randrange(4))
        records = {i: now for i in rng.sample(LOCAL_IDS, 5)}

        def drop_also(v: Any) -> tuple[dict[str, float], dict[str, float]]:
            posted, bound = dict(records), OrderedDict(records)  # a table that is not a dict too
            v.drop_all(dropped, (posted, bound))
            return posted, bound

        return [("drop_all also", drop_also)]
    # the read-only look at one view (converting it, as ``remaining`` does)
    return [
        ("remaining", lambda v: v.remaining(lid, now, offset)),
        ("may_read", lambda v: v.may_read(lid, now, offset)),
        ("left_and_margin", lambda v: v.left_and_margin(lid, now, {engine: offset})),
        ("deadline_of", lambda v: v.deadline_of(lid, offset)),
    ]


def _state(views: Any, now: float) -> tuple[Any, ...]:
    """Everything public a LeaseViews says, without changing it (no conversion)."""
    per_id = [
        (
            lid,
            lid in views,
            views.engine_of(lid),
            views.instance_of(lid),
            views.margin_of(lid),
            views.answered(lid),
            views.converted(lid),
            views.may_wait(lid, now, 0.0) if views.converted(lid) is False else None,
        )
        for lid in LOCAL_IDS
    ]
    any_names = [views.any_name(e, i) for e in ENGINES for i in INSTANCES]
    return (
        len(views),
        views.max_extension,
        len(views.claims),
        views.engines_known(),
        tuple(per_id),
        tuple(any_names),
    )


def _call(fn: Callable[[Any], Any], views: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(views)
    except (ValueError, TypeError) as exc:
        return "raised", type(exc).__name__


@pytest.mark.parametrize("seed", range(60))
def test_cython_and_twin_answer_alike(seed: int) -> None:
    py, c = load_core("python"), load_core("cython")
    rng = random.Random(seed)
    margin = rng.choice((0.0, 1.0, 2.0))
    cap = rng.choice((math.inf, 20.0))
    twin, cython = py.LeaseViews(margin, cap), c.LeaseViews(margin, cap)
    clock = [0.0]
    for step in range(400):
        for name, fn in _ops(rng, clock):
            got_py, got_c = _call(fn, twin), _call(fn, cython)
            assert _same(got_py, got_c), (seed, step, name, got_py, got_c)
        assert _same(_state(twin, clock[0]), _state(cython, clock[0])), (seed, step)
    # A last look that converts every view still there: the deadlines agree too.
    for lid in LOCAL_IDS:
        assert _same(twin.deadline_of(lid, 0.0), cython.deadline_of(lid, 0.0)), (seed, lid)
