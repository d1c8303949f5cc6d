"""One pipeline stage of Qwen3 over the paged K/V cache.

Numerics follow Hugging Face `modeling_qwen3` op for op (the oracle, docs/architecture.md section 6): RMSNorm
casts to float32 exactly as HF does, RoPE's inv_freq/cos/sin are computed in float32 like HF and
then cast to the model dtype, and residual additions happen in the same order. Attention differs
in form: it reads K/V from the paged cache through the step's block tables.

Like vLLM, the q/k/v projections are one matrix (`qkv_proj`, rows q|k|v) and gate/up another
(`gate_up_proj`, rows gate|up): one GEMM instead of three and two, which matters most for decode
steps, where the GEMMs are small and their per-call cost shows. Each output element is still the
dot product of one weight row with the input. `load_weights` copies the checkpoint's separate
tensors into their rows, one tensor at a time, so checkpoints keep Hugging Face's names
(`fuse_hf_weights` does the same stacking on a whole state dict, for other callers).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minipaged.config import ModelConfig
from worker import cpu_gemm, cpu_kernels
from worker.attention import AttentionBackend, get_backend
from worker.paged_cache import PagedKVCache, as_dtype


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
        got = torch.ops.mkldnn._linear_pointwise(x, w, torch.ones(5), "none", [], "")
        return torch.allclose(got, F.linear(x, w, torch.ones(5)), rtol=1e-5, atol=1e-5)
    except (AttributeError, RuntimeError):
        return False


ONEDNN_FP32_GEMM = _onednn_fp32_gemm()


class Linear(nn.Linear):
    """nn.Linear whose float32 CPU GEMM is oneDNN's when available (see _onednn_fp32_gemm);
    float64 (the parity mode) and other devices use F.linear. With `packed` (worker/cpu_gemm.py:
    the same weights as bfloat16 panels), batches of at most `packed_rows` rows run the
    bfloat16-weight kernel instead."""

    packed: torch.Tensor | None = None
    packed_rows: int = 0               # the most rows that take the packed path (all: a large number)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dtype == torch.float32 and x.numel() <= self.packed_rows * x.shape[-1]:
            return cpu_gemm.linear(x, self.packed, self.out_features, self.bias)
        if ONEDNN_FP32_GEMM and x.dtype == torch.float32 and x.device.type == "cpu":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Exactly HF's Qwen3RMSNorm: statistics in float32 (even for float64 models), cast back,
        # times the weight (the in-place steps work on fresh tensors and change no value).
        dtype = x.dtype
        x = x.to(torch.float32)
        rstd = x.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return (x * rstd).to(dtype).mul_(self.weight)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        # float32, the HF way (its default-RoPE init): bit-equal inv_freq is what float64 parity needs.
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)                          # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D] at each token's own position."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (x * cos) + (rotate_half(x) * sin)


# Checkpoint tensors that this module stacks into one parameter: (fused name, parts in row order).
FUSED = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))


def fuse_hf_weights(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face names -> this module's: each complete q/k/v (gate/up) set under one prefix
    becomes one `qkv_proj` (`gate_up_proj`) tensor, rows concatenated in that order. Works for
    whole-model names (`model.layers.3.self_attn.q_proj.weight`) and for one module's."""
    out = dict(state_dict)
    for fused, parts in FUSED:
        for suffix in ("weight", "bias"):
            first = f"{parts[0]}.{suffix}"
            for name in state_dict:
                if name != first and not name.endswith("." + first):
                    continue
                prefix = name[:-len(first)]
                names = [f"{prefix}{part}.{suffix}" for part in parts]
                if all(n in state_dict for n in names):
                    out[f"{prefix}{fused}.{suffix}"] = torch.cat([state_dict[n] for n in names])
                    for n in names:
                        del out[n]
    return out


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
        if cpu_kernels.fused_ok(qkv) and self.head_dim <= 512:  # same steps, one pass (float32, CPU)
            q, k = cpu_kernels.qk_norm_rope(qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                                            self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin)
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
        if cpu_kernels.fused_ok(gate_up):                # same steps, one pass (float32, CPU)
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

    def forward(self, h, cos, sin, batch, key_cache, value_cache):
        # residual + sublayer(h), added into the sublayer's fresh output
        h = self.self_attn(self.input_layernorm(h), cos, sin, batch, key_cache, value_cache).add_(h)
        return self.mlp(self.post_attention_layernorm(h)).add_(h)


class Qwen3Stage(nn.Module):
    """Layers [layer_start, layer_end); embeddings on the first stage, final norm + lm_head on the
    last (which also holds the embedding matrix when the lm_head is tied to it)."""

    embed_packed: torch.Tensor | None = None   # a tied embedding read from the lm_head's panels

    def __init__(self, config: ModelConfig, layer_start: int, layer_end: int,
                 dtype: torch.dtype | str, device: torch.device | str,
                 backend: AttentionBackend | str = "torch"):
        super().__init__()
        if not 0 <= layer_start < layer_end <= config.num_hidden_layers:
            raise ValueError(f"layer range [{layer_start}, {layer_end}) is not inside "
                             f"[0, {config.num_hidden_layers}) or is empty")
        self.config, self.layer_start, self.layer_end = config, layer_start, layer_end
        self.is_first, self.is_last = layer_start == 0, layer_end == config.num_hidden_layers
        self.dtype, self.device = as_dtype(dtype), torch.device(device)
        self.backend = get_backend(backend, self.device) if isinstance(backend, str) else backend
        with torch.device("meta"):       # no random init: every parameter is loaded afterwards
            self.embed_tokens = (nn.Embedding(config.vocab_size, config.hidden_size)
                                 if self.is_first else None)
            self.layers = nn.ModuleList(DecoderLayer(config, self.backend)
                                        for _ in range(layer_end - layer_start))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.is_last else None
            self.lm_head = (Linear(config.hidden_size, config.vocab_size, bias=False)
                            if self.is_last else None)
        self.to(self.dtype).to_empty(device=self.device)
        self.requires_grad_(False)       # inference only: lets inference-mode tensors mix freely
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta).to(self.device)
        if self.is_first and self.is_last and config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def _local_name(self, name: str) -> str | None:
        """Checkpoint name (HF's, after fuse_hf_weights) -> this module's parameter name (None if
        not this stage's)."""
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            if not self.layer_start <= i < self.layer_end:
                return None
            return f"layers.{i - self.layer_start}." + name.split(".", 3)[3]
        if name == "model.embed_tokens.weight":
            if self.is_first:
                return "embed_tokens.weight"     # also the lm_head when one stage holds both, tied
            return "lm_head.weight" if self.is_last and self.config.tie_word_embeddings else None
        if name == "model.norm.weight":
            return "norm.weight" if self.is_last else None
        if name == "lm_head.weight":
            return None if self.config.tie_word_embeddings or not self.is_last else "lm_head.weight"
        return None

    def _target(self, name: str, params: dict) -> tuple[str, int] | None:
        """Checkpoint name -> (this module's parameter, first row inside it) or None. A q/k/v or
        gate/up part lands in its rows of the fused parameter, so tensors can be copied in one at
        a time, never stacked into a second copy first."""
        for fused, parts in FUSED:
            for j, part in enumerate(parts):
                for suffix in ("weight", "bias"):
                    tail = f".{part}.{suffix}"
                    if not name.endswith(tail):
                        continue
                    local = self._local_name(name[:-len(tail)] + f".{fused}.{suffix}")
                    if local is None or local not in params:
                        return None if local is None else (local, -1)
                    sizes = self._fused_sizes(fused)
                    return local, sum(sizes[:j])
        local = self._local_name(name)
        return None if local is None else (local, 0)

    def _fused_sizes(self, fused: str) -> list[int]:
        c = self.config
        if fused == "qkv_proj":
            return [c.num_attention_heads * c.head_dim] + [c.num_key_value_heads * c.head_dim] * 2
        return [c.intermediate_size] * 2

    @torch.no_grad()
    def load_weights(self, state) -> None:
        """Copy a checkpoint into the parameters (cast to the model dtype): `state` is a dict or
        an iterable of (Hugging Face name, tensor) pairs, consumed one tensor at a time."""
        params = dict(self.named_parameters())          # tied parameters are listed once
        rows_done: dict[str, int] = {}                   # parameter -> rows copied so far
        items = state.items() if hasattr(state, "items") else state
        for name, tensor in items:
            target = self._target(name, params)
            if target is None:
                continue
            local, row = target
            if row < 0 or local not in params:
                raise ValueError(f"{name}: no such parameter here (an incomplete q/k/v or gate/up set?)")
            p = params[local]
            dst = None
            if row == 0 and tensor.shape == p.shape:
                dst = p
            elif tensor.dim() and row + tensor.shape[0] <= p.shape[0]:
                dst = p.narrow(0, row, tensor.shape[0])
            if dst is None or dst.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not fit "
                                 f"model {tuple(p.shape)} at row {row}")
            dst.copy_(tensor)
            rows_done[local] = rows_done.get(local, 0) + (tensor.shape[0] if tensor.dim() else 1)
        missing = sorted(n for n, p in params.items() if rows_done.get(n, 0) != (p.shape[0] if p.dim() else 1))
        if missing:
            raise ValueError(f"weights missing for layers [{self.layer_start}, {self.layer_end}): {missing[:8]}")

    def forward(self, batch: StepBatch, kv_cache: PagedKVCache,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_first:  # (bfloat16 rows widen exactly)
            h = (self.embed_tokens(batch.input_ids) if self.embed_packed is None else
                 cpu_gemm.rows_of(self.embed_packed, batch.input_ids)).to(self.dtype)
        else:
            if hidden_states is None:
                raise ValueError(f"stage [{self.layer_start}, {self.layer_end}) needs hidden states")
            h = hidden_states.to(device=self.device, dtype=self.dtype)
        cos, sin = self.rotary(batch.positions, self.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, batch, kv_cache.key_cache[i], kv_cache.value_cache[i])
        return self.norm(h) if self.is_last else h

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every tensor of weights this stage holds (parameters, each once, and packed copies)."""
        packed = [m.packed for m in self.modules() if isinstance(m, Linear) and m.packed is not None]
        return list(self.parameters()) + packed

    @torch.no_grad()
    def use_bf16_weights(self) -> bool:
        """Give every matrix a packed bfloat16 copy for small batches, and keep the lm_head and
        the embedding in bfloat16 only (worker/cpu_gemm.py says when and why). Only for float32
        compute on the CPU, with the kernel built, and weights that are exactly bfloat16 values;
        returns whether it did."""
        if self.dtype != torch.float32 or self.device.type != "cpu" or not cpu_gemm.available():
            return False
        layers = [m for m in self.layers.modules() if isinstance(m, Linear)]
        tables = [m for m in (self.embed_tokens, self.lm_head) if m is not None]
        if not all(cpu_gemm.exactly_bf16(m.weight) for m in layers + tables):
            return False
        for m in layers:
            m.packed, m.packed_rows = cpu_gemm.pack(m.weight), cpu_gemm.SMALL_BATCH_ROWS
        empty = nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
        tied = self.embed_tokens is not None and self.lm_head is not None and self.config.tie_word_embeddings
        if self.lm_head is not None:     # the panels only: its float32 copy is never read again
            self.lm_head.packed, self.lm_head.packed_rows = cpu_gemm.pack(self.lm_head.weight), 1 << 62
            self.lm_head.weight = empty
        if tied:                         # the embedding's rows come from the same panels
            self.embed_packed, self.embed_tokens.weight = self.lm_head.packed, empty
        elif self.embed_tokens is not None:
            self.embed_tokens.weight = nn.Parameter(self.embed_tokens.weight.to(torch.bfloat16), requires_grad=False)
        return True

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """[S, hidden] -> [S, vocab], float32 (float64 for float64 models)."""
        logits = self.lm_head(hidden_rows.to(self.dtype))
        return logits.to(torch.float64 if self.dtype == torch.float64 else torch.float32)
