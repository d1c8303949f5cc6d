"""Attention on the CPU at serving shapes, the bfloat16 mode (float32 queries over a bfloat16 cache).

    .venv/bin/python bench/cpu_attention.py [--base HEAD~1] [--batch 64] [--lens 40,72,150]
                                            [--varied] [--reps 15] [--heads 16,8,128]
                                            [--prefill 16x512,4x2048,32x48]

Decode: this tree's compiled loop (minipaged_paged_decode_f32_bf16) against another revision's,
built from that revision's sources, both loaded into one process, calls alternating; over 28 layer
caches in 2 MiB pages (as the worker allocates them), each of 1,170 blocks of 16, the batch's blocks
shuffled: one decode step's attention at the Qwen3-0.6B shape (16 query heads, 8 KV heads, head
dim 128) unless --heads. The caches (2 GB) do not fit in any cache, so every call reads K and V
from memory, as in a real step. The table gives the median time of the 28 calls, the GB/s of K and
V read (whole blocks), and the ratio; the anchor is the base revision in the same run. --varied:
each sequence's length drawn from [L/2, 3L/2) instead of L.

Prefill (--prefill SxL, "" to skip): S prompts of L tokens, one layer's causal attention, each of
this tree's engines on the same data, alternating: the float32 loop (cpu_attn_prefill.cpp
paged_prefill, the anchor) and the bfloat16-product engines this CPU has (cpu_attn_bf16.cpp: AMX
tiles, AVX512_BF16 pair dot products); ms, GFLOP/s of the causal products (4 H D per visible
query-key pair), and the ratio to the loop.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from worker import cpu_kernels, huge_pages  # noqa: E402

LAYERS, NUM_BLOCKS, BLOCK = 28, 1170, 16


def build_revision(rev: str, out_dir: str) -> ctypes.CDLL:
    """The kernels library built from `rev`'s worker/*.cpp and *.h (this tree's compiler and flags)."""
    names = subprocess.run(["git", "-C", ROOT, "ls-tree", "--name-only", rev, "worker/"], capture_output=True,
                           text=True, check=True).stdout.split()
    names = [n for n in names if n.endswith((".cpp", ".h"))]
    for name in names:
        text = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{name}"], capture_output=True, check=True).stdout
        with open(os.path.join(out_dir, os.path.basename(name)), "wb") as f:
            f.write(text)
    srcs = [os.path.join(out_dir, os.path.basename(n)) for n in names if n.endswith(".cpp")]
    lib_path = os.path.join(out_dir, "base.so")
    subprocess.run([cpu_kernels.CXX, *cpu_kernels.FLAGS, *srcs, "-o", lib_path], check=True, capture_output=True)
    return ctypes.CDLL(lib_path)


def decode_fn(lib: ctypes.CDLL):
    P, I = ctypes.c_void_p, ctypes.c_int
    fn = lib.minipaged_paged_decode_f32_bf16
    fn.argtypes = [P, P, P, I, P, I, P, I, I, I, I, I, ctypes.c_double, P, I]
    fn.restype = ctypes.c_int
    return fn


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="the decode loop's revision to compare with (default: HEAD)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lens", default="40,72,150")
    ap.add_argument("--varied", action="store_true")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--heads", default="16,8,128", help="query heads, KV heads, head dim")
    ap.add_argument("--prefill", default="16x512,4x2048,32x48", help="SxL prompts for the prefill table")
    args = ap.parse_args(argv)
    H, Hkv, D = (int(x) for x in args.heads.split(","))
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        fns = {"base": decode_fn(build_revision(args.base, tmp)), "this tree": decode_fn(cpu_kernels.load_library())}
    gen = torch.Generator().manual_seed(0)

    def cache():
        t = huge_pages.empty((NUM_BLOCKS, Hkv, BLOCK, D), torch.bfloat16)
        return t.copy_(torch.randn(NUM_BLOCKS, Hkv, BLOCK, D, generator=gen))
    caches = [(cache(), cache()) for _ in range(LAYERS)]
    B = args.batch
    q = torch.randn(B, H, D, generator=gen)
    out = torch.empty_like(q)
    print(f"decode attention, {B} sequences, {H}/{Hkv} heads x {D}, bfloat16 cache, {LAYERS} layers, "
          f"{threads} thread(s), base {args.base}, median of {args.reps}")
    print("| context | base ms | base GB/s | this tree ms | this tree GB/s | this / base |")
    print("|---|---|---|---|---|---|")
    for L in (int(x) for x in args.lens.split(",")):
        lens = (torch.randint(max(1, L // 2), L * 3 // 2, (B,), generator=gen) if args.varied
                else torch.full((B,), L)).to(torch.int32)
        blocks = (lens + BLOCK - 1) // BLOCK
        mb = int(blocks.max())
        if int(blocks.sum()) > NUM_BLOCKS:
            print(f"| {L} | (more blocks than a layer's cache) | | | | |")
            continue
        perm = torch.randperm(NUM_BLOCKS, generator=gen)[:B * mb].view(B, mb).to(torch.int32).contiguous()

        def step(fn):
            for k, v in caches:
                fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), NUM_BLOCKS, perm.data_ptr(), mb, lens.data_ptr(),
                   B, H, Hkv, BLOCK, D, D ** -0.5, out.data_ptr(), threads)
        times = {k: [] for k in fns}
        for _ in range(2):
            for fn in fns.values():
                step(fn)
        for _ in range(args.reps):
            for k, fn in fns.items():
                t = time.perf_counter()
                step(fn)
                times[k].append(time.perf_counter() - t)
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        nbytes = 2 * int(blocks.sum()) * BLOCK * Hkv * D * 2 * LAYERS
        label = f"{L // 2}-{L * 3 // 2 - 1}" if args.varied else str(L)
        print(f"| {label} | {med['base'] * 1e3:.2f} | {nbytes / med['base'] / 1e9:.1f} | "
              f"{med['this tree'] * 1e3:.2f} | {nbytes / med['this tree'] / 1e9:.1f} | "
              f"**{med['this tree'] / med['base']:.2f}** |")
    if args.prefill:
        prefill_table(args, H, Hkv, D, threads, gen)
    return 0


def prefill_table(args, H: int, Hkv: int, D: int, threads: int, gen: torch.Generator) -> None:
    from worker.attention_cpu import CpuTorchBackend
    be = CpuTorchBackend()
    engines = {"float32 loop": 0}
    kinds = cpu_kernels.load_library().minipaged_bf16_prefill_engines()
    if kinds & 2:
        engines["AMX tiles"] = 2
    if kinds & 1:
        engines["AVX512_BF16 pairs"] = 1
    print(f"\nprefill attention, one layer, {H}/{Hkv} heads x {D}, bfloat16 cache, {threads} thread(s), "
          f"median of {args.reps}")
    print("| prompts | " + " | ".join(f"{e} ms | GFLOP/s" for e in engines) + " | best vs loop |")
    print("|---|" + "---|---|" * len(engines) + "---|")
    for case in args.prefill.split(","):
        S, L = (int(x) for x in case.split("x"))
        blocks = (L + BLOCK - 1) // BLOCK
        nb = S * blocks + 1
        kc = torch.randn(nb, Hkv, BLOCK, D, generator=gen).bfloat16()
        vc = torch.randn(nb, Hkv, BLOCK, D, generator=gen).bfloat16()
        tables = torch.randperm(nb, generator=gen)[:S * blocks].view(S, blocks).to(torch.int32)
        lens = torch.full((S,), L, dtype=torch.int32)
        qsl = torch.arange(S + 1, dtype=torch.int32) * L
        q = torch.randn(S * L, H, D, generator=gen)
        times = {e: [] for e in engines}
        for rep in range(args.reps + 1):
            for name, engine in engines.items():
                be.bf16_prefill = engine
                t = time.perf_counter()
                be.paged_prefill(q, kc, vc, tables, lens, qsl, L, D ** -0.5)
                if rep:                                  # the first round warms up
                    times[name].append(time.perf_counter() - t)
        med = {e: sorted(v)[len(v) // 2] for e, v in times.items()}
        flops = S * L * (L + 1) / 2 * H * D * 4
        cells = " | ".join(f"{med[e] * 1e3:.1f} | {flops / med[e] / 1e9:.0f}" for e in engines)
        best = min(med.values())
        print(f"| {S} x {L} | {cells} | **{med['float32 loop'] / best:.2f}x** |")


if __name__ == "__main__":
    sys.exit(main())
