"""The smallest Llama config vLLM accepts, for connector tests and benchmarks
that build real vLLM configs without a model (nothing is loaded or run)."""

from __future__ import annotations

import json
from pathlib import Path

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 1,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "head_dim": 32,
    "torch_dtype": "float32",
}


def tiny_model_dir(path: Path) -> str:
    """A model directory at ``path`` holding only TINY_LLAMA's config.json."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(path)
