"""Attention-kernel benchmark: decode, varlen paged prefill and cache write, per backend, against
torch SDPA on the same data measured in the same run; then each kernel's registers and spills.

    python bench/kernels.py [--quick | --smoke] [--device cpu|cuda] [--backends a,b] [--json PATH]
                            [--reps N] [--no-ptxas]

Decode: B in {1, 16, 64, 256} x L in {512, 2048, 8192}; 16 query heads, 8 KV heads, head_dim 128,
block size 16, shuffled block tables. For each size: median time over --reps runs (CUDA events on
a GPU, perf_counter on the CPU) of every backend, the bytes the step must move (counted: K and V
of the whole context + Q + out + block tables and lengths) and achieved GB/s = bytes / time; beside
them torch SDPA (scaled_dot_product_attention with enable_gqa) on the same K/V stored contiguously
[B, Hkv, L, D]. Inputs smaller than ~4x the L2 cache rotate over several copies on a GPU.
Prefill: B sequences of n new tokens after a cached prefix of P (causal, queries aligned to the end
of the context), TFLOP/s over the counted causal FLOPs (4 H D per visible query-key pair), against
SDPA (causal; an explicit bottom-right mask when P > 0). Expect the pycuda prefill to be far slower
than SDPA on long prompts: 16-key tiles and fp32 FMA math without tensor cores, where SDPA runs
flash attention on them. Cache write (write_kv): GB/s, K and V read + written once.
Registers: `ptxas -v` for sm_90 (worker/kernels/ptxas.py), with the CTAs per SM each kernel allows.

On CUDA: backends torch and pycuda, bfloat16, plus a measured device-to-device copy bandwidth row
(bytes read + written) and each decode figure as % of it. On the CPU: the torch backend, float32;
--quick limits sizes to finish in < 2 minutes on a small machine (the table says which sizes were
skipped and why); --smoke runs one small size of each (scripts/gpu_check.sh --dry-run).

First suspects when the GPU table disappoints (not yet measured on a GPU): decode's shared-memory
stores of the K/V tile are scalar, with 4-way bank conflicts for 16-bit types; registers limit
bf16/f16 d128 decode and prefill to 4 CTAs per SM (see the registers table).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from worker.attention import get_backend  # noqa: E402

H, HKV, D, BS = 16, 8, 128, 16
BATCHES = (1, 16, 64, 256)
LENGTHS = (512, 2048, 8192)
ROTATE_BYTES = 256 << 20          # rotate input copies until at least this much is in play
CPU_QUICK_MAX_KV_BYTES = 300 << 20
CPU_FULL_MAX_KV_BYTES = 2 << 30


def timer(device: torch.device, fn, reps: int, warmup: int = 2) -> tuple[float, float, float]:
    """(median, min, max) seconds of fn(i) over reps runs, i = run index (for rotation)."""
    for i in range(warmup):
        fn(i)
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for i in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
    else:
        for i in range(reps):
            t0 = time.perf_counter()
            fn(i)
            times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times), max(times)


def rand(gen: torch.Generator, *shape, dtype) -> torch.Tensor:
    """Random normal data made on the generator's device (never zeros: they time differently)."""
    return torch.randn(*shape, generator=gen, device=gen.device).to(dtype)


def copy_bandwidth(device: torch.device, reps: int) -> tuple[float, float]:
    """Measured device-to-device copy of a 2 GiB buffer: (bytes read + written, median seconds)."""
    n = (2 << 30) // 4 if device.type == "cuda" else (256 << 20) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    med, _, _ = timer(device, lambda i: dst.copy_(src), reps)
    del src, dst
    return 2 * n * 4, med


def sdpa(q, k, v, scale, **kw):
    try:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True, **kw)
    except TypeError:  # older torch: repeat the KV heads
        g = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1),
                                              v.repeat_interleave(g, 1), scale=scale, **kw)


def contiguous_kv(cache, tables, L):
    """[num_blocks, Hkv, BS, D] paged through tables [B, nb] -> contiguous [B, Hkv, L, D]."""
    B, nb = tables.shape
    return (cache[tables.long()].permute(0, 2, 1, 3, 4).reshape(B, HKV, nb * BS, D)[:, :, :L]
            .contiguous())


def decode_case(device, dtype, backends, B, L, reps, gen):
    es = torch.empty((), dtype=dtype).element_size()
    blocks_per_seq = math.ceil(L / BS)
    kv_bytes = 2 * B * L * HKV * D * es
    counted = kv_bytes + 2 * B * H * D * es + B * blocks_per_seq * 4 + B * 4
    sets = max(1, min(64, ROTATE_BYTES // max(kv_bytes, 1))) if device.type == "cuda" else 1
    num_blocks = sets * B * blocks_per_seq
    kc = rand(gen, num_blocks, HKV, BS, D, dtype=dtype)
    vc = rand(gen, num_blocks, HKV, BS, D, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    tables = [perm[s * B * blocks_per_seq:(s + 1) * B * blocks_per_seq].view(B, blocks_per_seq)
              .contiguous() for s in range(sets)]
    lens = torch.full((B,), L, dtype=torch.int32, device=device)
    qs = [rand(gen, B, H, D, dtype=dtype) for _ in range(sets)]
    scale = D ** -0.5
    row = {"B": B, "L": L, "bytes": counted, "sets": sets, "results": {}}
    for name, be in backends.items():
        med, lo, hi = timer(device, lambda i, be=be: be.paged_decode(
            qs[i % sets], kc, vc, tables[i % sets], lens, scale), reps)
        extra = {"splits": be.last_num_splits} if hasattr(be, "last_num_splits") else {}
        row["results"][name] = {"s": med, "min": lo, "max": hi, "GBps": counted / med / 1e9,
                                **extra}
    # SDPA anchor on the same K/V, contiguous [B, Hkv, L, D] (gathered through the tables).
    kd = [contiguous_kv(kc, tables[s], L) for s in range(sets)]
    vd = [contiguous_kv(vc, tables[s], L) for s in range(sets)]
    del kc, vc
    q4 = [q.view(B, H, 1, D) for q in qs]
    med, lo, hi = timer(device, lambda i: sdpa(q4[i % sets], kd[i % sets], vd[i % sets], scale),
                        reps)
    row["results"]["sdpa"] = {"s": med, "min": lo, "max": hi, "GBps": counted / med / 1e9}
    # the backends agree with SDPA on this input (a cheap guard against timing a broken kernel)
    ref = sdpa(q4[0], kd[0], vd[0], scale).view(B, H, D).float()
    for name, be in backends.items():
        out = be.paged_decode(qs[0], *_paged_for_check(kd[0], vd[0], dtype, device), lens, scale)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        row["results"][name]["rel_err_vs_sdpa"] = err
    return row


def _paged_for_check(kd, vd, dtype, device):
    """Re-page contiguous K/V [B, Hkv, L, D] with an identity-permuted table (for the check)."""
    B, _, L, _ = kd.shape
    nb = math.ceil(L / BS)
    pad = nb * BS - L
    k = F.pad(kd, (0, 0, 0, pad)).view(B, HKV, nb, BS, D).permute(0, 2, 1, 3, 4).reshape(
        B * nb, HKV, BS, D).contiguous()
    v = F.pad(vd, (0, 0, 0, pad)).view(B, HKV, nb, BS, D).permute(0, 2, 1, 3, 4).reshape(
        B * nb, HKV, BS, D).contiguous()
    tables = torch.arange(B * nb, dtype=torch.int32, device=device).view(B, nb)
    return k, v, tables


def prefill_case(device, dtype, backends, B, prefix, n, reps, gen):
    """B sequences of n new tokens after a cached prefix of `prefix` tokens, causal."""
    L = prefix + n
    nb = math.ceil(L / BS)
    kc = rand(gen, B * nb, HKV, BS, D, dtype=dtype)
    vc = rand(gen, B * nb, HKV, BS, D, dtype=dtype)
    tables = torch.randperm(B * nb, generator=gen, device=device).to(torch.int32).view(B, nb)
    lens = torch.full((B,), L, dtype=torch.int32, device=device)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=device) * n
    q = rand(gen, B * n, H, D, dtype=dtype)
    flops = 4 * H * D * B * (n * prefix + n * (n + 1) // 2)   # visible (query, key) pairs
    scale = D ** -0.5
    row = {"B": B, "prefix": prefix, "n": n, "flops": flops, "results": {}}
    for name, be in backends.items():
        med, lo, hi = timer(device, lambda i, be=be: be.paged_prefill(
            q, kc, vc, tables, lens, qsl, n, scale), reps)
        row["results"][name] = {"s": med, "min": lo, "max": hi, "TFLOPs": flops / med / 1e12}
    kd, vd = contiguous_kv(kc, tables, L), contiguous_kv(vc, tables, L)
    q4 = q.view(B, n, H, D).transpose(1, 2)
    mask = (None if prefix == 0 else
            torch.ones(n, L, dtype=torch.bool, device=device).tril(prefix))  # bottom-right causal
    anchor = (lambda i: sdpa(q4, kd, vd, scale, is_causal=True)) if mask is None else \
        (lambda i: sdpa(q4, kd, vd, scale, attn_mask=mask))
    med, lo, hi = timer(device, anchor, reps)
    row["results"]["sdpa"] = {"s": med, "min": lo, "max": hi, "TFLOPs": flops / med / 1e12}
    ref = anchor(0).transpose(1, 2).reshape(B * n, H, D).float()
    for name, be in backends.items():
        out = be.paged_prefill(q, kc, vc, tables, lens, qsl, n, scale).float()
        row["results"][name]["rel_err_vs_sdpa"] = ((out - ref).norm() / ref.norm()).item()
    return row


def write_case(device, dtype, backends, T, reps, gen):
    es = torch.empty((), dtype=dtype).element_size()
    num_blocks = max(2 * math.ceil(T / BS), 64)
    counted = 2 * 2 * T * HKV * D * es + T * 8
    kc = rand(gen, num_blocks, HKV, BS, D, dtype=dtype)
    vc = rand(gen, num_blocks, HKV, BS, D, dtype=dtype)
    k = rand(gen, T, HKV, D, dtype=dtype)
    v = rand(gen, T, HKV, D, dtype=dtype)
    slots = torch.randperm(num_blocks * BS, generator=gen, device=device)[:T]
    row = {"T": T, "bytes": counted, "results": {}}
    for name, be in backends.items():
        med, lo, hi = timer(device, lambda i, be=be: be.write_kv(k, v, kc, vc, slots), reps)
        row["results"][name] = {"s": med, "min": lo, "max": hi, "GBps": counted / med / 1e9}
    return row


def plan(cuda: bool, mode: str):
    """(decode (B, L) pairs, prefill (B, prefix, n) triples, write token counts) for a mode."""
    if mode == "smoke":
        return [(1, 512)], [(1, 0, 64)], [256]
    decode = [(B, L) for B in BATCHES for L in LENGTHS]
    if cuda:
        return decode, [(1, 0, 512), (1, 0, 2048), (1, 0, 8192), (8, 0, 1024), (4, 6144, 2048)], \
            [256, 4096]
    if mode == "quick":
        return decode, [(1, 0, 512), (2, 256, 256)], [256]
    return decode, [(1, 0, 512), (1, 0, 2048), (4, 512, 512)], [256, 4096]


def print_report(dev_name, dtype, reps, backends, copy, decode_rows, skipped, prefill_rows,
                 write_rows, regs, elapsed):
    copy_bytes, copy_s = copy
    copy_bw = copy_bytes / copy_s if copy_s else None
    print(f"\n## decode attention: {dev_name}, {dtype}, H={H} Hkv={HKV} D={D} block={BS}, "
          f"median of {reps} ({elapsed:.0f} s in all)")
    if copy_bw:
        print(f"copy bandwidth (measured, read+write): {copy_bw / 1e9:.0f} GB/s")
    cols = list(backends) + ["sdpa"]
    hdr = "| B | L | MB moved | " + " | ".join(f"{c} us | {c} GB/s" + (" | %copy" if copy_bw else "")
                                               for c in cols) + " | splits | err vs sdpa |"
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for r in decode_rows:
        cells = [str(r["B"]), str(r["L"]), f"{r['bytes'] / 1e6:.1f}"]
        for c in cols:
            x = r["results"][c]
            cells += [f"{x['s'] * 1e6:.1f}", f"{x['GBps']:.1f}"]
            if copy_bw:
                cells.append(f"{100 * x['GBps'] * 1e9 / copy_bw:.0f}%")
        splits = next((r["results"][n].get("splits") for n in backends if n != "torch"), None)
        cells.append(str(splits) if splits is not None else "-")
        cells.append(", ".join(f"{n} {r['results'][n]['rel_err_vs_sdpa']:.1e}" for n in backends))
        print("| " + " | ".join(cells) + " |")
    if copy_bw:
        print(f"| d2d copy | - | {copy_bytes / 1e6:.0f} | {copy_s * 1e6:.1f} | "
              f"{copy_bw / 1e9:.1f} | 100% | (torch copy_, read + write bytes) |")
    for B, L, why in skipped:
        print(f"| {B} | {L} | skipped: {why} |")

    print(f"\n## varlen paged prefill (causal): {dev_name}, {dtype}, H={H} Hkv={HKV} D={D}")
    print("| B | cached | new | GFLOP | " + " | ".join(f"{c} ms | {c} TFLOP/s" for c in cols)
          + " | x sdpa time | err vs sdpa |")
    print("|---|---|---|---|" + "---|---|" * len(cols) + "---|---|")
    for r in prefill_rows:
        cells = [str(r["B"]), str(r["prefix"]), str(r["n"]), f"{r['flops'] / 1e9:.3g}"]
        for c in cols:
            cells += [f"{r['results'][c]['s'] * 1e3:.2f}", f"{r['results'][c]['TFLOPs']:.3g}"]
        sd = r["results"]["sdpa"]["s"]
        cells.append(", ".join(f"{n} {r['results'][n]['s'] / sd:.1f}x" for n in backends))
        cells.append(", ".join(f"{n} {r['results'][n]['rel_err_vs_sdpa']:.1e}" for n in backends))
        print("| " + " | ".join(cells) + " |")

    print(f"\n## cache write (write_kv): Hkv={HKV} D={D}, {dtype}")
    print("| tokens | MB moved | " + " | ".join(f"{c} us | {c} GB/s" for c in backends) + " |")
    print("|---|---|" + "---|---|" * len(backends))
    for r in write_rows:
        cells = [str(r["T"]), f"{r['bytes'] / 1e6:.2f}"]
        for c in backends:
            cells += [f"{r['results'][c]['s'] * 1e6:.1f}", f"{r['results'][c]['GBps']:.1f}"]
        print("| " + " | ".join(cells) + " |")

    print(f"\n## registers and spills (ptxas -v, sm_90): {regs['note']}")
    print("\n".join(regs["table"]))


def registers(enabled: bool) -> dict:
    if not enabled:
        return {"note": "skipped (--no-ptxas)", "table": [], "kernels": []}
    from worker.kernels import ptxas
    try:
        report, version = ptxas.ptxas_report("sm_90")
    except RuntimeError as e:
        return {"note": f"skipped: {str(e).splitlines()[0]}", "table": [], "kernels": []}
    spills = sum(r.spill_stores + r.spill_loads for r in report)
    return {"note": f"{version}; {len(report)} kernels, {spills} spill bytes in all",
            "table": ptxas.table(report), "kernels": [vars(r) for r in report]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes only (CPU: < 2 minutes)")
    size.add_argument("--smoke", action="store_true", help="one small size of each (seconds)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--backends", default=None, help="comma list (default: torch[,pycuda])")
    ap.add_argument("--no-ptxas", action="store_true", help="skip the registers table")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    dtype = torch.bfloat16 if cuda else torch.float32
    reps = args.reps or (2 if args.smoke else 30 if cuda else 3 if args.quick else 5)
    names = args.backends.split(",") if args.backends else (["torch", "pycuda"] if cuda
                                                            else ["torch"])
    backends = {n: get_backend(n, device if n != "torch" else None) for n in names}
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device=device).manual_seed(0)
    torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
    t_start = time.time()

    copy = copy_bandwidth(device, reps) if cuda else (None, None)
    decode_sizes, prefill_sizes, write_sizes = plan(cuda, mode)
    max_kv = None if cuda else CPU_QUICK_MAX_KV_BYTES if mode != "full" else CPU_FULL_MAX_KV_BYTES
    quick_cpu = (not cuda) and mode == "quick"
    es = torch.empty((), dtype=dtype).element_size()
    decode_rows, skipped = [], []
    for B, L in decode_sizes:
        kv_bytes = 2 * B * L * HKV * D * es
        if quick_cpu and B not in (1, 16):
            skipped.append((B, L, "not in --quick sizes"))
        elif max_kv is not None and kv_bytes > max_kv:
            skipped.append((B, L, f"K+V {kv_bytes / 2**20:.0f} MiB > CPU limit {max_kv / 2**20:.0f} MiB"))
        else:
            decode_rows.append(decode_case(device, dtype, backends, B, L, reps, gen))
            if cuda:
                torch.cuda.empty_cache()
    prefill_rows = [prefill_case(device, dtype, backends, B, p, n, reps, gen) for B, p, n in prefill_sizes]
    write_rows = [write_case(device, dtype, backends, T, reps, gen) for T in write_sizes]
    regs = registers(not args.no_ptxas)

    dev_name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print_report(dev_name, dtype, reps, backends, copy, decode_rows, skipped, prefill_rows,
                 write_rows, regs, time.time() - t_start)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": dev_name, "dtype": str(dtype), "mode": mode,
                       "copy_GBps": copy[0] / copy[1] / 1e9 if copy[1] else None, "copy_s": copy[1],
                       "decode": decode_rows, "prefill": prefill_rows, "write": write_rows,
                       "skipped": skipped, "registers": regs["kernels"]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
