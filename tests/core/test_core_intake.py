"""D's scheduler intake (``decode/intake.py``), both implementations.

The reference is what the scheduler's hooks did before the intake queued
them: each arrival read at once through ``_wire.lease_terms``, tracked, and
its view added; each departure dropped and untracked at once.  Random steps of
arrivals and departures, with well-formed, malformed and hostile lease fields,
must leave the same groups, views, messages and chunk versions in the intake
as in the reference, and the Cython module the same as its twin, down to
which arrivals it handed to the adapter's slow path."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest
from core_implementations import IMPLEMENTATIONS, load_core
from core_implementations import ViewFields as View

from vllm_nixl_lease._wire import (
    PARAM_LEASE_DEADLINE,
    PARAM_LEASE_EXTENSION,
    PARAM_LEASE_INSTANCE,
    PARAM_LEASE_INTERVAL,
    PARAM_LEASE_PROTOCOL,
    PARAM_LEASE_PROTOCOL_MAX,
    PARAM_LEASE_TAG,
    lease_terms,
)


@dataclass
class Group:  # the adapter's HeartbeatGroup
    engine_id: str
    instance: str
    tagged: bool
    target: tuple[Any, ...]


class Views:
    """The adapter's ``LeaseViewCollector`` state, with its ``attach``."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.new: dict[Any, Any] = {}
        self.dropped: list[Any] = []
        self.chunks: dict[Any, Any] = {}
        self.shipped: dict[Any, Any] = {}

    def attach(self) -> tuple[Any, ...]:
        out = (dict(self.new), list(self.dropped), dict(self.chunks))
        # Equality below ignores a tuple's type: each view must be the view type itself.
        assert all(type(view) is View for view in self.new.values()), self.new
        for local_id, view in self.new.items():
            self.shipped[local_id] = view.engine_id
        self.new, self.dropped, self.chunks = {}, [], {}
        return out


def _arrive_today(intake: Any, views: Views, tags: bool, local_id: Any, params: Any) -> None:
    """The scheduler's arrival before the intake (and its slow path now)."""
    engine_id = params.get("remote_engine_id")
    remote_id = params.get("remote_request_id")
    host, port, tp = params.get("remote_host"), params.get("remote_port"), params.get("tp_size")
    if engine_id is None or remote_id is None or host is None or port is None or tp is None:
        return
    generation = params.get("remote_registration_generation", 0)
    target = (host, port, tp, params.get("dcp_size", 1), params.get("pp_size", 1), generation)
    terms = None
    if views.enabled:
        try:
            terms = lease_terms(params)
        except ValueError:
            terms = None
    instance = terms.instance if terms is not None else ""
    tagged = bool(instance) and tags and terms is not None and terms.tag is not None
    name = terms.tag if tagged and terms is not None and terms.tag is not None else remote_id
    if intake.track(local_id, engine_id, instance, tagged, name, target) and terms is not None:
        views.new[local_id] = View(
            engine_id, instance, name, terms.deadline, terms.extension, terms.interval, terms.hello_version
        )
        chunk = intake.tracker.chunk_of(local_id)
        if chunk is not None:
            views.chunks[local_id] = chunk


def _leave_today(intake: Any, views: Views, local_id: Any) -> None:
    views.chunks.pop(local_id, None)
    if views.new.pop(local_id, None) is None and views.shipped.pop(local_id, None) is not None:
        views.dropped.append(local_id)
    intake.untrack(local_id)


class Side:
    """One intake (or the reference: the same class, every hook applied at once)."""

    def __init__(self, core: Any, fencing: bool, tags: bool, reference: bool = False) -> None:
        self.tracker = core.HeartbeatTracker(0.0, max_message_bytes=20)
        self.untrackable: list[tuple[Any, Any, str]] = []
        self.intake = core.Intake(
            self.tracker, Group, lambda i, n, e: self.untrackable.append((i, n, type(e).__name__))
        )
        self.views = Views(fencing)
        self.tags = tags
        self.reference = reference
        self.slow: list[Any] = []
        intake = self.intake
        intake.views, intake.view_type, intake.tags = self.views, View, tags
        intake.arrive_slow = self._slow

    def _slow(self, local_id: Any, params: Any) -> None:
        self.slow.append(local_id)
        _arrive_today(self.intake, self.views, self.tags, local_id, params)

    def arrive(self, local_id: Any, params: Any) -> None:
        if self.reference:
            _arrive_today(self.intake, self.views, self.tags, local_id, params)
        else:
            self.intake.events.append((local_id, params))

    def leave(self, local_id: Any) -> None:
        if self.reference:
            _leave_today(self.intake, self.views, local_id)
        else:
            self.intake.events.append(local_id)

    def step(self) -> tuple[Any, ...]:
        self.intake.apply()
        assert self.intake.events == []
        repacked = set(self.intake.repacked)
        self.intake.repacked.clear()
        groups = {k: (g.engine_id, g.instance, g.tagged, g.target) for k, g in self.intake.groups.items()}
        sent = {
            k: [(c, v, m, n) for c, v, m, n in chunks]
            for k, chunks in self.tracker.poll_paced_chunks(0.0).items()
        }
        return (
            self.views.attach(),
            groups,
            dict(self.intake.keys),
            self.intake.next_key,
            repacked,
            sent,
            list(self.untrackable),
        )


_GOOD_INSTANCE = "0123456789abcdef"
_GOOD_TAG = "AbC-_0123xy"


class _Float(float):
    pass


class _Hostile:
    """A value whose comparisons and hash misbehave: the core must not touch it."""

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("compared")

    __hash__ = None  # type: ignore[assignment]


def _pick(rng: random.Random, good: Any, *others: Any) -> Any:
    return good if rng.random() < 0.93 else rng.choice(others)


def _params(rng: random.Random, remote: int) -> Any:
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "remote_engine_id": _pick(rng, f"P{rng.randrange(3)}", None, 7, ""),
        "remote_request_id": _pick(rng, f"p-{remote}", None, "a,b", "", 12, "x" * 60),
        "remote_host": _pick(rng, "10.0.0.1", None),
        "remote_port": _pick(rng, 5600 + rng.randrange(2), None),
        "tp_size": _pick(rng, 1, None, 2),
    }
    if rng.random() < 0.3:
        params["dcp_size"] = rng.choice([1, 2])
    if rng.random() < 0.3:
        params["pp_size"] = rng.choice([1, 2])
    if rng.random() < 0.85:  # our P (else a stock P: no lease fields)
        params[PARAM_LEASE_DEADLINE] = _pick(
            rng,
            rng.choice([100.0 + remote, 100 + remote]),
            float("nan"),
            float("inf"),
            True,
            "1",
            None,
            _Float(3.0),
            10**400,
        )
        params[PARAM_LEASE_EXTENSION] = _pick(
            rng, rng.choice([20.0, 20]), 0.0, -1.0, float("inf"), None, _Float(2.0), 10**400, 0
        )
        if rng.random() < 0.8:
            params[PARAM_LEASE_INTERVAL] = _pick(
                rng, rng.choice([5.0, 5]), -1.0, float("nan"), -3, 10**400, None, "5", _Hostile()
            )
        if rng.random() < 0.8:
            params[PARAM_LEASE_PROTOCOL] = _pick(rng, 2, 3, 1, 2.0, True, "2", None)
            params[PARAM_LEASE_INSTANCE] = _pick(
                rng, _GOOD_INSTANCE, "0123456789ABCDEF", "0123", 5, None, "0123456789abcdeg"
            )
            if rng.random() < 0.8:
                params[PARAM_LEASE_TAG] = _pick(
                    rng, f"{remote:011d}", _GOOD_TAG, "AbC-_0123x=", "short", 5, None
                )
            if rng.random() < 0.7:
                params[PARAM_LEASE_PROTOCOL_MAX] = _pick(rng, 3, 2, 4, 10**30, True, 3.0, "3", None, -5)
    if rng.random() < 0.5:  # vLLM 0.33's P (the worker checks the type)
        params["remote_registration_generation"] = _pick(rng, rng.randrange(1, 3), "1", None, 10**30)
    if rng.random() < 0.03:
        return type("Params", (dict,), {})(params)  # a dict subclass: the adapter's path
    return params


def _run(core: Any, seed: int, fencing: bool, tags: bool, reference: bool) -> tuple[list[Any], list[Any]]:
    rng = random.Random(seed)
    side = Side(core, fencing, tags, reference)
    out = []
    live: list[Any] = []
    remote = 0
    for _ in range(80):
        for _ in range(rng.randrange(16)):
            roll = rng.random()
            if roll < 0.6 or not live:
                local = f"d{rng.randrange(150)}" if rng.random() < 0.97 else rng.choice([3, ""])
                remote += 1
                side.arrive(local, _params(rng, remote if rng.random() < 0.8 else remote // 2))
                live.append(local)
            else:
                local = rng.choice(live) if rng.random() < 0.9 else f"gone{rng.randrange(5)}"
                side.leave(local)
                if local in live and rng.random() < 0.8:
                    live.remove(local)
        out.append(side.step())
    return out, side.slow


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(("fencing", "tags"), [(True, True), (True, False), (False, False)])
def test_intake_matches_the_hooks_applied_at_once(core: Any, seed: int, fencing: bool, tags: bool) -> None:
    got, _ = _run(core, seed, fencing, tags, reference=False)
    want, _ = _run(load_core("python"), seed, fencing, tags, reference=True)
    assert got == want


@pytest.mark.parametrize("seed", range(12))
def test_cython_intake_matches_its_twin(seed: int) -> None:
    runs = [_run(load_core(name), seed, True, True, reference=False) for name in IMPLEMENTATIONS]
    assert runs[0] == runs[1]  # the same state, and the same arrivals handed to the slow path


def test_fast_path_takes_the_common_fields_itself(core: Any) -> None:
    side = Side(core, fencing=True, tags=True)
    ours = {
        "remote_engine_id": "P",
        "remote_request_id": "p-1",
        "remote_host": "h",
        "remote_port": 1,
        "tp_size": 1,
        PARAM_LEASE_DEADLINE: 10.0,
        PARAM_LEASE_EXTENSION: 8.0,
        PARAM_LEASE_INTERVAL: 2.0,
        PARAM_LEASE_PROTOCOL: 2,
        PARAM_LEASE_PROTOCOL_MAX: 3,
        PARAM_LEASE_INSTANCE: _GOOD_INSTANCE,
        PARAM_LEASE_TAG: _GOOD_TAG,
    }
    stock = {k: v for k, v in ours.items() if not k.startswith("remote_lease")} | {"remote_request_id": "p-2"}
    side.arrive("d1", ours)
    side.arrive("d2", stock)
    side.arrive("d3", ours | {PARAM_LEASE_DEADLINE: float("nan"), "remote_request_id": "p-3"})
    side.step()
    assert side.slow == ["d2", "d3"]  # a stock P and malformed fields: the adapter logs them
    assert side.views.shipped == {"d1": "P"}
    assert {g.tagged for g in side.intake.groups.values()} == {True, False}


def test_an_arrival_that_leaves_in_its_step_ships_no_view(core: Any) -> None:
    side = Side(core, fencing=True, tags=False)
    params = {
        "remote_engine_id": "P",
        "remote_request_id": "p-1",
        "remote_host": "h",
        "remote_port": 1,
        "tp_size": 1,
        PARAM_LEASE_DEADLINE: 10.0,
        PARAM_LEASE_EXTENSION: 8.0,
    }
    side.arrive("d1", params)
    side.leave("d1")
    (new, dropped, chunks), groups, *_ = side.step()
    assert (new, dropped, chunks, groups) == ({}, [], {}, {})
    assert len(side.tracker) == 0
    # The slow path's view of the same id, earlier in the step, goes too.
    side.arrive("d2", type("Params", (dict,), {})(params))
    side.arrive("d2", params)
    side.leave("d2")
    (new, dropped, chunks), *_ = side.step()
    assert (new, dropped, chunks) == ({}, [], {}) and side.slow == ["d2"]


def test_a_raising_callback_empties_the_queue(core: Any) -> None:
    side = Side(core, fencing=True, tags=False)

    def boom(local_id: Any, params: Any) -> None:
        raise RuntimeError("slow path failed")

    side.intake.arrive_slow = boom
    side.arrive(
        "d1",
        {
            "remote_engine_id": "P",
            "remote_request_id": "p",
            "remote_host": "h",
            "remote_port": 1,
            "tp_size": 1,
        },
    )
    with pytest.raises(RuntimeError):
        side.intake.apply()
    assert side.intake.events == []


def test_an_int_no_double_holds_is_malformed_not_a_crash() -> None:
    huge = 10**400
    with pytest.raises(ValueError):
        lease_terms({PARAM_LEASE_DEADLINE: huge, PARAM_LEASE_EXTENSION: 8.0})
    with pytest.raises(ValueError):
        lease_terms({PARAM_LEASE_DEADLINE: 1.0, PARAM_LEASE_EXTENSION: huge})
    terms = lease_terms({PARAM_LEASE_DEADLINE: 1, PARAM_LEASE_EXTENSION: 8, PARAM_LEASE_INTERVAL: huge})
    assert terms is not None and terms.interval is None and terms.deadline == 1.0
