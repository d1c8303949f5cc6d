"""The benches run at the real Qwen3-0.6B shape without crashing (issue 18): `--quick` smoke runs
of bench/profile_step.py (its K/V pool once sized for the tiny model: index_copy_ out of bounds)
and bench/e2e.py, on the shape's random checkpoint (made once into bench/shapes.py's cache)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, timeout=1200):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_named_shape_checkpoint_is_the_published_config():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from shapes import SHAPES, ensure_checkpoint
    path = ensure_checkpoint("qwen3-0.6b")
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    rope = cfg.get("rope_parameters") or {}            # where transformers 5 writes rope_theta
    for key, value in SHAPES["qwen3-0.6b"].items():
        assert cfg.get(key, rope.get(key)) == value, key
    assert (cfg.get("torch_dtype") or cfg.get("dtype")) == "bfloat16"


def test_profile_step_quick_at_the_real_shape():
    out = run("bench/profile_step.py", "--model", "qwen3-0.6b", "--workload", "prefill", "--quick",
              "--threads", "1", "--skip-cluster")
    assert "### Prefill / mixed step" in out and "attn backend: paged_prefill" in out


def test_e2e_quick_at_the_real_shape():
    out = run("bench/e2e.py", "--model", "qwen3-0.6b", "--quick")
    assert "### prefill:" in out and "### decode:" in out
    assert "| minipaged, 1 worker |" in out and "worker0" in out          # start-up and RSS printed
