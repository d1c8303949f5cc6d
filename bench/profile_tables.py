"""bench/profile_step.py's Part 1 tables: where a step's time goes in the in-process replay, per phase
and per step type. Apart so that profile_step.py stays a readable size."""
from __future__ import annotations

import collections


GROUPS = [  # display order of phase prefixes
    "svc: schedule", "svc: build StepRequest", "svc: serialize", "worker: parse", "worker: validate",
    "worker: make_batch", "worker: forward (glue)", "fwd:", "attn backend:", "lm_head + logits",
    "sampler", "worker: sample (glue)", "worker: build + serialize reply", "svc: parse reply", "svc: apply"]


def order_key(name):
    for i, g in enumerate(GROUPS):
        if name.startswith(g):
            return (i, name)
    return (len(GROUPS), name)


def breakdown_table(per_step, want_decode: bool) -> tuple[str, float, int]:
    rows = [s for s in per_step if s[0] == want_decode]
    if not rows:
        return "(no such steps)\n", 0.0, 0
    n = len(rows)
    acc = collections.Counter()
    for *_, c in rows:
        acc.update(c)
    step_ms = 1000 * sum(r[2] for r in rows) / n
    tokens = sum(r[1] for r in rows) / n
    lines = [f"| phase | ms/step | % of step |", "|---|---|---|"]
    for name in sorted(acc, key=order_key):
        ms = 1000 * acc[name] / n
        lines.append(f"| {name} | {ms:.3f} | {100 * ms / step_ms:.1f}% |")
    timed = 1000 * sum(acc.values()) / n
    lines.append(f"| (outside any timer) | {step_ms - timed:.3f} | {100 * (step_ms - timed) / step_ms:.1f}% |")
    lines.append(f"| **step** ({n} steps, {tokens:.0f} tokens/step on average) | **{step_ms:.3f}** | 100% |")
    return "\n".join(lines) + "\n", step_ms, n


def summary_rows(per_step):
    """Service / worker / (in-process) totals per step type."""
    out = {}
    for label, sel in (("decode", True), ("prefill/mixed", False)):
        rows = [s for s in per_step if s[0] == sel]
        if not rows:
            continue
        svc = sum(v for *_, c in rows for k, v in c.items() if k.startswith("svc:"))
        wall = sum(r[2] for r in rows)
        out[label] = dict(n=len(rows), wall=wall, svc=svc, worker=wall - svc)
    return out


def print_replay(r) -> None:
    """Part 1: the whole workload's rate, one breakdown per step type, the untimed forward for
    reference, service against worker totals, and torch.profiler's table if asked for."""
    print("## In-process replay (both planes' code, no wire)\n")
    print(f"whole workload: {r['total']:.2f} s, {len(r['per_step'])} steps, "
          f"{r['tokens'] / r['total']:.0f} tok/s in process\n")
    for label, want in (("Steady decode step", True), ("Prefill / mixed step", False)):
        table, step_ms, n = breakdown_table(r["per_step"], want)
        print(f"### {label}\n")
        print(table)
    if r["untimed"] is not None:
        print(f"decode step forward + sample with no timers (same batch shape at mid-generation): "
              f"{r['untimed']:.3f} ms\n")
    sums = summary_rows(r["per_step"])
    print("| step type | steps | total s | service s | worker s | worker share |")
    print("|---|---|---|---|---|---|")
    for label, v in sums.items():
        print(f"| {label} | {v['n']} | {v['wall']:.3f} | {v['svc']:.3f} | {v['worker']:.3f} | "
              f"{100 * v['worker'] / v['wall']:.1f}% |")
    if r["torch_table"]:
        print("\n### torch.profiler, steady decode forward (5 steps)\n\n```\n" + r["torch_table"] + "```\n")
