"""The blocks one Qwen3 decoder layer is made of: Linear, RMSNorm, RoPE, attention over the
paged K/V cache, the SwiGLU MLP, and the layer itself (worker/model.py stacks them into a stage).

Numerics follow Hugging Face `modeling_qwen3` op for op (the oracle, docs/architecture.md section 6): RMSNorm
casts to float32 exactly as HF does, RoPE's inv_freq/cos/sin are computed in float32 like HF and
then cast to the model dtype, and residual additions happen in the same order. Attention differs
in form: it reads K/V from the paged cache through the step's block tables.

Like vLLM, the q/k/v projections are one matrix (`qkv_proj`, rows q|k|v) and gate/up another
(`gate_up_proj`, rows gate|up): one GEMM instead of three and two, which matters most for decode
steps, where the GEMMs are small and their per-call cost shows. Each output element is still the
dot product of one weight row with the input.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minipaged.config import ModelConfig
from worker import cpu_gemm, cpu_kernels
from worker.attention import AttentionBackend
from worker.rope import inv_freq_and_scale


@dataclass
class StepBatch:
    """One engine step, as device tensors. T packed tokens of B sequences."""
    input_ids: torch.Tensor | None     # int64 [T] (first stage only)
    positions: torch.Tensor            # int64 [T]
    slot_mapping: torch.Tensor         # [T], -1 = padding
    query_start_loc: torch.Tensor      # int32 [B+1]
    seq_lens: torch.Tensor             # int32 [B], context length after this step
    block_tables: torch.Tensor         # int32 [B, max_blocks]
    max_query_len: int
    is_decode: bool                    # every sequence has exactly one query token

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


def _onednn_fp32_gemm() -> bool:
    """Can float32 GEMMs go to oneDNN? torch's F.linear calls MKL's sgemm, which on AMD CPUs runs
    its non-AVX-512 code: ~100 GFLOP/s per core here, where oneDNN (the GEMM torch's Inductor and
    vLLM's CPU backend use) does ~230. Checked once against F.linear; MINIPAGED_CPU_KERNELS=0
    keeps F.linear."""
    if os.environ.get("MINIPAGED_CPU_KERNELS", "1") == "0" or not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w = torch.randn(3, 8), torch.randn(5, 8)
        want = F.linear(x, w, torch.ones(5))
        got = torch.ops.mkldnn._linear_pointwise(x, w, torch.ones(5), "none", [], "")
        packed = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, 64),
                                                    torch.ones(5), "none", [], "")
        return all(torch.allclose(y, want, rtol=1e-5, atol=1e-5) for y in (got, packed))
    except (AttributeError, RuntimeError):
        return False


ONEDNN_FP32_GEMM = _onednn_fp32_gemm()


@functools.cache
def onednn_bf16_gemm() -> bool:
    """Can bfloat16 GEMMs go to oneDNN (the bfloat16 compute mode)? Only on a CPU with bfloat16
    instructions (AVX512_BF16 or AMX-BF16; elsewhere oneDNN would emulate them), checked once
    against F.linear on a small case."""
    from worker.dtype_choice import cpu_has_bf16
    if not (ONEDNN_FP32_GEMM and cpu_has_bf16()):
        return False
    try:
        x, w = torch.randn(3, 32).bfloat16(), torch.randn(40, 32).bfloat16()
        got = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, 64), None,
                                                 "none", [], "")
        return torch.allclose(got.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2)
    except (AttributeError, RuntimeError):
        return False


def cpu_bf16_mode() -> bool:
    """Does the CPU bfloat16 mode run here (worker/model_runner.py `mixed_bf16`): the compiled
    kernels built and oneDNN's bfloat16 GEMMs native?"""
    return cpu_kernels.load_library() is not None and onednn_bf16_gemm()


class Linear(nn.Linear):
    """nn.Linear whose float32 CPU GEMM is oneDNN's when available (see _onednn_fp32_gemm);
    float64 (the parity mode) and other devices use F.linear. With `packed` (worker/cpu_gemm.py:
    the same weights as bfloat16 panels), batches of at most `packed_rows` rows run the
    bfloat16-weight kernel instead; with `vnni` too (AMX), every batch runs from the bfloat16
    copies and the float32 weight is gone. In the bfloat16 mode (pack_onednn_bf16) the product
    is widened to float32 unless `bf16_out`: then it stays bfloat16 for a consumer that reads it
    as it is (DecoderLayer.forward_bf16)."""

    packed: torch.Tensor | None = None
    packed_rows: int = 0               # the most rows that take the packed path (all: a large number)
    vnni: torch.Tensor | None = None   # cpu_gemm.pack_vnni(weight): larger batches on AMX
    onednn: torch.Tensor | None = None  # pack_onednn(): the float32 weight in oneDNN's own layout
    bf16_out: bool = False             # the bfloat16 mode's layers: the product stays bfloat16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn is not None and self.onednn.dtype == torch.bfloat16:   # pack_onednn_bf16
            x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
            y = torch.ops.mkldnn._linear_pointwise(x2, self.onednn, None, "none", [], "")
            if self.bf16_out:
                if self.bias is not None:
                    y = y.float().add_(self.bias).to(torch.bfloat16)
                return y.view(*x.shape[:-1], self.out_features)
            out = torch.empty(y.shape, dtype=torch.float32).copy_(y)     # (copy_: ~4x .float() here)
            if self.bias is not None:
                out.add_(self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        if self.packed is not None and x.dtype == torch.float32 and (
                self.vnni is not None or x.numel() <= self.packed_rows * x.shape[-1]):
            return cpu_gemm.linear(x, self.packed, self.out_features, self.bias, self.vnni)
        if ONEDNN_FP32_GEMM and x.dtype == torch.float32 and x.device.type == "cpu":
            w = self.weight if self.onednn is None else self.onednn
            return torch.ops.mkldnn._linear_pointwise(x, w, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @torch.no_grad()
    def pack_onednn(self) -> bool:
        """Hand the float32 weight to oneDNN in its blocked layout, once, instead of oneDNN
        re-blocking it on every call (what vLLM's CPU backend and IPEX do): 5-25% per GEMM on this
        project's 2-core EPYC, decode to prefill sizes (bench/results/). The dense copy goes; the
        packed one has the same bytes. Returns whether it did."""
        w = self.weight
        if not (ONEDNN_FP32_GEMM and w.dtype == torch.float32 and w.device.type == "cpu" and w.numel()):
            return False
        self._to_onednn(w)
        return True

    def _to_onednn(self, w: torch.Tensor) -> None:
        """w (float32 or bfloat16) into oneDNN's blocked layout; the dense weight goes."""
        self.onednn = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), 64)
        self.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)

    @torch.no_grad()
    def pack_onednn_bf16(self) -> None:
        """The bfloat16 compute mode: the weight as bfloat16 in oneDNN's blocked layout, computed by
        its AMX / AVX512_BF16 kernels from x rounded to bfloat16, the product widened to float32
        (the bias, if any, added in float32). The float32 weight goes."""
        self._to_onednn(self.weight.to(torch.bfloat16))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def fused_ok(self, x: torch.Tensor) -> bool:
        """May the compiled add + RMSNorm pass take x? float32 rows [T, n], contiguous, on the CPU."""
        return x.dim() == 2 and x.is_contiguous() and self.weight.dtype == torch.float32 and cpu_kernels.fused_ok(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_ok(x):   # the same float32 steps in one pass instead of ~7 torch ops
            return cpu_kernels.add_rmsnorm(x, None, self.weight, self.eps)
        # Exactly HF's Qwen3RMSNorm: statistics in float32 (even for float64 models), cast back,
        # times the weight (the in-place steps work on fresh tensors and change no value).
        dtype = x.dtype
        x = x.to(torch.float32)
        rstd = x.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return (x * rstd).to(dtype).mul_(self.weight)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, rope: dict | None = None):
        super().__init__()
        # float32, the HF way (worker/rope.py): bit-equal inv_freq is what float64 parity needs.
        inv_freq, self.scale = inv_freq_and_scale(head_dim, theta, rope or {})
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)                          # [T, D]
        if self.scale != 1.0:             # YaRN's attention factor, in float32 as HF applies it
            return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D] at each token's own position."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (x * cos) + (rotate_half(x) * sin)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend):
        super().__init__()
        H, D, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads,
                                                            config.num_key_value_heads, D)
        self.scale = D ** -0.5
        self.qkv_sizes = [self.num_heads * D, self.num_kv_heads * D, self.num_kv_heads * D]
        self.qkv_proj = Linear(H, sum(self.qkv_sizes), bias=bias)   # rows: q | k | v
        self.o_proj = Linear(self.num_heads * D, H, bias=bias)
        self.q_norm = RMSNorm(D, config.rms_norm_eps)                   # QK-norm, per head, before RoPE
        self.k_norm = RMSNorm(D, config.rms_norm_eps)
        self.backend = backend

    def forward(self, x, cos, sin, batch: StepBatch, key_cache, value_cache):
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if (cpu_kernels.fused_ok(qkv) or self.qkv_proj.bf16_out) and self.head_dim <= 512:
            # same steps, one pass (float32 math, CPU; bfloat16 qkv in the bfloat16 mode: k comes
            # out bfloat16 for the cache, q float32 for the attention loops)
            q, k = cpu_kernels.qk_norm_rope(qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                                            self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin)
            if k.dtype != key_cache.dtype:
                k, v = k.to(key_cache.dtype), v.to(key_cache.dtype)
        else:
            q = self.q_norm(q.view(T, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(T, self.num_kv_heads, self.head_dim))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        self.backend.write_kv(k, v, key_cache, value_cache, batch.slot_mapping)
        if batch.is_decode:
            o = self.backend.paged_decode(q, key_cache, value_cache, batch.block_tables,
                                          batch.seq_lens, self.scale)
        else:
            o = self.backend.paged_prefill(q, key_cache, value_cache, batch.block_tables,
                                           batch.seq_lens, batch.query_start_loc,
                                           batch.max_query_len, self.scale)
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        H, self.inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = Linear(H, 2 * self.inter, bias=False)    # rows: gate | up
        self.down_proj = Linear(self.inter, H, bias=False)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if cpu_kernels.fused_ok(gate_up) or self.gate_up_proj.bf16_out:   # one pass (float32 math, CPU)
            return self.down_proj(cpu_kernels.silu_mul(gate_up, self.inter))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.self_attn = Attention(config, backend)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    bf16_io = False        # the bfloat16 mode (use_bf16_io): forward_bf16

    def forward(self, h, cos, sin, batch, key_cache, value_cache):
        if self.bf16_io:
            return self.forward_bf16(h, cos, sin, batch, key_cache, value_cache)
        # residual + sublayer(h), added into the sublayer's fresh output
        a = self.self_attn(self.input_layernorm(h), cos, sin, batch, key_cache, value_cache)
        norm = self.post_attention_layernorm
        if norm.fused_ok(a):   # a += h and its RMSNorm in one pass (float32, CPU)
            x = cpu_kernels.add_rmsnorm(a, h, norm.weight, norm.eps)
            h = a
        else:
            h = a.add_(h)
            x = norm(h)
        return self.mlp(x).add_(h)

    def use_bf16_io(self) -> None:
        """The bfloat16 mode (its matrices already in pack_onednn_bf16 form): the projections hand
        their bfloat16 products straight to the next step instead of widening them to float32."""
        for m in (self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj):
            m.bf16_out = True
        self.bf16_io = True

    def forward_bf16(self, h, cos, sin, batch, key_cache, value_cache):
        """The same layer with bfloat16 crossing every GEMM boundary, as vLLM's CPU backend and
        HF's bfloat16 model do, while the residual stream h stays float32 (updated in place: the
        stage hands each layer a tensor of its own). Each norm is one pass that also adds the
        sublayer's output into h and writes the next GEMM's bfloat16 input."""
        bf16 = torch.bfloat16
        x = cpu_kernels.add_rmsnorm(h, None, self.input_layernorm.weight, self.input_layernorm.eps, bf16)
        y = self.self_attn(x, cos, sin, batch, key_cache, value_cache)
        x = cpu_kernels.add_rmsnorm(h, y, self.post_attention_layernorm.weight,
                                    self.post_attention_layernorm.eps, bf16)
        return h.add_(self.mlp(x))
