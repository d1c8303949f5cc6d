"""Vectorized paged attention in plain torch: the reference backend (CPU and GPU).

It gathers each sequence's context out of the paged cache through its block table into a padded
dense tensor and runs masked softmax attention on it. Simple and exact rather than fast: scores
are computed in float64 for float64 models (exact parity with the oracle) and in float32 otherwise.
"""
from __future__ import annotations

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, Hkv, bs, D] x [B, max_blocks] -> [B, Hkv, max_blocks * bs, D] (context order)."""
    blocks = cache[block_tables.long().clamp_min(0)]          # [B, M, Hkv, bs, D]; -1 entries masked later
    B, M, H, bs, D = blocks.shape
    return blocks.permute(0, 2, 1, 3, 4).reshape(B, H, M * bs, D)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
            scale: float) -> torch.Tensor:
    """q [B, Hkv, G, L, D], k/v [B, Hkv, N, D], mask [B, L, N] (True = may attend)."""
    cdt = _compute_dtype(q.dtype)
    scores = torch.einsum("bhgld,bhnd->bhgln", q.to(cdt), k.to(cdt)) * scale
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs)                           # padding query rows see no keys
    return torch.einsum("bhgln,bhnd->bhgld", probs, v.to(cdt))


class TorchBackend:
    name = "torch"

    def write_kv(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        slots = slot_mapping.long()
        valid = slots >= 0
        slots, key, value = slots[valid], key[valid], value[valid]
        block_size = key_cache.shape[2]
        blk, off = slots // block_size, slots % block_size
        # Advanced indices around a slice: the indexed view is [n, Hkv, D], matching key/value.
        key_cache[blk, :, off] = key.to(key_cache.dtype)
        value_cache[blk, :, off] = value.to(value_cache.dtype)

    def paged_decode(self, query, key_cache, value_cache, block_tables, seq_lens, scale):
        B, H, D = query.shape
        Hkv = key_cache.shape[1]
        k = gather_context(key_cache, block_tables)
        v = gather_context(value_cache, block_tables)
        n = torch.arange(k.shape[2], device=query.device)
        mask = (n[None, :] < seq_lens.long()[:, None])[:, None, :]           # [B, 1, N]
        q = query.view(B, Hkv, H // Hkv, 1, D)
        out = _attend(q, k, v, mask, scale)                                  # [B, Hkv, G, 1, D]
        return out.reshape(B, H, D).to(query.dtype)

    def paged_prefill(self, query, key_cache, value_cache, block_tables, seq_lens,
                      query_start_loc, max_query_len, scale):
        T, H, D = query.shape
        B = seq_lens.shape[0]
        Hkv = key_cache.shape[1]
        dev = query.device
        qsl = query_start_loc.long()
        qlens = qsl[1:] - qsl[:-1]
        # Scatter the packed queries into a padded [B, L] grid: token t -> (seq b, row i).
        seq_of = torch.repeat_interleave(torch.arange(B, device=dev), qlens, output_size=T)
        row_of = torch.arange(T, device=dev) - qsl[seq_of]
        L = max(int(max_query_len), 1)
        q = query.new_zeros(B, L, H, D)
        q[seq_of, row_of] = query
        q = q.view(B, L, Hkv, H // Hkv, D).permute(0, 2, 3, 1, 4)          # [B, Hkv, G, L, D]

        k = gather_context(key_cache, block_tables)
        v = gather_context(value_cache, block_tables)
        # Row i of sequence b sits at context position seq_len - qlen + i: causal over the context.
        q_pos = (seq_lens.long() - qlens)[:, None] + torch.arange(L, device=dev)[None, :]
        n = torch.arange(k.shape[2], device=dev)
        mask = (n[None, None, :] <= q_pos[:, :, None]) & (n[None, None, :] < seq_lens.long()[:, None, None])
        out = _attend(q, k, v, mask, scale)                                  # [B, Hkv, G, L, D]
        out = out.permute(0, 3, 1, 2, 4).reshape(B, L, H, D)
        return out[seq_of, row_of].to(query.dtype)
