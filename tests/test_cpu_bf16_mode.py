"""The CPU's bfloat16 compute mode (`--dtype bfloat16` with the compiled kernels on a CPU with
bfloat16 instructions): oneDNN's bfloat16 GEMMs, a bfloat16 K/V cache, float32 activations between
them (worker/dtype_choice.py).

Its kernels are checked against the float32 ones on the same (widened) values, and the whole model
against the float64 transformers oracle within bfloat16's tolerance; pipeline stages must agree
with one stage exactly, since hidden states cross in float32."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.checkpoints import load_oracle, make_checkpoint
from tests.test_attention_torch import native_backend, paged_context
from tests.test_model_parity import Pager, random_prompts, rel_diff, run_steps, schedule
from worker.cpu_kernels import load_library
from worker.layers import onednn_bf16_gemm
from worker.model_runner import ModelRunner

needs_mode = pytest.mark.skipif(not (load_library() and onednn_bf16_gemm()),
                                reason="needs the compiled CPU kernels and a CPU with bfloat16 instructions")


def bf16_caches(num_blocks, Hkv, block_size, d, g):
    kc = torch.randn(num_blocks, Hkv, block_size, d, generator=g).bfloat16()
    vc = torch.randn(num_blocks, Hkv, block_size, d, generator=g).bfloat16()
    return kc, vc


@pytest.mark.parametrize("block_size", [1, 7, 16])
@pytest.mark.parametrize("head_dim", [16, 64, 128])    # 64 and 128: the vector forms
def test_decode_over_bfloat16_cache_equals_float32_kernel(block_size, head_dim):
    """The cache's values read exactly; with AVX512_BF16 (head dims 64, 128) the query is rounded
    to bfloat16 first, as the AMX prefill and a bfloat16 model do."""
    seq_lens = [1, 9, 23, 16]
    kc, vc, tables, _ = paged_context(seq_lens, block_size, 2, seed=block_size + head_dim, head_dim=head_dim)
    kc, vc = kc.bfloat16(), vc.bfloat16()
    q = torch.randn(4, 4, head_dim, generator=torch.Generator().manual_seed(head_dim))
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    be = native_backend()
    got = be.paged_decode(q, kc, vc, tables, sl, 0.25)
    if head_dim in (64, 128) and load_library().minipaged_decode_rounds_q_bf16():
        q = q.bfloat16().float()      # AVX512_BF16: q . k as bfloat16 pair products (exact in float32)
    want = be.paged_decode(q, kc.float(), vc.float(), tables, sl, 0.25)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def prefill_case(block_size, group, seed, seq_lens=(5, 1, 40, 30), qlens=(5, 1, 6, 29), head_dim=128):
    """A varlen prefill over shuffled bfloat16 blocks (by default a decode row and two cached
    prefixes): (q, kc, vc, tables, seq_lens, query_start_loc, max_query_len)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    kc, vc = bf16_caches(sum(need) + 2, 2, block_size, head_dim, g)
    perm = torch.randperm(kc.shape[0], generator=g)
    tables = torch.full((len(seq_lens), max(need)), -1, dtype=torch.int32)
    for b, start in enumerate(np.cumsum([0] + need[:-1])):
        tables[b, :need[b]] = perm[start:start + need[b]].to(torch.int32)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(qlens)]), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), 2 * group, head_dim, generator=g) * 2
    return q, kc, vc, tables, torch.tensor(seq_lens, dtype=torch.int32), qsl, max(qlens)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_over_bfloat16_cache_equals_float32_kernel(block_size, group):
    """The AVX-512 loop (MINIPAGED_BF16_PREFILL=0, or neither AMX nor AVX512_BF16) reads the cache's
    values exactly."""
    q, kc, vc, tables, sl, qsl, mq = prefill_case(block_size, group, block_size * 3 + group)
    be = native_backend()
    be.bf16_prefill = 0
    got = be.paged_prefill(q, kc, vc, tables, sl, qsl, mq, 0.3)
    want = be.paged_prefill(q, kc.float(), vc.float(), tables, sl, qsl, mq, 0.3)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def bf16_model_attention(q, kc, vc, tables, sl, qsl, scale):
    """What the bfloat16-product prefill computes, in float64: q and the softmax weights exp(s - max) rounded
    to bfloat16 (as a bfloat16 model feeds its matmuls), everything else exact."""
    out = torch.empty(q.shape, dtype=torch.float64)
    H, Hkv, bs = q.shape[1], kc.shape[1], kc.shape[2]
    for b in range(len(sl)):
        L, t0, t1 = int(sl[b]), int(qsl[b]), int(qsl[b + 1])
        blocks = tables[b, :-(-L // bs)].long()
        k = kc[blocks].double().transpose(0, 1).reshape(Hkv, -1, kc.shape[-1])[:, :L]
        v = vc[blocks].double().transpose(0, 1).reshape(Hkv, -1, kc.shape[-1])[:, :L]
        for h in range(H):
            qh = q[t0:t1, h].bfloat16().double()
            s = qh @ k[h // (H // Hkv)].T
            pos = torch.arange(L)[None, :] <= (L - (t1 - t0) + torch.arange(t1 - t0))[:, None]
            s = s.masked_fill(~pos, float("-inf"))
            p = torch.exp((s - s.max(-1, keepdim=True).values) * scale).bfloat16().double()
            out[t0:t1, h] = (p @ v[h // (H // Hkv)]) / p.sum(-1, keepdim=True)
    return out


def bf16_engines() -> list[int]:
    """The bfloat16-product prefill engines here (cpu_attn_bf16.cpp: 2 AMX tiles, 1 AVX512_BF16)."""
    from worker.cpu_kernels import load_library
    lib = load_library()
    e = lib.minipaged_bf16_prefill_engines() if lib is not None else 0
    return [x for x in (2, 1) if e & x]


@pytest.mark.parametrize("engine", [2, 1])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("group", [1, 2, 4, 16])
def test_bf16_prefill_computes_a_bfloat16_models_attention(engine, block_size, group):
    """cpu_attn_bf16.cpp, on AMX tiles and on AVX512_BF16 pair dot products, against its float64
    emulation (seen: <= 1e-5, where the exact float32 loop is 3e-2 away; a weight whose bfloat16
    rounding flips on float32 noise moves a few outputs by up to ~3e-3: at most 0.1% of them past
    1e-3, none past 1e-2), and near that exact loop on average. Contexts past 32 positions (several
    chunks), cached prefixes, a decode row."""
    be = native_backend()
    if engine not in bf16_engines():
        pytest.skip({2: "no AMX here", 1: "no AVX512_BF16 here"}[engine])
    be.bf16_prefill = engine
    q, kc, vc, tables, sl, qsl, mq = prefill_case(block_size, group, 11 * block_size + group,
                                                  seq_lens=(5, 1, 40, 30, 75), qlens=(5, 1, 6, 29, 75))
    got = be.paged_prefill(q, kc, vc, tables, sl, qsl, mq, 0.3)
    diff = (got.double() - bf16_model_attention(q, kc, vc, tables, sl, qsl, 0.3)).abs()
    assert float(diff.max()) < 1e-2 and float((diff > 1e-3).double().mean()) < 1e-3
    be.bf16_prefill = 0
    exact = be.paged_prefill(q, kc, vc, tables, sl, qsl, mq, 0.3)
    assert (got - exact).abs().mean() < 1e-2 * exact.abs().mean()


def test_bf16_prefill_engines_agree():
    """AMX and the pair dot products multiply the same bfloat16 values: equal up to float32 rounding
    and the weight roundings it flips (see the test above)."""
    if bf16_engines() != [2, 1]:
        pytest.skip("needs both AMX and AVX512_BF16")
    be = native_backend()
    q, kc, vc, tables, sl, qsl, mq = prefill_case(16, 2, 5, seq_lens=(40, 75), qlens=(6, 75))
    out = []
    for engine in (2, 1):
        be.bf16_prefill = engine
        out.append(be.paged_prefill(q, kc, vc, tables, sl, qsl, mq, 0.3))
    diff = (out[0] - out[1]).abs()          # (the two may add a pair's products in either order)
    assert float(diff.max()) < 1e-2 and float((diff > 1e-3).double().mean()) < 1e-3


def test_bf16_prefill_leaves_other_head_layouts_to_the_exact_loop():
    """A group size that does not divide 16 query rows, or a head dim that is no multiple of 64:
    the bfloat16-product entry does nothing (-2) and the AVX-512 loop's exact answer comes back."""
    be = native_backend()
    for group, head_dim in ((3, 128), (1, 32)):
        q, kc, vc, tables, sl, qsl, mq = prefill_case(16, group, 3, head_dim=head_dim)
        got = be.paged_prefill(q, kc, vc, tables, sl, qsl, mq, 0.3)
        want = be.paged_prefill(q, kc.float(), vc.float(), tables, sl, qsl, mq, 0.3)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rmsnorm_matches_torch(dtype):
    """The residual step (cpu_fused.cpp add_rmsnorm): h += y in place, then HF's RMSNorm ops in
    float32; the bfloat16 mode's form rounds the result once to bfloat16 (one bfloat16 step where
    float32 sums differ). RMSNorm.forward itself takes this path for float32 rows, so the oracle
    here is HF's op sequence written out. QK-norm + RoPE and SwiGLU: tests/test_model_parity.py."""
    from worker import cpu_kernels
    from worker.layers import RMSNorm
    if cpu_kernels.load_library() is None:
        pytest.skip("no C++ compiler: the CPU kernels could not be built")
    g = torch.Generator().manual_seed(1)
    T, n = 21, 96
    h, y = torch.randn(T, n, generator=g), torch.randn(T, n, generator=g).to(dtype)
    weight = torch.rand(n, generator=g) + 0.5
    want_h = h + y.float()
    want = (weight * (want_h * want_h.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt())).to(dtype)
    got = cpu_kernels.add_rmsnorm(h, y, weight, 1e-6, dtype)       # h += y, in place
    torch.testing.assert_close(h, want_h, rtol=0, atol=0)
    step = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-6)
    torch.testing.assert_close(got.float(), want.float(), **step)
    norm = RMSNorm(n, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(weight)
        assert torch.equal(norm(want_h), cpu_kernels.add_rmsnorm(want_h.clone(), None, weight, 1e-6))
    with pytest.raises(ValueError, match="must be"):
        cpu_kernels.add_rmsnorm(h, y.double(), weight, 1e-6, dtype)


def test_write_kv_rounds_float32_into_a_bfloat16_cache():
    be = native_backend()
    kc, vc = torch.zeros(3, 2, 4, 8, dtype=torch.bfloat16), torch.zeros(3, 2, 4, 8, dtype=torch.bfloat16)
    k, v = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    be.write_kv(k, v, kc, vc, torch.tensor([5, -1]))
    assert torch.equal(kc[1, :, 1], k[0].bfloat16()) and torch.equal(vc[1, :, 1], v[0].bfloat16())
    assert int((kc != 0).sum()) == int((k[0] != 0).sum())


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # float32 weights: the mode rounds them to bfloat16 itself
    return make_checkpoint(num_layers=2, hidden=256, heads=4, kv_heads=1, head_dim=128, tie=False, vocab=96,
                           seed=5, directory=str(tmp_path_factory.mktemp("bf16-mode")))


@needs_mode
@pytest.mark.parametrize("block_size", [1, 16])
def test_bfloat16_mode_matches_transformers_and_stages_agree(ckpt, block_size):
    prompts = random_prompts([7, 40, 19], seed=6)          # chunked prefill, then 4 decode steps
    runs = {}
    for layers in ((0, None), (0, 1)):
        runners = [ModelRunner(ckpt, 0, None, "bfloat16", "cpu")] if layers[1] is None else [
            ModelRunner(ckpt, 0, 1, "bfloat16", "cpu"), ModelRunner(ckpt, 1, 2, "bfloat16", "cpu")]
        for r in runners:
            assert r.mixed_bf16 and r.stage.dtype == torch.float32
            r.init_cache(128, block_size)
            assert r.kv_cache.key_cache[0].dtype == torch.bfloat16
            assert r.kv_bytes_per_block(block_size) == 2 * 2 * 1 * 128 * block_size * r.num_layers
        runs[len(runners)] = run_steps(runners, Pager(128, block_size, seed=7), schedule(prompts, 16, 4))
    for sid in prompts:                                    # hidden states cross stages in float32
        torch.testing.assert_close(runs[1][sid], runs[2][sid], rtol=0, atol=0)
    hf = load_oracle(ckpt, torch.float64)
    with torch.no_grad():
        want = {sid: hf(torch.tensor([t])).logits[0] for sid, t in prompts.items()}
    assert rel_diff({s: g.double() for s, g in runs[1].items()}, want) < 6e-2    # bfloat16's tolerance
