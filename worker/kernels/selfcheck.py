"""A small, complete run of every kernel family against the float64 torch reference: cache write
(with padding slots), decode (one split; split-KV with empty splits), prefill (cached prefixes,
GQA 4, several query tiles), in float32 and bfloat16, head_dim 64 and 128.

    python -m worker.kernels.selfcheck --backend pycuda|emulated [--schedule SPEC]

Sized for compute-sanitizer (racecheck, memcheck) on a GPU, where it is the one race and memory
check the CPU emulation cannot give (scripts/gpu_check.sh); on the CPU it runs on the emulation,
under any SIMT schedule. Inputs are made and the reference computed on the CPU, so the only device
kernels are ours (and copies): a sanitizer's report is about them. Exit 0 when every case agrees.
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

from worker.attention_torch import TorchBackend

TOL = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2}
BS, KVH, G = 16, 2, 4


def paged(seq_lens, D, dtype, gen):
    """Random caches and shuffled block tables (rows padded with -1), on the CPU."""
    need = [math.ceil(n / BS) for n in seq_lens]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.full((len(seq_lens), max(need) + 1), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[at:at + n]
        at += n
    kc = torch.randn(num_blocks, KVH, BS, D, generator=gen).to(dtype)
    vc = torch.randn(num_blocks, KVH, BS, D, generator=gen).to(dtype)
    return kc, vc, tables, torch.tensor(seq_lens, dtype=torch.int32)


def cases(dtype, D, gen):
    """(name, run(backend, to_device) -> output on the CPU, reference output) per case."""
    ref = TorchBackend()
    out = []
    # cache write, two padding slots
    T = 13
    slots = torch.randperm(8 * BS, generator=gen)[:T]
    slots[[2, 7]] = -1
    k, v = (torch.randn(T, KVH, D, generator=gen).to(dtype) for _ in range(2))
    kc0 = torch.randn(8, KVH, BS, D, generator=gen).to(dtype)
    want = [kc0.clone(), kc0.clone()]
    ref.write_kv(k, v, want[0], want[1], slots)

    def write(be, dev):
        kc, vc = kc0.clone().to(dev), kc0.clone().to(dev)     # .to() alone may alias
        be.write_kv(k.to(dev), v.to(dev), kc, vc, slots.to(dev))
        return torch.cat([kc.cpu().flatten(), vc.cpu().flatten()])
    out.append(("write_kv", write, torch.cat([w.flatten() for w in want])))
    # decode: a short batch (one split), and a long context next to short ones (split-KV with
    # empty splits on a GPU of any size)
    for name, lens in (("decode", [5, 17, 33]), ("decode_split", [1, 900, 40])):
        kc, vc, tables, sl = paged(lens, D, dtype, gen)
        q = torch.randn(len(lens), KVH * G, D, generator=gen).to(dtype)
        want = ref.paged_decode(q.double(), kc.double(), vc.double(), tables, sl, D ** -0.5)
        out.append((name, lambda be, dev, a=(q, kc, vc, tables, sl): be.paged_decode(
            *(x.to(dev) for x in a), D ** -0.5).cpu(), want))
    # prefill after cached prefixes, one query tile and several
    seqs = [(0, 5), (13, 40), (30, 1)]
    kc, vc, tables, sl = paged([p + n for p, n in seqs], D, dtype, gen)
    qsl = torch.tensor([0, 5, 45, 46], dtype=torch.int32)
    q = torch.randn(46, KVH * G, D, generator=gen).to(dtype)
    want = ref.paged_prefill(q.double(), kc.double(), vc.double(), tables, sl, qsl, 40, D ** -0.5)
    out.append(("prefill", lambda be, dev: be.paged_prefill(
        *(x.to(dev) for x in (q, kc, vc, tables, sl, qsl)), 40, D ** -0.5).cpu(), want))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--backend", choices=["pycuda", "emulated"], required=True)
    ap.add_argument("--schedule", default=None, help="SIMT schedule of the emulation, e.g. random:1")
    ap.add_argument("--quick", action="store_true", help="float32 d64 and bfloat16 d128 only")
    args = ap.parse_args(argv)
    from worker.attention import get_backend
    dev = "cuda" if args.backend == "pycuda" else "cpu"
    be = get_backend(args.backend, dev)
    be.poison_outputs = True
    if args.schedule:
        from worker.kernels import emulated
        emulated.set_schedule(args.schedule)
    failed, n = [], 0
    gen = torch.Generator().manual_seed(2026)
    combos = [(torch.float32, 64), (torch.bfloat16, 128)] if args.quick else \
        [(dt, d) for dt in (torch.float32, torch.bfloat16) for d in (64, 128)]
    for dtype, D in combos:
        for name, run, want in cases(dtype, D, gen):
            got = run(be, dev)
            bad = bool(got.isnan().any())       # a poisoned element was never written
            err = ((got.double() - want.double()).norm() / want.double().norm()).item()
            ok = not bad and err < TOL[dtype]
            n += 1
            print(f"{'ok  ' if ok else 'FAIL'} {name:13s} {str(dtype)[6:]:8s} d{D:<3d} "
                  f"rel err {err:.1e}", flush=True)
            if not ok:
                failed.append(f"{name} {dtype} d{D}")
    if dev == "cuda":
        torch.cuda.synchronize()
    print(f"selfcheck on {args.backend}"
          f"{' (schedule ' + args.schedule + ')' if args.schedule else ''}: "
          f"{n - len(failed)}/{n} cases ok" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
