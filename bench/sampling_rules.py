"""What sampling and the per-request rules cost (temperature / top-p / top-k, min_tokens, penalties,
top logprobs) against greedy decoding with none.

Part 1, in process: one decode step's sampling as the worker runs it (worker/sampler.sample, or
worker/logits_processors.sample_with_rules for rows with rules) on [rows, vocab] float32 logits,
ms per step, each row's parameters on every row.
Part 2, end to end: one SDK job of --prompts requests (prompts of 16-64 random ids, --new-tokens
each, greedy unless the row samples) through LocalCluster (service + 1 worker), each row's
parameters on every request; tok/s and the ratio to the first row, rows taking turns for --repeat
rounds, each row of each round on new prompts (a repeated batch would hit the prefix cache).

    .venv/bin/python bench/sampling_rules.py [--model qwen3-0.6b|tiny|PATH] [--dtype auto]
        [--prompts 64] [--new-tokens 64] [--repeat 2] [--skip-cluster] [--bf16-logits] [--rows greedy,top_p 0.8]

min_tokens rows do not ignore EOS, so EOS is masked on every step (min_tokens = new tokens: every
request still generates exactly --new-tokens); the other rows ignore EOS. Random weights give flat
distributions: a top-p nucleus there holds most of the vocabulary (the sampler's slow case: its
candidates cannot hold it, and it bins the row); a trained model's is usually a few dozen tokens.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from e2e import workload  # noqa: E402
from shapes import resolve_model  # noqa: E402


def rules(n: int) -> dict[str, dict]:
    return {"none (greedy)": dict(ignore_eos=True),
            "temperature 1.0 (every token kept)": dict(ignore_eos=True, temperature=1.0, seed=1),
            "temperature 0.6, top_p 0.95, top_k 20 (Qwen3's card)": dict(ignore_eos=True, temperature=0.6,
                                                                         top_p=0.95, top_k=20, seed=1),
            "temperature 0.7, top_p 0.8": dict(ignore_eos=True, temperature=0.7, top_p=0.8, seed=1),
            "temperature 1.0, min_p 0.05": dict(ignore_eos=True, temperature=1.0, min_p=0.05, seed=1),
            "min_tokens (EOS masked)": dict(min_new_tokens=n),
            "repetition_penalty 1.1": dict(ignore_eos=True, repetition_penalty=1.1),
            "presence 0.5 + frequency 0.5": dict(ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.5),
            "logprobs 5": dict(ignore_eos=True, logprobs=5)}


def has_rules(rule: dict) -> bool:
    return any(key in rule for key in ("min_new_tokens", "logprobs", "min_p")) or any(key.endswith("penalty") for key in rule)


def extras_for(rule: dict, rows: int, vocab: int, history: int, eos: int):
    """The SamplingExtras a step of `rows` sequences with `history` ids each would carry."""
    from worker.validate_sampling import SamplingExtras
    rng = np.random.default_rng(0)
    x = SamplingExtras()
    x.top_logprobs = rule.get("logprobs", 0)
    if "min_p" in rule:
        x.min_p = np.full(rows, rule["min_p"], dtype=np.float32)
    if "min_new_tokens" in rule:
        x.suppress = np.ones(rows, dtype=bool)
        x.suppress_counts = np.ones(rows, dtype=np.int32)
        x.suppress_ids = np.full(rows, eos, dtype=np.int32)
    if any(k.endswith("penalty") for k in rule):
        x.repetition = np.full(rows, rule.get("repetition_penalty", 1.0))
        x.presence = np.full(rows, rule.get("presence_penalty", 0.0))
        x.frequency = np.full(rows, rule.get("frequency_penalty", 0.0))
        x.penalty_counts = np.full(rows, history, dtype=np.int32)
        x.penalty_prompt_lens = np.full(rows, history // 2, dtype=np.int32)
        x.penalty_tokens = rng.integers(0, vocab, rows * history).astype(np.int32)
    return x


def in_process(args, vocab: int, eos: int) -> None:
    from worker import logits_processors, sampler
    rows = args.prompts
    # rounded to bfloat16, as the CPU bfloat16 mode's lm_head writes them (auto on a bfloat16 CPU):
    # values tie far more often than float32 ones, which the top-k head must handle
    logits = torch.randn(rows, vocab).bfloat16().float() if args.bf16_logits else torch.randn(rows, vocab)
    zeros = lambda dt: np.zeros(rows, dtype=dt)  # noqa: E731
    print(f"## Part 1: one decode step's sampling, {rows} rows x {vocab} vocab, float32, "
          f"{torch.get_num_threads()} torch threads (histories of {2 * args.new_tokens} ids for penalties)\n")
    print("| rule | ms per step | vs none |")
    print("|---|---|---|")
    base = None
    for name, rule in rules(args.new_tokens).items():
        x = extras_for(rule, rows, vocab, 2 * args.new_tokens, eos) if has_rules(rule) else None
        params = (np.full(rows, rule.get("temperature", 0.0), np.float32), np.full(rows, rule.get("top_p", 1.0),
                  np.float32), np.full(rows, rule.get("top_k", 0), np.int32), np.arange(rows, dtype=np.int64),
                  zeros(np.int32))
        times = []
        for i in range(23):
            work = logits.clone()    # the rules run in place: each step its own logits, copied untimed
            t0 = time.perf_counter()
            if x is None:
                sampler.sample(work, *params)
            else:   # the worker's path (worker/model_runner.py): logprobs=k asks for the token's own too
                logits_processors.sample_with_rules(work, x, *params, return_logprobs=x.top_logprobs > 0)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        ms = 1e3 * statistics.median(times)
        base = base or ms
        print(f"| {name} | {ms:.2f} | {ms / base:.2f}x |")


def cluster(args) -> None:
    from client import LocalCluster
    from minipaged.config import load_model_config
    vocab = load_model_config(args.model).vocab_size if args.model != "tiny" else 256
    tps: dict[str, list[float]] = {}
    with LocalCluster(model=args.model, workers=1, dtype=args.dtype, startup_timeout=900) as c:
        c.client.wait(c.client.submit([{"prompt_token_ids": p, "max_new_tokens": 4}
                                       for p in workload(4, 1, 16, 64, vocab)]))
        seed = 100
        for _ in range(args.repeat):
            for name, rule in rules(args.new_tokens).items():
                if args.rows and name not in args.rows and not any(r in name for r in args.rows):
                    continue
                seed += 1
                reqs = [dict(prompt_token_ids=p, max_new_tokens=args.new_tokens, **rule)
                        for p in workload(args.prompts, seed, 16, 64, vocab)]
                t0 = time.perf_counter()
                results = c.client.wait(c.client.submit(reqs))
                wall = time.perf_counter() - t0
                tokens = sum(sum(len(ch.token_ids) for ch in r.choices) if r.choices else len(r.token_ids)
                             for r in results)
                tps.setdefault(name, []).append(tokens / wall)
    print(f"\n## Part 2: LocalCluster (service + 1 worker, {args.dtype}), one job of {args.prompts} requests, "
          f"prompts of 16-64 ids, {args.new_tokens} new tokens each, greedy unless the row samples, {args.repeat} rounds\n")
    print("| rule on every request | tok/s (mean) | each round | vs none |")
    print("|---|---|---|---|")
    base = statistics.mean(next(iter(tps.values())))
    for name, v in tps.items():
        m = statistics.mean(v)
        print(f"| {name} | {m:.0f} | {', '.join(f'{x:.0f}' for x in v)} | {m / base:.2f}x |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b", help="tiny, a named shape (bench/shapes.py) or a checkpoint")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--skip-cluster", action="store_true")
    ap.add_argument("--rows", type=lambda v: [x for x in v.split(",") if x], default=[],
                    help="Part 2 only: comma list of substrings of the rows to run (default: every row; "
                         "the first one run is the anchor)")
    ap.add_argument("--bf16-logits", action="store_true",
                    help="Part 1's logits rounded to bfloat16 (the CPU bfloat16 mode's lm_head output)")
    args = ap.parse_args()
    args.model = resolve_model(args.model)
    from minipaged.config import load_model_config
    cfg = load_model_config(args.model) if args.model != "tiny" else None
    vocab = cfg.vocab_size if cfg else 256
    eos = (cfg.eos_token_ids[0] if cfg and getattr(cfg, "eos_token_ids", None) else 1)
    torch.set_num_threads(os.cpu_count() or 1)   # as the cluster's one worker computes
    in_process(args, vocab, eos)
    if not args.skip_cluster:
        cluster(args)


if __name__ == "__main__":
    main()
