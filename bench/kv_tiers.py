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
With `--routing-tier-slots S` (a table for each value; 0: no tier) every worker also offers a second
KV tier of S blocks (write-back): the exact router then sees what each chain's pool *and* tier hold,
and the approximate index is sized to the pool plus the tier.
Each row runs `--repeat` times on fresh clusters (fresh caches); the table shows the medians of
the runs' hit rates and TTFT percentiles. SIMULATED H200s (worker/simulator.py), Qwen3-8B shape,
every process on this machine's cores.

Section `tier`: multi-turn conversations under cache pressure, one chain, the second KV tier off /
write-through / write-back (`--kv-tier-policy`; the workers offer the same `--kv-tier-bytes` in every
row, so the policy is the only difference). `--convs` conversations run at once, each `--turns`
turns: a first prompt of 1-2k ids, then each turn appends the previous answer and a user message of
32-128 ids, `--new` new tokens a turn. The pool (`--tier-num-blocks`) holds a fraction of the
conversations' histories: a turn whose history was evicted recomputes it (tier off) or loads it
back from host RAM. The table gives the later turns' TTFT (p50, p99), the first turns' p50, the
device prefix-cache and tier hit rates (prompt blocks), the bytes moved each way and tokens/s.
  - simulated H200s, Qwen3-8B shape (tier copies timed at the host link's 55 GB/s each way,
    overlapped with compute layer by layer: worker/simulator.py);
  - real CPU workers on this machine (`--cpu-models tiny,qwen3-0.6b`: the embedded tiny Qwen3, and
    random weights of the real 0.6B shape from bench/shapes.py), smaller conversations; every row's
    tokens are compared with the tier-off row's (greedy: they must be identical).

    .venv/bin/python bench/kv_tiers.py [--only routing,tier,disagg] [--tenants 48] [--per 8] [--num-blocks 1024]
        [--new 32] [--rate 0 | --concurrency 32] [--repeat 5] [--convs 48] [--turns 4]
        [--tier-num-blocks 1024] [--cpu-models tiny,qwen3-0.6b] [--quick]

Section `disagg` (bench/pd_split.py): a mixed load of long prompts and short chats, 4 colocated
replicas against 2 prefill + 2 decode chains, simulated H200s.
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

from client import AsyncClient, LocalCluster  # noqa: E402
from minipaged.config import load_model_config  # noqa: E402
from minipaged.constants import kv_bytes_per_block  # noqa: E402
from scale import CONFIG_8B  # noqa: E402
from pd_split import add_arguments, bench_disagg  # noqa: E402

POLICIES = ("off", "write-through", "write-back")


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


def _per_block_8b() -> int:
    """K/V bytes of one block of 16 tokens of the simulated Qwen3-8B, all layers, bfloat16 (2.25 MiB)."""
    c = load_model_config(CONFIG_8B)
    return kv_bytes_per_block(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 16, 2)


PER_BLOCK_8B = _per_block_8b()


def one_run(replicas: int, router: str, reqs: list[dict], args, tier_slots: int = 0) -> tuple:
    """(device hit rate, tier hit rate, TTFT p50, p90, p99 s, wall s) of one fresh cluster serving reqs."""
    extra = ("--router", router, "--num-blocks", str(args.num_blocks))
    worker = ("--kv-tier-bytes", str(tier_slots * PER_BLOCK_8B)) if tier_slots else ()
    with sim_cluster(replicas=replicas, extra=extra, worker_extra=worker) as c:
        b = c.client.stats()
        t0 = time.perf_counter()
        if args.rate > 0:
            lat = asyncio.run(open_loop_ttfts(c.address, reqs, args.rate, seed=len(reqs)))
        else:
            lat = asyncio.run(ttfts(c.address, reqs, concurrency=args.concurrency))
        wall = time.perf_counter() - t0
        a = c.client.stats()
    q, h = a.prefix_cache_queries - b.prefix_cache_queries, a.prefix_cache_hits - b.prefix_cache_hits
    th = a.tier_hits - b.tier_hits
    pct = lambda p: lat[min(len(lat) - 1, int(len(lat) * p))]  # noqa: E731
    return (h / q if q else 0.0, th / q if q else 0.0, pct(0.5), pct(0.9), pct(0.99), wall)


def bench_routing(args) -> None:
    for slots in [int(x) for x in args.routing_tier_slots.split(",")]:
        routing_table(args, slots)


def routing_table(args, tier_slots: int) -> None:
    setups = (("4 replicas, exact", 4, "exact"), ("4 replicas, prefix (approximate)", 4, "prefix"),
              ("4 replicas, round-robin", 4, "round_robin"), ("1 replica", 1, "exact"))
    runs: dict[str, list] = {label: [] for label, *_ in setups}
    for r in range(args.repeat):          # rows take turns within each repetition (the machine drifts)
        reqs = shared_prefix_requests(seed=11 + r, systems=args.tenants, per=args.per, new=args.new)
        for label, replicas, router in setups:
            runs[label].append(one_run(replicas, router, reqs, args, tier_slots))
    rows, exact = [], None
    for label, *_ in setups:
        med = [sorted(x)[len(x) // 2] for x in zip(*runs[label])]
        exact = exact or med
        rows.append((label, f"{med[0]:.3f}", f"{med[1]:.3f}", f"{1e3 * med[2]:.0f}", f"{1e3 * med[3]:.0f}",
                     f"{1e3 * med[4]:.0f}", f"{med[3] / exact[3]:.2f}x", f"{med[5]:.1f}"))
    load = f"Poisson arrivals at {args.rate:g}/s" if args.rate > 0 else f"{args.concurrency} concurrent streams"
    table(f"tenants' system prompts under cache pressure ({args.tenants} prompts of 1-2k ids x {args.per} requests, "
          f"user turns of 32-128 ids, {args.new} new; {load}; pool {args.num_blocks} blocks of 16 per chain"
          f"{f', KV tier {tier_slots} blocks per chain (write-back)' if tier_slots else ', no KV tier'}), "
          f"simulated H200, median of {args.repeat} runs",
          ("routing", "device hit rate", "tier hit rate", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "p90 vs exact",
           "wall s"), rows)


# ---------------------------------------------------------------- the second KV tier
def conversations(seed: int, convs: int, first: tuple, user: tuple, vocab: int) -> list[tuple]:
    """Each conversation: (first prompt ids, [user message ids of each later turn]); turns are
    added by the caller (their count is the length of the list + 1)."""
    rng = random.Random(seed)
    ids = lambda lo, hi: [rng.randrange(2, vocab) for _ in range(rng.randint(lo, hi))]  # noqa: E731
    return [(ids(*first), [ids(*user) for _ in range(8)]) for _ in range(convs)]


async def run_conversations(address: str, convs: list[tuple], turns: int, new: int, at_once: int = 0):
    """The conversations, `at_once` at a time (0: all; a new one starts when one ends), each one's
    turns one after another (a turn's prompt is the history so
    far: earlier prompts, their answers, a new user message). Returns (first turns' TTFTs, later
    turns' TTFTs, every turn's tokens, tokens generated)."""
    first, later, outputs = [], [], []
    gate = asyncio.Semaphore(at_once or len(convs))
    async with AsyncClient(address) as c:
        async def one(conv):
            async with gate:
                return await turns_of(conv)

        async def turns_of(conv):
            history, msgs, mine = list(conv[0]), conv[1], []
            for t in range(turns):
                t0, toks = time.perf_counter(), []
                async for ch in c.stream(prompt_token_ids=history, max_new_tokens=new, ignore_eos=True):
                    if not toks:
                        (first if t == 0 else later).append(time.perf_counter() - t0)
                    toks += ch.token_ids
                mine.append(toks)
                history += toks + msgs[t]
            return mine
        outputs = await asyncio.gather(*(one(cv) for cv in convs))
    return sorted(first), sorted(later), outputs, sum(len(t) for o in outputs for t in o)


def tier_run(policy: str, convs, args, cluster) -> dict:
    with cluster(policy) as c:
        b = c.client.stats()
        t0 = time.perf_counter()
        first, later, outputs, gen = asyncio.run(run_conversations(c.address, convs, args.turns, args.tier_new,
                                                                   args.at_once))
        wall = time.perf_counter() - t0
        a = c.client.stats()
    d = lambda k: getattr(a, k) - getattr(b, k)  # noqa: E731
    pct = lambda x, p: x[min(len(x) - 1, int(len(x) * p))] if x else float("nan")  # noqa: E731
    return dict(later50=pct(later, 0.5), later99=pct(later, 0.99), first50=pct(first, 0.5),
                dev=d("prefix_cache_hits") / max(1, d("prefix_cache_queries")),
                tier=d("tier_hits") / max(1, d("prefix_cache_queries")),
                saved=d("tier_saved_blocks") * a.tier_block_bytes, loaded=d("tier_loaded_blocks") * a.tier_block_bytes,
                tps=gen / wall, wall=wall, outputs=outputs)


def tier_table(title: str, runs: dict, check_tokens: bool) -> None:
    off = runs["off"]
    rows = []
    for policy, r in runs.items():
        same = "" if not check_tokens else (
            f"{sum(x == y for x, y in zip(r['outputs'], off['outputs']))}/{len(off['outputs'])}")
        rows.append((policy, f"{1e3 * r['later50']:.0f}", f"{1e3 * r['later99']:.0f}",
                     f"{off['later50'] / r['later50']:.2f}x", f"{1e3 * r['first50']:.0f}", f"{r['dev']:.3f}",
                     f"{r['tier']:.3f}", f"{r['saved'] / 2**30:.2f} / {r['loaded'] / 2**30:.2f}",
                     f"{r['tps']:.0f}", f"{r['wall']:.1f}") + ((same,) if check_tokens else ()))
    header = ("KV tier", "later TTFT p50 ms", "p99 ms", "p50 vs off", "first TTFT p50 ms", "device hit rate",
              "tier hit rate", "saved / loaded GiB", "tok/s", "wall s") + (("same tokens as off",) if check_tokens else ())
    table(title, header, rows)


def bench_tier_sim(args) -> None:
    tier_bytes = args.tier_slots * PER_BLOCK_8B

    def cluster(policy):
        return LocalCluster(model=CONFIG_8B, workers=1, simulate="h200", dtype=None, startup_timeout=300,
                            extra_worker_args=["--kv-tier-bytes", str(tier_bytes)],
                            extra_service_args=["--num-blocks", str(args.tier_num_blocks), "--kv-tier-policy", policy])
    runs: dict[str, list] = {p: [] for p in POLICIES}
    for r in range(args.repeat):
        convs = conversations(31 + r, args.convs, (1024, 2048), (32, 128), 150000)
        for p in POLICIES:
            runs[p].append(tier_run(p, convs, args, cluster))
    med = {p: {k: sorted(x[k] for x in v)[len(v) // 2] if k != "outputs" else v[0][k] for k in v[0]}
           for p, v in runs.items()}
    gate = f"{args.at_once} at a time" if args.at_once else "at once"
    tier_table(f"multi-turn conversations, simulated H200, Qwen3-8B shape: {args.convs} {gate} x {args.turns} turns "
               f"(first prompt 1-2k ids, user turns 32-128, {args.tier_new} new); pool {args.tier_num_blocks} blocks "
               f"of 16, tier {tier_bytes / 2**30:.1f} GiB host RAM; "
               f"median of {args.repeat}", med, check_tokens=False)


def bench_tier_cpu(args) -> None:
    from shapes import SHAPES, ensure_checkpoint
    for name in [m for m in args.cpu_models.split(",") if m]:
        model = ensure_checkpoint(name) if name in SHAPES else name
        small = name == "tiny"
        first, user, vocab = ((256, 512), (16, 48), 500) if small else ((256, 512), (16, 48), 150000)
        num_blocks = args.cpu_num_blocks

        def cluster(policy):
            return LocalCluster(model=model, workers=1, dtype="float32", num_blocks=num_blocks,
                                extra_worker_args=["--kv-tier-bytes", str(args.cpu_tier_bytes)],
                                extra_service_args=["--kv-tier-policy", policy])
        convs = conversations(41, args.cpu_convs, first, user, vocab)
        runs = {p: tier_run(p, convs, args, cluster) for p in POLICIES}
        tier_table(f"multi-turn conversations, real CPU worker ({name}, float32, this machine's 2 cores): "
                   f"{args.cpu_convs} at once x {args.turns} turns (first prompt {first[0]}-{first[1]} ids, user "
                   f"turns {user[0]}-{user[1]}, {args.tier_new} new); pool {num_blocks} blocks of 16, tier "
                   f"{args.cpu_tier_bytes / 2**30:.1f} GiB", runs, check_tokens=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="routing,tier,disagg")
    ap.add_argument("--tenants", type=int, default=48)
    ap.add_argument("--per", type=int, default=8, help="requests per tenant")
    ap.add_argument("--num-blocks", type=int, default=1024, help="each chain's pool (blocks of 16 tokens)")
    ap.add_argument("--new", type=int, default=32, help="new tokens per request")
    ap.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second (0: closed loop)")
    ap.add_argument("--concurrency", type=int, default=32, help="streams at a time when --rate is 0")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--routing-tier-slots", default="0",
                    help="routing: each chain's KV tier in blocks of 16, a table for each (0: no tier)")
    ap.add_argument("--convs", type=int, default=48, help="tier: conversations at once (simulated)")
    ap.add_argument("--turns", type=int, default=4, help="tier: turns per conversation")
    ap.add_argument("--at-once", type=int, default=0,
                    help="tier: conversations in flight at a time (0: all; another starts when one ends)")
    ap.add_argument("--tier-new", type=int, default=64, help="tier: new tokens per turn")
    ap.add_argument("--tier-num-blocks", type=int, default=2048, help="tier: the simulated chain's pool")
    ap.add_argument("--tier-slots", type=int, default=32768, help="tier: simulated tier slots (blocks of 16)")
    ap.add_argument("--cpu-models", default="tiny,qwen3-0.6b", help="tier: real CPU rows ('' = none)")
    ap.add_argument("--cpu-convs", type=int, default=6)
    ap.add_argument("--cpu-num-blocks", type=int, default=64, help="tier: the CPU worker's pool (blocks of 16)")
    ap.add_argument("--cpu-tier-bytes", type=int, default=2 << 30)
    ap.add_argument("--quick", action="store_true", help="a smoke run: small loads, one repetition")
    add_arguments(ap)
    args = ap.parse_args()
    if args.quick:
        args.tenants, args.per, args.repeat = 8, 2, 1
        args.pd_requests, args.pd_repeat = 16, 1
        args.convs, args.turns, args.tier_new, args.cpu_convs, args.cpu_models = 4, 2, 4, 2, "tiny"
    only = args.only.split(",")
    if "routing" in only:
        bench_routing(args)
    if "tier" in only:
        bench_tier_sim(args)
        bench_tier_cpu(args)
    if "disagg" in only:
        bench_disagg(args)


if __name__ == "__main__":
    main()
