"""The metadata plane as the cluster's KV directory (issue 22), measured with simulated workers.

Section `routing`: many tenants' system prompts under cache pressure, over 4 replicas. Each tenant
has a system prompt of 1-2k tokens; each request is one tenant's prompt plus a user turn of 32-128
tokens, `--new` new tokens; requests come shuffled across tenants, either as Poisson arrivals at
`--rate` requests/s (open loop: TTFT includes the queue a slower cache builds up, as a service's
users see it) or, with `--rate 0`, `--concurrency` streams at a time (closed loop).
Each chain's pool is capped (`--num-blocks`) so that the 4 pools together hold only part of the
tenants' prefixes: a request that lands where its prefix is not cached recomputes it. Rows:
  - exact: the router reads what each chain's prefix cache holds (metadata_service/router.py);
  - prefix: the approximate index (an LRU of what was routed to each chain);
  - round-robin;
  - 1 replica with the same pool cap (the hit rate a single cache reaches).
Each row runs `--repeat` times on fresh clusters (fresh caches); the table shows the medians of
the runs' hit rates and TTFT percentiles. SIMULATED H200s (worker/simulator.py), Qwen3-8B shape,
every process on this machine's cores.

    .venv/bin/python bench/kv_tiers.py [--only routing] [--tenants 48] [--per 8] [--num-blocks 1024]
        [--new 32] [--rate 0 | --concurrency 32] [--repeat 5] [--quick]

(The KV tier and disaggregated prefill/decode sections of issue 22 are not built yet.)
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from scale import shared_prefix_requests, sim_cluster, table, ttfts  # noqa: E402  (puts the repo root on the path)

from client import AsyncClient  # noqa: E402


async def open_loop_ttfts(address: str, reqs: list[dict], rate: float, seed: int) -> list[float]:
    """Each request starts at its Poisson arrival time (`rate` per second), whatever is still
    running; returns the sorted times to first token."""
    rng, at, out = random.Random(seed), 0.0, []
    async with AsyncClient(address) as c:
        async def one(r, delay):
            await asyncio.sleep(delay)
            t0 = time.perf_counter()
            async for _ in c.stream(**r):
                out.append(time.perf_counter() - t0)
                break
        tasks = []
        for r in reqs:
            tasks.append(one(r, at))
            at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return sorted(out)


def one_run(replicas: int, router: str, reqs: list[dict], args) -> tuple:
    """(hit rate, TTFT p50, p90, p99 s, wall s) of one fresh cluster serving reqs."""
    extra = ("--router", router, "--num-blocks", str(args.num_blocks))
    with sim_cluster(replicas=replicas, extra=extra) as c:
        b = c.client.stats()
        t0 = time.perf_counter()
        if args.rate > 0:
            lat = asyncio.run(open_loop_ttfts(c.address, reqs, args.rate, seed=len(reqs)))
        else:
            lat = asyncio.run(ttfts(c.address, reqs, concurrency=args.concurrency))
        wall = time.perf_counter() - t0
        a = c.client.stats()
    q, h = a.prefix_cache_queries - b.prefix_cache_queries, a.prefix_cache_hits - b.prefix_cache_hits
    pct = lambda p: lat[min(len(lat) - 1, int(len(lat) * p))]  # noqa: E731
    return (h / q if q else 0.0, pct(0.5), pct(0.9), pct(0.99), wall)


def bench_routing(args) -> None:
    setups = (("4 replicas, exact", 4, "exact"), ("4 replicas, prefix (approximate)", 4, "prefix"),
              ("4 replicas, round-robin", 4, "round_robin"), ("1 replica", 1, "exact"))
    runs: dict[str, list] = {label: [] for label, *_ in setups}
    for r in range(args.repeat):          # rows take turns within each repetition (the machine drifts)
        reqs = shared_prefix_requests(seed=11 + r, systems=args.tenants, per=args.per, new=args.new)
        for label, replicas, router in setups:
            runs[label].append(one_run(replicas, router, reqs, args))
    rows, exact = [], None
    for label, *_ in setups:
        med = [sorted(x)[len(x) // 2] for x in zip(*runs[label])]
        exact = exact or med
        rows.append((label, f"{med[0]:.3f}", f"{1e3 * med[1]:.0f}", f"{1e3 * med[2]:.0f}", f"{1e3 * med[3]:.0f}",
                     f"{med[2] / exact[2]:.2f}x", f"{med[4]:.1f}"))
    load = f"Poisson arrivals at {args.rate:g}/s" if args.rate > 0 else f"{args.concurrency} concurrent streams"
    table(f"tenants' system prompts under cache pressure ({args.tenants} prompts of 1-2k ids x {args.per} requests, "
          f"user turns of 32-128 ids, {args.new} new; {load}; pool {args.num_blocks} blocks of 16 per chain), "
          f"simulated H200, median of {args.repeat} runs",
          ("routing", "hit rate", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "p90 vs exact", "wall s"), rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="routing")
    ap.add_argument("--tenants", type=int, default=48)
    ap.add_argument("--per", type=int, default=8, help="requests per tenant")
    ap.add_argument("--num-blocks", type=int, default=1024, help="each chain's pool (blocks of 16 tokens)")
    ap.add_argument("--new", type=int, default=32, help="new tokens per request")
    ap.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second (0: closed loop)")
    ap.add_argument("--concurrency", type=int, default=32, help="streams at a time when --rate is 0")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 8 tenants x 2, one repetition")
    args = ap.parse_args()
    if args.quick:
        args.tenants, args.per, args.repeat = 8, 2, 1
    if "routing" in args.only.split(","):
        bench_routing(args)


if __name__ == "__main__":
    main()
