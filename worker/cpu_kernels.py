"""The CPU kernels library (worker/cpu_attn_decode.cpp, cpu_attn_prefill.cpp: the paged attention
loops, sharing cpu_attn_common.h; worker/cpu_fused.cpp: the fused elementwise steps of the Qwen3
block; worker/cpu_sampling.cpp: the sampler's passes over rows;
worker/cpu_attn_bf16.cpp: the bfloat16 mode's prefill attention in bfloat16 products, on AMX or
AVX512_BF16; worker/cpu_gemm.cpp, cpu_gemm_amx.cpp: the bfloat16-weight GEMMs of
worker/cpu_gemm.py), called through ctypes on torch tensors.

It is compiled on first use with the machine's C++ compiler (`g++ -O3 -march=native -fopenmp`,
about a second) into build/cpu_kernels/<hash>/, where the hash covers the source, the flags, the
compiler and the CPU's feature flags, so a copy of the repo moved to another machine rebuilds
instead of running illegal instructions. Concurrent builders write to a temporary name and rename
it into place. Without a compiler (or with MINIPAGED_CPU_KERNELS=0) `load_library()` is None and
every caller runs its torch code, after a single log line saying so.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
import threading

import numpy as np
import torch

from minipaged.paths import build_dir

log = logging.getLogger("worker.cpu_kernels")

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = [os.path.join(_HERE, name) for name in ("cpu_attn_decode.cpp", "cpu_attn_prefill.cpp", "cpu_attn_bf16.cpp",
                                                    "cpu_fused.cpp", "cpu_sampling.cpp", "cpu_gemm.cpp",
                                                    "cpu_gemm_amx.cpp")]
HEADERS = [os.path.join(_HERE, name) for name in ("cpu_math.h", "cpu_attn_common.h")]  # part of the build's hash
BUILD_DIR = os.environ.get("MINIPAGED_CPU_KERNEL_DIR", build_dir("cpu_kernels"))  # not site-packages
CXX = os.environ.get("CXX", "g++")
FLAGS = ["-x", "c++", "-std=c++17", "-O3", "-march=native", "-fopenmp", "-fno-trapping-math",
         "-fno-math-errno", "-fPIC", "-shared", "-Wall", "-Wextra"]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def library_path() -> str:
    h = hashlib.sha256()
    for source in SOURCES + HEADERS:
        with open(source, "rb") as f:
            h.update(f.read())
    version = subprocess.run([CXX, "--version"], capture_output=True, text=True).stdout
    for part in (" ".join(FLAGS), version, _cpu_flags()):
        h.update(part.encode())
    return os.path.join(BUILD_DIR, h.hexdigest()[:16], "libminipaged_cpu_kernels.so")


def build_library() -> str:
    """Compile the library unless this exact build exists; return its path. Raises on failure."""
    path = library_path()
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    cmd = [CXX, *FLAGS, *SOURCES, "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    os.replace(tmp, path)
    return path


def load_library() -> ctypes.CDLL | None:
    """The compiled library, or None when it is switched off or cannot be built (logged once)."""
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("MINIPAGED_CPU_KERNELS", "1") == "0":
            log.info("MINIPAGED_CPU_KERNELS=0: the CPU kernels are off, everything runs in torch")
            return None
        try:
            lib = ctypes.CDLL(build_library())
        except (OSError, RuntimeError) as e:
            log.warning("CPU kernels unavailable, everything runs in torch: %s", e)
            return None
        P, I = ctypes.c_void_p, ctypes.c_int
        for fn in (lib.minipaged_paged_decode_f32, lib.minipaged_paged_decode_f64,
                   lib.minipaged_paged_decode_f32_bf16):
            fn.argtypes = [P, P, P, I, P, I, P, I, I, I, I, I, ctypes.c_double, P, I]
            fn.restype = ctypes.c_int
        for fn in (lib.minipaged_paged_prefill_f32, lib.minipaged_paged_prefill_f64,
                   lib.minipaged_paged_prefill_f32_bf16):
            fn.argtypes = [P, P, P, I, P, I, P, P, P, I, I, I, I, I, I, ctypes.c_double, P, I]
            fn.restype = ctypes.c_int
        lib.minipaged_paged_prefill_f32_bf16_rounded.argtypes = [I, P, P, P, I, P, I, P, P, P, I, I, I, I, I, I,
                                                                 ctypes.c_double, P, I]
        lib.minipaged_paged_prefill_f32_bf16_rounded.restype = ctypes.c_int
        for fn in (lib.minipaged_qk_norm_rope_f32, lib.minipaged_qk_norm_rope_bf16):
            fn.argtypes = [P, I, I, I, I, I, P, P, ctypes.c_float, P, P, P, P, I]
        for fn in (lib.minipaged_silu_mul_f32, lib.minipaged_silu_mul_bf16):
            fn.argtypes = [P, I, I, I, P, I]
        for fn in (lib.minipaged_add_rmsnorm_bf16, lib.minipaged_add_rmsnorm_f32):
            fn.argtypes = [P, P, I, I, P, ctypes.c_float, P, I]
        lib.minipaged_row_weights_f32.argtypes = [P, I, I, P, P, I]
        lib.minipaged_pick_whole_f32.argtypes = [P, I, I, P, I, P, I]
        lib.minipaged_min_p_f32.argtypes = [P, I, I, P, I]
        lib.minipaged_head_stable_f32.argtypes = [P, I, I, I, P, P, I]
        lib.minipaged_nucleus_weights_f32.argtypes = [P, I, P, I, P, P, P, I]
        lib.minipaged_grammar_mask_f32.argtypes = [P, I, P, I, P, I, I]
        for fn in (lib.minipaged_linear_bf16w_f32, lib.minipaged_linear_amx_f32):
            fn.argtypes = [P, ctypes.c_int64, I, I, P, I, P, P, ctypes.c_int64, I]
        for fn in (lib.minipaged_qk_norm_rope_f32, lib.minipaged_qk_norm_rope_bf16, lib.minipaged_silu_mul_f32,
                   lib.minipaged_silu_mul_bf16, lib.minipaged_add_rmsnorm_bf16, lib.minipaged_add_rmsnorm_f32,
                   lib.minipaged_linear_bf16w_f32, lib.minipaged_row_weights_f32, lib.minipaged_pick_whole_f32,
                   lib.minipaged_min_p_f32, lib.minipaged_head_stable_f32, lib.minipaged_nucleus_weights_f32,
                   lib.minipaged_grammar_mask_f32):
            fn.restype = None
        for fn in (lib.minipaged_bf16w_available, lib.minipaged_bf16w_all_batches, lib.minipaged_amx_available,
                   lib.minipaged_linear_amx_f32, lib.minipaged_bf16_prefill_engines,
                   lib.minipaged_decode_rounds_q_bf16):
            fn.restype = I
        L = ctypes.c_int64
        lib.minipaged_write_kv.argtypes = [P, L, P, L, P, I, P, P, L, I, I, I, I]
        lib.minipaged_write_kv.restype = I
        _lib = lib
        return _lib


def fused_ok(x: torch.Tensor) -> bool:
    """May the fused elementwise kernels take this activation? float32 on the CPU, unit stride
    along the last dim, and the library built. (float64, the parity mode, keeps HF's exact ops; the
    bfloat16 mode's layers call the bfloat16 forms themselves.)"""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(-1) == 1
            and load_library() is not None)


def qk_norm_rope(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [T, (H + 2 Hkv) D] rows q|k|v -> q [T, H, D], k [T, Hkv, D]: per-head RMSNorm (QK-norm)
    then rotate-half RoPE at cos/sin [T, D] (float32), in one pass instead of ~22 torch ops. q is
    float32; k has qkv's dtype (bfloat16 qkv: the bfloat16 mode, whose cache is bfloat16)."""
    T = qkv.shape[0]
    q = torch.empty(T, num_heads, head_dim, dtype=torch.float32)
    k = torch.empty(T, num_kv_heads, head_dim, dtype=qkv.dtype)
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    lib = load_library()
    fn = lib.minipaged_qk_norm_rope_bf16 if qkv.dtype == torch.bfloat16 else lib.minipaged_qk_norm_rope_f32
    fn(qkv.data_ptr(), qkv.stride(0), T, num_heads, num_kv_heads, head_dim, q_weight.data_ptr(),
       k_weight.data_ptr(), eps, cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k.data_ptr(),
       torch.get_num_threads())
    return q, k


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """gate_up [T, 2I] rows gate|up -> silu(gate) * up [T, I], in one pass (float32 or bfloat16
    in and out, float32 math)."""
    T = gate_up.shape[0]
    out = torch.empty(T, inter, dtype=gate_up.dtype)
    lib = load_library()
    fn = lib.minipaged_silu_mul_bf16 if gate_up.dtype == torch.bfloat16 else lib.minipaged_silu_mul_f32
    fn(gate_up.data_ptr(), gate_up.stride(0), T, inter, out.data_ptr(), torch.get_num_threads())
    return out


def row_weights(x: torch.Tensor, temp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Sampling weights exp((x - row max) / T) of float32 rows x [R, V] (contiguous, on the CPU)
    into `out` (same shape), 0 below exp(-87.3); temp [R] (any float dtype, used as float32)."""
    R, V = x.shape
    t = temp.to(torch.float32).contiguous()
    load_library().minipaged_row_weights_f32(x.data_ptr(), R, V, t.data_ptr(), out.data_ptr(),
                                             torch.get_num_threads())
    return out


def head_stable(x: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first m (<= V) of each float32 row's stable descending order (value descending, ties to
    the lower id) of x [R, V] (contiguous, CPU): (values float32 [R, m], ids int64 [R, m])."""
    R, V = x.shape
    if not 1 <= m <= V:
        raise ValueError(f"head_stable: m = {m} must be in [1, {V}]")
    vals, ids = torch.empty(R, m, dtype=torch.float32), torch.empty(R, m, dtype=torch.int64)
    load_library().minipaged_head_stable_f32(x.data_ptr(), R, V, m, vals.data_ptr(), ids.data_ptr(),
                                             torch.get_num_threads())
    return vals, ids


def min_p_mask(x: torch.Tensor, drop: torch.Tensor) -> None:
    """In place on float32 rows x [R, V] (contiguous, CPU): -inf below each row's max + drop[r]."""
    R, V = x.shape
    d = drop.to(torch.float32).contiguous()
    load_library().minipaged_min_p_f32(x.data_ptr(), R, V, d.data_ptr(), torch.get_num_threads())


def nucleus_weights(x: torch.Tensor, rows: torch.Tensor, temp: torch.Tensor, p: torch.Tensor,
                    out: torch.Tensor) -> torch.Tensor:
    """Top-p alone (worker/sampler.py _nucleus_by_bins, compiled): for the float32 rows `rows` of
    x [R, V] (contiguous, CPU), their weights exp((x - max) / T) with every token outside the
    nucleus (mass p of the row's) set to 0, into `out` (float32 [n, V], contiguous), returned."""
    V = x.shape[1]
    idx = rows.to(torch.int64).contiguous()
    t = temp.to(torch.float32).contiguous()
    pp = p.to(torch.float64).contiguous()
    load_library().minipaged_nucleus_weights_f32(x.data_ptr(), V, idx.data_ptr(), idx.numel(), t.data_ptr(),
                                                 pp.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out


def grammar_mask(x: torch.Tensor, rows: np.ndarray, words: np.ndarray) -> None:
    """In place on float32 rows x [R, V] (contiguous, CPU): -inf in row rows[g] wherever the packed
    bitmask words[g] (int32 [G, ceil(V / 32)], bit j of word w = token 32 w + j) has a 0."""
    V = x.shape[1]
    idx = np.ascontiguousarray(rows, dtype=np.int64)
    w = np.ascontiguousarray(words, dtype=np.int32)
    load_library().minipaged_grammar_mask_f32(x.data_ptr(), V, idx.ctypes.data, idx.size, w.ctypes.data,
                                              w.shape[1], torch.get_num_threads())


def pick_whole(w: torch.Tensor, u: torch.Tensor, chunk: int) -> torch.Tensor:
    """Inverse CDF over float32 weight rows w [R, V] (contiguous, CPU) in id order at u [R]
    (float64): int64 [R] (worker/sampler.py _pick_whole)."""
    R, V = w.shape
    uu = u.to(torch.float64).contiguous()
    out = torch.empty(R, dtype=torch.int64)
    load_library().minipaged_pick_whole_f32(w.data_ptr(), R, V, uu.data_ptr(), chunk, out.data_ptr(),
                                            torch.get_num_threads())
    return out


def add_rmsnorm(h: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The residual step: h += y in place (h the float32 residual stream [T, n], contiguous; y a
    sublayer's output of `dtype`, or None), then RMSNorm(h) * weight as `dtype` [T, n], the next
    GEMM's input: float32 (the float32 layers) or bfloat16 (the bfloat16 mode)."""
    T, n = h.shape
    if not (h.dtype == torch.float32 and h.is_contiguous() and weight.dtype == torch.float32):
        raise ValueError("add_rmsnorm takes a contiguous float32 residual and float32 weight")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"add_rmsnorm writes float32 or bfloat16, not {dtype}")
    if y is not None:
        y = y.contiguous()
        if y.dtype != dtype or y.shape != h.shape:
            raise ValueError(f"add_rmsnorm: y must be {str(dtype).replace('torch.', '')} {tuple(h.shape)}")
    out = torch.empty(T, n, dtype=dtype)
    lib = load_library()
    fn = lib.minipaged_add_rmsnorm_bf16 if dtype == torch.bfloat16 else lib.minipaged_add_rmsnorm_f32
    fn(h.data_ptr(), None if y is None else y.data_ptr(), T, n, weight.data_ptr(), eps, out.data_ptr(),
       torch.get_num_threads())
    return out
