"""bench/profile_step.py's Part 2: the same workload through LocalCluster (service and worker as
processes, gRPC on loopback), its wall time per step split with the service's Stats. Apart so that
profile_step.py stays a readable size."""
from __future__ import annotations

import time

from e2e import workload


def cluster_run(args, prompts):
    """The workload through LocalCluster; the service's Stats split its wall time per step into the
    worker's compute (each stage's StageTiming, summed by the chain) and the rest."""
    from client import LocalCluster

    def chain_busy_ms(st):
        return sum(float(s["step_ms"]) * int(c["steps"]) for c in st.chains for s in c["stages"])

    kw = dict(threads=args.threads) if args.threads else {}
    with LocalCluster(model=args.model, workers=args.workers, dtype=args.dtype,
                      block_size=args.block_size, **kw) as c:
        warm = workload(4, seed=1)
        c.client.wait(c.client.submit([{"prompt_token_ids": p, "max_new_tokens": 4} for p in warm]))
        base = c.client.stats()
        t0 = time.perf_counter()
        job = c.client.submit([{"prompt_token_ids": p, "max_new_tokens": args.new_tokens, "ignore_eos": True}
                               for p in prompts])
        c.client.wait(job)
        wall = time.perf_counter() - t0
        st = c.client.stats()
    steps = sum(int(ch["steps"]) for ch in st.chains) - sum(int(ch["steps"]) for ch in base.chains)
    meta_s = (st.metadata_ms_per_step * st.steps - base.metadata_ms_per_step * base.steps) / 1000
    busy_s = (chain_busy_ms(st) - chain_busy_ms(base)) / 1000
    return dict(wall=wall, steps=steps, meta_s=meta_s, busy_s=busy_s)


def print_cluster(args, r, c) -> None:
    """Part 2: the cluster's rate against the replay's, and its wall time per step split by Stats."""
    inproc, n = r["total"], len(r["per_step"])
    per = lambda x: 1000 * x / max(c["steps"], 1)  # noqa: E731
    print(f"\n## Distributed path (LocalCluster, {args.workers} worker(s), gRPC on loopback, "
          f"{'%d threads' % args.threads if args.threads else 'its default threads'})\n")
    print(f"{c['steps']} steps in {c['wall']:.3f} s: {r['tokens'] / c['wall']:.0f} tok/s "
          f"(in-process replay above: {r['tokens'] / inproc:.0f} tok/s over {n} steps"
          f"{', CPU time' if args.cpu_time else ''})\n")
    print("| per step (Stats) | ms | % of step |")
    print("|---|---|---|")
    wall_ms = per(c["wall"])
    for label, v in (("worker compute (stages' StageTiming, summed)", per(c["busy_s"])),
                     ("metadata service: schedule + build + apply (overlaps compute with async "
                      "scheduling)", per(c["meta_s"]))):
        print(f"| {label} | {v:.2f} | {100 * v / wall_ms:.1f}% |")
    rest = wall_ms - per(c["busy_s"])
    print(f"| wall minus worker compute: wire, hand-offs, service work not overlapped | {rest:.2f} | "
          f"{100 * rest / wall_ms:.1f}% |")
    print(f"| **step** | **{wall_ms:.2f}** | 100% |")
