"""D worker: a handshake that heartbeats start serves the READs after it.

vLLM 0.33's pull worker learns P's KV registration generation only from a
READ, so the first READ over a connection a heartbeat made saw a generation
newer than none, dropped the connection and handshook again (a second NIXL
``add_remote_agent`` per P engine, on the step the READs were due).  Our
heartbeat sender records the generation the group's requests named when it
starts the handshake; upstream's own check then keeps the connection, and a
READ naming a newer generation still makes it handshake again.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm_support import (
    fake_request,
    make_kv_cache_config,
    make_worker,
    remote_prefill_params,
    shared_vllm_config,
)

from vllm_nixl_lease.adapter.metadata import LEASE_HEARTBEATS_ATTR, EngineHeartbeats
from vllm_nixl_lease.adapter.schedulers import LeaseNixlPullConnectorScheduler
from vllm_nixl_lease.adapter.workers import LeaseNixlPullConnectorWorker


class PastTheGenerationCheck(Exception):
    """Upstream's READ went on to read over the connection it had."""


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory: pytest.TempPathFactory):
    from vllm.config import set_current_vllm_config

    vc = shared_vllm_config(
        tmp_path_factory.mktemp("hs"), {"kv_lease_duration": 12, "heartbeat_step_bytes": 1 << 20}
    )
    with set_current_vllm_config(vc):
        return LeaseNixlPullConnectorScheduler(vc, "d-engine", make_kv_cache_config())


def _worker() -> Any:
    w = make_worker(LeaseNixlPullConnectorWorker, 12)
    w.handshakes = []

    def handshake(host: str, port: int, tp: int, engine_id: str, *rest: Any) -> Any:
        w.handshakes.append(engine_id)
        return {(0, 0): f"{engine_id}-agent-{len(w.handshakes)}"}, 0.0

    w._nixl_handshake = handshake
    w.cleanups = []

    def cleanup(engine_id: str, **kwargs: Any) -> None:
        w.cleanups.append(engine_id)
        del w._remote_agents[engine_id]

    w._cleanup_remote_engine = cleanup
    # A stop just past upstream's generation check: the bidirectional expiry test.
    w._bidirectional_kv_xfer_enabled = True

    def past(meta: Any) -> bool:
        raise PastTheGenerationCheck

    w._is_turn2_read_expired = past
    return w


def _params(remote_id: str, generation: object) -> dict[str, Any]:
    return {**remote_prefill_params("P1", remote_id), "remote_registration_generation": generation}


def _heartbeat_handshake(worker: Any, groups: dict[str, EngineHeartbeats]) -> None:
    meta = type("Meta", (), {LEASE_HEARTBEATS_ATTR: groups})()
    worker.heartbeat_sender.send(meta)
    fut = worker._handshake_futures.get("P1")
    if fut is not None:
        fut.result(timeout=10)
        worker._handshake_initiation_executor.submit(lambda: None).result(timeout=10)  # its callback ran


def _read(worker: Any, req_id: str, generation: int) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker

    meta = NixlConnectorMetadata()
    meta.add_new_req_to_recv(
        req_id, ([1],), {**_params("p-" + req_id, generation), "remote_block_ids": ([7],)}
    )
    NixlPullConnectorWorker._read_blocks_for_req(worker, req_id, meta.reqs_to_recv[req_id])


def test_scheduler_ships_the_generation_the_first_request_named(scheduler) -> None:
    scheduler.on_new_request(fake_request("d1", **_params("p-1", 3)))
    scheduler.on_new_request(fake_request("d2", **_params("p-2", 4)))
    groups = getattr(scheduler.build_connector_meta(None), LEASE_HEARTBEATS_ATTR)
    assert [hb.registration_generation for hb in groups.values()] == [3]
    for local in ("d1", "d2"):
        scheduler._stop_heartbeat(local)


def _upstream_checks_generations() -> bool:
    """vLLM 0.33's pull worker does; 0.32's has no generations (nothing to keep)."""
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker

    return "_remote_registration_generations" in inspect.getsource(
        NixlPullConnectorWorker._read_blocks_for_req
    )


def test_first_read_after_a_heartbeat_handshake_keeps_the_connection() -> None:
    if not _upstream_checks_generations():
        pytest.skip("this vLLM's READ checks no registration generation")
    worker = _worker()
    _heartbeat_handshake(worker, {"g0": EngineHeartbeats("P1", [b"HB:p-1"], "127.0.0.1", 5600, 1, 1, 1, 2)})
    assert worker.handshakes == ["P1"] and "P1" in worker._remote_agents
    assert worker._remote_registration_generations == {"P1": 2}
    for generation in (1, 2):  # named by requests P handed out before the handshake
        with pytest.raises(PastTheGenerationCheck):
            _read(worker, f"d{generation}", generation)
    assert worker.cleanups == [] and worker.handshakes == ["P1"]
    # P registered its KV cache again after the handshake: upstream's rule still holds.
    _read(worker, "d3", 3)
    worker._handshake_futures["P1"].result(timeout=10)
    assert worker.cleanups == ["P1"] and worker._remote_registration_generations == {"P1": 3}
    assert worker.handshakes == ["P1", "P1"]


@pytest.mark.parametrize("generation", ["2", True, None, 2.0])
def test_a_generation_that_is_not_an_int_is_not_recorded(generation: object) -> None:
    worker = _worker()
    hb = EngineHeartbeats("P1", [b"HB:p-1"], "127.0.0.1", 5600, 1, registration_generation=generation)  # type: ignore[arg-type]
    _heartbeat_handshake(worker, {"g0": hb})
    assert worker.handshakes == ["P1"] and worker._remote_registration_generations == {}


def test_a_handshake_already_running_or_notif_only_records_nothing() -> None:
    """A handshake started earlier (by a READ) may have loaded an older
    registration than this group's requests name; a notification-only one
    loads none."""
    from concurrent.futures import Future

    worker = _worker()
    running: Future[Any] = Future()
    worker._handshake_futures["P1"] = running
    hb = EngineHeartbeats("P1", [b"HB:p-1"], "127.0.0.1", 5600, 1, registration_generation=5)
    worker.heartbeat_sender.send(type("Meta", (), {LEASE_HEARTBEATS_ATTR: {"g0": hb}})())
    assert worker._remote_registration_generations == {} and worker.heartbeat_sender.waiting
    del worker._handshake_futures["P1"]

    worker = _worker()
    worker._hb_handshake_notif_only = True
    hb = EngineHeartbeats("P1", [b"HB:p-1"], "127.0.0.1", 5600, 1, 1, 2, registration_generation=5)
    _heartbeat_handshake(worker, {"g0": hb})
    assert worker.handshakes == ["P1"] and worker._remote_registration_generations == {}
