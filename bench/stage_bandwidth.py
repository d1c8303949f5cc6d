"""Decode attention split by layers over processes, as pipeline stages split it, against one process
using every core: does a pipeline on one memory bus read K/V any faster?

    .venv/bin/python bench/stage_bandwidth.py [--seqs 64] [--context 300] [--layers 4] [--reps 200] [--rounds 3]

Issue 19 asks 2 stages of the tiny model on this 2-core CPU to reach 1.0x one worker. Half of a
tiny decode step is paged attention, which streams K/V from memory. Rows, alternating, each round:
  - one process, one thread per core, every layer (what one worker does: the anchor);
  - one process per core, one thread each, each over its share of the layers, all at once (what
    the stages of a pipeline do: the same bytes in all).
Shape: tiny's (8 query heads, 4 KV heads of 64, float32 cache, blocks of 16), every sequence with
`--context` tokens, blocks shuffled across the cache. GB/s count K and V read (whole blocks).
"""
from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

H, HKV, D, BS = 8, 4, 64, 16


def run(seqs: int, context: int, layers: int, threads: int, reps: int, seed: int, ready=None, go=None, out=None):
    """(seconds, bytes) of `reps` decode steps over `layers` caches with `threads` threads."""
    torch.set_num_threads(threads)
    from worker import cpu_kernels
    fn = cpu_kernels.load_library().minipaged_paged_decode_f32
    P, I = ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [P, P, P, I, P, I, P, I, I, I, I, I, ctypes.c_double, P, I]
    per_seq = -(-context // BS)
    blocks = seqs * per_seq
    gen = torch.Generator().manual_seed(seed)
    caches = [(torch.randn(blocks, HKV, BS, D, generator=gen), torch.randn(blocks, HKV, BS, D, generator=gen))
              for _ in range(layers)]
    order = np.random.default_rng(seed).permutation(blocks).astype(np.int32)
    tables = torch.from_numpy(order.reshape(seqs, per_seq))
    lens = torch.full((seqs,), context, dtype=torch.int32)
    q, o = torch.randn(seqs, H, D, generator=gen), torch.empty(seqs, H, D)

    def step():
        for k, v in caches:
            fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), blocks, tables.data_ptr(), per_seq, lens.data_ptr(),
               seqs, H, HKV, BS, D, D ** -0.5, o.data_ptr(), threads)
    step()
    if ready is not None:      # the caches are built: start with the others
        ready.put(os.getpid())
        go.wait()
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    res = (time.perf_counter() - t0, reps * layers * seqs * context * HKV * D * 4 * 2)
    if out is not None:
        out.put(res)
    return res


def split(args, parts: int) -> tuple[float, float]:
    """`parts` processes at once, each over layers / parts: (step ms, GB/s together)."""
    ready, go, outs = mp.Queue(), mp.Event(), [mp.Queue() for _ in range(parts)]
    procs = [mp.Process(target=run, args=(args.seqs, args.context, args.layers // parts, 1, args.reps, i,
                                          ready, go, outs[i])) for i in range(parts)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get()
    go.set()
    res = [q.get() for q in outs]
    for p in procs:
        p.join()
    wall = max(r[0] for r in res)
    return 1e3 * wall / args.reps, sum(r[1] for r in res) / wall / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    cores = os.cpu_count() or 1
    mib = args.seqs * args.context * HKV * D * 4 * 2 * args.layers / 2**20
    rows = {f"1 process x {cores} threads, {args.layers} layers (one worker)": [],
            f"{cores} processes x 1 thread, {args.layers // cores} layers each, at once (stages)": []}
    names = list(rows)
    for _ in range(args.rounds):
        dt, nbytes = run(args.seqs, args.context, args.layers, cores, args.reps, 0)
        rows[names[0]].append((1e3 * dt / args.reps, nbytes / dt / 1e9))
        rows[names[1]].append(split(args, cores))
    print(f"decode attention, {args.seqs} sequences x {args.context} tokens, {H}/{HKV} heads x {D}, float32 cache, "
          f"{mib:.0f} MiB of K/V in all, median of {args.rounds} rounds")
    print("| setup | step ms | GB/s | vs one process |")
    print("|---|---|---|---|")
    anchor = statistics.median(g for _, g in rows[names[0]])
    for name, vals in rows.items():
        ms, gbs = statistics.median(m for m, _ in vals), statistics.median(g for _, g in vals)
        print(f"| {name} | {ms:.2f} | {gbs:.1f} | {gbs / anchor:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
