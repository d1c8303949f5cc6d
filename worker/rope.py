"""RoPE's inverse frequencies and cos/sin scale for a Qwen3 config.json: the default, linear and
YaRN types, computed in float32 with transformers' own expressions (modeling_rope_utils), so that
float64 parity with transformers holds for each of them.

YaRN is how Qwen3 serves past its native context: its model card adds `"rope_scaling": {"rope_type":
"yarn", "factor": 4.0, "original_max_position_embeddings": 32768}` to config.json for 131,072
tokens. Which types a config may name, and how long a context each allows, is
minipaged/config.py's (`ModelConfig.rope`, `max_context`)."""
from __future__ import annotations

import math

import torch


def inv_freq_and_scale(head_dim: int, theta: float, rope: dict) -> tuple[torch.Tensor, float]:
    """(inv_freq float32 [head_dim // 2], the factor cos and sin are multiplied by)."""
    kind = rope.get("rope_type", "default")
    if kind == "yarn":
        return _yarn(head_dim, theta, rope)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))
    if kind == "linear":
        inv_freq /= rope["factor"]
    return inv_freq, 1.0


def _yarn(dim: int, base: float, rope: dict) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): dimensions that rotate often keep their frequency, slow ones are
    interpolated by `factor`, a linear ramp between; cos and sin are scaled by the attention factor."""
    factor, original = rope["factor"], rope["original_max_position_embeddings"]
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(_mscale(factor, mscale) / _mscale(factor, mscale_all_dim))
        else:
            attention_factor = _mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001                     # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp                       # 1: the dimension keeps its own frequency
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
