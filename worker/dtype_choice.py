"""`--dtype auto`: which dtype a worker computes in when the user does not say.

Decision: the checkpoint's own dtype (`torch_dtype`, or `dtype` as newer transformers write it, in
config.json) where the device computes it well, float32 where it does not. That is what vLLM and
transformers (5.x loads a bfloat16 checkpoint as bfloat16) do by default:
  - CUDA: the checkpoint's dtype (bfloat16 for the released Qwen3 checkpoints; float32 stays
    float32; bfloat16 when config.json says nothing);
  - CPU: bfloat16 for a bfloat16 checkpoint on a CPU with bfloat16 instructions (AVX512_BF16 or
    AMX-BF16 in /proc/cpuinfo), as the mixed mode where the compiled kernels run
    (worker/model_runner.py `mixed_bf16`: oneDNN bfloat16 GEMMs, a bfloat16 K/V cache, float32
    activations between them). Measured faster than float32 on both such CPUs we had (Qwen3-0.6B
    shape, 2 threads): 1.5-1.9x on a Xeon with AMX, 1.4-1.6x on a Zen 5 EPYC, where it is
    1.10-1.14x vLLM's bfloat16 (bench/results/cpu-vs-vllm-zen5-bf16-2026-12-06.md). Where that mode
    cannot run, torch's plain bfloat16 only if the bfloat16-weight float32 kernels cannot either
    (float32 from packed bfloat16 weights beat torch's bfloat16 on the AMX Xeon: 90 vs 58 tok/s).
    Everything else computes in float32: float32 checkpoints, `tiny`, CPUs without bfloat16
    instructions (a bfloat16 checkpoint's weights then stay bfloat16, packed: worker/cpu_gemm.py).
  `--dtype float32` gives transformers' float32 tokens exactly on any checkpoint; float64 stays an
  explicit parity mode.
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
                  cpuinfo: str = "/proc/cpuinfo", bf16_modes: tuple[bool, bool] | None = None) -> str:
    """A concrete dtype name for `requested` ("auto", None or a dtype name) on `device`.
    `bf16_modes`: (the bfloat16 mode runs here, the bfloat16-weight float32 kernels run here);
    None: ask worker/layers.py and worker/cpu_gemm.py."""
    if requested not in (None, "auto"):
        return requested
    ckpt = checkpoint_dtype(config)
    if device.startswith("cuda"):
        return ckpt if ckpt in ("bfloat16", "float16", "float32") else "bfloat16"
    if ckpt == "bfloat16" and cpu_has_bf16(cpuinfo):
        if bf16_modes is None:
            from worker import cpu_gemm
            from worker.layers import cpu_bf16_mode
            bf16_modes = (cpu_bf16_mode(), cpu_gemm.available())
        mixed, packed_f32 = bf16_modes
        # torch's plain bfloat16 is slower than float32 from packed bfloat16 weights (58 vs 90 tok/s
        # decode-heavy on the AMX Xeon): it is auto's choice only where neither of those runs
        return "bfloat16" if mixed or not packed_f32 else "float32"
    return "float32"
