"""Does every worker added add throughput? One run, one table per question, load proportional to
the workers (weak scaling, as in the roofline: each replica or micro-batch gets the load one worker
would have).

Simulated rows (SIMULATED: real processes, RPCs, scheduler, block manager and wire; compute replaced
by worker/simulator.py's H200 roofline model of a Qwen3-8B-shaped config, bench/configs/qwen3-8b):
  1. replicas R in {1, 2, 4, 8}, R x the requests: tokens/s, ratio to R=1, metadata-service CPU %
  2. stages N in {1, 2, 4, 8} of one chain, N x the requests: tokens/s, ratio, each stage's busy %
  3. async scheduling: one replica, a fixed 5 ms step: tokens/s against the model's ideal
  4. shared prefixes (8 system prompts of 1-2k tokens, 32 requests each) over 4 replicas:
     prefix-aware vs round-robin routing: prefix-cache hit rate, TTFT p50 / p99
  5. per-step wire bytes and metadata ms at 256 sequences x 2k and x 32k context, full vs delta tables
Real rows (the tiny model computing on this CPU): 1 worker vs 2 stages vs 2 replicas on the same cores.

    .venv/bin/python bench/scale.py [--quick] [--only replicas,stages,overlap,prefix,wire,cpu]
        [--prompts short,long] [--against OTHER_CHECKOUT]

Replica and stage tables, per workload (short: 64-256 prompt ids, long: 512-1536; 128 new tokens):
tokens/s, the ratio to one worker, and host CPU microseconds per generated token for the metadata
service and for the workers (from /proc, per token that went through each worker). --against runs
each of those rows with another checkout's code too, right after this tree's: today's machine
drifts by ~30% in minutes, so only rows run side by side compare.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from client import AsyncClient, LocalCluster  # noqa: E402

CONFIG_8B = os.path.join(ROOT, "bench", "configs", "qwen3-8b")


def requests(n, lo, hi, new, seed, vocab=150000):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(1000, vocab) for _ in range(rng.randint(lo, hi))],
             "max_new_tokens": new, "ignore_eos": True} for _ in range(n)]


def run_job(cluster, reqs):
    """Submit one job, wait for it; (tokens/s, wall s, Stats before, Stats after)."""
    c = cluster.client
    before = c.stats()
    t0 = time.perf_counter()
    results = c.wait(c.submit(reqs), timeout=3600)
    wall = time.perf_counter() - t0
    after = c.stats()
    tokens = sum(len(r.token_ids) for r in results)
    return tokens / wall, wall, before, after


def busy_fractions(before, after, wall):
    """Each stage's compute time over the job's wall time (chain order)."""
    out = []
    for b, a in zip(before.chains, after.chains):
        for sb, sa in zip(b["stages"], a["stages"]):
            out.append((float(sa["step_ms"]) * int(a["steps"]) - float(sb["step_ms"]) * int(b["steps"])) / 1e3 / wall)
    return out


def cpu_percent(before, after, wall):
    return 100.0 * (after.metadata_cpu_seconds - before.metadata_cpu_seconds) / wall


def proc_cpu_s(pid):
    """User + system CPU seconds of a process, all its threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid):
    """proc_cpu_s of a process and its children (a sharded service's shards)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(x) for x in f.read().split()]
    except OSError:
        kids = []
    return proc_cpu_s(pid) + sum(tree_cpu_s(k) for k in kids)


def timed_job(cluster, reqs):
    """run_job plus host CPU per generated token: (tps, wall, before, after, service us/token,
    worker us/token). The worker figure is each worker's CPU over the tokens that went through it
    (a replica's worker sees its share, a stage sees every token of its chain), averaged."""
    procs = cluster.processes
    cpu0 = [tree_cpu_s(procs[0].pid)] + [proc_cpu_s(p.pid) for p in procs[1:]]
    tps, wall, b, a = run_job(cluster, reqs)
    cpu1 = [tree_cpu_s(procs[0].pid)] + [proc_cpu_s(p.pid) for p in procs[1:]]
    tokens = tps * wall
    per_worker_tokens = tokens / cluster.replicas
    service_us = 1e6 * (cpu1[0] - cpu0[0]) / tokens
    worker_us = [1e6 * (y - x) / per_worker_tokens for x, y in zip(cpu0[1:], cpu1[1:])]
    return tps, wall, b, a, service_us, sum(worker_us) / len(worker_us)


WORKLOADS = {"short": (64, 256, 128), "long": (512, 1536, 128)}   # prompt ids lo, hi; new tokens


# ---------------------------------------------------------------- simulated
def sim_cluster(stages=1, replicas=1, profile="h200", extra=(), root=None, worker_extra=()):
    return LocalCluster(model=CONFIG_8B, workers=stages, replicas=replicas, simulate=profile, dtype=None,
                        startup_timeout=300, extra_service_args=list(extra), root=root,
                        extra_worker_args=list(worker_extra))


def workload_title(name, args):
    lo, hi, new = args.workloads[name]
    return f"{name} prompts ({lo}-{hi} ids, {new} new)"


def bench_replicas(args):
    bench_workers(args, "replicas")


def bench_stages(args):
    bench_workers(args, "stages")


def bench_workers(args, kind: str):
    """R replicas or N stages with R (N) x the requests, each workload; with --against, every row
    also runs the other checkout's code right after this one's (the machine's drift hits both)."""
    trees = [("", None)] + ([(os.path.basename(os.path.abspath(args.against)), args.against)] if args.against else [])
    for name in args.prompts:
        lo, hi, new = args.workloads[name]
        rows, base = [], {}
        points = [(n, k, m) for n in getattr(args, kind) for k in (args.shards if kind == "replicas" else [1])
                  for m in (args.micro_batches if kind == "stages" and n > 1 else [0]) if k == 1 or k <= n]
        for n, shards, mb in points:
            for label, root in trees:
                kw = dict(replicas=n) if kind == "replicas" else dict(stages=n)
                extra = (["--shards", str(shards)] if shards > 1 else []) + (["--micro-batches", str(mb)] if mb else [])
                with sim_cluster(root=root, extra=extra, **kw) as c:
                    run_job(c, requests(8 * n, 64, 128, 4, seed=99))          # warm-up
                    runs = sorted((timed_job(c, requests(args.per_worker * n, lo, hi, new, seed=n + 100 * i))
                                   for i in range(args.repeat_rows)), key=lambda r: r[0])
                    tps, wall, b, a, svc_us, wrk_us = runs[len(runs) // 2]   # the median run by tok/s
                base.setdefault(label, tps)
                setup = (f"{n} {kind if n > 1 else kind[:-1]}" + (f", {shards} shards" if shards > 1 else "")
                         + (f", {mb} micro-batches" if mb else "")
                         + (f" ({label or 'this tree'})" if args.against else ""))
                busy = [" ".join(f"{x:.0%}" for x in busy_fractions(b, a, wall))] if kind == "stages" else []
                rows.append((setup, f"{tps:,.0f}", f"{tps / base[label]:.2f}x", *busy, f"{cpu_percent(b, a, wall):.0f}%",
                             f"{svc_us:.1f}", f"{wrk_us:.1f}", f"{wall:.1f}"))
        what, letter = ("replicas", "R") if kind == "replicas" else ("pipeline stages", "N")
        table(f"simulated H200 {what} (Qwen3-8B shape), {workload_title(name, args)}, {letter} x the requests",
              ("setup", "tok/s", f"vs {letter}=1", *(["stage busy"] if kind == "stages" else []),
               "metadata CPU", "service us/token", "worker us/token", "wall s"), rows)


def bench_overlap(args):
    step = 0.005
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"fixed_step_s": step}, f)
    rows = []
    n = args.per_worker
    for label, extra in (("async scheduling (default)", ()), ("synchronous", ("--no-async-scheduling",))):
        with sim_cluster(profile=f.name, extra=extra) as c:
            run_job(c, requests(16, 32, 64, 4, seed=97))
            # decode-bound: n sequences, short prompts, long outputs: ideal = n tokens per 5 ms step
            reqs = requests(n, 16, 32, args.new, seed=5)
            tps, wall, b, a = run_job(c, reqs)
            steps = a.steps - b.steps
        ideal = sum(r["max_new_tokens"] for r in reqs) / (steps * step)
        rows.append((label, f"{tps:,.0f}", f"{ideal:,.0f}", f"{tps / ideal:.0%}", steps,
                     f"{1e3 * wall / steps:.2f}"))
    os.unlink(f.name)
    table("one simulated replica, fixed 5 ms step: host work hidden behind the step?",
          ("scheduling", "tok/s", "ideal tok/s", "of ideal", "steps", "ms/step"), rows)


def shared_prefix_requests(seed=7, systems=8, per=32, new=32):
    rng = random.Random(seed)
    heads = [[rng.randrange(1000, 150000) for _ in range(rng.randint(1024, 2048))] for _ in range(systems)]
    reqs = [{"prompt_token_ids": h + [rng.randrange(1000, 150000) for _ in range(rng.randint(32, 128))],
             "max_new_tokens": new, "ignore_eos": True} for h in heads for _ in range(per)]
    rng.shuffle(reqs)
    return reqs


async def ttfts(address, reqs, concurrency=64):
    sem = asyncio.Semaphore(concurrency)
    out = []
    async with AsyncClient(address) as c:
        async def one(r):
            async with sem:
                t0 = time.perf_counter()
                async for _ in c.stream(**r):
                    out.append(time.perf_counter() - t0)
                    break
        await asyncio.gather(*(one(r) for r in reqs))
    return sorted(out)


def bench_prefix(args):
    """Each setup serves the workload `repeats` times on fresh clusters (fresh caches); the table
    shows the median of the runs' hit rates and TTFT percentiles (one run is under a second)."""
    rows, base_rate = [], None
    setups = [("1 replica", 1, "prefix", 1), ("4 replicas, prefix-aware", 4, "prefix", 1),
              ("4 replicas, round-robin", 4, "round_robin", 1)]
    setups += [(f"4 replicas, prefix-aware, {k} shards", 4, "prefix", k) for k in args.shards if 1 < k <= 4]
    for label, replicas, router, shards in setups:
        runs = []
        for r in range(args.repeat_prefix):
            reqs = shared_prefix_requests(seed=7 + r, per=args.prefix_per)
            extra = ("--router", router) + (("--shards", str(shards)) if shards > 1 else ())
            with sim_cluster(replicas=replicas, extra=extra) as c:
                b = c.client.stats()
                t0 = time.perf_counter()
                lat = asyncio.run(ttfts(c.address, reqs))
                wall = time.perf_counter() - t0
                a = c.client.stats()
            q, h = a.prefix_cache_queries - b.prefix_cache_queries, a.prefix_cache_hits - b.prefix_cache_hits
            runs.append((h / q if q else 0.0, lat[len(lat) // 2], lat[-(-len(lat) * 99 // 100) - 1], wall))   # nearest rank
        med = [sorted(x)[len(x) // 2] for x in zip(*runs)]
        rate = med[0]
        base_rate = base_rate if base_rate is not None else rate
        rows.append((label, f"{rate:.3f}", f"{rate / base_rate:.2f}x", f"{1e3 * med[1]:.0f}", f"{1e3 * med[2]:.0f}",
                     f"{med[3]:.1f}"))
    table(f"shared prefixes (8 system prompts of 1-2k tokens x {args.prefix_per} requests, 64 concurrent streams), "
          f"simulated H200, median of {args.repeat_prefix} runs",
          ("routing", "hit rate", "vs 1 replica", "TTFT p50 ms", "TTFT p99 ms", "wall s"), rows)


def bench_wire(args):
    """In process: the metadata service's per-step path for a steady decode step, and its bytes."""
    import numpy as np

    from metadata_service.block_manager import KVBlockManager
    from metadata_service.chain import ChainConfig, ChainRunner
    from metadata_service.scheduler import Scheduler
    from metadata_service.sequence import SamplingParams, Sequence
    from minipaged.v1 import worker_pb2
    from minipaged.wire import pack

    class FakeEngine:
        eos_ids = set()

        def finish(self, *a, **k):
            pass

        def stream_tokens(self, *a, **k):
            pass

    rows = []
    for ctx in (2048, 32768):
        for full in (True, False):
            B, bs = 256, 16
            m = KVBlockManager(B * (ctx // bs + 8), bs)
            runner = ChainRunner.__new__(ChainRunner)       # only its packing and apply paths
            runner.cfg, runner.epoch, runner.next_step_id, runner.wire_bytes = ChainConfig(), 1, 1, 0
            runner.tokens_to_first = False
            runner.engine, runner.manager, runner.generated_tokens = FakeEngine(), m, 0
            sch = runner.scheduler = Scheduler(m, 1 << 20, B, full_tables=full)
            seqs = [Sequence([7] * ctx, SamplingParams(max_new_tokens=1 << 20), seq_id=i) for i in range(B)]
            for s in seqs:
                sch.add(s)
            while any(s.num_computed_tokens < ctx for s in seqs):     # prefill, not timed
                b = sch.schedule()
                sch.step_done(b)
                for s, d in zip(b.seqs, b.do_sample.tolist()):
                    if d:
                        s.output_token_ids.append(9)
                        s.num_tokens += 1
            times, sizes = [], []
            for _ in range(args.wire_steps):
                t0 = time.perf_counter()
                b = sch.schedule()
                req = runner._step_request(b, [])
                data = req.SerializeToString()
                reply = worker_pb2.StepReply(step_id=req.step_id, sampled_token_ids=pack(np.full(B, 9)))
                sch.step_done(b)
                runner._apply(b, worker_pb2.StepReply.FromString(reply.SerializeToString()))
                times.append(time.perf_counter() - t0)
                sizes.append(len(data))
            times.sort()
            rows.append((f"{B} seqs x {ctx // 1024}k ctx", "full tables" if full else "delta tables",
                         f"{np.mean(sizes) / 1024:,.1f}", f"{1e3 * times[len(times) // 2]:.3f}"))
    table("metadata service per decode step (schedule + pack + serialize + apply), in process",
          ("batch", "block tables", "KiB/step", "ms/step (median)"), rows)


def bench_cpu(args):
    """The tiny model computing on this CPU: do more workers on the same cores lose anything? The
    three setups stay up side by side (idle ones sleep) and take turns on the same job, each warmed
    up with it first: the machine's drift hits them alike, and the table shows medians of the runs."""
    import contextlib
    rng = random.Random(0)
    reqs = [{"prompt_token_ids": [rng.randrange(0, 256) for _ in range(rng.randint(16, 512))],
             "max_new_tokens": 64, "ignore_eos": True} for _ in range(args.cpu_prompts)]
    setups = (("1 worker", dict(workers=1)), ("2 pipeline stages", dict(workers=2)),
              ("2 replicas", dict(workers=1, replicas=2)))
    runs = {label: [] for label, _ in setups}
    with contextlib.ExitStack() as stack:
        clusters = {label: stack.enter_context(LocalCluster(model="tiny", dtype="float32", **kw))
                    for label, kw in setups}
        for c in clusters.values():
            run_job(c, reqs)                                   # warm-up: the same job, untimed
        for _ in range(args.repeat):
            for label, c in clusters.items():
                runs[label].append(run_job(c, reqs)[0])
    med = {label: sorted(v)[len(v) // 2] for label, v in runs.items()}
    base = runs["1 worker"]
    rows = []
    for label, v in runs.items():
        ratios = sorted(x / b for x, b in zip(v, base))
        rows.append((label, f"{med[label]:,.0f}", f"{ratios[len(ratios) // 2]:.2f}x",
                     f"{ratios[0]:.2f}-{ratios[-1]:.2f}x"))
    table(f"tiny Qwen3 computing on this CPU ({os.cpu_count()} cores), {len(reqs)} prompts of 16-512, 64 new, "
          f"setups taking turns, {args.repeat} rounds",
          ("setup", "tok/s (median)", "vs 1 worker (median of rounds)", "range"), rows)


def table(title, header, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "| " + " | ".join(str(x).ljust(w) for x, w in zip(r, widths)) + " |"  # noqa: E731
    print(f"\n{title}\n" + line(header) + "\n|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))
    sys.stdout.flush()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller loads, fewer points (a smoke run)")
    ap.add_argument("--only", default="replicas,stages,overlap,prefix,wire,cpu")
    ap.add_argument("--against", default="", metavar="CHECKOUT",
                    help="replica and stage rows also run this other checkout's code, alternating row by row")
    ap.add_argument("--prompts", default="short,long",
                    help="workloads of the replica and stage tables: short (64-256 ids), long (512-1536); 128 new")
    ap.add_argument("--shards", default="1",
                    help="replica rows also run with the service split into this many shards (e.g. 1,2,4; a "
                         "shard count above the replicas is skipped)")
    ap.add_argument("--repeat-rows", type=int, default=1,
                    help="replica and stage rows: run the job this many times on the same cluster, report the median")
    ap.add_argument("--replicas", default="", help="replica counts of the replica tables (default 1,2,4,8)")
    ap.add_argument("--stages", default="", help="stage counts of the stage tables (default 1,2,4,8)")
    ap.add_argument("--micro-batches", default="0",
                    help="micro-batch counts of the multi-stage rows (0 = the service's default), e.g. 5,6")
    args = ap.parse_args()
    args.shards = [int(x) for x in args.shards.split(",")]
    q = args.quick
    counts = [1, 2] if q else [1, 2, 4, 8]
    args.replicas = [int(x) for x in args.replicas.split(",")] if args.replicas else counts
    args.stages = [int(x) for x in args.stages.split(",")] if args.stages else counts
    args.micro_batches = [int(x) for x in args.micro_batches.split(",")]
    args.per_worker = 32 if q else 256
    args.prompts = args.prompts.split(",")
    args.workloads = {k: (lo // 2, hi // 2, 16) for k, (lo, hi, _) in WORKLOADS.items()} if q else WORKLOADS
    args.new = 16 if q else 128
    args.prefix_per = 4 if q else 32
    args.repeat_prefix = 1 if q else 9
    args.wire_steps = 5 if q else 50
    args.cpu_prompts, args.repeat = (16, 1) if q else (64, 9)
    print(f"bench/scale.py {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores; "
          f"simulated rows: SIMULATED H200 (worker/simulator.py)")
    for name in args.only.split(","):
        {"replicas": bench_replicas, "stages": bench_stages, "overlap": bench_overlap, "prefix": bench_prefix,
         "wire": bench_wire, "cpu": bench_cpu}[name](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
