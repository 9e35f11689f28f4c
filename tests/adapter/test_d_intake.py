"""D's scheduler queues arrivals and departures and applies them once per step
(``decode/intake.py``): every step's metadata (heartbeats, views) must be what
the hooks produced when each tracked, untracked and collected at once, for
random sequences of arrivals (well-formed, stock, malformed, both roles),
finished READs, aborts and steps."""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm_support import Clock, fake_request, make_kv_cache_config, remote_prefill_params, shared_vllm_config

from vllm_nixl_lease._wire import (
    PARAM_LEASE_DEADLINE,
    PARAM_LEASE_EXTENSION,
    PARAM_LEASE_INSTANCE,
    PARAM_LEASE_INTERVAL,
    PARAM_LEASE_PROTOCOL,
    PARAM_LEASE_PROTOCOL_MAX,
    PARAM_LEASE_TAG,
)
from vllm_nixl_lease.adapter.schedulers import LeaseNixlPullConnectorScheduler


class AtOnce(LeaseNixlPullConnectorScheduler):
    """Each hook does its part at once, through the adapter's Python path."""

    def on_new_request(self, request: Any) -> None:
        self._quiet = False
        params = request.kv_transfer_params
        if params is None or not params.get("do_remote_prefill"):
            NixlPullConnectorScheduler.on_new_request(self, request)
            return
        if params.get("do_remote_decode"):
            self._truncate_request_for_prefill(request)
        self._arrive_slow(request.request_id, params)

    def _stop_heartbeat(self, req_id: str) -> None:
        self._quiet = False
        self.lease_views.drop(req_id)
        self.heartbeats.untrack(req_id)

    def update_connector_output(self, connector_output: Any) -> None:
        for req_id in connector_output.finished_recving or ():
            self._stop_heartbeat(req_id)


@pytest.fixture(scope="module")
def make(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("intake")

    def build(cls: type, extra: dict[str, Any]) -> Any:
        from vllm.config import set_current_vllm_config

        vc = shared_vllm_config(root, {"kv_lease_duration": 12, **extra})
        with set_current_vllm_config(vc):
            return cls(vc, "d-engine", make_kv_cache_config())

    return build


def _params(rng: random.Random, n: int) -> dict[str, Any] | None:
    roll = rng.random()
    if roll < 0.03:
        return None
    params: dict[str, Any] = remote_prefill_params(
        f"P{rng.randrange(3)}", f"p-{n}", port=5600 + rng.randrange(2)
    )
    if roll < 0.06:
        params["do_remote_prefill"] = False
    elif roll < 0.09:
        params["do_remote_decode"] = True  # both roles
    if rng.random() < 0.05:
        del params[rng.choice(["remote_host", "remote_port", "tp_size", "remote_request_id"])]
    if rng.random() < 0.85:  # our P
        params[PARAM_LEASE_DEADLINE] = rng.choice([100.0 + n] * 8 + [float("nan"), 3, None])
        params[PARAM_LEASE_EXTENSION] = rng.choice([8.0] * 8 + [0.0, "8"])
        params[PARAM_LEASE_INTERVAL] = rng.choice([2.0, 2.0, None, -1.0, 2])
        if rng.random() < 0.8:
            params[PARAM_LEASE_PROTOCOL] = rng.choice([2, 2, 2, 3, 2.0])
            params[PARAM_LEASE_PROTOCOL_MAX] = rng.choice([3, 3, 2, None, True])
            params[PARAM_LEASE_INSTANCE] = rng.choice(["0123456789abcdef"] * 5 + ["fedcba9876543210", "XYZ"])
            params[PARAM_LEASE_TAG] = rng.choice([f"{n:011d}"] * 5 + [None, "bad=tag===="])
    return params


def _drive(sched: Any, clock: Clock, seed: int) -> list[Any]:
    rng = random.Random(seed)
    out = []
    live: list[str] = []
    n = 0
    for _ in range(60):
        for _ in range(rng.randrange(10)):
            if rng.random() < 0.6 or not live:
                n += 1
                local = f"d{n}" if rng.random() < 0.95 else f"d{max(1, n - 3)}"
                sched.on_new_request(fake_request(local, **(_params(rng, n) or {})))
                live.append(local)
            elif rng.random() < 0.5:
                done = set(rng.sample(live, min(len(live), rng.randrange(1, 4))))
                sched.update_connector_output(SimpleNamespace(finished_recving=done))
                for local in done:  # then request_finished's own stop
                    sched._stop_heartbeat(local)
                    live.remove(local)
            else:
                local = rng.choice(live)
                sched._stop_heartbeat(local)  # an abort
                live.remove(local)
        meta = sched.build_connector_meta(None)
        out.append((getattr(meta, "lease_heartbeats", None), getattr(meta, "lease_views", None)))
        clock.advance(rng.choice([0.01, 0.3, 1.0]))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "extra", [{}, {"heartbeat_tags": False}, {"lease_fencing": False}, {"max_heartbeat_bytes": 256}]
)
def test_a_step_ships_what_the_hooks_did_at_once(
    make: Any, clock: Clock, seed: int, extra: dict[str, Any]
) -> None:
    start = clock.now
    want = _drive(make(AtOnce, extra), clock, seed)
    clock.now = start
    got = _drive(make(LeaseNixlPullConnectorScheduler, extra), clock, seed)
    assert got == want
    assert any(heartbeats for heartbeats, _ in got)
    if extra.get("lease_fencing", True):
        assert any(views is not None and views.new and views.dropped for _, views in got)


def test_a_malformed_request_keeps_its_log_line(
    make: Any, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    sched = make(LeaseNixlPullConnectorScheduler, {})
    params = remote_prefill_params("P", "p-1") | {
        PARAM_LEASE_DEADLINE: float("nan"),
        PARAM_LEASE_EXTENSION: 8.0,
    }
    with caplog.at_level(logging.WARNING):
        sched.on_new_request(fake_request("d1", **params))
        sched.build_connector_meta(None)
    assert "malformed lease fields" in caplog.text and "d1" in caplog.text
    assert "d1" in sched.heartbeats.tracker  # heartbeated all the same, as upstream


def test_both_roles_leave_upstreams_heartbeat_dicts_empty(make: Any, clock: Clock) -> None:
    sched = make(LeaseNixlPullConnectorScheduler, {})
    sched.on_new_request(fake_request("d1", **remote_prefill_params("P", "p-1"), do_remote_decode=True))
    assert sched._heartbeat_req_engine == {} and sched._heartbeat_by_engine == {}
    sched.build_connector_meta(None)
    assert "d1" in sched.heartbeats.tracker


def test_a_scheduler_tracking_nothing_never_calls_the_schedule(
    make: Any, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_nixl_lease.adapter.d_scheduler.heartbeat_schedule import HeartbeatSchedule

    calls: list[bool] = []
    real = HeartbeatSchedule.attach

    def attach(self: HeartbeatSchedule, meta: object) -> bool:
        calls.append(tracking := real(self, meta))
        return tracking

    monkeypatch.setattr(HeartbeatSchedule, "attach", attach)
    sched = make(LeaseNixlPullConnectorScheduler, {})
    for _ in range(3):  # a P's steps: nothing is ever tracked
        sched.build_connector_meta(None)
    assert calls == [False]
    sched.on_new_request(fake_request("d1", **remote_prefill_params("P0", "p-1")))
    for _ in range(2):
        sched.build_connector_meta(None)
        clock.advance(10.0)  # past the heartbeat interval: the tick falls due
    assert calls == [False, True, True]
    meta = sched.build_connector_meta(None)
    assert getattr(meta, "lease_heartbeats", None)  # still heartbeated while it waits
    sched._stop_heartbeat("d1")
    sched.build_connector_meta(None)
    sched.build_connector_meta(None)
    assert calls == [False, True, True, True, False]
