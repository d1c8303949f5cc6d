"""The torch backend on a CPU device: the same torch code, with attention in compiled loops.

`TorchBackend` (worker/attention_torch.py) stays the pure-torch reference that the kernel tests
compare against. `CpuTorchBackend` is what `get_backend("torch", "cpu")` gives a worker: it inherits
everything, and its `paged_decode` / `paged_prefill` call the loops of worker/cpu_attn_decode.cpp / cpu_attn_prefill.cpp,
which read K/V straight from the cache through the block tables: decode reads each sequence's
blocks once instead of gathering them into a buffer for two batched matmuls (~3x per layer), and
prefill runs each tile of queries as a small register-blocked GEMM against the rows it may see,
instead of gather + SDPA (whose GEMMs are MKL's slow path on AMD CPUs). Without the library (no
compiler, or MINIPAGED_CPU_KERNELS=0) it is the pure-torch backend.
"""
from __future__ import annotations

import os

import torch

from worker.attention_torch import TorchBackend
from worker.cpu_kernels import load_library


def _i32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


class CpuTorchBackend(TorchBackend):
    """TorchBackend whose decode and prefill attention run the compiled loops when they can
    (float32/float64 CPU tensors), and the K/V write as one compiled copy; everything else is the
    torch code."""
    name = "torch"

    def __init__(self):
        super().__init__()
        self._lib = load_library()
        # The bfloat16 mode's prefill in bfloat16 products (cpu_attn_bf16.cpp) on AMX tiles, else
        # AVX512_BF16 pair dot products: it rounds q and the softmax weights to bfloat16 as a
        # bfloat16 model does, where the AVX-512 loop multiplies the cache's values in float32.
        # `bf16_prefill` is the engine (2 AMX, 1 pairs, 0 the loop); MINIPAGED_AMX=0 leaves AMX
        # out, MINIPAGED_BF16_PREFILL=0 keeps the loop.
        engines = self._lib.minipaged_bf16_prefill_engines() if self._lib is not None else 0
        if os.environ.get("MINIPAGED_AMX", "1") == "0":
            engines &= ~2
        if os.environ.get("MINIPAGED_BF16_PREFILL", "1") == "0":
            engines = 0
        self.bf16_prefill = 2 if engines & 2 else engines & 1

    @property
    def native(self) -> bool:
        return self._lib is not None

    def _kernel(self, kind: str, query, key_cache, value_cache):
        """The compiled entry point for these tensors, or None (then the torch code runs)."""
        suffix = _SUFFIX.get((query.dtype, key_cache.dtype))
        if self._lib is None or query.device.type != "cpu" or suffix is None or value_cache.dtype != key_cache.dtype:
            return None
        if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
            raise ValueError(f"paged_{kind}: the K/V caches must be contiguous")
        return getattr(self._lib, f"minipaged_paged_{kind}_{suffix}")

    def write_kv(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        """The compiled slot copy (cpu_fused.cpp minipaged_write_kv) for CPU caches, heads
        contiguous (float32 K/V for a bfloat16 cache rounded first); otherwise the torch code."""
        if key_cache.dtype == torch.bfloat16 and key.dtype == torch.float32:   # the bfloat16 compute mode
            key, value = key.to(torch.bfloat16), value.to(torch.bfloat16)
        num_blocks, Hkv, bs, D = key_cache.shape
        ok = (self._lib is not None and key.device.type == "cpu" and key.dtype == value.dtype == key_cache.dtype
              == value_cache.dtype and key_cache.is_contiguous() and value_cache.is_contiguous()
              and key.dim() == value.dim() == 3 and key.shape[1:] == value.shape[1:] == (Hkv, D)
              and key.stride()[1:] == value.stride()[1:] == (D, 1))
        if not ok:
            return super().write_kv(key, value, key_cache, value_cache, slot_mapping)
        slots = slot_mapping.to(torch.int64).contiguous()
        bad = self._lib.minipaged_write_kv(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                                           slots.data_ptr(), slots.numel(), key_cache.data_ptr(),
                                           value_cache.data_ptr(), num_blocks, Hkv, bs, D, key.element_size())
        if bad:
            raise IndexError(f"write_kv: token {bad - 1} has slot {int(slots[bad - 1])}, past the cache's "
                             f"{num_blocks * bs} slots")

    def paged_decode(self, query, key_cache, value_cache, block_tables, seq_lens, scale):
        fn = self._kernel("decode", query, key_cache, value_cache)
        if fn is None:
            q = query.to(key_cache.dtype)     # (float32 queries of a bfloat16 cache: torch in bfloat16)
            return super().paged_decode(q, key_cache, value_cache, block_tables, seq_lens, scale).to(query.dtype)
        B, H, D = query.shape
        num_blocks, Hkv, block_size, _ = key_cache.shape
        query, tables, lens = query.contiguous(), _i32(block_tables), _i32(seq_lens)
        out = torch.empty_like(query)
        bad = fn(query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), num_blocks,
                 tables.data_ptr(), tables.shape[1], lens.data_ptr(), B, H, Hkv, block_size, D,
                 float(scale), out.data_ptr(), torch.get_num_threads())
        if bad:
            b = bad - 1
            raise IndexError(f"paged_decode: sequence {b} (seq_len {int(lens[b])}) reads a block "
                             f"outside [0, {num_blocks}) or past its block table row of {tables.shape[1]}")
        return out

    def paged_prefill(self, query, key_cache, value_cache, block_tables, seq_lens,
                      query_start_loc, max_query_len, scale):
        fn = self._kernel("prefill", query, key_cache, value_cache)
        if fn is None or query.shape[-1] % (64 // query.element_size()):  # whole vectors of d
            fn = None
        if fn is None:
            return super().paged_prefill(query.to(key_cache.dtype), key_cache, value_cache, block_tables,
                                         seq_lens, query_start_loc, max_query_len, scale).to(query.dtype)
        qsl = query_start_loc.long()
        qlens = qsl[1:] - qsl[:-1]
        is_dec = qlens == 1
        if bool(is_dec.all()):
            return self.paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale)
        T, H, D = query.shape
        num_blocks, Hkv, block_size, _ = key_cache.shape
        query = query.contiguous()
        out = torch.empty_like(query)
        if bool(is_dec.any()):  # decode rows of a mixed step: the decode loop, at their offsets
            dec = is_dec.nonzero().squeeze(1)
            rows = qsl[dec]
            out[rows] = self.paged_decode(query[rows], key_cache, value_cache, block_tables[dec],
                                          seq_lens[dec], scale)
        pre = (~is_dec).nonzero().squeeze(1)
        tables, lens = _i32(block_tables[pre]), _i32(seq_lens[pre])
        starts, qls = _i32(qsl[:-1][pre]), _i32(qlens[pre])
        args = (query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), num_blocks,
                tables.data_ptr(), tables.shape[1], lens.data_ptr(), starts.data_ptr(), qls.data_ptr(),
                pre.numel(), T, H, Hkv, block_size, D, float(scale), out.data_ptr(), torch.get_num_threads())
        bad = -2
        if key_cache.dtype == torch.bfloat16 and self.bf16_prefill:   # -2: this head layout not there
            bad = self._lib.minipaged_paged_prefill_f32_bf16_rounded(self.bf16_prefill, *args)
        if bad == -2:
            bad = fn(*args)
        if bad:
            b = int(pre[bad - 1])
            raise IndexError(f"paged_prefill: sequence {b} (seq_len {int(seq_lens[b])}, query length "
                             f"{int(qlens[b])}) reads a block outside [0, {num_blocks}), past its block "
                             f"table row, or queries outside the {T} tokens")
        return out


# (query dtype, cache dtype) -> the kernels' suffix
_SUFFIX = {(torch.float32, torch.float32): "f32", (torch.float64, torch.float64): "f64",
           (torch.float32, torch.bfloat16): "f32_bf16"}
