"""Weights: the embedded `tiny` model's deterministic random weights, and loading only the tensors
one pipeline stage needs from a local Hugging Face Qwen3 checkpoint.

Parameter names are Hugging Face's (`model.layers.3.self_attn.q_proj.weight`, ...) everywhere, so
`Qwen3ForCausalLM.load_state_dict(tiny_state_dict(cfg))` builds the very same model in transformers.
"""
from __future__ import annotations

import hashlib
import json
import os

import torch

from minipaged.config import TINY_SEED, ModelConfig

_LAYER_MATRICES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the whole model, in the (fixed) order tiny_state_dict draws them."""
    H, D = config.hidden_size, config.head_dim
    q, kv, inter = config.num_attention_heads * D, config.num_key_value_heads * D, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, H)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        dims = {"self_attn.q_proj": (q, H), "self_attn.k_proj": (kv, H), "self_attn.v_proj": (kv, H),
                "self_attn.o_proj": (H, q), "mlp.gate_proj": (inter, H), "mlp.up_proj": (inter, H),
                "mlp.down_proj": (H, inter)}
        for name in _LAYER_MATRICES:
            shapes[p + name + ".weight"] = dims[name]
            if config.attention_bias and name.startswith("self_attn"):
                shapes[p + name + ".bias"] = dims[name][:1]
        for norm in ("self_attn.q_norm", "self_attn.k_norm"):
            shapes[p + norm + ".weight"] = (D,)
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
    shapes["model.norm.weight"] = (H,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, H)
    return shapes


def tiny_state_dict(config: ModelConfig) -> dict[str, torch.Tensor]:
    """float32, on CPU, from torch.Generator().manual_seed(TINY_SEED) drawn in param_shapes order:
    N(0, 0.02) for matrices and embeddings, ones for norm weights, zeros for biases."""
    gen = torch.Generator().manual_seed(TINY_SEED)
    out = {}
    for name, shape in param_shapes(config).items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape)
        elif name.endswith(".bias"):
            out[name] = torch.zeros(shape)
        else:
            out[name] = torch.randn(shape, generator=gen) * 0.02
    return out


def stage_needs(name: str, config: ModelConfig, layer_start: int, layer_end: int) -> bool:
    """Is this checkpoint tensor used by the stage serving layers [layer_start, layer_end)?"""
    last = layer_end == config.num_hidden_layers
    if name.startswith("model.layers."):
        return layer_start <= int(name.split(".")[2]) < layer_end
    if name == "model.embed_tokens.weight":
        return layer_start == 0 or (last and config.tie_word_embeddings)
    if name in ("model.norm.weight", "lm_head.weight"):
        return last and not (name == "lm_head.weight" and config.tie_word_embeddings)
    return False


def _checkpoint_files(path: str) -> list[str]:
    """Weight files of a checkpoint directory: sharded or single safetensors, else pytorch .bin."""
    for index, single in (("model.safetensors.index.json", "model.safetensors"),
                          ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        if os.path.isfile(os.path.join(path, index)):
            with open(os.path.join(path, index)) as f:
                return sorted(set(json.load(f)["weight_map"].values()))
        if os.path.isfile(os.path.join(path, single)):
            return [single]
    raise FileNotFoundError(f"{path}: no model.safetensors(.index.json) or pytorch_model.bin(.index.json)")


def _read_tensors(path: str, want) -> dict[str, torch.Tensor]:
    """Read the tensors whose name satisfies want(name), opening each file lazily."""
    out = {}
    for fname in _checkpoint_files(path):
        full = os.path.join(path, fname)
        if fname.endswith(".safetensors"):
            from safetensors import safe_open
            with safe_open(full, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if want(name):
                        out[name] = f.get_tensor(name)
        else:
            # mmap: only the pages of the tensors we keep are read.
            sd = torch.load(full, map_location="cpu", weights_only=True, mmap=True)
            out.update({k: v for k, v in sd.items() if want(k)})
    return out


def load_state_dict(model: str, config: ModelConfig, layer_start: int,
                    layer_end: int) -> dict[str, torch.Tensor]:
    """The tensors of layers [layer_start, layer_end) (+ embeddings / final norm / lm_head as the
    stage's position needs), from "tiny" or a local checkpoint directory."""
    want = lambda name: stage_needs(name, config, layer_start, layer_end)  # noqa: E731
    if model == "tiny":
        return {k: v for k, v in tiny_state_dict(config).items() if want(k)}
    return _read_tensors(model, want)


def _probe_names(config: ModelConfig) -> list[str]:
    last = config.num_hidden_layers - 1
    names = ["model.embed_tokens.weight", f"model.layers.{last}.mlp.down_proj.weight",
             "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
    return names + ([] if config.tie_word_embeddings else ["lm_head.weight"])


def fingerprint(config: ModelConfig, state_dict: dict[str, torch.Tensor] | None = None) -> str:
    """Identity of (config, weights) that every stage of one model computes identically.

    Decision: the stage's own state_dict is NOT hashed (stages hold disjoint tensors). Instead every
    stage reads the same few probe tensors of the WHOLE model (the embedding, the first and last
    layer's matrices, the final norm, an untied lm_head) straight from the source: re-generated for
    "tiny", read lazily from the checkpoint files otherwise (safetensors reads just those tensors).
    Their float64 sums and sums of squares, plus the config's shape fields, go into a sha256.
    Different weights change these sums unless the checkpoints differ only outside the probes."""
    shape_fields = {k: getattr(config, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
        "attention_bias")}
    names = set(_probe_names(config))
    if config.name == "tiny":
        probes = {k: v for k, v in tiny_state_dict(config).items() if k in names}
    else:
        probes = _read_tensors(config.name, lambda n: n in names)
    h = hashlib.sha256(json.dumps(shape_fields, sort_keys=True).encode())
    for name in sorted(probes):
        t = probes[name].to(torch.float64)
        h.update(f"{name}:{tuple(t.shape)}:{t.sum().item():.12e}:{t.square().sum().item():.12e}".encode())
    return h.hexdigest()[:16]
