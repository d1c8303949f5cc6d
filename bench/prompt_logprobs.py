"""Prefill throughput with and without prompt logprobs (issue 23), at the Qwen3-0.6B shape.

Model: a random Qwen3 with Qwen3-0.6B's shape (vocab 151,936, hidden 1024, 16 query / 8 KV heads,
head_dim 128, intermediate 3072, tied embeddings), made here with transformers and saved with
`save_pretrained` (nothing is downloaded); `--layers` of its 28 (default 4: on a 2-core CPU the full
depth makes each run minutes long; the lm_head, which is what prompt logprobs add, is full size
whatever the depth, so fewer layers make the relative cost look LARGER than at full depth).

Workload: `--prompts` prompts of `--prompt-len` random ids, one job through LocalCluster (1 float32
worker, prefix caching off so every row computes the same work), rows alternated `--repeat` times:
  - without: max_new_tokens 1 (the prefill, one token sampled);
  - with k = `--k`: the same plus prompt_logprobs=k (lm_head over every prompt row, in row chunks);
  - with k, max_new_tokens 0 (what a harness asks: the prompt's logprobs and nothing else).
Prefill tok/s = prompt tokens / wall time of the job.

    .venv/bin/python bench/prompt_logprobs.py [--layers 4] [--prompts 8] [--prompt-len 512] [--k 1]
        [--repeat 3] [--ckpt DIR (reuse / keep the checkpoint)]
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from client import LocalCluster  # noqa: E402

QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, max_position_embeddings=40960,
                 rope_theta=1000000.0, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645)


def make_checkpoint(directory: str, layers: int) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=layers, **QWEN3_06B))
    model.save_pretrained(directory)


def run(cluster, prompts, **kw) -> float:
    t0 = time.perf_counter()
    results = cluster.client.wait(cluster.client.submit([dict(prompt_token_ids=p, **kw) for p in prompts]))
    wall = time.perf_counter() - t0
    assert all(r.error is None for r in results), [r.error for r in results]
    if "prompt_logprobs" in kw:
        assert all(len(r.prompt_logprobs) == len(p) for r, p in zip(results, prompts))
    return sum(len(p) for p in prompts) / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ckpt", default=None)
    args = ap.parse_args()
    ckpt = args.ckpt or tempfile.mkdtemp(prefix="qwen3-06b-shape-")
    if not os.path.isfile(os.path.join(ckpt, "config.json")):
        t = time.perf_counter()
        make_checkpoint(ckpt, args.layers)
        print(f"checkpoint: {args.layers} layers at the Qwen3-0.6B shape in {time.perf_counter() - t:.0f}s ({ckpt})")
    rng = random.Random(0)
    prompts = [[rng.randrange(0, QWEN3_06B["vocab_size"]) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    rows = {"without (max_new_tokens 1)": dict(max_new_tokens=1),
            f"with prompt_logprobs={args.k} (max_new_tokens 1)": dict(max_new_tokens=1, prompt_logprobs=args.k),
            f"with prompt_logprobs={args.k} (max_new_tokens 0)": dict(max_new_tokens=0, prompt_logprobs=args.k)}
    got = {name: [] for name in rows}
    try:
        with LocalCluster(model=ckpt, workers=1, dtype="float32", extra_service_args=["--no-prefix-caching"]) as c:
            run(c, prompts[:2], max_new_tokens=1, prompt_logprobs=args.k)            # warm-up
            for _ in range(args.repeat):
                for name, kw in rows.items():
                    got[name].append(run(c, prompts, **kw))
    finally:
        if args.ckpt is None:
            shutil.rmtree(ckpt, ignore_errors=True)
    base = sum(got["without (max_new_tokens 1)"]) / args.repeat
    print(f"\n{args.prompts} prompts x {args.prompt_len} tokens, Qwen3-0.6B shape with {args.layers} layers, "
          f"1 float32 CPU worker, {args.repeat} repetitions\n")
    print("| row | prefill tok/s (mean) | each | vs without |")
    print("|---|---:|---|---:|")
    for name, vals in got.items():
        mean = sum(vals) / len(vals)
        print(f"| {name} | {mean:,.0f} | {', '.join(f'{v:,.0f}' for v in vals)} | {mean / base:.2f}x |")


if __name__ == "__main__":
    main()
