"""bfloat16 weights, float32 compute on the CPU (worker/cpu_gemm.cpp, worker/cpu_gemm_amx.cpp).

A released Qwen3 checkpoint is bfloat16; on a CPU the worker computes in float32
(worker/dtype_choice.py), which would store every weight in 4 bytes. A decode step reads all of
them for a few rows, so its time is the weights' bytes: the lm_head alone is 622 MB in float32 at
the Qwen3-0.6B shape. The kernels here read the same exact values from 2 bytes each, so the result
is the float32 product of the checkpoint's own numbers (to float32 rounding of a different
summation order than oneDNN's, ~1e-6 relative), from half the bytes:
  - pack() + linear(): panels of 16 columns, each weight widened in a register (AVX2 or AVX-512
    FMA tiles);
  - pack_vnni() + linear(vnni=...): AMX's pair-interleaved layout, x split exactly into three
    bfloat16 parts so that AMX's bfloat16 products, summed in float32, are the float32 product.

Policy (Qwen3Stage.use_bf16_weights):
  - every matrix of a layer gains a panel copy for batches of at most SMALL_BATCH_ROWS rows (decode
    steps), where it is 1.1-2.6x faster than oneDNN's float32 GEMM (bench/results/profile-*.md,
    probes-fifth-round-2026-12-07.md);
  - with AMX (amx_available()) it also gains the AMX copy, which batches of AMX_MIN_ROWS or more
    take, and loses its float32 copy;
  - without AMX but with AVX-512 (all_batches()) every batch takes the panels and the float32 copy
    goes: the panels match or beat oneDNN's blocked GEMM at every size there;
  - on AVX2 it keeps its float32 copy for large batches (prefill chunks, where oneDNN's blocked
    GEMM is ~15% faster than the panels);
  - the lm_head keeps only its panels: its input is one row per sampling sequence, a small batch,
    and dropping its float32 copy pays for half the layers' second copy in memory; a tied embedding
    on the same stage reads its rows from those panels (rows_of), another stage's embedding is kept
    as a bfloat16 table;
  - only when the checkpoint's values are exactly bfloat16 (a bfloat16 checkpoint computed in
    float32) and the CPU has AVX2 + FMA; MINIPAGED_BF16_WEIGHTS=0 switches it all off,
    MINIPAGED_AMX=0 the AMX part. float64 (the parity mode) never uses it.
"""
from __future__ import annotations

import os

import torch

from worker.cpu_kernels import load_library

PANEL = 16                  # output columns per packed panel (the kernel's register tile width)
# At most this many rows: the packed kernel; more: oneDNN's float32 GEMM. On the AVX2 Zen 3 (2 threads,
# bench/cpu_gemm.py at the 0.6B shape, streamed) the panels beat oneDNN by 1.12-1.34x from 64 to 128
# rows and by 1.0-1.29x to 256, where 48 had left a 64-row decode step on oneDNN at ~60% of FMA peak;
# prefill chunks beyond it keep oneDNN (~15% faster there on the AVX2 machine the 48 came from).
def _env_rows(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if not text.isdigit():
        raise ValueError(f"{name} must be a whole number of rows, got {text!r}")
    return int(text)


SMALL_BATCH_ROWS = _env_rows("MINIPAGED_PANEL_ROWS", 256)   # (the variable: to compare)
EVERY_BATCH = 1 << 62       # packed_rows of a matrix with no float32 copy: every batch takes the panels
AMX_MIN_ROWS = 8            # with AMX (pack_vnni) from this many rows on: the AMX kernel


def available() -> bool:
    """The kernel is built for this CPU (AVX2 + FMA) and not switched off."""
    if os.environ.get("MINIPAGED_BF16_WEIGHTS", "1") == "0":
        return False
    lib = load_library()
    return lib is not None and bool(lib.minipaged_bf16w_available())


def all_batches() -> bool:
    """The panels are the fastest float32 GEMM here at every batch size, so a layer needs no float32
    copy: the AVX-512 tiles (16 x 1024 x 6144 to 1024 rows on this project's AVX-512 EPYC, 2
    threads: 0-5% faster than oneDNN's prepacked float32 GEMM from 256 rows, 3-20% at 48-128,
    1.5x at 16). On AVX2 oneDNN stays ~15% faster for prefill chunks."""
    return available() and bool(load_library().minipaged_bf16w_all_batches())


def amx_available() -> bool:
    """Large batches can take the AMX kernel (worker/cpu_gemm_amx.cpp): built for this CPU, the
    kernel granted AMX state, and not switched off (MINIPAGED_AMX=0)."""
    if os.environ.get("MINIPAGED_AMX", "1") == "0" or not available():
        return False
    return bool(load_library().minipaged_amx_available())


def exactly_bf16(weight: torch.Tensor) -> bool:
    """Is every value of this float32 tensor a bfloat16 value? (Checked in slices: no full copy.)"""
    flat = weight.detach().reshape(-1)
    step = 1 << 22
    return all(torch.equal(flat[i:i + step], flat[i:i + step].bfloat16().float())
               for i in range(0, flat.numel(), step))


def _padded_slices(weight: torch.Tensor, panels: int, kp: int):
    """(p0, p1, rows): panels [p0, p1) of the [N, K] weight as bfloat16 [16 (p1 - p0), kp], zero
    padded; a slice at a time, so no second full-size temporary."""
    n, k = weight.shape
    for p0 in range(0, panels, 256):
        p1 = min(panels, p0 + 256)
        rows = weight.detach()[p0 * PANEL:p1 * PANEL].to(torch.bfloat16)
        if rows.shape != ((p1 - p0) * PANEL, kp):
            padded = torch.zeros((p1 - p0) * PANEL, kp, dtype=torch.bfloat16)
            padded[:rows.shape[0], :k] = rows
            rows = padded
        yield p0, p1, rows


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weight -> [ceil(N/16), K, 16] bfloat16 panels (zero rows pad N), as int16 bits."""
    n, k = weight.shape
    panels = (n + PANEL - 1) // PANEL
    out = torch.empty(panels, k, PANEL, dtype=torch.bfloat16)
    for p0, p1, rows in _padded_slices(weight, panels, k):
        out[p0:p1] = rows.view(p1 - p0, PANEL, k).transpose(1, 2)
    return out.view(torch.int16)


def pack_vnni(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weight -> AMX's pair-interleaved panels [P, Kp/2, 16, 2] bfloat16 bits (int16):
    vnni[p, k // 2, j, k % 2] = W[16 p + j, k]; Kp = K rounded up to 32, P = panels rounded up to
    even, the padding zeros."""
    n, k = weight.shape
    kp, panels = (k + 31) // 32 * 32, (n + 31) // 32 * 2
    out = torch.empty(panels, kp // 2, PANEL, 2, dtype=torch.bfloat16)
    for p0, p1, rows in _padded_slices(weight, panels, kp):
        out[p0:p1] = rows.view(p1 - p0, PANEL, kp // 2, 2).transpose(1, 2)
    return out.view(torch.int16)


def rows_of(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the [N, K] matrix that pack() packed, as bfloat16 [len(ids), K]: the embedding
    lookup of a tied lm_head, read from its panels (so no second copy of the table is kept)."""
    return packed.view(torch.bfloat16)[ids // PANEL, :, ids % PANEL]


def linear(x: torch.Tensor, packed: torch.Tensor | None, n: int, bias: torch.Tensor | None = None,
           vnni: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32 @ W^T (+ bias) -> [..., n] float32, W given as pack(W); with vnni
    (pack_vnni(W)), batches of at least AMX_MIN_ROWS rows (every batch, without packed) take the
    AMX kernel: 16 x 1024 x 6144 streamed from memory 1.3x, 128 rows 2.8x, 1024 rows 2.1x the
    packed kernel on this project's Xeon."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    y = torch.empty(m, n, dtype=torch.float32)
    if m and vnni is not None and (packed is None or m >= AMX_MIN_ROWS):
        if load_library().minipaged_linear_amx_f32(
                x2.data_ptr(), x2.stride(0), m, k, vnni.data_ptr(), n,
                bias.data_ptr() if bias is not None else None, y.data_ptr(), y.stride(0), torch.get_num_threads()):
            raise RuntimeError("AMX is not available to this process (vnni weights need amx_available())")
    elif m:
        load_library().minipaged_linear_bf16w_f32(
            x2.data_ptr(), x2.stride(0), m, k, packed.data_ptr(), n,
            bias.data_ptr() if bias is not None else None, y.data_ptr(), y.stride(0), torch.get_num_threads())
    return y.view(*shape[:-1], n)
