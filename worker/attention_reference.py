"""The seed article's paged attention, spelled out: walk each sequence's block table block by
block and fold every key into an online softmax (running max m, running sum l, accumulator acc).

Slow on purpose (Python loops over sequences, heads and blocks): it is the second oracle that the
vectorized and CUDA backends are checked against, written to be read next to the article.
"""
from __future__ import annotations

import math

import torch


def _online_softmax_attention(q, key_cache, value_cache, table, context_len, kv_head, scale):
    """One query vector q [D] over the first context_len positions of one sequence."""
    block_size = key_cache.shape[2]
    m, l = -math.inf, 0.0
    acc = torch.zeros_like(q)
    for logical in range((context_len + block_size - 1) // block_size):
        physical = int(table[logical])
        n = min(block_size, context_len - logical * block_size)
        k = key_cache[physical, kv_head, :n].to(q.dtype)      # [n, D]
        v = value_cache[physical, kv_head, :n].to(q.dtype)
        s = (k @ q) * scale                                    # [n]
        m_new = max(m, float(s.max()))
        correction = math.exp(m - m_new)                       # rescale what was summed so far
        p = torch.exp(s - m_new)
        l = l * correction + float(p.sum())
        acc = acc * correction + p @ v
        m = m_new
    return acc / l


def _cdt(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def reference_paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale):
    B, H, D = query.shape
    group = H // key_cache.shape[1]
    out = torch.empty_like(query)
    for b in range(B):
        for h in range(H):
            out[b, h] = _online_softmax_attention(
                query[b, h].to(_cdt(query.dtype)), key_cache, value_cache, block_tables[b],
                int(seq_lens[b]), h // group, scale)
    return out


def reference_paged_prefill(query, key_cache, value_cache, block_tables, seq_lens,
                            query_start_loc, max_query_len, scale):
    T, H, D = query.shape
    group = H // key_cache.shape[1]
    out = torch.empty_like(query)
    for b in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        prefix = int(seq_lens[b]) - (end - start)
        for i, t in enumerate(range(start, end)):
            for h in range(H):
                # Causal: the token at context position prefix + i sees positions 0..prefix + i.
                out[t, h] = _online_softmax_attention(
                    query[t, h].to(_cdt(query.dtype)), key_cache, value_cache, block_tables[b],
                    prefix + i + 1, h // group, scale)
    return out
