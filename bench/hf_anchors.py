"""The transformers rows of bench/e2e.py: `generate` per prompt (the greedy oracle), on the
left-padded batch, and `generate_batch` (its continuous batching with paged attention). Kept apart
from e2e.py so that each file stays a readable size; e2e.py re-exports these."""
from __future__ import annotations

import sys
import time

import torch

from worker.model_runner import cpu_compute_threads


def run_hf_per_prompt(model, prompts, new_tokens):
    t0 = time.perf_counter()
    tokens = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0)
            tokens.append(out[0, len(p):].tolist())
    return dict(wall=time.perf_counter() - t0, tokens=tokens, util=1.0, meta_ms=None)


def run_hf_padded(model, prompts, new_tokens):
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generation wants
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
    wall = time.perf_counter() - t0
    used = sum(len(p) + new_tokens for p in prompts)
    return dict(wall=wall, tokens=out[:, width:].tolist(), util=used / (len(prompts) * (width + new_tokens)),
                meta_ms=None)


def run_hf_generate_batch(model, prompts, new_tokens):
    from transformers import GenerationConfig
    cfg = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    t0 = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=cfg)  # it manages no_grad itself
    wall = time.perf_counter() - t0
    ordered = [out[k].generated_tokens for k in sorted(out, key=lambda k: int(str(k).rsplit("_", 1)[-1]))] \
        if all(str(k).rsplit("_", 1)[-1].isdigit() for k in out) else None
    return dict(wall=wall, tokens=ordered, n_tokens=sum(len(o.generated_tokens) for o in out.values()),
                util=float("nan"), meta_ms=None)


def run_hf_rows(args, plan, runs) -> None:
    """The tiny workload's transformers rows (one run each) into runs["tiny"]; `plan` is e2e.py's Plan."""
    # HF on one core fewer than the machine has, as vLLM's compute (and ours with the
    # recommended setting): the other serves the host side
    torch.set_num_threads(cpu_compute_threads())
    prompts, new = plan.loads["tiny"]
    if not args.skip_hf_per_prompt:
        runs["tiny"]["HF generate, per prompt"] = [run_hf_per_prompt(plan.model, prompts, new)]
    runs["tiny"]["HF generate, padded batch"] = [run_hf_padded(plan.model, prompts, new)]
    try:
        runs["tiny"]["HF generate_batch (paged)"] = [run_hf_generate_batch(plan.model, prompts, new)]
    except Exception as e:  # report, don't hide: the table says it failed
        print(f"generate_batch failed: {type(e).__name__}: {e}", file=sys.stderr)
