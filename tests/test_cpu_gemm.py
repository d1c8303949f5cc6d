"""The bfloat16-weight GEMM (worker/cpu_gemm.py, issue 18): the float32 product of the exact
bfloat16 values, for every batch size, widths that are not a multiple of its panel, a bias, and
row-strided input; the stage uses it only where the README says."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker import cpu_gemm

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="needs AVX2 + FMA and the CPU kernels")


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 14, 15, 16, 17, 29, 48, 100])   # AVX2 tiles of 6 rows, AVX-512 of 16 (14 on panel pairs)
@pytest.mark.parametrize("n,k", [(16, 8), (24, 8), (40, 33), (64, 17), (257, 64)])   # odd panel counts, a partial panel in a pair
def test_matches_float32_linear(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    packed = cpu_gemm.pack(w.float())
    assert packed.shape == ((n + 15) // 16, k, 16)
    want = F.linear(x.double(), w.double(), bias.double())
    got = cpu_gemm.linear(x, packed, n, bias)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu_gemm.linear(x, packed, n), F.linear(x, w.float()), rtol=1e-5, atol=1e-5)


def test_strided_and_batched_input():
    w = torch.randn(48, 32).bfloat16().float()
    packed = cpu_gemm.pack(w)
    wide = torch.randn(5, 64)
    x = wide[:, :32]                                  # row stride 64, not 32
    torch.testing.assert_close(cpu_gemm.linear(x, packed, 48), x @ w.T, rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 3, 32)
    assert cpu_gemm.linear(x3, packed, 48).shape == (2, 3, 48)
    assert cpu_gemm.linear(torch.empty(0, 32), packed, 48).shape == (0, 48)


def test_rows_of_reads_the_packed_table():
    w = torch.randn(37, 24).bfloat16()
    ids = torch.tensor([0, 36, 5, 16, 5])
    assert torch.equal(cpu_gemm.rows_of(cpu_gemm.pack(w.float()), ids), w[ids])


def test_stage_forward_same_with_and_without(monkeypatch):
    """A bfloat16-valued model gives the same logits through the packed path as through oneDNN's
    float32 GEMMs (to float32 rounding), on one stage and split in two (embedding and lm_head on
    different stages)."""
    from minipaged.config import load_model_config
    from worker.model import Qwen3Stage
    from worker.weights import tiny_state_dict
    cfg = load_model_config("tiny")
    sd = {k: v.bfloat16().float() for k, v in tiny_state_dict(cfg).items()}
    ids = torch.tensor([3, 200, 17, 511])
    ref = Qwen3Stage(cfg, 0, cfg.num_hidden_layers, torch.float32, "cpu")
    ref.load_weights(sd)
    want = ref.compute_logits(ref.embed_tokens(ids))
    for split in (None, 2):
        first = Qwen3Stage(cfg, 0, split or cfg.num_hidden_layers, torch.float32, "cpu")
        first.load_weights(sd)
        assert first.use_bf16_weights()
        last = first
        if split:
            last = Qwen3Stage(cfg, split, cfg.num_hidden_layers, torch.float32, "cpu")
            last.load_weights(sd)
            assert last.use_bf16_weights() and first.embed_tokens.weight.dtype == torch.bfloat16
        emb = (cpu_gemm.rows_of(first.embed_packed, ids) if first.embed_packed is not None
               else first.embed_tokens(ids)).float()
        torch.testing.assert_close(emb, ref.embed_tokens(ids), rtol=0, atol=0)
        torch.testing.assert_close(last.compute_logits(emb), want, rtol=1e-5, atol=1e-5)


def test_exactly_bf16():
    w = torch.randn(64, 64)
    assert not cpu_gemm.exactly_bf16(w)
    assert cpu_gemm.exactly_bf16(w.bfloat16().float())


def test_stage_uses_it_only_for_bf16_values_in_float32():
    from minipaged.config import load_model_config
    from worker.model import Qwen3Stage
    from worker.weights import tiny_state_dict
    cfg = load_model_config("tiny")
    sd = tiny_state_dict(cfg)
    stage = Qwen3Stage(cfg, 0, cfg.num_hidden_layers, torch.float32, "cpu")
    stage.load_weights(sd)
    assert not stage.use_bf16_weights()               # the tiny weights are not bfloat16 values
    stage.load_weights({k: v.bfloat16().float() for k, v in sd.items()})
    assert stage.use_bf16_weights()
    assert stage.layers[0].mlp.down_proj.packed is not None
    assert stage.embed_packed is stage.lm_head.packed          # tied: one bfloat16 copy of the table
    assert stage.lm_head.weight.numel() == stage.embed_tokens.weight.numel() == 0
    down = stage.layers[0].mlp.down_proj
    if cpu_gemm.amx_available():                       # AMX's copy for 8+ rows, no float32 one
        assert down.vnni is not None and down.weight.numel() == 0
    elif cpu_gemm.all_batches():                       # AVX-512: the panels for every batch
        assert down.weight.numel() == 0 and down.packed_rows == cpu_gemm.EVERY_BATCH
        x = torch.randn(100, down.in_features)         # a prefill-sized batch takes them too
        w = sd["model.layers.0.mlp.down_proj.weight"].bfloat16().float()
        torch.testing.assert_close(down(x), x @ w.T, rtol=1e-5, atol=1e-5)
    else:                                              # AVX2: oneDNN's float32 GEMM for prefill
        assert down.weight.numel() == down.in_features * down.out_features
    f64 = Qwen3Stage(cfg, 0, cfg.num_hidden_layers, torch.float64, "cpu")
    f64.load_weights({k: v.bfloat16().float() for k, v in sd.items()})
    assert not f64.use_bf16_weights()                 # the parity mode keeps its own GEMMs


amx = pytest.mark.skipif(not cpu_gemm.amx_available(), reason="needs AMX (AMX-BF16 and the kernel's grant)")


def test_pack_vnni_layout():
    w = torch.randn(40, 33).bfloat16()
    v = cpu_gemm.pack_vnni(w.float()).view(torch.bfloat16)
    assert v.shape == (4, 32, 16, 2)           # 40 columns -> 4 panels (an even count), K 33 -> 64
    for n, k in ((0, 0), (39, 32), (17, 5), (16, 31)):
        assert v[n // 16, k // 2, n % 16, k % 2] == w[n, k]
    assert v[2, :, 8:].abs().sum() == 0 and v[3].abs().sum() == 0 and v[:, 17:].abs().sum() == 0 and v[:, 16, :, 1].abs().sum() == 0   # padding


@amx
@pytest.mark.parametrize("m", [1, 7, 8, 31, 32, 33, 100, 300])
@pytest.mark.parametrize("n,k", [(16, 8), (40, 33), (257, 64), (64, 200)])
def test_amx_matches_float32_linear(m, n, k):
    """x split exactly into three bfloat16 parts: the float32 product to float32 rounding."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, k)   # magnitudes a bfloat16 x would lose
    bias = torch.randn(n, generator=g)
    vnni = cpu_gemm.pack_vnni(w.float())
    want = F.linear(x.double(), w.double(), bias.double())
    for packed in (None, cpu_gemm.pack(w.float())):      # alone, and beside the small-batch kernel
        got = cpu_gemm.linear(x, packed, n, bias, vnni=vnni)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_bench_quick_at_the_real_shape():
    """bench/cpu_gemm.py runs at the Qwen3-0.6B shape (sizes only: no checkpoint is made)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "bench/cpu_gemm.py", "--quick", "--threads", "1"], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| gate_up (1024 x 6144) | 16 |" in proc.stdout
