"""Helpers for tests that use real vLLM classes on CPU (``conftest.py`` has
set VLLM_TARGET_DEVICE).  Workers are built by ``harness.upstream_fake``
(shared with the benchmarks), with a hand-driven ``time.perf_counter``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    HeartbeatInfo,
    NixlConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

from harness.fake_clock import Clock  # noqa: F401  (re-exported for the connector tests)
from harness.tiny_model import tiny_model_dir
from harness.upstream_fake import FakeNixlWrapper, make_upstream_worker  # noqa: F401
from vllm_nixl_lease._wire import default_lease_extension
from vllm_nixl_lease.adapter.config import LeaseConfig

# Stock classes, re-exported for the connector tests.
STOCK_PULL_WORKER = NixlPullConnectorWorker
STOCK_PUSH_WORKER = NixlPushConnectorWorker


def make_worker(cls: type, lease_duration: int = 30, extra: dict[str, Any] | None = None) -> Any:
    """A pull/push worker (stock or ours) with just the lease-path state (``harness.upstream_fake``),
    and our lease components when ``cls`` is ours."""
    w = make_upstream_worker(cls, default_lease_extension(lease_duration))
    if hasattr(cls, "_setup_lease"):
        w._setup_lease(LeaseConfig.from_extra_config({"kv_lease_duration": lease_duration, **(extra or {})}))
    return w


def p_step(worker: Any, meta: NixlConnectorMetadata | None = None) -> set[str]:
    """One engine step on P, as ``get_transfer_results`` orders the lease path:
    start_load_kv, then notifications, then the expiry sweep."""
    if meta is not None:
        worker.start_load_kv(meta)
    done = worker._get_new_notifs()
    worker._reap_expired_send_leases(done)
    return done


def p_idle(worker: Any, clock: Any, seconds: float, step_s: float = 1.0) -> set[str]:
    """P steps on with nothing new for ``seconds``, a step every ``step_s``; the
    requests finished meanwhile.  (A clock jump with no step in between is P's
    own stall, which ours treats apart: see lease_keeper.py.)"""
    done: set[str] = set()
    end = clock.now + seconds
    while clock.now < end - 1e-9:
        clock.advance(min(step_s, end - clock.now))
        done |= p_step(worker)
    return done


def p_meta(
    clock: Clock,
    in_batch: tuple[str, ...] = (),
    to_send: dict[str, float] | None = None,
    not_processed: tuple[str, ...] = (),
    scheduler_offset: float = 0.0,
) -> NixlConnectorMetadata:
    """Scheduler metadata; ``to_send`` holds lease durations, turned into
    deadlines on a scheduler clock ``scheduler_offset`` away from ours."""
    meta = NixlConnectorMetadata()
    meta.scheduler_clock = clock.now + scheduler_offset
    meta.reqs_in_batch = set(in_batch)
    meta.reqs_not_processed = set(not_processed)
    meta.reqs_to_send = {r: meta.scheduler_clock + d for r, d in (to_send or {}).items()}
    return meta


class WorkerMeta:
    """The metadata our D scheduler hands the pull worker: lease views, heartbeat
    messages, READs to start, and upstream's fields the worker reads."""

    def __init__(
        self, views: Any = None, heartbeats: dict | None = None, reqs_to_recv: dict | None = None
    ) -> None:
        self.lease_views = views
        self.lease_heartbeats = heartbeats or {}
        self.reqs_to_recv = reqs_to_recv or {}
        self.reqs_in_batch: set = set()
        self.reqs_not_processed: set = set()
        self.reqs_to_send: dict = {}
        self.scheduler_clock = 0.0
        self.heartbeat_by_engine: dict = {}


def hb_info(ids: set[str], host: str = "127.0.0.1", port: int = 5600, tp: int = 1) -> HeartbeatInfo:
    return HeartbeatInfo(req_ids=set(ids), host=host, port=port, tp_size=tp)


def make_vllm_config(model_dir: str, extra: dict[str, Any] | None = None, role: str = "kv_both") -> Any:
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig

    kv = KVTransferConfig(
        kv_connector="NixlConnector",
        kv_role=role,
        kv_buffer_device="cpu",
        kv_connector_extra_config=dict(extra or {}),
    )
    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32")
    return VllmConfig(model_config=model, kv_transfer_config=kv, cache_config=CacheConfig(block_size=32))


def make_kv_cache_config() -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=32, dtype=torch.float32)
    return KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )


_CONFIG_CACHE: dict[tuple, Any] = {}


def shared_vllm_config(tmp_root: Path, extra: dict[str, Any] | None = None, role: str = "kv_both") -> Any:
    """A VllmConfig per (extra, role), built once per process (it is slow)."""
    key = (json.dumps(extra or {}, sort_keys=True), role)
    if key not in _CONFIG_CACHE:
        model_dir = tiny_model_dir(tmp_root / "tiny-llama")
        _CONFIG_CACHE[key] = make_vllm_config(model_dir, extra, role)
    return _CONFIG_CACHE[key]


def fake_request(req_id: str, **params: Any) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(request_id=req_id, kv_transfer_params=dict(params) if params else None)


def remote_prefill_params(engine: str, remote_id: str, port: int = 5600, tp: int = 1) -> dict[str, Any]:
    return dict(
        do_remote_prefill=True,
        remote_engine_id=engine,
        remote_request_id=remote_id,
        remote_host="127.0.0.1",
        remote_port=port,
        tp_size=tp,
    )
