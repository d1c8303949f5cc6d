"""The goal of issue 23: lm-evaluation-harness's `local-completions` model, pointed at our gateway,
runs a small multiple-choice task (tests/lm_eval/minipaged_mc.yaml, five items) to the end, and
every per-choice loglikelihood equals the one its own `hf` model computes in process on the same
checkpoint (float32 on both sides).

lm-eval lives in its own venv (its dependencies must not touch the project's torch): create it
with `make lmeval-venv` (LMEVAL_VENV, default .venv-lmeval in the repository; `make test` builds it;
see docs/gateway.md). Without it this test is skipped and says so."""
from __future__ import annotations

import glob
import json
import os
import subprocess

import pytest

from client import LocalCluster
from tests.checkpoints import make_checkpoint

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.environ.get("LMEVAL_VENV", os.path.join(ROOT, ".venv-lmeval"))
LM_EVAL = os.path.join(VENV, "bin", "lm_eval")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def run_lm_eval(model: str, model_args: str, out: str, *extra: str) -> list[dict]:
    cmd = [LM_EVAL, "--model", model, "--model_args", model_args, "--tasks", "minipaged_mc",
           "--include_path", "tests/lm_eval", "--batch_size", "1", "--log_samples", "--output_path", out, *extra]
    r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **OFFLINE}, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    files = glob.glob(os.path.join(out, "*", "samples_minipaged_mc_*.jsonl"))
    assert len(files) == 1, files
    with open(files[0]) as f:
        return sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])


def loglikelihoods(samples: list[dict]) -> list[list[float]]:
    return [[float(resp[0]) for resp in s["filtered_resps"]] for s in samples]


@pytest.mark.skipif(not os.path.isfile(LM_EVAL),
                    reason=f"lm-eval is not installed at {VENV} (create it with `make lmeval-venv`, "
                           f"or point LMEVAL_VENV at a venv that has `lm-eval[api]`)")
def test_lm_eval_local_completions_equals_its_hf_model(tmp_path):
    from tests.test_gateway import add_tokenizer
    ckpt = str(tmp_path / "ckpt")
    make_checkpoint(num_layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32, vocab=320, seed=11, directory=ckpt)
    add_tokenizer(ckpt, 320)
    with LocalCluster(model=ckpt, workers=1, dtype="float32", http=True) as c:
        api = run_lm_eval("local-completions",
                          f"model={ckpt},base_url={c.http_url}/v1/completions,tokenizer_backend=huggingface,"
                          f"tokenizer={ckpt},num_concurrent=1,max_retries=1", str(tmp_path / "api"))
    hf = run_lm_eval("hf", f"pretrained={ckpt},dtype=float32", str(tmp_path / "hf"), "--device", "cpu")
    assert [s["doc_id"] for s in api] == [s["doc_id"] for s in hf] == list(range(5))
    ours, theirs = loglikelihoods(api), loglikelihoods(hf)
    assert [len(x) for x in ours] == [3] * 5
    for a, b in zip(ours, theirs):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-4)
    # the greedy flags (is the continuation the argmax at every step?) agree too
    assert [[r[1] for r in s["filtered_resps"]] for s in api] == [[r[1] for r in s["filtered_resps"]] for s in hf]
