"""`--dtype auto`: which dtype a worker computes in when the user does not say.

Decision: the checkpoint's own dtype (`torch_dtype`, or `dtype` as newer transformers write it, in
config.json) where the device computes it well, float32 where it does not:
  - CUDA: the checkpoint's dtype (bfloat16 for the released Qwen3 checkpoints; float32 stays
    float32; bfloat16 when config.json says nothing);
  - CPU: float32. A bfloat16 checkpoint computed in float32 keeps its weights as bfloat16
    (worker/cpu_gemm.py: packed panels, and AMX's layout where the CPU has AMX), so its GEMMs read
    2-byte weights and give the float32 product of the checkpoint's exact values; this worker's
    compiled attention kernels are float32/float64 only. Measured on a Xeon with AMX-BF16
    (Qwen3-0.6B shape, 2 threads): float32 90 tok/s decode-heavy, 34 prefill-heavy; bfloat16
    compute (oneDNN's AMX GEMMs, torch attention) 58 and 28. The cost: K/V in float32 takes twice
    the bytes per token. bfloat16 only for a bfloat16 checkpoint on a CPU with bfloat16
    instructions (AVX512_BF16 or AMX-BF16 in /proc/cpuinfo) when those kernels are not built
    (no compiler, MINIPAGED_CPU_KERNELS=0 or MINIPAGED_BF16_WEIGHTS=0). float64 stays an explicit
    parity mode.
An explicit `bfloat16` on a CPU with the compiled kernels and bfloat16 instructions is a mixed
mode (worker/model_runner.py `mixed_bf16`): oneDNN bfloat16 GEMMs, a bfloat16 K/V cache, float32
activations between them; auto does not pick it yet (README: not shown faster than float32 here).
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
                  cpuinfo: str = "/proc/cpuinfo", bf16_weight_kernels: bool | None = None) -> str:
    """A concrete dtype name for `requested` ("auto", None or a dtype name) on `device`
    (`bf16_weight_kernels`: whether worker/cpu_gemm.py runs here; None: ask it)."""
    if requested not in (None, "auto"):
        return requested
    ckpt = checkpoint_dtype(config)
    if device.startswith("cuda"):
        return ckpt if ckpt in ("bfloat16", "float16", "float32") else "bfloat16"
    if ckpt == "bfloat16" and cpu_has_bf16(cpuinfo):
        if bf16_weight_kernels is None:
            from worker import cpu_gemm
            bf16_weight_kernels = cpu_gemm.available()
        return "float32" if bf16_weight_kernels else "bfloat16"
    return "float32"
