"""The CPU GEMMs of a layer at a real shape: our bfloat16-weight panels (worker/cpu_gemm.py) against
oneDNN's prepacked float32 GEMM (what the worker uses otherwise, and vLLM's CPU backend) and
torch's F.linear, measured in the same run.

    python bench/cpu_gemm.py [--model qwen3-0.6b|qwen3-1.7b|tiny] [--rows 1,4,16,48,128,512]
                             [--threads N] [--quick]

Each matrix of the shape (qkv, o, gate_up, down) is made `--copies` times (default: the model's
layer count, capped at 28), so every call streams its weights from memory as a decode step does
(the cache-resident figure, one copy called again and again, is printed beside it). GFLOP/s =
2 M K N / time, the median of 5 passes over all copies.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.shapes import SHAPES  # noqa: E402
from minipaged.config import load_model_config  # noqa: E402
from worker import cpu_gemm  # noqa: E402


def _time(fn, copies: int, passes: int = 5) -> float:
    ts = []
    for _ in range(passes + 1):
        t = time.perf_counter()
        for i in range(copies):
            fn(i)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts[1:]) / copies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--rows", default="1,4,16,48,128,512")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--copies", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="rows 1 and 16, 2 copies (smoke test)")
    args = ap.parse_args()
    if not cpu_gemm.available():
        sys.exit("the bfloat16-weight kernel is not built for this CPU (needs AVX2 + FMA and a C++ compiler)")
    torch.set_num_threads(args.threads)
    # a named shape's sizes without making its checkpoint; tiny or a directory from its config.json
    c = SHAPES.get(args.model) or vars(load_model_config(args.model))
    h, d, heads, kv, inter = (c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"],
                              c["intermediate_size"])
    mats = {"qkv": (h, (heads + 2 * kv) * d), "o": (heads * d, h), "gate_up": (h, 2 * inter), "down": (inter, h)}
    rows = [1, 16] if args.quick else [int(r) for r in args.rows.split(",")]
    copies = 2 if args.quick else (args.copies or min(28, c["num_hidden_layers"]))
    print(f"model {args.model}: {args.threads} threads, {copies} copies of each matrix, "
          f"panels for every batch here: {cpu_gemm.all_batches()}, AMX: {cpu_gemm.amx_available()}\n")
    print("| matrix (K x N) | rows | panels streamed GFLOP/s | panels in cache | oneDNN prepacked f32 "
          "streamed (anchor) | F.linear f32 streamed | panels / oneDNN |")
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for name, (k, n) in mats.items():
        w32 = [torch.randn(n, k, generator=g).bfloat16().float() for _ in range(copies)]
        panels = [cpu_gemm.pack(w) for w in w32]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in w32]
        for m in rows:
            x = torch.randn(m, k, generator=g)
            fl = 2 * m * k * n / 1e9
            t_p = _time(lambda i: cpu_gemm.linear(x, panels[i], n), copies)
            t_c = _time(lambda i: cpu_gemm.linear(x, panels[0], n), copies)
            t_o = _time(lambda i: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], ""), copies)
            t_f = _time(lambda i: torch.nn.functional.linear(x, w32[i]), copies)
            print(f"| {name} ({k} x {n}) | {m} | {fl / t_p:.0f} | {fl / t_c:.0f} | {fl / t_o:.0f} | "
                  f"{fl / t_f:.0f} | {t_o / t_p:.2f}x |")
        del w32, panels, onednn


if __name__ == "__main__":
    main()
