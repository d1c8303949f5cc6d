"""bench/e2e.py's table: tok/s per row, the ratios to the vLLM rows, how many generations match
vLLM's and HF's greedy output, start-up and peak RSS. Its own module so that e2e.py stays a readable
size; e2e.py re-exports these names."""
from __future__ import annotations

import os
import sys


def identical(a, b) -> str:
    if a is None or b is None:
        return "-"
    return f"{sum(x == y for x, y in zip(a, b))}/{len(b)}"


def tps(r):
    n = r.get("n_tokens") or sum(len(t) for t in r["tokens"])
    return n / r["wall"]


def print_table(title, runs, ref_key, alt_key):
    """One workload's rows: tok/s, ratios to the equal-cores vLLM row (ref) and its default (alt)."""
    mean = {k: sum(tps(r) for r in v) / len(v) for k, v in runs.items()}
    ref, alt = mean.get(ref_key), mean.get(alt_key)
    ref_tokens = runs[ref_key][-1]["tokens"] if ref_key in runs else None
    hf_tokens = runs["HF generate, per prompt"][0]["tokens"] if "HF generate, per prompt" in runs else None
    print(f"\n### {title}\n")
    print("| system | tok/s (mean) | each run | x vLLM equal cores | x vLLM default | same tokens as vLLM "
          "(equal cores) | same as HF greedy | start-up to ready s | peak RSS MB per process | KV util |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for k, v in runs.items():
        each = ", ".join(f"{tps(r):.1f}" for r in v)
        rv = f"{mean[k] / ref:.2f}" if ref else "-"
        ra = f"{mean[k] / alt:.2f}" if alt else "-"
        same_v = ", ".join(identical(r["tokens"], ref_tokens) for r in v) if ref_tokens else "-"
        same_hf = ", ".join(identical(r["tokens"], hf_tokens) for r in v)
        ups = [r["startup"] for r in v if r.get("startup") is not None]
        up = f"{sum(ups) / len(ups):.1f}" if ups else "-"
        rss: dict = {}
        for r in v:  # the largest peak seen per process name (pids stripped)
            for name, mb in r.get("rss", {}).items():
                key = name.split(" ", 1)[-1]
                rss[key] = max(rss.get(key, 0.0), mb)
        rss_s = ", ".join(f"{n} {mb:.0f}" for n, mb in rss.items()) or "-"
        util = sum(r["util"] for r in v) / len(v)     # (the anchors report none; a short run may miss it)
        util_s = "-" if util != util else f"{util:.3f}"
        print(f"| {k} | {mean[k]:.1f} | {each} | {rv} | {ra} | {same_v} | {same_hf} | {up} | {rss_s} | {util_s} |")


def print_report(args, plan, runs, version: str, final: bool) -> None:
    """The header and every workload's table: at the end, and (partial) after each vLLM anchor but the
    last, so that a long run cut short still says something."""
    ref_key = next((f"{a} {version}" for a, _ in plan.anchors if "equal" in a), None)
    alt_key = next((f"{a} {version}" for a, _ in plan.anchors if "default" in a), None)
    print(f"\n{'' if final else '(partial, so far) '}model {args.model} ({plan.ckpt}), {args.dtype} compute"
          f"{'' if (args.vllm_dtype or args.dtype) == args.dtype else f' (vLLM: {args.vllm_dtype})'}, greedy, "
          f"ignore_eos; {os.cpu_count()} CPUs; K/V space {plan.kv_gib:g} GiB for us and vLLM; load average "
          f"{os.getloadavg()[0]:.1f} now; start-up: ours = processes spawned to cluster ready (weights "
          f"loaded), vLLM = LLM() + its warm-up", flush=True)
    for w, (prompts, new) in plan.loads.items():
        lens = [len(p) for p in prompts]
        print_table(f"{w}: {len(prompts)} prompts of {min(lens)}-{max(lens)} ids ({sum(lens)} in all), "
                    f"{new} new tokens each", runs[w], ref_key, alt_key)
    sys.stdout.flush()
