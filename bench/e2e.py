"""End-to-end throughput on one machine: this system against transformers, measured in the same run.

Workload (issue 4 section 8): the embedded `tiny` Qwen3 in float32, 64 prompts with lengths uniform
in 16-512 (fixed seed), 64 new tokens each, greedy, no EOS. Rows: this system with 1 worker and with
2 pipeline stages; transformers `generate` per prompt, on the left-padded batch, and `generate_batch`
(its continuous batching with paged attention). A second table times the metadata service's per-step
path (schedule + pack + serialize + apply) with 256 running sequences, in process.

    .venv/bin/python bench/e2e.py [--prompts 64] [--new-tokens 64] [--skip-hf-per-prompt]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from client import LocalCluster  # noqa: E402
from minipaged.config import TINY_CONFIG, load_model_config  # noqa: E402


def workload(n: int, seed: int = 0):
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(rng.randint(16, 512))] for _ in range(n)]


def hf_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from worker.weights import tiny_state_dict
    model = Qwen3ForCausalLM(Qwen3Config(**TINY_CONFIG))
    model.load_state_dict(tiny_state_dict(load_model_config("tiny")), strict=False)
    return model.float().eval()


def run_system(prompts, new_tokens, workers):
    with LocalCluster(model="tiny", workers=workers, dtype="float32", block_size=16) as c:
        # warm-up on other prompts (no prefix-cache help): first-call allocations, thread pools
        warm = workload(4, seed=1)
        c.client.wait(c.client.submit([{"prompt_token_ids": p, "max_new_tokens": 4} for p in warm]))
        base = c.client.stats()
        util, stop = [], threading.Event()

        def poll():
            while not stop.is_set():
                st = c.client.stats()
                if st.running:
                    util.append(st.kv_utilization)
                time.sleep(0.25)  # Stats checks every invariant: keep the probe light
        t = threading.Thread(target=poll, daemon=True)
        t.start()
        t0 = time.perf_counter()
        job = c.client.submit([{"prompt_token_ids": p, "max_new_tokens": new_tokens, "ignore_eos": True}
                               for p in prompts])
        results = c.client.wait(job)
        wall = time.perf_counter() - t0
        stop.set()
        t.join()
        st = c.client.stats()
        assert all(len(r.token_ids) == new_tokens for r in results)
        steps = st.steps - base.steps
        meta_ms = (st.metadata_ms_per_step * st.steps - base.metadata_ms_per_step * base.steps) / max(steps, 1)
        return dict(wall=wall, tokens=sum(len(r.token_ids) for r in results),
                    util=sum(util) / len(util) if util else float("nan"), meta_ms=meta_ms, steps=steps)


def run_hf_per_prompt(model, prompts, new_tokens):
    t0 = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            model.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=0)
    wall = time.perf_counter() - t0
    return dict(wall=wall, tokens=len(prompts) * new_tokens, util=1.0, meta_ms=None, steps=None)


def run_hf_padded(model, prompts, new_tokens):
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generation wants
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0)
    wall = time.perf_counter() - t0
    used = sum(len(p) + new_tokens for p in prompts)
    return dict(wall=wall, tokens=len(prompts) * new_tokens, util=used / (len(prompts) * (width + new_tokens)),
                meta_ms=None, steps=None)


def run_hf_generate_batch(model, prompts, new_tokens):
    from transformers import GenerationConfig
    cfg = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    t0 = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=cfg)  # it manages no_grad itself
    wall = time.perf_counter() - t0
    tokens = sum(len(o.generated_tokens) for o in out.values())
    return dict(wall=wall, tokens=tokens, util=float("nan"), meta_ms=None, steps=None)


def metadata_path_per_step(num_seqs=256, context=2048, steps=50):
    """Schedule + build the StepRequest + serialize + apply a fake reply, 256 decoding sequences."""
    import numpy as np

    from metadata_service.engine import Engine
    from metadata_service.sequence import SamplingParams, Sequence
    from minipaged.v1 import worker_pb2
    from minipaged.wire import pack

    eng = Engine(block_size=16, num_blocks=num_seqs * (context // 16 + 64), max_num_batched_tokens=8192,
                 max_num_seqs=num_seqs)
    eng.vocab_size = 512
    rng = np.random.default_rng(0)
    for _ in range(num_seqs):
        eng.scheduler.add(Sequence(rng.integers(0, 256, context - 1).tolist(), SamplingParams(max_new_tokens=10**6)))
    while eng.scheduler.waiting:  # prefill everything (not timed)
        b = eng.scheduler.schedule()
        eng._apply(b, worker_pb2.StepReply(sampled_token_ids=pack(np.ones(int(b.do_sample.sum()), np.int32))))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        with eng.lock:
            b = eng.scheduler.schedule()
        eng._step_request(b).SerializeToString()
        eng._apply(b, worker_pb2.StepReply(sampled_token_ids=pack(np.ones(len(b.seqs), np.int32))))
        times.append(time.perf_counter() - t0)
    assert len(b.seqs) == num_seqs and b.num_tokens == num_seqs
    times.sort()
    return 1000 * times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--skip-hf-per-prompt", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    prompts = workload(args.prompts)
    rows = {}
    rows["minipaged, 1 worker"] = run_system(prompts, args.new_tokens, 1)
    rows["minipaged, 2 stages"] = run_system(prompts, args.new_tokens, 2)
    model = hf_model()
    if not args.skip_hf_per_prompt:
        rows["HF generate, per prompt"] = run_hf_per_prompt(model, prompts, args.new_tokens)
    rows["HF generate, padded batch"] = run_hf_padded(model, prompts, args.new_tokens)
    try:
        rows["HF generate_batch (paged)"] = run_hf_generate_batch(model, prompts, args.new_tokens)
    except Exception as e:  # report, don't hide: the table says it failed
        print(f"generate_batch failed: {type(e).__name__}: {e}", file=sys.stderr)

    tps = {k: v["tokens"] / v["wall"] for k, v in rows.items()}
    pad = tps.get("HF generate, padded batch")
    gb = tps.get("HF generate_batch (paged)")
    print(f"\n{args.prompts} prompts, lengths 16-512, {args.new_tokens} new tokens, greedy, tiny Qwen3 float32, "
          f"{torch.get_num_threads()} torch threads\n")
    print(f"{'system':28} {'wall s':>8} {'tok/s':>8} {'x padded':>9} {'x gen_batch':>11} {'KV util':>8} "
          f"{'meta ms/step':>12}")
    for k, v in rows.items():
        meta = f"{v['meta_ms']:.3f}" if v["meta_ms"] is not None else "-"
        print(f"{k:28} {v['wall']:8.2f} {tps[k]:8.1f} {tps[k] / pad if pad else float('nan'):9.2f} "
              f"{tps[k] / gb if gb else float('nan'):11.2f} {v['util']:8.3f} {meta:>12}")
    ms = metadata_path_per_step()
    print(f"\nmetadata-service path per step, 256 running sequences at 2k context (schedule + pack + "
          f"serialize + apply, median): {ms:.3f} ms (goal <= 1 ms)")


if __name__ == "__main__":
    main()
