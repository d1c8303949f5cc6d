"""Model configuration shared by both planes: the embedded `tiny` Qwen3 and local checkpoints.

Only what the planes need is read: the shapes, RoPE, norm eps, tying and the EOS ids. Weights are
the worker's business (worker/weights.py)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

# The embedded default: a small Qwen3 with a byte-level tokenizer (ids 0-255 are bytes).
TINY_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": 256,
    "eos_token_id": 256,
}
TINY_SEED = 20260101


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = "tiny"
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, cfg: dict, name: str) -> "ModelConfig":
        if cfg.get("model_type", "qwen3") != "qwen3":
            raise ValueError(f"{name}: model_type {cfg.get('model_type')!r} is not qwen3")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"{name}: rope type {rope_type!r} is not supported (only default RoPE)")
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            eos_token_ids=eos_ids,
            name=name,
            raw=cfg,
        )


def load_model_config(model: str) -> ModelConfig:
    """`tiny` or a local checkpoint directory holding config.json."""
    if model == "tiny":
        return ModelConfig.from_dict(TINY_CONFIG, "tiny")
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--model {model!r}: no config.json there (expected 'tiny' or a local "
                                f"Hugging Face Qwen3 checkpoint directory)")
    with open(path) as f:
        cfg = json.load(f)
    # generation_config.json may name more EOS ids (Qwen3 chat models do).
    gen_path = os.path.join(model, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            gen_eos = json.load(f).get("eos_token_id")
        if gen_eos is not None:
            cfg = dict(cfg, eos_token_id=sorted(set(([gen_eos] if isinstance(gen_eos, int) else gen_eos)
                                                    + ModelConfig.from_dict(cfg, model).eos_token_ids)))
    return ModelConfig.from_dict(cfg, model)
