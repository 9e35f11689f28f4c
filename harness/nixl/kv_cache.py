"""vLLM configuration and KV caches for a harness engine (child side).

One tiny Llama layer; its KV cache is real CPU memory registered with NIXL.
Only imported inside engine processes: it imports vLLM.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from .spec import EngineSpec

BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32
LAYER = "model.layers.0.self_attn.attn"
HEAD_DIM = 32


def tiny_llama(kv_heads: int) -> dict[str, Any]:
    # Same shape as tests/adapter/vllm_support.TINY_LLAMA, with a settable KV head
    # count so heterogeneous TP has heads to split.
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": 1,
        "vocab_size": 256,
        "max_position_embeddings": 4096,
        "head_dim": HEAD_DIM,
        "torch_dtype": "float32",
    }


def model_dir(spec: EngineSpec) -> str:
    path = Path(spec.workdir) / f"tiny-llama-kv{spec.kv_heads}"
    path.mkdir(parents=True, exist_ok=True)
    cfg = path / "config.json"
    if not cfg.exists():
        tmp = path / f"config.json.{os.getpid()}"
        tmp.write_text(json.dumps(tiny_llama(spec.kv_heads)))
        tmp.replace(cfg)  # atomic: several engines may race here
    return str(path)


def vllm_config(spec: EngineSpec, engine_id: str) -> Any:
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig

    kv = KVTransferConfig(
        kv_connector="NixlPushConnector" if spec.push else "NixlConnector",
        kv_role="kv_producer" if spec.role == "P" else "kv_consumer",
        kv_buffer_device="cpu",
        engine_id=engine_id,
        kv_connector_extra_config={"kv_lease_duration": spec.lease, **spec.extra},
    )
    model = ModelConfig(model=model_dir(spec), skip_tokenizer_init=True, dtype="float32")
    cache = CacheConfig(block_size=BLOCK_SIZE)
    cache.kv_cache_layout = "LBHNC"  # normally resolved by the engine core
    parallel = ParallelConfig(tensor_parallel_size=spec.tp_size)
    config = VllmConfig(
        model_config=model, kv_transfer_config=kv, cache_config=cache, parallel_config=parallel
    )
    if spec.tp_size == 1:
        # Rank 0 takes the scheduler's metadata in-process, as vLLM's uniprocess
        # executor does on a GPU (the CPU platform turns "uni" into "mp").
        config.parallel_config.distributed_executor_backend = "uni"
    return config


def kv_cache_config(spec: EngineSpec) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    heads = max(1, spec.kv_heads // spec.tp_size)
    kv_spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=heads, head_size=HEAD_DIM, dtype=torch.float32
    )
    page = kv_spec.page_size_bytes
    tensor = KVCacheTensor(
        size=page * spec.num_blocks, layers=[LAYER], layer_stride=page * spec.num_blocks, block_stride=page
    )
    return KVCacheConfig(
        num_blocks=spec.num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec([LAYER], kv_spec)],
    )


def allocate(kv_config: Any) -> dict[str, torch.Tensor]:
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    return allocate_kv_cache(kv_config, torch.device("cpu"), KVCacheLayout.LBHNC)


def fill_blocks(cache: torch.Tensor, blocks: list[int], seed: str) -> None:
    """Write request-specific data into ``blocks`` (what a prefill would write)."""
    gen = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "little"))
    for b in blocks:
        cache[b].copy_(torch.randn(cache[b].shape, generator=gen))


def digest_heads(cache: torch.Tensor, blocks: list[int], sampled: bool = False) -> list[str]:
    """sha256 per KV head over ``blocks`` (layout [B, H, N, C]): comparable
    between a TP-sharded P rank and an unsharded D.  ``sampled``: only each
    block's first and last token rows (a block P reused for another request
    is rewritten whole, so this still tells): thousands of reads completing
    in one step would otherwise spend a second hashing."""
    picked = cache.numpy()[blocks]  # one gather (a copy): no per-block torch calls
    if sampled:
        picked = picked[:, :, [0, -1]]
    return [hashlib.sha256(picked[:, h].tobytes()).hexdigest() for h in range(picked.shape[1])]
