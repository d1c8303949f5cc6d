"""The vectorized torch backend against the seed's online-softmax loop (attention_reference), plain
dense causal attention, and one transformers Qwen3Attention layer."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.attention import AttentionBackend, get_backend
from worker.attention_reference import reference_paged_decode, reference_paged_prefill
from worker.attention_torch import TorchBackend

D = 16
DT = torch.float64


def paged_context(seq_lens, block_size, num_kv_heads, seed, extra_blocks=3, head_dim=D):
    """Random K/V for B sequences, scattered over shuffled physical blocks. Returns the caches,
    the block tables (-1 padded), and each sequence's dense K/V [Hkv, L, D]."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g)
    kc = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=g, dtype=DT)
    vc = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=g, dtype=DT)
    tables = torch.full((len(seq_lens), max(need)), -1, dtype=torch.int32)
    dense, start = [], 0
    for b, n in enumerate(seq_lens):
        tables[b, :need[b]] = perm[start:start + need[b]].to(torch.int32)
        start += need[b]
        blocks = kc[tables[b, :need[b]].long()], vc[tables[b, :need[b]].long()]
        dense.append(tuple(x.permute(1, 0, 2, 3).reshape(num_kv_heads, -1, D)[:, :n] for x in blocks))
    return kc, vc, tables, dense


def dense_causal(q, k, v, scale, prefix):
    """q [L, H, D] at context positions prefix.., k/v [Hkv, N, D]: plain softmax attention."""
    H, Hkv = q.shape[1], k.shape[0]
    k, v = k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0)
    s = torch.einsum("lhd,hnd->hln", q, k) * scale
    n = torch.arange(k.shape[1])
    s = s.masked_fill(n[None, None, :] > (prefix + torch.arange(q.shape[0]))[None, :, None], float("-inf"))
    return torch.einsum("hln,hnd->lhd", torch.softmax(s, -1), v)


def test_factory_and_protocol():
    backend = get_backend("torch", "cpu")
    assert isinstance(backend, TorchBackend) and isinstance(backend, AttentionBackend)
    assert backend.name == "torch"
    with pytest.raises(ValueError):
        get_backend("nope")


@pytest.mark.parametrize("block_size", [1, 7, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_decode_matches_reference(block_size, group):
    Hkv = 2
    seq_lens = [1, 9, 23, 16]
    kc, vc, tables, dense = paged_context(seq_lens, block_size, Hkv, seed=block_size * 10 + group)
    q = torch.randn(len(seq_lens), Hkv * group, D, dtype=DT)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    out = TorchBackend().paged_decode(q, kc, vc, tables, sl, 0.25)
    ref = reference_paged_decode(q, kc, vc, tables, sl, 0.25)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for b, n in enumerate(seq_lens):
        exp = dense_causal(q[b:b + 1], *dense[b], 0.25, n - 1)[0]
        torch.testing.assert_close(out[b], exp, rtol=0, atol=1e-12)


@pytest.mark.parametrize("block_size", [1, 7, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_prefill_with_cached_prefix_matches_reference(block_size, group):
    Hkv = 2
    seq_lens = [5, 1, 20, 13]
    qlens = [5, 1, 6, 13]            # sequence 2 has a cached prefix of 14 tokens
    kc, vc, tables, dense = paged_context(seq_lens, block_size, Hkv, seed=block_size + group)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(qlens)]), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), Hkv * group, D, dtype=DT)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    out = TorchBackend().paged_prefill(q, kc, vc, tables, sl, qsl, max(qlens), 0.3)
    ref = reference_paged_prefill(q, kc, vc, tables, sl, qsl, max(qlens), 0.3)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for b, (n, ql) in enumerate(zip(seq_lens, qlens)):
        rows = slice(int(qsl[b]), int(qsl[b + 1]))
        torch.testing.assert_close(out[rows], dense_causal(q[rows], *dense[b], 0.3, n - ql),
                                   rtol=0, atol=1e-12)


def test_prefill_of_one_token_each_equals_decode():
    kc, vc, tables, _ = paged_context([3, 17], 4, 2, seed=7)
    q = torch.randn(2, 4, D, dtype=DT)
    sl = torch.tensor([3, 17], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    be = TorchBackend()
    torch.testing.assert_close(be.paged_prefill(q, kc, vc, tables, sl, qsl, 1, 0.5),
                               be.paged_decode(q, kc, vc, tables, sl, 0.5), rtol=0, atol=1e-14)


def write_backends():
    from worker.attention_cpu import CpuTorchBackend
    return [TorchBackend, CpuTorchBackend]     # the torch code and the compiled copy (when built)


@pytest.mark.parametrize("backend", write_backends())
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("block_size", [1, 7, 16])
def test_write_kv_scatters_and_skips_padding(block_size, slot_dtype, backend):
    num_blocks, Hkv = 6, 2
    g = torch.Generator().manual_seed(block_size)
    kc = torch.randn(num_blocks, Hkv, block_size, D, generator=g, dtype=DT)
    vc = torch.randn(num_blocks, Hkv, block_size, D, generator=g, dtype=DT)
    before_k, before_v = kc.clone(), vc.clone()
    chosen = torch.randperm(num_blocks * block_size, generator=g)[:5]
    slots = torch.cat([chosen[:2], torch.tensor([-1]), chosen[2:], torch.tensor([-1])]).to(slot_dtype)
    key = torch.randn(len(slots), Hkv, D, generator=g, dtype=DT)
    # value as the model passes it: a column slice of one [T, q|k|v] tensor (rows strided)
    value = torch.randn(len(slots), 3 * Hkv * D, generator=g, dtype=DT)[:, Hkv * D:2 * Hkv * D].view(-1, Hkv, D)
    backend().write_kv(key, value, kc, vc, slots)
    exp_k, exp_v = before_k.clone(), before_v.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            exp_k[s // block_size, :, s % block_size] = key[t]
            exp_v[s // block_size, :, s % block_size] = value[t]
    assert torch.equal(kc, exp_k) and torch.equal(vc, exp_v)


@pytest.mark.parametrize("backend", write_backends())
def test_write_kv_only_padding_changes_nothing(backend):
    kc, vc = torch.randn(3, 1, 4, D, dtype=DT), torch.randn(3, 1, 4, D, dtype=DT)
    k0, v0 = kc.clone(), vc.clone()
    backend().write_kv(torch.ones(2, 1, D, dtype=DT), torch.ones(2, 1, D, dtype=DT), kc, vc,
                            torch.tensor([-1, -1], dtype=torch.int32))
    assert torch.equal(kc, k0) and torch.equal(vc, v0)


def test_native_write_kv_refuses_a_slot_past_the_cache():
    be = native_backend()
    kc, vc = torch.zeros(2, 1, 4, D, dtype=DT), torch.zeros(2, 1, 4, D, dtype=DT)
    with pytest.raises(IndexError, match="token 1 has slot 8"):
        be.write_kv(torch.ones(2, 1, D, dtype=DT), torch.ones(2, 1, D, dtype=DT), kc, vc, torch.tensor([0, 8]))


def test_float32_cache_matches_reference():
    kc, vc, tables, _ = paged_context([11, 4], 4, 1, seed=3)
    kc, vc = kc.float(), vc.float()
    q = torch.randn(2, 2, D)
    sl = torch.tensor([11, 4], dtype=torch.int32)
    out = TorchBackend().paged_decode(q, kc, vc, tables, sl, 0.25)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference_paged_decode(q, kc, vc, tables, sl, 0.25),
                               rtol=1e-5, atol=1e-6)


# ---- the seed's integration check: one transformers Qwen3Attention layer through the paged cache


@pytest.mark.parametrize("impl,atol", [("sdpa", 1e-12), ("eager", 1e-6)])
def test_one_qwen3_attention_layer_matches_transformers(impl, atol):
    """eager computes its softmax in float32 even for float64 models, hence its looser bound."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding

    from minipaged.config import ModelConfig
    from worker.model import Attention, RotaryEmbedding, StepBatch, fuse_hf_weights

    hf_cfg = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         intermediate_size=128, num_hidden_layers=1, vocab_size=32,
                         attn_implementation=impl)
    torch.manual_seed(0)
    hf = Qwen3Attention(hf_cfg, layer_idx=0).to(DT).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * (0.1 if p.dim() > 1 else 1.0))
    ours = Attention(ModelConfig.from_dict(hf_cfg.to_dict(), "layer"), TorchBackend()).to(DT)
    ours.load_state_dict(fuse_hf_weights(hf.state_dict()))

    T, block_size = 13, 4
    x = torch.randn(1, T, 64, dtype=DT)
    pos = torch.arange(T)
    rope = Qwen3RotaryEmbedding(hf_cfg)
    mask = torch.full((T, T), torch.finfo(DT).min, dtype=DT).triu(1)[None, None]
    with torch.no_grad():
        expected, _ = hf(x, rope(x, pos[None]), mask)

    # Prefill the first 9 tokens, then decode the remaining 4 one by one, through shuffled blocks.
    table = torch.tensor([6, 1, 4, 0], dtype=torch.int32)
    kc, vc = torch.zeros(8, 2, block_size, 32, dtype=DT), torch.zeros(8, 2, block_size, 32, dtype=DT)
    slots = table[pos // block_size].long() * block_size + pos % block_size
    cos, sin = RotaryEmbedding(32, hf_cfg.rope_parameters["rope_theta"])(pos, DT)
    got = []
    with torch.no_grad():
        for lo, hi in [(0, 9), (9, 10), (10, 11), (11, 12), (12, 13)]:
            n = hi - lo
            batch = StepBatch(None, pos[lo:hi], slots[lo:hi], torch.tensor([0, n], dtype=torch.int32),
                              torch.tensor([hi], dtype=torch.int32), table[None], n, n == 1)
            got.append(ours(x[0, lo:hi], cos[lo:hi], sin[lo:hi], batch, kc, vc))
    torch.testing.assert_close(torch.cat(got), expected[0], rtol=0, atol=atol)


# ---- the paged cache container


def test_paged_cache_layout_copy_blocks_and_checksum():
    from worker.paged_cache import PagedKVCache, blocks_for_budget

    cache = PagedKVCache(2, 5, 2, 4, D, "float64", "cpu")
    assert len(cache.key_cache) == len(cache.value_cache) == 2
    assert cache.key_cache[1].shape == (5, 2, 4, D) and cache.value_cache[0].dtype == DT
    empty = cache.checksum()
    TorchBackend().write_kv(torch.ones(1, 2, D, dtype=DT), torch.ones(1, 2, D, dtype=DT),
                            cache.key_cache[1], cache.value_cache[1], torch.tensor([9]))
    written = cache.checksum()
    assert written != empty and written == cache.checksum()          # deterministic
    cache.copy_blocks([2], [4])                                        # slot 9 lives in block 2
    assert torch.equal(cache.key_cache[1][4], cache.key_cache[1][2])
    assert torch.equal(cache.value_cache[0][4], cache.value_cache[0][2])
    assert cache.checksum() != written
    moved = cache.checksum()
    with pytest.raises(IndexError):
        cache.copy_blocks(np.array([0], np.int32), np.array([5], np.int32))
    assert cache.checksum() == moved                                   # rejected: nothing changed
    # Moving the same data to another block changes the fingerprint too (block ids are weighted).
    a = PagedKVCache(1, 3, 1, 2, D, torch.float32)
    b = PagedKVCache(1, 3, 1, 2, D, torch.float32)
    a.key_cache[0][0] = 1.0
    b.key_cache[0][1] = 1.0
    assert a.checksum() != b.checksum()
    per_block = 2 * 2 * 2 * 4 * D * 8                                   # K+V, layers, heads, slots, dim, bytes
    assert blocks_for_budget(per_block * 7 + 5, 2, 2, 4, D, torch.float64) == 7
    assert blocks_for_budget(per_block * 7, 2, 2, 4, D, "float32") == 14
    assert cache.nbytes == 5 * per_block


# ---- the torch backend on a CPU device: decode through the compiled loop (worker/attention_cpu)


def native_backend():
    from worker.attention_cpu import CpuTorchBackend
    be = CpuTorchBackend()
    if not be.native:
        pytest.skip("no C++ compiler: the CPU decode library could not be built")
    return be


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-13), (torch.float32, 2e-6)])
@pytest.mark.parametrize("block_size", [1, 7, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [D, 64, 128])   # 64 and 128: the float32 vector forms
def test_native_decode_matches_torch_and_reference(block_size, group, dtype, atol, head_dim):
    Hkv = 2
    seq_lens = [1, 9, 0, 23, 16, 0]       # 2 and 5 have no context: zeros, like the torch path
    kc, vc, tables, _ = paged_context([max(n, 1) for n in seq_lens], block_size, Hkv, seed=block_size + 3 * group,
                                      head_dim=head_dim)
    kc, vc = kc.to(dtype), vc.to(dtype)
    q = torch.randn(len(seq_lens), Hkv * group, head_dim, dtype=dtype)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    out = native_backend().paged_decode(q, kc, vc, tables, sl, 0.25)
    atol *= max(1, head_dim // D)   # rounding grows with the dot products' length (any summation order)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out, TorchBackend().paged_decode(q, kc, vc, tables, sl, 0.25), rtol=0, atol=atol)
    has = sl > 0
    torch.testing.assert_close(out[has], reference_paged_decode(q[has], kc, vc, tables[has], sl[has], 0.25),
                               rtol=0, atol=atol)
    assert not out[~has].any()


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-13), (torch.float32, 2e-6)])
@pytest.mark.parametrize("block_size", [1, 7, 16])
@pytest.mark.parametrize("group", [1, 2, 4, 16])
@pytest.mark.parametrize("vectors", [1, 2, 3, 8])  # head dim in vectors: P.V takes 2 at a time
def test_native_prefill_matches_torch_and_reference(block_size, group, dtype, atol, vectors):
    Hkv = 1 if group == 16 else 2
    d = vectors * 64 // (8 if dtype == torch.float64 else 4)  # whole AVX-512 vectors (AVX2: twice as many)
    seq_lens = [5, 1, 40, 13, 30]
    qlens = [5, 1, 6, 13, 29]        # 2 and 4 have a cached prefix; 1 is a decode row (mixed step)
    g = torch.Generator().manual_seed(block_size * 7 + group)
    need = [-(-n // block_size) for n in seq_lens]
    kc = torch.randn(sum(need) + 2, Hkv, block_size, d, generator=g, dtype=dtype)
    vc = torch.randn(sum(need) + 2, Hkv, block_size, d, generator=g, dtype=dtype)
    perm = torch.randperm(kc.shape[0], generator=g)
    tables = torch.full((len(seq_lens), max(need)), -1, dtype=torch.int32)
    for b, start in enumerate(np.cumsum([0] + need[:-1])):
        tables[b, :need[b]] = perm[start:start + need[b]].to(torch.int32)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(qlens)]), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), Hkv * group, d, generator=g, dtype=dtype)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    out = native_backend().paged_prefill(q, kc, vc, tables, sl, qsl, max(qlens), 0.3)
    atol *= vectors                 # rounding grows with the dot products' length (any summation order)
    torch.testing.assert_close(out, TorchBackend().paged_prefill(q, kc, vc, tables, sl, qsl, max(qlens), 0.3),
                               rtol=0, atol=atol)
    torch.testing.assert_close(out, reference_paged_prefill(q, kc, vc, tables, sl, qsl, max(qlens), 0.3),
                               rtol=0, atol=atol)


def test_native_prefill_refuses_queries_outside_the_batch():
    kc, vc, tables, _ = paged_context([5, 9], 4, 1, seed=2)
    kc, vc = kc.float(), vc.float()
    q = torch.randn(14, 2, D)
    be = native_backend()
    qsl = torch.tensor([0, 5, 14], dtype=torch.int32)
    bad = tables.clone()
    bad[1, 2] = -1                                             # a hole inside the used part
    with pytest.raises(IndexError, match="sequence 1"):
        be.paged_prefill(q, kc, vc, bad, torch.tensor([5, 9], dtype=torch.int32), qsl, 9, 0.5)


def test_native_decode_refuses_blocks_outside_the_cache():
    kc, vc, tables, _ = paged_context([5, 9], 4, 1, seed=1)
    q = torch.randn(2, 2, D, dtype=DT)
    be = native_backend()
    bad = tables.clone()
    bad[1, 1] = kc.shape[0]                                    # one past the last block
    with pytest.raises(IndexError, match="sequence 1"):
        be.paged_decode(q, kc, vc, bad, torch.tensor([5, 9], dtype=torch.int32), 0.5)
    with pytest.raises(IndexError, match="sequence 0"):        # longer than its table row
        be.paged_decode(q, kc, vc, tables, torch.tensor([4 * tables.shape[1] + 1, 9], dtype=torch.int32), 0.5)


def test_native_decode_can_be_switched_off():
    import os
    import subprocess
    import sys
    code = ("from worker.attention import get_backend; from worker.attention_cpu import CpuTorchBackend; "
            "b = get_backend('torch', 'cpu'); assert isinstance(b, CpuTorchBackend); print(b.native)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root,
                         env={**os.environ, "MINIPAGED_CPU_KERNELS": "0"})
    assert out.stdout.strip() == "False"
