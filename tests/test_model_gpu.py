"""Whole-model parity on a GPU: ModelRunner with the torch and the PyCUDA backends, float32 and
bfloat16, against transformers on the same weights. Needs CUDA (+ PyCUDA for that backend): run by
scripts/gpu_check.sh (`pytest -m gpu`); deselected by default."""
from __future__ import annotations

import pytest
import torch

from tests.checkpoints import load_oracle, make_checkpoint
from tests.test_model_parity import Pager, random_prompts, rel_diff, run_steps, schedule
from worker.model_runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
TOL = {"float32": 1e-3, "bfloat16": 6e-2}  # relative to the largest logit


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # head_dim 128 and GQA 4: the shapes the kernels specialise for
    return make_checkpoint(num_layers=2, hidden=256, heads=4, kv_heads=1, head_dim=128, tie=False, vocab=96,
                           seed=5, directory=str(tmp_path_factory.mktemp("gpu-ckpt")))


@pytest.mark.parametrize("backend", ["torch", "pycuda"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_gpu_model_matches_transformers(ckpt, backend, dtype, block_size):
    runner = ModelRunner(ckpt, 0, None, dtype, "cuda", backend)
    runner.init_cache(128, block_size)
    prompts = random_prompts([7, 40, 19], seed=6)             # chunked prefill, then 4 decode steps
    got = run_steps([runner], Pager(128, block_size, seed=7), schedule(prompts, 16, 4))
    hf = load_oracle(ckpt, torch.float64)                     # the float64 CPU oracle
    with torch.no_grad():
        want = {sid: hf(torch.tensor([t])).logits[0] for sid, t in prompts.items()}
    got = {sid: g.double().cpu() for sid, g in got.items()}
    assert rel_diff(got, want) < TOL[dtype]
