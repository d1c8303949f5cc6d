"""Where a step's time goes, end to end: metadata service, wire, worker (and inside the forward).

Part 1 replays the e2e workload (bench/e2e.py: 64 prompts of 16-512 random ids, 64 new tokens,
greedy, ignore_eos) in ONE process, through the real code of both planes in the order the wire
would run it: the service schedules, builds and serializes the StepRequest; the worker parses,
validates, builds the batch, runs the forward, samples and serializes its reply; the service parses
it and applies the tokens. Each phase has a timer, and so has every module and attention-backend
call inside the forward (nested timers: a module's time excludes its timed children). Steps are
split into pure decode steps (every sequence has one query token: the steady state) and the rest
(prefill chunks, mixed steps).

Part 2 runs the same workload through LocalCluster (the service and the worker as processes, gRPC
on loopback, the SDK as client) and splits its wall time per step with the service's Stats: the
worker's compute (each stage's StageTiming, summed per chain), the service's own work (which async
scheduling overlaps with compute), and the rest: the wire, hand-offs, unoverlapped host work.

    .venv/bin/python bench/profile_step.py [--model tiny|PATH] [--dtype float32] [--workers 1]
        [--prompts 64] [--new-tokens 64] [--block-size 16] [--threads N] [--skip-cluster]
        [--torch-profile] [--cpu-time]

Timers add a few microseconds per module call (about 0.2 ms per decode step of the tiny model);
the `forward, untimed` row of Part 1 is the same forward with no timer at all, for reference.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import step_timers  # noqa: E402
from e2e import WORKLOADS, workload  # noqa: E402
from profile_cluster import cluster_run, print_cluster  # noqa: E402
from profile_tables import print_replay  # noqa: E402
from shapes import SHAPES, resolve_model  # noqa: E402
from step_timers import Timers, instrument  # noqa: E402


# ------------------------------------------------------------------------------------ part 1

def service_shell(num_blocks: int, block_size: int):
    """The metadata service's per-step code without its threads or sockets: a Scheduler sending
    full block tables (the worker here keeps no SequenceStore) and a ChainRunner used only for
    its packing and apply paths, as bench/scale.py does."""
    from metadata_service.block_manager import KVBlockManager
    from metadata_service.chain import ChainConfig, ChainRunner
    from metadata_service.scheduler import Scheduler

    class Engine:  # what ChainRunner._apply calls back
        eos_ids: set = set()

        def finish(self, *a, **k):
            pass

        def stream_tokens(self, *a, **k):
            pass

    cfg = ChainConfig(block_size=block_size)
    svc = ChainRunner.__new__(ChainRunner)
    svc.cfg, svc.epoch, svc.next_step_id, svc.wire_bytes, svc.generated_tokens = cfg, 1, 1, 0, 0
    svc.tokens_to_first = False                             # one stage: it knows its own tokens
    svc.engine, svc.manager = Engine(), KVBlockManager(num_blocks, block_size)
    svc.scheduler = Scheduler(svc.manager, cfg.max_num_batched_tokens, cfg.max_num_seqs, full_tables=True)
    return svc


def pool_blocks(runner, prompts, args) -> int:
    """The worker's CPU default (256 MiB of K/V), or what the workload needs if that is more: at
    real shapes a block holds ~100x the tiny model's bytes, and the whole workload runs at once."""
    bs = args.block_size
    need = sum(-(-(len(p) + args.new_tokens + 32) // bs) for p in prompts) + 4 * -(-(512 + 4) // bs) + 8
    return max(need, 256 * 1024 * 1024 // runner.kv_bytes_per_block(bs))


def replay_setup(args, prompts):
    """The worker's ModelRunner with its K/V pool, the limits it validates against, and the service shell."""
    from worker.__main__ import keep_freed_memory
    from worker.model_runner import ModelRunner
    from worker.validation import StepLimits

    keep_freed_memory()  # as the worker process does at start (re-faulting pages would dominate)
    runner = ModelRunner(args.model, 0, None, args.dtype, "cpu")
    cfg = runner.config
    num_blocks = pool_blocks(runner, prompts, args)
    runner.init_cache(num_blocks, args.block_size)
    limits = StepLimits(cfg.vocab_size, cfg.hidden_size, cfg.max_context, num_blocks,
                        args.block_size, True)
    return runner, limits, service_shell(num_blocks, args.block_size)


def add_all(svc, ps, new_tokens):
    """Queue the prompts as the e2e workload runs them: greedy, exactly new_tokens each (EOS ignored)."""
    from metadata_service.sequence import SamplingParams, Sequence
    for p in ps:
        svc.scheduler.add(Sequence(list(p), SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)))


def step_function(svc, runner, limits):
    """One step through both planes in the wire's order, a timer per phase: `run_step(timers)`.
    Its imports are done here, once, so that no step pays for them."""
    from minipaged import wire
    from minipaged.v1 import worker_pb2
    from worker.validation import validate_step

    def run_step(t: Timers):
        with t("svc: schedule"):
            b = svc.scheduler.schedule()
        with t("svc: build StepRequest"):
            req = svc._step_request(b, [])
        with t("svc: serialize"):
            data = req.SerializeToString()
        with t("worker: parse"):
            req = worker_pb2.StepRequest.FromString(data)
        with t("worker: validate"):
            a = validate_step(req, limits)
        with t("worker: make_batch"):
            batch = runner.make_batch(a.input_ids, a.positions, a.slot_mapping, a.query_start_loc,
                                      a.seq_lens, a.block_tables)
        with t("worker: forward (glue)"):
            hidden = runner.execute(batch)
        with t("worker: sample (glue)"):
            ids = runner.sample(hidden, a.query_start_loc, a.do_sample, a.temperature,
                                a.top_p, a.top_k, a.seeds, a.sample_offsets)[0]
        with t("worker: build + serialize reply"):
            reply = worker_pb2.StepReply(step_id=req.step_id, sampled_token_ids=wire.pack(ids)).SerializeToString()
        with t("svc: parse reply"):
            reply = worker_pb2.StepReply.FromString(reply)
        with t("svc: apply"):
            svc.scheduler.step_done(b)
            svc._apply(b, reply)
        return batch.is_decode, batch.num_tokens
    return run_step


def time_insides(runner, timers: Timers):
    """Timers on the forward's modules, attention backend, sampler and logits; returns their undo."""
    undo = instrument(runner.stage, runner.stage.backend, timers)
    import worker.sampler as sampler_mod
    real_sample = sampler_mod.sample

    def timed_sample(*a, **k):
        with timers("sampler"):
            return real_sample(*a, **k)
    sampler_mod.sample = timed_sample
    real_logits = runner.stage.compute_logits

    def timed_logits(*a, **k):
        with timers("lm_head + logits"):
            return real_logits(*a, **k)
    runner.stage.compute_logits = timed_logits

    def restore():
        sampler_mod.sample = real_sample
        runner.stage.compute_logits = real_logits
        undo()
    return restore


def timed_steps(svc, run_step, timers: Timers):
    """Every step until the scheduler runs dry: (is_decode, tokens, wall, timer deltas) each, and the total."""
    per_step = []
    t_all = step_timers.CLOCK()
    while svc.scheduler.has_work():
        before = timers.snapshot()
        t0 = step_timers.CLOCK()
        is_decode, ntok = run_step(timers)
        wall = step_timers.CLOCK() - t0
        per_step.append((is_decode, ntok, wall, timers.snapshot() - before))
    total = step_timers.CLOCK() - t_all
    return per_step, total


def replay(args, prompts):
    """The whole workload through both planes' code in one process, one timer per phase."""
    runner, limits, svc = replay_setup(args, prompts)
    timers = Timers()
    run_step = step_function(svc, runner, limits)
    # warm-up on other prompts (first-call allocations), as bench/e2e.py does
    add_all(svc, workload(4, seed=1), 4)
    while svc.scheduler.has_work():
        run_step(Timers())
    # the forward's and the sampler's insides get their own timers from here on
    restore = time_insides(runner, timers)
    add_all(svc, prompts, args.new_tokens)
    per_step, total = timed_steps(svc, run_step, timers)
    restore()

    untimed = None
    if any(d for d, *_ in per_step):  # the same decode forward once more with no timer (reference)
        untimed = untimed_decode_ms(runner, runner.config, prompts, args)
    torch_table = torch_profile(runner, prompts, args) if args.torch_profile else None
    return dict(per_step=per_step, total=total, untimed=untimed, torch_table=torch_table,
                tokens=args.new_tokens * len(prompts))


def in_worker_thread(fn, *a):
    """Run fn on a fresh thread, as the worker runs Steps on a gRPC executor thread. It matters:
    with 2 OpenMP threads on a busy 2-core machine, torch ops issued from the main thread ran ~10x
    slower than the same ops from any other thread (libgomp's handling of the initial thread)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn(*a)))
    t.start()
    t.join()
    if not out:
        raise RuntimeError("the replay thread failed (see its traceback above)")
    return out[0]


def decode_batch(runner, prompts, args, extra: int):
    """A decode step of every prompt at context len(prompt) + extra, contiguous block tables."""
    bs, B = args.block_size, len(prompts)
    lens = np.array([len(p) + extra for p in prompts])
    nblk = (lens + bs - 1) // bs
    tables = np.full((B, nblk.max()), -1, np.int32)
    tables[np.arange(nblk.max())[None, :] < nblk[:, None]] = np.arange(nblk.sum())
    pos = lens - 1
    slots = tables[np.arange(B), pos // bs] * bs + pos % bs
    ids = np.random.default_rng(extra).integers(0, runner.config.vocab_size, B).astype(np.int32)
    qsl = np.arange(B + 1, dtype=np.int32)
    return runner.make_batch(ids, pos.astype(np.int32), slots.astype(np.int32), qsl,
                             lens.astype(np.int32), tables), qsl


def untimed_decode_ms(runner, cfg, prompts, args, reps=15):
    """Median ms of a steady decode step (forward + sample) at mid-generation context, no timers."""
    clean = runner                                # its timers are off again (instrument's undo)
    B = len(prompts)
    zeros, ones = np.zeros(B), np.ones(B)
    times = []
    for r in range(reps + 3):
        batch, qsl = decode_batch(clean, prompts, args, args.new_tokens // 2 + r)
        t0 = step_timers.CLOCK()
        h = clean.execute(batch)
        clean.sample(h, qsl, ones, zeros, ones, zeros, zeros, zeros)
        times.append(step_timers.CLOCK() - t0)
    return 1000 * float(np.median(times[3:]))


def torch_profile(runner, prompts, args, steps=5):
    from torch.profiler import ProfilerActivity, profile
    batch, qsl = decode_batch(runner, prompts, args, args.new_tokens // 2)
    runner.execute(batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            runner.execute(batch)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help=f"tiny, a checkpoint directory, or a named shape "
                    f"({', '.join(SHAPES)}: random weights, made once into bench/shapes.py's cache)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="tiny",
                    help="prompt count, prompt lengths and new tokens (bench/e2e.py's WORKLOADS)")
    ap.add_argument("--prompts", type=int, default=0, help="override the workload's prompt count")
    ap.add_argument("--new-tokens", type=int, default=0, help="override the workload's new tokens")
    ap.add_argument("--quick", action="store_true", help="4 prompts, 4 new tokens (a smoke test)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--skip-cluster", action="store_true", help="skip Part 2")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads, in process and per worker (default: worker.model_runner."
                         "cpu_compute_threads() in process, LocalCluster's own choice for the cluster)")
    ap.add_argument("--torch-profile", action="store_true", help="also print torch.profiler's op table")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time Part 1 with this thread's CPU time instead of wall time: steadier on a busy "
                         "machine, but only meaningful with 1 torch thread (other threads' work is not counted)")
    return ap.parse_args()


def main():
    args = parse_args()
    n, shortest, longest, new = WORKLOADS[args.workload]
    args.prompts = 4 if args.quick else (args.prompts or n)
    args.new_tokens = 4 if args.quick else (args.new_tokens or new)
    args.model = resolve_model(args.model)
    if args.cpu_time:
        step_timers.CLOCK = time.thread_time   # the Timers and this file's timings read it at each call
    from worker.model_runner import cpu_compute_threads
    torch.set_num_threads(args.threads or cpu_compute_threads())
    from minipaged.config import load_model_config
    vocab = 256 if args.workload == "tiny" else load_model_config(args.model).vocab_size
    prompts = workload(args.prompts, 0, shortest, longest, vocab)
    print(f"{args.prompts} prompts of {shortest}-{longest} ids, {args.new_tokens} new tokens, greedy, model {args.model} "
          f"{args.dtype}, block size {args.block_size}, {torch.get_num_threads()} torch threads, "
          f"{'CPU' if args.cpu_time else 'wall'} time in Part 1, load average {os.getloadavg()[0]:.1f}\n")

    r = in_worker_thread(replay, args, prompts)
    print_replay(r)
    if not args.skip_cluster:
        print_cluster(args, r, cluster_run(args, prompts))


if __name__ == "__main__":
    main()
