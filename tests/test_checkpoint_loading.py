"""Checkpoints as they ship (issue 18): bfloat16 `torch_dtype`, sharded safetensors with an index,
`--dtype auto`, loading one tensor at a time with progress logged."""
from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import torch

from minipaged.config import load_model_config
from tests.checkpoints import make_checkpoint
from tests.test_model_parity import Pager
from worker import cpu_gemm
from worker.dtype_choice import checkpoint_dtype, cpu_has_bf16, resolve_dtype
from worker.model_runner import ModelRunner

VOCAB = 128


@pytest.fixture(scope="module")
def bf16_sharded(tmp_path_factory):
    """A random Qwen3 (GQA, tied) saved the way Qwen3-1.7B ships: bfloat16, several shards."""
    from transformers import Qwen3ForCausalLM
    src = make_checkpoint(num_layers=3, hidden=128, heads=4, kv_heads=2, head_dim=64, vocab=VOCAB, seed=5,
                          directory=str(tmp_path_factory.mktemp("f32")))
    d = str(tmp_path_factory.mktemp("bf16-sharded"))
    Qwen3ForCausalLM.from_pretrained(src).to(torch.bfloat16).save_pretrained(d, max_shard_size="200KB")
    return d


def fake_cpuinfo(tmp_path, flags: str) -> str:
    p = tmp_path / "cpuinfo"
    p.write_text(f"processor\t: 0\nflags\t\t: fpu sse avx2 {flags}\n")
    return str(p)


def test_checkpoint_is_sharded_bf16(bf16_sharded):
    with open(os.path.join(bf16_sharded, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1
    assert checkpoint_dtype(load_model_config(bf16_sharded)) == "bfloat16"


def test_dtype_auto_picks_what_the_readme_says(bf16_sharded, tmp_path):
    cfg = load_model_config(bf16_sharded)
    no_bf16, bf16 = fake_cpuinfo(tmp_path, "avx512f avx512bw"), fake_cpuinfo(tmp_path / "..", "avx512_bf16")
    assert not cpu_has_bf16(no_bf16) and cpu_has_bf16(bf16)
    assert resolve_dtype("auto", cfg, "cpu", no_bf16) == "float32"      # AVX-512 alone: float32
    assert resolve_dtype("auto", cfg, "cpu", bf16, (True, True)) == "bfloat16"     # the checkpoint's, as vLLM, HF
    assert resolve_dtype("auto", cfg, "cpu", bf16, (False, False)) == "bfloat16"   # torch's bfloat16
    assert resolve_dtype("auto", cfg, "cpu", bf16, (False, True)) == "float32"     # packed weights: faster
    assert resolve_dtype("auto", cfg, "cuda") == "bfloat16"
    assert resolve_dtype("float64", cfg, "cpu", bf16) == "float64"       # explicit wins
    tiny = load_model_config("tiny")                                     # no dtype in its config
    assert resolve_dtype("auto", tiny, "cpu", bf16) == "float32" and resolve_dtype(None, tiny, "cuda") == "bfloat16"
    from worker.__main__ import resolve_args
    a = resolve_args(["--model", bf16_sharded])                          # the default is auto
    assert a.dtype == resolve_dtype("auto", cfg, "cpu")                  # this CPU's row of the table above


def greedy_ours(runner, prompt, n):
    runner.init_cache(32, 4)
    pager, tokens, chunk = Pager(32, 4, seed=1), [], prompt
    one, zero = np.ones(1), np.zeros(1)
    for _ in range(n):
        args = pager.step({0: chunk})
        hidden = runner.execute(runner.make_batch(*args))
        ids = runner.sample(hidden, args[3], one, zero, one, zero.astype(np.int32), zero.astype(np.int64),
                            np.array([len(tokens)], np.int32))[0]
        tokens.append(int(ids[0]))
        chunk = [tokens[-1]]
    return tokens


def test_sharded_bf16_checkpoint_matches_transformers_in_float32(bf16_sharded, caplog):
    from transformers import Qwen3ForCausalLM
    hf = Qwen3ForCausalLM.from_pretrained(bf16_sharded, dtype=torch.float32).eval()
    with caplog.at_level(logging.INFO):
        runner = ModelRunner(bf16_sharded, 0, None, "float32", "cpu")
    assert runner.dtype == torch.float32
    assert any("weights loaded" in r.getMessage() for r in caplog.records)   # load time logged
    assert any("ready" in r.getMessage() and "weights in" in r.getMessage() for r in caplog.records)
    # the values are the checkpoint's bfloat16 ones, exactly (bfloat16 -> float32 is exact)
    sd = hf.state_dict()
    want = torch.cat([sd[f"model.layers.2.self_attn.{n}_proj.weight"] for n in "qkv"])
    qkv = runner.stage.layers[2].self_attn.qkv_proj
    if qkv.weight.numel() == 0:        # with AMX only the bfloat16 copies remain (cpu_gemm.py)
        got = cpu_gemm.rows_of(qkv.packed, torch.arange(want.shape[0]))
    else:
        got = qkv.weight
    assert torch.equal(got.to(torch.float32), want)
    rng = np.random.default_rng(3)
    for length in (7, 13):
        prompt = rng.integers(0, VOCAB, length).tolist()
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8, min_new_tokens=8,
                              pad_token_id=0)[0, length:].tolist()
        assert greedy_ours(runner, prompt, 8) == ref


@pytest.mark.parametrize("amx", [True, False], ids=["amx-if-present", "amx-off"])
def test_float32_compute_of_bf16_weights_matches_transformers(bf16_sharded, amx, monkeypatch):
    """--dtype float32 on a bfloat16 checkpoint: the layers run from their bfloat16 copies (the
    packed kernel for small batches; with AMX, larger ones from pack_vnni and no float32 copy;
    without, oneDNN's float32 GEMM), and greedy tokens are transformers' float32 ones; a 40-token
    prompt takes the large-batch path."""
    from transformers import Qwen3ForCausalLM
    if not amx:
        monkeypatch.setattr(cpu_gemm, "amx_available", lambda: False)
    hf = Qwen3ForCausalLM.from_pretrained(bf16_sharded, dtype=torch.float32).eval()
    runner = ModelRunner(bf16_sharded, 0, None, "float32", "cpu")
    down = runner.stage.layers[0].mlp.down_proj
    if cpu_gemm.available():
        assert down.packed is not None
        assert (down.vnni is not None and down.weight.numel() == 0) == cpu_gemm.amx_available()
    rng = np.random.default_rng(4)
    for length in (5, 40):
        prompt = rng.integers(0, VOCAB, length).tolist()
        ref = list(prompt)
        with torch.no_grad():          # plain greedy (generate's min_new_tokens would suppress EOS)
            for _ in range(6):
                ref.append(int(hf(torch.tensor([ref])).logits[0, -1].argmax()))
        assert greedy_ours(runner, prompt, 6) == ref[length:]


def test_load_streams_without_a_second_copy(bf16_sharded, monkeypatch):
    """Tensors reach load_weights one at a time: the loader never builds the whole state dict."""
    import worker.weights as weights
    seen, real = [], weights.iter_tensors

    def spy(path, want, **kw):
        for name, t in real(path, want, **kw):
            seen.append(name)
            yield name, t
    monkeypatch.setattr(weights, "iter_tensors", spy)
    monkeypatch.setattr(weights, "load_state_dict", lambda *a: pytest.fail("whole state dict built"))
    runner = ModelRunner(bf16_sharded, 1, 3, "float32", "cpu")
    assert "model.layers.2.mlp.down_proj.weight" in seen
    assert not any(n.startswith("model.layers.0.mlp.") for n in seen)   # not this stage's
    ref = ModelRunner(bf16_sharded, 0, None, "float32", "cpu")
    assert runner.fingerprint == ref.fingerprint                          # stages agree on identity


def test_bfloat16_runs_on_cpu(bf16_sharded):
    """What auto picks on a CPU with bfloat16 instructions must run on any CPU (the torch paths;
    the compiled kernels are float32/float64 only)."""
    runner = ModelRunner(bf16_sharded, 0, None, "bfloat16", "cpu")
    assert runner.dtype == torch.bfloat16 and runner.stage.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    tokens = greedy_ours(runner, [3, 1, 4, 1, 5, 9, 2, 6], 4)
    assert len(tokens) == 4 and all(0 <= t < VOCAB for t in tokens)


# ---------------------------------------------------------------- broken and unusual checkpoints

def _edit_tensors(d: str, edit) -> None:
    """Rewrite a single-file checkpoint's tensors through edit(dict) (in place)."""
    from safetensors.torch import load_file, save_file
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_each_fused_part_must_have_its_own_shape(tmp_path):
    """q_proj and k_proj 16 rows off in opposite directions sum to the right fused rows: refused,
    as transformers refuses it (before, part of q/k/v was never filled and k overlapped v)."""
    d = make_checkpoint(num_layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32, directory=str(tmp_path / "c"))
    p = "model.layers.1.self_attn."
    _edit_tensors(d, lambda t: t.update({p + "q_proj.weight": t[p + "q_proj.weight"][:48],
                                         p + "k_proj.weight": torch.cat([t[p + "k_proj.weight"]] * 2)[:48]}))
    with pytest.raises(ValueError, match=r"[qk]_proj.weight: checkpoint shape \(48, 64\), the config needs"):
        ModelRunner(d, dtype="float64")


def test_tensors_the_model_has_no_place_for_are_ignored_as_transformers_does(tmp_path, caplog):
    d = make_checkpoint(num_layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32, directory=str(tmp_path / "c"))
    ref = ModelRunner(d, dtype="float64")
    _edit_tensors(d, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(16),
                                         "model.layers.1.self_attn.q_proj.bias": torch.ones(64)}))
    with caplog.at_level(logging.WARNING, logger="worker.model"):
        r = ModelRunner(d, dtype="float64")
    assert "ignored 2 checkpoint tensor(s)" in caplog.text
    for (n, a), (_, b) in zip(ref.stage.named_parameters(), r.stage.named_parameters()):
        assert torch.equal(a, b), n
    assert r.fingerprint != ref.fingerprint          # another file, though the same model computes


def test_a_fine_tune_of_one_matrix_is_another_model(tmp_path):
    d = make_checkpoint(num_layers=3, hidden=64, heads=2, kv_heads=1, head_dim=32, directory=str(tmp_path / "c"))
    base = ModelRunner(d, dtype="float64", layer_start=0, layer_end=2).fingerprint
    assert ModelRunner(d, dtype="float64", layer_start=2, layer_end=3).fingerprint == base   # stages agree
    _edit_tensors(d, lambda t: t["model.layers.1.self_attn.v_proj.weight"].mul_(1.01))      # a merged LoRA
    assert ModelRunner(d, dtype="float64", layer_start=2, layer_end=3).fingerprint != base


def test_a_truncated_weight_file_is_one_line_naming_it(tmp_path):
    d = make_checkpoint(num_layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32, directory=str(tmp_path / "c"))
    path = os.path.join(d, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1000)
    with pytest.raises(ValueError, match=r"model.safetensors: .* past the file's .* \(truncated\?\)"):
        ModelRunner(d, dtype="float64")
    with open(path, "wb"):
        pass
    with pytest.raises(ValueError, match="not a safetensors file"):
        ModelRunner(d, dtype="float64")
