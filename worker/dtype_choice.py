"""`--dtype auto`: which dtype a worker computes in when the user does not say.

Decision: the checkpoint's own dtype (`torch_dtype`, or `dtype` as newer transformers write it, in
config.json) where the device computes it well, float32 where it does not:
  - CUDA: the checkpoint's dtype (bfloat16 for the released Qwen3 checkpoints; float32 stays
    float32; bfloat16 when config.json says nothing);
  - CPU: bfloat16 only for a bfloat16 checkpoint on a CPU with bfloat16 instructions
    (AVX512_BF16 or AMX-BF16 in /proc/cpuinfo); float32 everywhere else. Without those
    instructions every bfloat16 op converts to float32 and back, and this worker's compiled CPU
    kernels are float32/float64 only, so float32 is both faster and exact to the checkpoint's values
    (a bfloat16 value is exactly representable in float32). float64 stays an explicit parity mode.
"""
from __future__ import annotations

from minipaged.config import ModelConfig

_NAMES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "float": "float32",
          "float64": "float64", "half": "float16"}


def checkpoint_dtype(config: ModelConfig) -> str | None:
    """The dtype config.json declares (None for the embedded tiny model or when absent)."""
    raw = config.raw or {}
    value = raw.get("torch_dtype") or raw.get("dtype")
    return _NAMES.get(str(value).removeprefix("torch.")) if value else None


def cpu_has_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def resolve_dtype(requested: str | None, config: ModelConfig, device: str,
                  cpuinfo: str = "/proc/cpuinfo") -> str:
    """A concrete dtype name for `requested` ("auto", None or a dtype name) on `device`."""
    if requested not in (None, "auto"):
        return requested
    ckpt = checkpoint_dtype(config)
    if device.startswith("cuda"):
        return ckpt if ckpt in ("bfloat16", "float16", "float32") else "bfloat16"
    if ckpt == "bfloat16" and cpu_has_bf16(cpuinfo):
        return "bfloat16"
    return "float32"
