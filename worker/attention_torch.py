"""Paged attention in plain torch: the reference backend (CPU and GPU).

Decode works on the blocks themselves, without padding: every (sequence, block) pair of the batch
is one row, K/V blocks are gathered once with `index_select` in the cache's own [block, head, slot,
dim] layout (no permute copy), and the softmax is a segment softmax over each sequence's blocks.
So a step reads only the blocks its sequences use, not B x the longest context.

Prefill runs each sequence's chunk through `scaled_dot_product_attention` against its gathered
context: causal when the chunk is the whole context, else with a bottom-right causal mask (a
cached prefix precedes the chunk). Decode rows of a
mixed step take the decode path. Scores are float64 for float64 models (exact parity with the
oracle) and float32 otherwise."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def gather_context(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's context: [num_blocks, Hkv, bs, D] x block ids -> [Hkv, length, D]."""
    ctx = cache.index_select(0, blocks)                        # [n, Hkv, bs, D]
    n, H, bs, D = ctx.shape
    return ctx.permute(1, 0, 2, 3).reshape(H, n * bs, D)[:, :length]


class TorchBackend:
    name = "torch"

    def __init__(self):
        # Reused gather buffers: a fresh 20 MB tensor per layer per step costs more in page faults
        # (the allocator returns big blocks to the OS) than the copy itself.
        self._scratch: dict = {}

    def _buffer(self, name: str, shape, like: torch.Tensor) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < n or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._scratch[name] = torch.empty(max(n, 1), dtype=like.dtype, device=like.device)
        return buf[:n].view(shape)

    def _gather_blocks(self, name: str, cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        out = self._buffer(name, (blocks.numel(), *cache.shape[1:]), cache)
        return torch.index_select(cache, 0, blocks, out=out)

    def write_kv(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        slots = slot_mapping.long()
        if not bool((slots >= 0).all()):           # padding (-1) is skipped
            keep = slots >= 0
            slots, key, value = slots[keep], key[keep], value[keep]
        _, Hkv, bs, D = key_cache.shape
        # One copy per cache: seen as rows [num_blocks * Hkv * bs, D], token t's head h goes to
        # row (block * Hkv + h) * bs + offset.
        heads = torch.arange(Hkv, device=slots.device)
        rows = (((slots // bs) * Hkv)[:, None] + heads[None, :]) * bs + (slots % bs)[:, None]
        rows = rows.reshape(-1)
        key_cache.view(-1, D).index_copy_(0, rows, key.reshape(-1, D).to(key_cache.dtype))
        value_cache.view(-1, D).index_copy_(0, rows, value.reshape(-1, D).to(value_cache.dtype))

    def paged_decode(self, query, key_cache, value_cache, block_tables, seq_lens, scale):
        B, H, D = query.shape
        _, Hkv, bs, _ = key_cache.shape
        G = H // Hkv
        dev, cdt = query.device, _compute_dtype(query.dtype)
        lens = seq_lens.long()
        nblk = (lens + bs - 1) // bs                                            # blocks per sequence
        used = torch.arange(block_tables.shape[1], device=dev)[None, :] < nblk[:, None]
        blocks = block_tables.long()[used]                                      # [R] in sequence order
        seq_of = torch.repeat_interleave(torch.arange(B, device=dev), nblk, output_size=blocks.numel())
        k = self._gather_blocks("k", key_cache, blocks).to(cdt)                 # [R, Hkv, bs, D]
        v = self._gather_blocks("v", value_cache, blocks).to(cdt)
        q = query.to(cdt).view(B, Hkv, G, D).index_select(0, seq_of)            # [R, Hkv, G, D]
        s = torch.matmul(q, k.transpose(-1, -2)) * scale                        # [R, Hkv, G, bs]
        # mask the slots past the end of each sequence (the tail of its last block)
        first = torch.cumsum(nblk, 0) - nblk
        pos = (torch.arange(blocks.numel(), device=dev) - first[seq_of])[:, None] * bs \
            + torch.arange(bs, device=dev)[None, :]
        s = s.masked_fill(~(pos < lens[seq_of][:, None])[:, None, None, :], float("-inf"))
        # segment softmax over each sequence's blocks
        idx = seq_of[:, None, None].expand(-1, Hkv, G)
        mx = torch.full((B, Hkv, G), float("-inf"), dtype=cdt, device=dev)
        mx.scatter_reduce_(0, idx, s.amax(-1), reduce="amax")
        p = torch.exp(s - mx.index_select(0, seq_of)[..., None])
        den = torch.zeros(B, Hkv, G, dtype=cdt, device=dev).index_add_(0, seq_of, p.sum(-1))
        out = torch.zeros(B, Hkv, G, D, dtype=cdt, device=dev).index_add_(0, seq_of, torch.matmul(p, v))
        out = out / den.clamp_min(torch.finfo(cdt).tiny)[..., None]             # empty context -> 0
        return out.view(B, H, D).to(query.dtype)

    def paged_prefill(self, query, key_cache, value_cache, block_tables, seq_lens,
                      query_start_loc, max_query_len, scale):
        qsl = query_start_loc.long()
        qlens = qsl[1:] - qsl[:-1]
        is_dec = qlens == 1
        n_dec = int(is_dec.sum())
        if n_dec == qlens.numel():
            return self.paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale)
        out = torch.empty_like(query)
        if n_dec:  # decode rows of a mixed step: a decode's single token sits at its offset
            dec = is_dec.nonzero().squeeze(1)
            rows = qsl[dec]
            out[rows] = self.paged_decode(query[rows], key_cache, value_cache, block_tables[dec],
                                          seq_lens[dec], scale)
        bs, cdt = key_cache.shape[2], _compute_dtype(query.dtype)
        tables = block_tables.long()
        starts, lens = qsl.tolist(), seq_lens.tolist()
        # one SDPA per prefill chunk: a handful per step (the token budget bounds them), never per
        # token; 4-D inputs (3-D ones take SDPA's slower math path on the CPU), GQA without copies
        for b in (~is_dec).nonzero().squeeze(1).tolist():
            lo, hi, L = starts[b], starts[b + 1], lens[b]
            blocks = tables[b, :(L + bs - 1) // bs]
            k = gather_context(key_cache, blocks, L).to(cdt)[None]                 # [1, Hkv, L, D]
            v = gather_context(value_cache, blocks, L).to(cdt)[None]
            q = query[lo:hi].to(cdt).transpose(0, 1)[None]                         # [1, H, qlen, D]
            qlen = hi - lo
            if qlen == L:  # the chunk is the whole context: plain causal
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:  # after a cached prefix, bottom-right causal: query i sits at L - qlen + i
                mask = torch.ones(qlen, L, dtype=torch.bool, device=query.device).tril(L - qlen)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            out[lo:hi] = o[0].transpose(0, 1).to(query.dtype)
        return out
