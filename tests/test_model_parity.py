"""Whole-model parity: ModelRunner over a PagedKVCache with hand-built StepBatches against
transformers' Qwen3ForCausalLM on the same weights (float64: max |diff| < 1e-9; float32: 1e-4
relative), plus chunked prefill, pipeline stages, packed batches, the tiny model and greedy
generation."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from minipaged import wire
from tests.checkpoints import load_oracle, make_checkpoint
from worker.model_runner import ModelRunner
from worker.weights import fingerprint, load_state_dict

VOCAB = 96


@dataclass
class Pager:
    """A toy block allocator for the tests: shuffled free list, one block table per sequence."""
    num_blocks: int
    block_size: int
    seed: int = 0
    free: list = field(init=False)
    tables: dict = field(default_factory=dict)
    lens: dict = field(default_factory=dict)

    def __post_init__(self):
        self.free = np.random.default_rng(self.seed).permutation(self.num_blocks).tolist()

    def step(self, chunks: dict[int, list[int]]):
        """chunks: seq id -> new token ids. Returns make_batch's numpy arguments."""
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        for sid, toks in chunks.items():
            start = self.lens.get(sid, 0)
            end = start + len(toks)
            table = self.tables.setdefault(sid, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            p = np.arange(start, end)
            ids += toks
            pos.append(p)
            slots.append(np.asarray(table)[p // self.block_size] * self.block_size + p % self.block_size)
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(end)
            self.lens[sid] = end
        width = max(len(self.tables[s]) for s in chunks)
        tables = np.full((len(chunks), width), -1, dtype=np.int32)
        for i, sid in enumerate(chunks):
            tables[i, :len(self.tables[sid])] = self.tables[sid]
        return (np.asarray(ids, np.int32), np.concatenate(pos).astype(np.int32),
                np.concatenate(slots).astype(np.int32), np.asarray(qsl, np.int32),
                np.asarray(seq_lens, np.int32), tables)


def run_steps(stages, pager, steps):
    """Run each step's chunks through the stage chain; returns {seq: [logits rows in order]}."""
    rows: dict[int, list] = {}
    for chunks in steps:
        args = pager.step(chunks)
        hidden = None
        for runner in stages:
            hidden = runner.execute(runner.make_batch(*args), hidden)
        logits = stages[-1].stage.compute_logits(hidden)
        qsl = args[3]
        for i, sid in enumerate(chunks):
            rows.setdefault(sid, []).append(logits[qsl[i]:qsl[i + 1]])
    return {sid: torch.cat(r) for sid, r in rows.items()}


def oracle_logits(hf, prompts):
    with torch.no_grad():
        return {sid: hf(torch.tensor([toks])).logits[0] for sid, toks in prompts.items()}


def schedule(prompts, prefill_chunk, decode_steps):
    """Chunked prefill of every prompt (all in one packed batch per step), then decode steps."""
    lens = {sid: len(t) - decode_steps for sid, t in prompts.items()}
    steps, done = [], {sid: 0 for sid in prompts}
    while any(done[s] < lens[s] for s in prompts):
        step = {}
        for sid, toks in prompts.items():
            if done[sid] < lens[sid]:
                n = min(prefill_chunk, lens[sid] - done[sid])
                step[sid] = toks[done[sid]:done[sid] + n]
                done[sid] += n
        steps.append(step)
    for k in range(decode_steps):
        steps.append({sid: [toks[lens[sid] + k]] for sid, toks in prompts.items()})
    return steps


def random_prompts(lengths, seed):
    rng = np.random.default_rng(seed)
    return {sid: rng.integers(0, VOCAB, n).tolist() for sid, n in enumerate(lengths)}


def max_diff(got, want):
    return max(float((got[s].double() - want[s].double()).abs().max()) for s in want)


def rel_diff(got, want):
    return max(float((got[s].double() - want[s].double()).abs().max() / want[s].abs().max()) for s in want)


CONFIGS = {  # name: (checkpoint kwargs, block size)
    "gqa1-d64-tied-bs16": (dict(hidden=128, heads=2, kv_heads=2, head_dim=64, tie=True), 16),
    "gqa2-d128-untied-bs1": (dict(hidden=128, heads=2, kv_heads=1, head_dim=128, tie=False), 1),
    "gqa4-d64-untied-bs16": (dict(hidden=128, heads=4, kv_heads=1, head_dim=64, tie=False), 16),
    "gqa4-d32-tied-bs1": (dict(hidden=64, heads=4, kv_heads=1, head_dim=32, tie=True), 1),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: make_checkpoint(num_layers=2, vocab=VOCAB, seed=i, **kw,
                                  directory=str(tmp_path_factory.mktemp(name)))
            for i, (name, (kw, _)) in enumerate(CONFIGS.items())}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_prefill_then_decode_float64(checkpoints, name):
    block_size = CONFIGS[name][1]
    runner = ModelRunner(checkpoints[name], 0, None, "float64", "cpu")
    runner.init_cache(64, block_size)
    prompts = random_prompts([7, 19, 12], seed=1)        # last 4 tokens of each are decoded
    got = run_steps([runner], Pager(64, block_size, seed=2), schedule(prompts, 100, 4))
    assert max_diff(got, oracle_logits(load_oracle(checkpoints[name]), prompts)) < 1e-9


def test_float32_within_1e4_relative(checkpoints):
    path = checkpoints["gqa4-d64-untied-bs16"]
    runner = ModelRunner(path, 0, None, "float32", "cpu")
    runner.init_cache(16, 16)
    prompts = random_prompts([9, 21], seed=3)
    got = run_steps([runner], Pager(16, 16, seed=4), schedule(prompts, 100, 3))
    assert got[0].dtype == torch.float32
    assert rel_diff(got, oracle_logits(load_oracle(path, torch.float32), prompts)) < 1e-4


@pytest.mark.parametrize("name", ["gqa2-d128-untied-bs1", "gqa1-d64-tied-bs16"])
def test_chunked_prefill_equals_one_shot_and_two_stages_equal_one(checkpoints, name):
    path, block_size = checkpoints[name], 4
    prompts = random_prompts([23, 10], seed=5)
    one = ModelRunner(path, 0, None, "float64", "cpu")
    one.init_cache(32, block_size)
    whole = run_steps([one], Pager(32, block_size, seed=6), schedule(prompts, 100, 2))
    one.init_cache(32, block_size)
    chunked = run_steps([one], Pager(32, block_size, seed=7), schedule(prompts, 5, 2))
    s0, s1 = ModelRunner(path, 0, 1, "float64", "cpu"), ModelRunner(path, 1, 2, "float64", "cpu")
    assert (s0.is_first, s0.is_last, s1.is_first, s1.is_last) == (True, False, False, True)
    assert s0.fingerprint == s1.fingerprint == one.fingerprint
    s0.init_cache(32, block_size)
    s1.init_cache(32, block_size)
    staged = run_steps([s0, s1], Pager(32, block_size, seed=8), schedule(prompts, 7, 2))
    want = oracle_logits(load_oracle(path), prompts)
    assert max_diff(chunked, whole) < 1e-10
    assert max_diff(staged, whole) < 1e-10
    assert max_diff(whole, want) < 1e-9


def test_tiny_model_matches_transformers():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from minipaged.config import TINY_CONFIG, load_model_config
    from worker.weights import tiny_state_dict

    hf = Qwen3ForCausalLM(Qwen3Config(**TINY_CONFIG))
    sd = tiny_state_dict(load_model_config("tiny"))
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    assert torch.equal(hf.lm_head.weight, sd["model.embed_tokens.weight"])   # tied
    hf = hf.to(torch.float64).eval()
    runner = ModelRunner("tiny", 0, None, "float64", "cpu")
    runner.init_cache(16, 16)
    prompts = {0: list(b"hello paged world"), 1: list(b"qwen3")}
    got = run_steps([runner], Pager(16, 16, seed=9), schedule(prompts, 100, 2))
    assert max_diff(got, oracle_logits(hf, prompts)) < 1e-9


def test_greedy_generation_matches_hf_generate(checkpoints):
    path = checkpoints["gqa4-d64-untied-bs16"]
    hf = load_oracle(path)
    prompt = random_prompts([11], seed=10)[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=9,
                          min_new_tokens=9, pad_token_id=0)[0, len(prompt):].tolist()
    runner = ModelRunner(path, 0, None, "float64", "cpu")
    runner.init_cache(8, 4)
    pager = Pager(8, 4, seed=11)
    tokens, chunk = [], prompt
    for _ in range(9):                                    # prefill + 8 decode steps
        args = pager.step({0: chunk})
        hidden = runner.execute(runner.make_batch(*args))
        one = np.ones(1)
        ids, logprobs, logits, _ = runner.sample(hidden, args[3], one, np.zeros(1, np.float32), one,
                                              np.zeros(1, np.int32), np.zeros(1, np.int64),
                                              np.array([len(tokens)], np.int32),
                                              return_logprobs=True, return_logits=True)
        assert logits.shape == (1, VOCAB) and logits.dtype == np.float64 and logprobs[0] <= 0
        tokens.append(int(ids[0]))
        chunk = [tokens[-1]]
    assert tokens == ref


def test_sample_takes_last_query_row_of_flagged_sequences(checkpoints):
    runner = ModelRunner(checkpoints["gqa4-d32-tied-bs1"], 0, None, "float64", "cpu")
    runner.init_cache(64, 1)
    prompts = random_prompts([5, 8, 3], seed=12)
    # Through the wire: make_batch gets read-only views of packed bytes.
    args = tuple(wire.unpack(wire.pack(a)).reshape(a.shape) for a in Pager(64, 1).step(prompts))
    assert not args[0].flags.writeable
    hidden = runner.execute(runner.make_batch(*args))
    do = np.array([1, 0, 1], np.uint8)
    B = 3
    ids, lp, logits, _ = runner.sample(hidden, args[3], do, np.zeros(B, np.float32), np.ones(B, np.float32),
                                    np.zeros(B, np.int32), np.zeros(B, np.int64), np.zeros(B, np.int32),
                                    return_logits=True)
    want = runner.stage.compute_logits(hidden[torch.tensor([4, 15])])
    assert lp is None and ids.shape == (2,)
    np.testing.assert_array_equal(logits, want.numpy())
    np.testing.assert_array_equal(ids, want.argmax(-1).numpy())


def test_weights_loading_and_fingerprint(checkpoints, tmp_path):
    from tests.checkpoints import qwen3_config  # noqa: F401  (same builder as the checkpoints)
    from transformers import Qwen3ForCausalLM
    from minipaged.config import load_model_config

    path = checkpoints["gqa4-d64-untied-bs16"]
    cfg = load_model_config(path)
    sd0, sd1 = load_state_dict(path, cfg, 0, 1), load_state_dict(path, cfg, 1, 2)
    assert "model.embed_tokens.weight" in sd0 and "lm_head.weight" not in sd0
    assert not any(k.startswith("model.layers.1.") for k in sd0)
    assert "lm_head.weight" in sd1 and "model.embed_tokens.weight" not in sd1   # untied
    assert fingerprint(cfg, sd0) == fingerprint(cfg, sd1)
    # Sharded safetensors (index.json) load the same tensors; other weights change the fingerprint.
    hf = Qwen3ForCausalLM.from_pretrained(path)
    sharded = str(tmp_path / "sharded")
    hf.save_pretrained(sharded, max_shard_size="100KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    sd1s = load_state_dict(sharded, load_model_config(sharded), 1, 2)
    assert sd1s.keys() == sd1.keys() and all(torch.equal(sd1s[k], sd1[k]) for k in sd1)
    assert fingerprint(load_model_config(sharded), sd1s) == fingerprint(cfg, sd1)
    other = make_checkpoint(num_layers=2, vocab=VOCAB, seed=99, hidden=128, heads=4, kv_heads=1,
                            head_dim=64, tie=False, directory=str(tmp_path / "other"))
    assert fingerprint(load_model_config(other)) != fingerprint(cfg)
    # pytorch_model.bin fallback
    binary = str(tmp_path / "bin")
    os.makedirs(binary)
    torch.save(hf.state_dict(), os.path.join(binary, "pytorch_model.bin"))
    hf.config.save_pretrained(binary)
    sdb = load_state_dict(binary, load_model_config(binary), 1, 2)
    assert sdb.keys() == sd1.keys() and all(torch.equal(sdb[k], sd1[k]) for k in sd1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cpu_steps_match_the_torch_ops(dtype):
    """qk_norm_rope and silu_mul (worker/cpu_fused.cpp, float32 math on the CPU) against the
    module code they replace: RMSNorm (HF's ops) then RoPE, and F.silu(gate) * up. bfloat16 is the
    bfloat16 mode's form (GEMM products in; k and silu_mul's output written bfloat16, q float32):
    the torch ops in float32 on the same values, rounded once, within one bfloat16 step."""
    from worker import cpu_kernels
    from worker.model import RMSNorm, RotaryEmbedding, apply_rope
    if cpu_kernels.load_library() is None:
        pytest.skip("no C++ compiler: the CPU kernels could not be built")
    g = torch.Generator().manual_seed(0)
    T, H, Hkv, D, inter = 37, 8, 2, 64 if dtype == torch.float32 else 128, 96
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype)
    qn, kn = RMSNorm(D, 1e-6), RMSNorm(D, 1e-6)
    with torch.no_grad():
        qn.weight.copy_(torch.rand(D, generator=g) + 0.5)
        kn.weight.copy_(torch.rand(D, generator=g) + 0.5)
    cos, sin = RotaryEmbedding(D, 1e6)(torch.randint(0, 4000, (T,), generator=g), torch.float32)
    q, k = cpu_kernels.qk_norm_rope(qkv, H, Hkv, D, qn.weight, kn.weight, 1e-6, cos, sin)
    x = qkv.float()
    with torch.no_grad():
        want_q = apply_rope(qn(x[:, :H * D].view(T, H, D)), cos, sin)
        want_k = apply_rope(kn(x[:, H * D:(H + Hkv) * D].view(T, Hkv, D)), cos, sin).to(dtype)
    step = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-6)
    assert q.dtype == torch.float32 and k.dtype == dtype
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.float(), want_k.float(), **step)
    gate_up = (torch.randn(T, 2 * inter, generator=g) * 6).to(dtype)       # both signs, |g| up to ~25
    gu = gate_up.float()
    want = (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]).to(dtype)
    got = cpu_kernels.silu_mul(gate_up, inter)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **(dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32
                                                            else step))
