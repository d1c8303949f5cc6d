"""The whole model through the CUDA kernels' own source, run on the CPU by the SIMT emulation
(`worker/kernels/simt_cpu.h`): float32 logits against transformers, chunked prefill then decode;
and the same logits, bit for bit, under a hostile schedule (simt_schedule.h)."""
from __future__ import annotations

import pytest
import torch

from tests.checkpoints import load_oracle, make_checkpoint
from tests.test_model_parity import Pager, random_prompts, rel_diff, run_steps, schedule
from worker.kernels import emulated
from worker.model_runner import ModelRunner


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(num_layers=2, hidden=256, heads=4, kv_heads=1, head_dim=128, tie=False, vocab=96,
                           seed=5, directory=str(tmp_path_factory.mktemp("ckpt")))


def run_model(ckpt, block_size):
    runner = ModelRunner(ckpt, 0, None, "float32", "cpu", "emulated")
    runner.init_cache(128, block_size)
    prompts = random_prompts([7, 40, 19], seed=6)
    return prompts, run_steps([runner], Pager(128, block_size, seed=7), schedule(prompts, 16, 4))


@pytest.mark.parametrize("block_size", [1, 16])
def test_emul_whole_model_matches_transformers(ckpt, block_size):
    prompts, got = run_model(ckpt, block_size)
    hf = load_oracle(ckpt, torch.float64)
    with torch.no_grad():
        want = {sid: hf(torch.tensor([t])).logits[0] for sid, t in prompts.items()}
    assert rel_diff({s: g.double() for s, g in got.items()}, want) < 1e-4


def test_emul_whole_model_identical_under_a_hostile_schedule(ckpt):
    with emulated.schedule("forward"):
        _, want = run_model(ckpt, 16)
    with emulated.schedule("random:11"):
        _, got = run_model(ckpt, 16)
    assert want.keys() == got.keys()
    assert all(torch.equal(got[s], want[s]) for s in want)
