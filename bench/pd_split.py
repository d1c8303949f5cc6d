"""bench/kv_tiers.py's section `disagg`: disaggregated prefill/decode against colocated replicas at
equal hardware (issue 22), simulated H200s (worker/simulator.py), Qwen3-8B shape.

A mixed load arrives open loop (Poisson, at each of `--pd-rates` requests/s: a table each): a `--pd-long` share of long
prompts (4-8k ids, 256 new tokens) among short chats (100-400 ids, 128 new). Rows, 4 simulated GPUs
each:
  - 4 colocated replicas (--role both): a long prompt's chunked-prefill steps share the step with
    every decode of its chain;
  - 2 prefill + 2 decode chains (--role prefill / decode): prompts run on the prefill chains, their
    K/V move to a decode chain over the K/V link (50 GB/s, `kv_link` of the profile; the move runs
    beside the decode steps, as the real worker's PullQueue does).
Per row: TTFT p50 / p99, inter-token latency p50 / p99 (every gap between streamed tokens, a gap
shared out over the tokens of its chunk), the second token's wait p50 / p99 (a disaggregated
request's move is in it; one gap in ~150, so ITL p99 barely sees it), goodput (requests/s whose TTFT <= 2 s and whose mean
inter-token latency <= 50 ms, DistServe's SLO attainment), tokens/s, and the moves' count and GB.
Medians over `--pd-repeat` fresh clusters; the rows take turns within each repetition."""
from __future__ import annotations

import asyncio
import random
import time

from scale import CONFIG_8B, table

from client import AsyncClient, LocalCluster

SETUPS = (("4 colocated replicas", ["both"] * 4), ("2 prefill + 2 decode chains", ["prefill", "prefill", "decode", "decode"]))
TTFT_SLO, ITL_SLO = 2.0, 0.050


def mixed_requests(n: int, long_share: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        long = rng.random() < long_share
        ids = [rng.randrange(1000, 150000) for _ in range(rng.randint(4096, 8192) if long else rng.randint(100, 400))]
        out.append({"prompt_token_ids": ids, "max_new_tokens": 256 if long else 128, "ignore_eos": True})
    return out


async def stream_times(address: str, reqs: list[dict], rate: float, seed: int) -> list[tuple]:
    """Each request at its Poisson arrival: (TTFT s, [inter-token gaps s], second token's wait s or
    None) per request (the second token's wait holds a disaggregated request's K/V move)."""
    rng, at, out = random.Random(seed), 0.0, []
    async with AsyncClient(address) as c:
        async def one(r, delay):
            await asyncio.sleep(delay)
            t0 = time.perf_counter()
            last, first, gaps, second = t0, None, [], None
            async for chunk in c.stream(**r):
                now = time.perf_counter()
                if first is None:
                    first = now - t0
                else:
                    n = max(1, len(chunk.token_ids))
                    gaps += [(now - last) / n] * n
                    second = now - last if second is None else second
                last = now
            out.append((first, gaps, second))
        tasks = []
        for r in reqs:
            tasks.append(one(r, at))
            at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return out


def one_run(roles: list[str], reqs: list[dict], rate: float) -> tuple:
    with LocalCluster(model=CONFIG_8B, workers=1, replicas=len(roles), roles=roles, simulate="h200", dtype=None,
                      startup_timeout=300) as c:
        b = c.client.stats()
        t0 = time.perf_counter()
        res = asyncio.run(stream_times(c.address, reqs, rate, seed=len(reqs)))
        wall = time.perf_counter() - t0
        a = c.client.stats()
    ttft = sorted(r[0] for r in res)
    itl = sorted(g for r in res for g in r[1])
    pct = lambda xs, p: xs[min(len(xs) - 1, int(len(xs) * p))]  # noqa: E731
    second = sorted(r[2] for r in res if r[2] is not None)
    good = sum(1 for f, g, _ in res if f <= TTFT_SLO and (not g or sum(g) / len(g) <= ITL_SLO))
    tokens = sum(len(r[1]) + 1 for r in res)
    moved_gb = (a.kv_moved_blocks - b.kv_moved_blocks) * a.tier_block_bytes / 1e9
    return (pct(ttft, 0.5), pct(ttft, 0.99), pct(itl, 0.5), pct(itl, 0.99), good / wall, tokens / wall,
            a.kv_moves - b.kv_moves, moved_gb, a.kv_move_failures - b.kv_move_failures, pct(second, 0.5),
            pct(second, 0.99))


def bench_disagg(args) -> None:
    for rate in (float(x) for x in args.pd_rates.split(",")):
        disagg_table(args, rate)


def disagg_table(args, rate: float) -> None:
    runs: dict[str, list] = {label: [] for label, _ in SETUPS}
    for r in range(args.pd_repeat):
        reqs = mixed_requests(args.pd_requests, args.pd_long, seed=101 + r)
        for label, roles in SETUPS:
            runs[label].append(one_run(roles, reqs, rate))
    rows, base = [], None
    for label, _ in SETUPS:
        m = [sorted(x)[len(x) // 2] for x in zip(*runs[label])]
        base = base or m
        rows.append((label, f"{1e3 * m[0]:.0f}", f"{1e3 * m[1]:.0f}", f"{1e3 * m[2]:.1f}", f"{1e3 * m[3]:.1f}",
                     f"{base[3] / m[3]:.2f}x", f"{1e3 * m[9]:.0f} / {1e3 * m[10]:.0f}", f"{m[4]:.2f}", f"{m[5]:.0f}",
                     f"{m[6]:.0f} / {m[7]:.1f} GB / {m[8]:.0f}"))
    table(f"mixed load: {args.pd_requests} requests, {args.pd_long:.0%} of 4-8k ids with 256 new, the rest 100-400 "
          f"ids with 128 new; Poisson arrivals at {rate:g}/s; 4 simulated H200s per row, Qwen3-8B shape; "
          f"goodput = requests/s with TTFT <= {TTFT_SLO:g} s and mean ITL <= {1e3 * ITL_SLO:.0f} ms; "
          f"median of {args.pd_repeat} runs",
          ("setup", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "ITL p99 gain",
           "2nd token wait p50 / p99 ms", "goodput req/s",
           "tok/s", "moves / bytes / failed"), rows)


def add_arguments(ap) -> None:
    ap.add_argument("--pd-requests", type=int, default=200, help="disagg: requests per run")
    ap.add_argument("--pd-long", type=float, default=0.25, help="disagg: share of 4-8k prompts")
    ap.add_argument("--pd-rates", default="6,12", help="disagg: Poisson arrivals per second (a table each)")
    ap.add_argument("--pd-repeat", type=int, default=3)
