"""Named real model shapes for the benches: random weights with the published Qwen3 config.json
values, made locally with transformers and saved once into a cache directory (no download).

    qwen3-0.6b  hidden 1024, 28 layers, 16 q / 8 kv heads, head_dim 128, intermediate 3072
    qwen3-1.7b  hidden 2048, 28 layers, 16 q / 8 kv heads, head_dim 128, intermediate 6144
    (both: vocab 151,936, tied embeddings, rope_theta 1e6, 40,960 positions, rms_norm_eps 1e-6)

They are saved as the real checkpoints ship: bfloat16 (`torch_dtype` in config.json), the 1.7B
shape in two safetensors shards with a `model.safetensors.index.json`, so the benches exercise the
same loading path as a downloaded Qwen3. Cache: $MINIPAGED_CACHE (default ~/.cache/minipaged).

    .venv/bin/python bench/shapes.py qwen3-0.6b      # prints the checkpoint directory
"""
from __future__ import annotations

import json
import os
import sys

_COMMON = dict(vocab_size=151936, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
               head_dim=128, tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=40960,
               rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False, bos_token_id=151643,
               eos_token_id=151645)
SHAPES = {
    "qwen3-0.6b": dict(_COMMON, hidden_size=1024, intermediate_size=3072),
    "qwen3-1.7b": dict(_COMMON, hidden_size=2048, intermediate_size=6144),
}
# Both repositories' generation_config.json: the servers' sampling defaults (minipaged/generation_defaults.py).
GENERATION_CONFIG = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                     "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                     "transformers_version": "4.51.0"}
# What the real repositories ship: 0.6B in one file, 1.7B in two shards.
_SHARD = {"qwen3-0.6b": "5GB", "qwen3-1.7b": "2GB"}


def cache_dir() -> str:
    return os.environ.get("MINIPAGED_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "minipaged")


def ensure_checkpoint(shape: str, directory: str | None = None, seed: int = 0) -> str:
    """The checkpoint directory of `shape`, written (random weights, bfloat16) if not there yet, with
    the real repository's generation_config.json (also into a directory cached before it had one)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    directory = directory or os.path.join(cache_dir(), f"{shape}-random-bf16-seed{seed}")
    if os.path.isfile(os.path.join(directory, "config.json")):
        _write_generation_config(directory)
        return directory
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**SHAPES[shape])
    model = Qwen3ForCausalLM._from_config(config, torch_dtype=torch.bfloat16)  # HF's own random init
    tmp = directory + ".partial"
    model.save_pretrained(tmp, max_shard_size=_SHARD[shape])
    _write_generation_config(tmp)
    os.replace(tmp, directory)  # complete or absent: an interrupted write is never taken as cached
    return directory


def _write_generation_config(directory: str) -> None:
    path = os.path.join(directory, "generation_config.json")
    try:
        with open(path) as f:
            if json.load(f) == GENERATION_CONFIG:
                return
    except (OSError, ValueError):
        pass
    with open(path + ".tmp", "w") as f:
        json.dump(GENERATION_CONFIG, f, indent=2)
    os.replace(path + ".tmp", path)


def resolve_model(name: str) -> str:
    """A named shape -> its cached checkpoint; anything else (tiny, a directory) unchanged."""
    return ensure_checkpoint(name) if name in SHAPES else name


if __name__ == "__main__":
    for name in sys.argv[1:] or list(SHAPES):
        print(ensure_checkpoint(name))
