"""Where to cut a model into pipeline stages: the even split against the lm_head-weighted one that
LocalCluster (and `minipaged serve --stages`) uses, on real CPU workers at a real shape.

The last stage reads the lm_head beside its layers on every decode step (9.9 layers' worth at
Qwen3-0.6B; client/cluster.py split_layers), so the weighted split gives it fewer layers. Rows take
turns within each round; a decode-heavy load (16 prompts of 16-64 ids, 64 new) and a prefill-heavy
one (16 of 64-512, 32 new: the lm_head runs only for sampled rows there, so the even split should
win). tok/s counts prompt and generated tokens.

    .venv/bin/python bench/layer_split.py [--model qwen3-0.6b] [--stages 2] [--rounds 2]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import client.cluster as cluster  # noqa: E402
from minipaged.config import lm_head_layers  # noqa: E402
from scale import table  # noqa: E402
from shapes import resolve_model  # noqa: E402

LOADS = {"decode-heavy": (16, 64, 64), "prefill-heavy": (64, 512, 32)}   # prompt ids lo, hi; new tokens
SPLITS = {"even": lambda c: 0.0, "lm_head-weighted": lm_head_layers}   # what split_layers is given


def requests(lo: int, hi: int, new: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(1000, 100000) for _ in range(rng.randint(lo, hi))],
             "max_new_tokens": new, "ignore_eos": True} for _ in range(16)]


def one_run(model: str, stages: int, split, reqs: list[dict]) -> tuple[float, list]:
    cluster.lm_head_layers = split           # LocalCluster's split, for this cluster only
    try:
        with cluster.LocalCluster(model=model, workers=stages, dtype="float32", startup_timeout=600) as c:
            c.client.wait(c.client.submit(reqs[:2]))          # warm-up
            t0 = time.perf_counter()
            res = c.client.wait(c.client.submit(reqs))
            dt = time.perf_counter() - t0
            layers = c.layers[:stages]
    finally:
        cluster.lm_head_layers = lm_head_layers
    tokens = sum(len(r.token_ids) for r in res) + sum(len(r["prompt_token_ids"]) for r in reqs)
    return tokens / dt, layers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    model = resolve_model(args.model)
    for load, (lo, hi, new) in LOADS.items():
        reqs = requests(lo, hi, new)
        runs = {name: [] for name in SPLITS}
        layers = {}
        for _ in range(args.rounds):
            for name, split in SPLITS.items():
                tps, layers[name] = one_run(model, args.stages, split, reqs)
                runs[name].append(tps)
        base = sum(runs["even"]) / len(runs["even"])
        rows = [(name, " ".join(f"{a}:{b}" for a, b in layers[name]), f"{sum(v) / len(v):.1f}",
                 " / ".join(f"{x:.1f}" for x in v), f"{sum(v) / len(v) / base:.2f}x") for name, v in runs.items()]
        table(f"{args.model}, {args.stages} CPU stages (float32, {os.cpu_count()} cores), {load}: 16 prompts of "
              f"{lo}-{hi} ids, {new} new; lm_head = {lm_head_layers(cluster.load_model_config(model)):.1f} layers",
              ("split", "layers", "tok/s (mean)", "each round", "vs even"), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
