"""The K/V budget arithmetic of worker/memory.py on a simulated GPU: torch.cuda.mem_get_info and
memory_reserved are mocked, so these run anywhere. The case that motivated it: compose's two
stages at 0.45 on one GPU, one of them restarted next to the other's full cache."""
from __future__ import annotations

import logging

import pytest
import torch

from worker import memory
from worker.__main__ import DEFAULT_CPU_KV_BYTES, DEFAULT_GPU_MEMORY_FRACTION, kv_budget_bytes, resolve_args

GiB = memory.GiB
TOTAL = 141 * GiB
CONTEXT = GiB // 2          # a CUDA context, outside torch's allocator


class FakeGpu:
    """One device shared by processes; `current` is the process asking."""

    def __init__(self, total=TOTAL):
        self.total, self.procs, self.current = total, {}, None

    def start(self, name):                       # a process creates its CUDA context
        self.procs[name] = {"torch": 0, "other": CONTEXT}
        self.current = name

    def alloc(self, name, torch_bytes=0, other_bytes=0):
        self.procs[name]["torch"] += torch_bytes
        self.procs[name]["other"] += other_bytes

    def exit(self, name):
        del self.procs[name]

    def used(self):
        return sum(p["torch"] + p["other"] for p in self.procs.values())

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (self.total - self.used(), self.total))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: self.procs[self.current]["torch"])


@pytest.fixture
def gpu(monkeypatch):
    g = FakeGpu()
    g.install(monkeypatch)
    return g


def budget_for(args_list):
    return kv_budget_bytes(resolve_args(["--model", "tiny", "--device", "cuda", *args_list]))


def start_stage(gpu, name, weights, fraction="0.45"):
    """A worker's start: context, baseline, weights, budget, cache. Returns its budget."""
    gpu.start(name)
    args = resolve_args(["--model", "tiny", "--device", "cuda", "--kv-memory-fraction", fraction])
    args.memory_baseline = memory.take_baseline("cuda")
    gpu.alloc(name, torch_bytes=weights)
    budget = kv_budget_bytes(args)
    gpu.alloc(name, torch_bytes=budget)
    return budget


def test_two_stages_one_gpu_and_a_restart(gpu):
    weights = 8 * GiB
    a = start_stage(gpu, "stage0", weights)
    b = start_stage(gpu, "stage1", weights)
    share = int(0.45 * TOTAL) - weights
    assert a == b == share                       # each gets its own share, not what is left
    gpu.exit("stage0")                           # crash; stage1 keeps its cache
    again = start_stage(gpu, "stage0", weights)
    assert again == share                        # the old rule gave max(0, <0) = 0: exit 2 forever
    assert gpu.total - gpu.used() >= memory.ACTIVATION_MARGIN_BYTES
    # the replaced rule, for the record: it charged stage1's cache to the restarted stage
    free_before_cache = gpu.total - (gpu.used() - again)
    assert int(TOTAL * 0.45) - (TOTAL - free_before_cache) <= 0


def test_budget_capped_by_free_memory(gpu):
    gpu.start("other")
    gpu.alloc("other", torch_bytes=100 * GiB)    # someone else holds most of the device
    b = start_stage(gpu, "me", 2 * GiB, fraction="0.9")
    free_before_cache = gpu.total - (gpu.used() - b)
    assert b == free_before_cache - memory.ACTIVATION_MARGIN_BYTES
    assert b < int(0.9 * TOTAL) - 2 * GiB


def test_weights_larger_than_the_share_give_zero_and_say_why(gpu, caplog):
    gpu.start("me")
    gpu.alloc("me", torch_bytes=70 * GiB)
    with caplog.at_level(logging.ERROR, logger="worker.memory"):
        assert budget_for(["--kv-memory-fraction", "0.45"]) == 0
    assert "share 0.45" in caplog.text and "own 70.00 GiB" in caplog.text


def test_default_fraction_and_non_torch_growth_since_the_baseline(gpu):
    gpu.start("other")
    gpu.alloc("other", other_bytes=3 * GiB)      # a non-torch process: not ours, before our start
    gpu.start("me")
    base = memory.take_baseline("cuda")
    gpu.alloc("me", torch_bytes=GiB, other_bytes=GiB // 4)   # weights + a cubin and workspaces
    now = memory.snapshot("cuda")
    assert memory.own_usage(now, base) == GiB + GiB // 4
    assert memory.own_usage(now) == GiB              # without a baseline: torch's share only
    b = memory.gpu_kv_budget(now, DEFAULT_GPU_MEMORY_FRACTION, base)
    assert b.bytes == int(DEFAULT_GPU_MEMORY_FRACTION * TOTAL) - GiB - GiB // 4
    assert budget_for([]) == int(DEFAULT_GPU_MEMORY_FRACTION * TOTAL) - GiB   # default, no baseline


@pytest.mark.parametrize("frac", ["1", "1.0", "1.5", "0", "-0.1"])
def test_fraction_outside_zero_one_is_refused(frac):
    with pytest.raises(SystemExit):
        resolve_args(["--model", "tiny", "--device", "cuda", "--kv-memory-fraction", frac])
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        memory.check_fraction(float(frac))


def test_fixed_sizes_and_cpu_defaults():
    assert kv_budget_bytes(resolve_args(["--model", "tiny", "--num-blocks", "64"])) == 0
    assert kv_budget_bytes(resolve_args(["--model", "tiny", "--kv-cache-bytes", "4096"])) == 4096
    assert kv_budget_bytes(resolve_args(["--model", "tiny"])) == DEFAULT_CPU_KV_BYTES
    assert 0 < kv_budget_bytes(resolve_args(["--model", "tiny", "--kv-memory-fraction", "0.01"]))


@pytest.mark.parametrize("flags", [["--dtype", "float16"], ["--threads", "-1"], ["--data-port", "-5"]])
def test_worker_flags_out_of_their_range_stop_the_start(flags):
    with pytest.raises(SystemExit):
        resolve_args(["--model", "tiny", *flags])


def test_a_cache_that_can_never_be_made_is_refused_at_start():
    """(Before: the worker registered, and the service retried InitCache on it ~16 times a second.)"""
    from types import SimpleNamespace

    from worker.__main__ import _cache_never_fits
    runner = SimpleNamespace(kv_bytes_per_block=lambda bs: 8192 * bs)
    args = resolve_args(["--model", "tiny", "--kv-cache-bytes", "10"])
    assert "holds no token (one takes 8192 bytes" in _cache_never_fits(args, runner, 10)
    args = resolve_args(["--model", "tiny", "--num-blocks", "100000000"])
    assert "--num-blocks 100000000 needs at least 762.9 GiB" in _cache_never_fits(args, runner, 0)
    assert _cache_never_fits(resolve_args(["--model", "tiny", "--num-blocks", "64"]), runner, 0) == ""
