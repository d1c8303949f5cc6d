"""One pipeline stage of Qwen3 over the paged K/V cache: embeddings, a range of decoder layers
(worker/layers.py, which also says how the numerics follow Hugging Face's), the final norm and
lm_head, and the loading of a checkpoint into them.

The q/k/v projections are one parameter (`qkv_proj`, rows q|k|v) and gate/up another
(`gate_up_proj`, rows gate|up). `load_weights` copies the checkpoint's separate tensors into their
rows, one tensor at a time, so checkpoints keep Hugging Face's names (`fuse_hf_weights` does the
same stacking on a whole state dict, for other callers).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from minipaged.config import ModelConfig
from worker import cpu_gemm, cpu_kernels
from worker.attention import AttentionBackend, get_backend
# StepBatch and the blocks are imported from here by the runner, tests and benchmarks.
from worker.layers import (MLP, Attention, DecoderLayer, Linear, RMSNorm,  # noqa: F401
                           RotaryEmbedding, StepBatch, apply_rope, rotate_half)
from worker.paged_cache import PagedKVCache, as_dtype

log = logging.getLogger("worker.model")

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


class Qwen3Stage(nn.Module):
    """Layers [layer_start, layer_end); embeddings on the first stage, final norm + lm_head on the
    last (which also holds the embedding matrix when the lm_head is tied to it). `matrix_dtype`:
    the matrices' and the embedding's storage dtype when it is not `dtype` (the bfloat16 mode)."""

    embed_packed: torch.Tensor | None = None   # a tied embedding read from the lm_head's panels
    bf16_io = False                            # the bfloat16 mode's layers (DecoderLayer.forward_bf16)

    def __init__(self, config: ModelConfig, layer_start: int, layer_end: int,
                 dtype: torch.dtype | str, device: torch.device | str,
                 backend: AttentionBackend | str = "torch", matrix_dtype: torch.dtype | None = None):
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
        self.to(self.dtype)
        if matrix_dtype is not None:   # the bfloat16 mode: matrices and embedding loaded as bfloat16,
            for m in self.modules():   # never a float32 copy of them (peak memory, load time)
                if isinstance(m, (Linear, nn.Embedding)):
                    m.to(matrix_dtype)
        self.to_empty(device=self.device)
        self.requires_grad_(False)       # inference only: lets inference-mode tensors mix freely
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope).to(self.device)
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

    def _target(self, name: str, params: dict) -> tuple[str, int, int] | None:
        """Checkpoint name -> (this module's parameter, first row inside it, rows it must have:
        -1 = the whole parameter), or None (not this stage's). A q/k/v or gate/up part lands in its
        rows of the fused parameter, so tensors can be copied in one at a time, never stacked into a
        second copy first."""
        for fused, parts in FUSED:
            for j, part in enumerate(parts):
                for suffix in ("weight", "bias"):
                    tail = f".{part}.{suffix}"
                    if not name.endswith(tail):
                        continue
                    local = self._local_name(name[:-len(tail)] + f".{fused}.{suffix}")
                    if local is None:
                        return None
                    sizes = self._fused_sizes(fused)
                    return local, sum(sizes[:j]), sizes[j]
        local = self._local_name(name)
        return None if local is None else (local, 0, -1)

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
        unexpected: list[str] = []          # no place for them here (transformers ignores them too: rotary inv_freq)
        items = state.items() if hasattr(state, "items") else state
        for name, tensor in items:
            target = self._target(name, params)
            if target is None:
                continue
            local, row, rows = target
            if local not in params:
                unexpected.append(name)
                continue
            p = params[local]
            whole = rows < 0
            want = p.shape if whole else (rows, *p.shape[1:])
            if tuple(tensor.shape) != tuple(want):       # each q/k/v or gate/up part its own rows
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, the config needs {tuple(want)}")
            (p if whole else p.narrow(0, row, rows)).copy_(tensor)
            rows_done[local] = rows_done.get(local, 0) + (tensor.shape[0] if tensor.dim() else 1)
        if unexpected:
            log.warning("ignored %d checkpoint tensor(s) this model has no place for (transformers ignores them "
                        "too): %s", len(unexpected), unexpected[:4])
        missing = sorted(n for n, p in params.items() if rows_done.get(n, 0) != (p.shape[0] if p.dim() else 1))
        if missing:
            parts = dict(FUSED)      # a fused parameter: name the checkpoint's tensors it is made of
            named = [next((f"{n} ({' / '.join(parts[f])})" for f in parts if f".{f}." in n), n) for n in missing]
            raise ValueError(f"weights missing for layers [{self.layer_start}, {self.layer_end}): {named[:8]}")

    def forward(self, batch: StepBatch, kv_cache: PagedKVCache,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_first:  # (bfloat16 rows widen exactly, into a fresh tensor)
            h = (self.embed_tokens(batch.input_ids) if self.embed_packed is None else
                 cpu_gemm.rows_of(self.embed_packed, batch.input_ids)).to(self.dtype)
        else:
            if hidden_states is None:
                raise ValueError(f"stage [{self.layer_start}, {self.layer_end}) needs hidden states")
            h = hidden_states.to(device=self.device, dtype=self.dtype)
            if self.bf16_io:    # the bfloat16 layers update h in place: never the caller's tensor
                h = h.clone(memory_format=torch.contiguous_format)
        cos, sin = self.rotary(batch.positions, self.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, batch, kv_cache.key_cache[i], kv_cache.value_cache[i])
        return self.norm(h) if self.is_last else h

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every tensor of weights this stage holds (parameters, each once, and packed copies)."""
        packed = [t for m in self.modules() if isinstance(m, Linear) for t in (m.packed, m.vnni, m.onednn)
                  if t is not None]
        return list(self.parameters()) + packed

    def use_onednn_weights(self) -> int:
        """The layers' matrices that still compute from a dense float32 weight go to oneDNN's
        blocked layout (Linear.pack_onednn); the lm_head stays (a tied one is the embedding).
        Returns how many."""
        return sum(m.pack_onednn() for m in self.layers.modules() if isinstance(m, Linear))

    @torch.no_grad()
    def use_onednn_bf16_weights(self) -> None:
        """The bfloat16 compute mode (worker/dtype_choice.py): every parameter rounded to its
        nearest bfloat16 value, whatever dtype the checkpoint came in; every matrix, the lm_head
        too, in oneDNN's bfloat16 layout (Linear.pack_onednn_bf16); the embedding a bfloat16
        table (its rows widen exactly), its own even when tied, since the lm_head's copy is opaque;
        the layers pass bfloat16 between their GEMMs (DecoderLayer.use_bf16_io), the residual stream
        and the lm_head's product float32."""
        for p in self.parameters():      # (matrices made with matrix_dtype=bfloat16 already are)
            if p.dtype != torch.bfloat16:
                p.copy_(p.to(torch.bfloat16))
        if self.embed_tokens is not None:
            self.embed_tokens.weight = nn.Parameter(self.embed_tokens.weight.to(torch.bfloat16), requires_grad=False)
        for m in self.modules():
            if isinstance(m, Linear):
                m.pack_onednn_bf16()
        if self.dtype == torch.float32 and self.device.type == "cpu" and cpu_kernels.load_library() is not None:
            for layer in self.layers:
                layer.use_bf16_io()
            self.bf16_io = True

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
        empty = nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
        amx = cpu_gemm.amx_available()
        every_batch = not amx and cpu_gemm.all_batches()
        for m in layers:
            m.packed, m.packed_rows = cpu_gemm.pack(m.weight), cpu_gemm.SMALL_BATCH_ROWS
            if amx:                      # large batches from AMX's copy: the float32 one goes
                m.vnni, m.weight = cpu_gemm.pack_vnni(m.weight), empty
            elif every_batch:            # the panels for every batch: the float32 one goes
                m.packed_rows, m.weight = cpu_gemm.EVERY_BATCH, empty
        tied = self.embed_tokens is not None and self.lm_head is not None and self.config.tie_word_embeddings
        if self.lm_head is not None:     # the panels only: its float32 copy is never read again
            self.lm_head.packed, self.lm_head.packed_rows = cpu_gemm.pack(self.lm_head.weight), cpu_gemm.EVERY_BATCH
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
