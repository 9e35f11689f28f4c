"""Tiny random-weight Llama + locally trained byte-level BPE tokenizer, made offline and cached.

Run inside the serving virtualenv (`python -m harness.serve.assets DIR`) so that the saved config matches
the transformers version that `vllm serve` will read it with.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

# Bump when anything below changes: it names the cache directory.
ASSETS_VERSION = "1"

_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Prefill computes the prompt once and decode streams the answer token by token.",
    "A lease keeps the key value cache alive until the decoder has read it.",
    "Heartbeats renew the lease while the request waits in the decode queue.",
    "When the decoder dies the prefill server reclaims the blocks it was holding.",
    "Hello, how are you today? I am fine, thank you very much.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in text too.",
    "Once upon a time there was a small model with random weights.",
    "It could not speak well, but it always answered the same way twice.",
    "The router sends each request to prefill first and then to decode.",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}</s>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _train_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_SENTENCES * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return len(fast)


def _write_model(out: Path, vocab_size: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 32: the CPU attention backend supports 32, 64, 80, ...
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        # Larger than the 0.02 default so greedy argmax has clear margins: P and D compute the
        # same tokens even with different batch shapes.
        initializer_range=0.2,
        dtype="float32",
    )
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(out), safe_serialization=True)


def build(out: Path) -> Path:
    """Create the assets in `out` (idempotent: a finished directory holds `assets.json`)."""
    if (out / "assets.json").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    vocab = _train_tokenizer(tmp)
    _write_model(tmp, vocab)
    (tmp / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (tmp / "assets.json").write_text(json.dumps({"version": ASSETS_VERSION, "vocab_size": vocab}))
    if out.exists():  # another process won the race; keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(out)
    return out


def ensure_assets(python: str | os.PathLike[str], build_dir: Path) -> Path:
    """Build the assets with the serving interpreter `python` unless cached; return the model dir."""
    out = build_dir / f"pd-assets-v{ASSETS_VERSION}"
    if (out / "assets.json").exists():
        return out
    build_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(_repo_root()))
    subprocess.run([str(python), "-m", "harness.serve.assets", str(out)], check=True, env=env, timeout=300)
    return out


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    print(build(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
