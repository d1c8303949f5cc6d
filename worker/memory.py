"""How many bytes a worker's K/V cache may take (`--kv-memory-fraction`, `--kv-cache-bytes`).

The fraction is this process's share of the device, as in vLLM: weights, K/V and whatever else
this process holds count against `fraction * total`, and ONLY this process's usage counts, so
several workers can share one GPU (compose runs two stages at 0.45 each). The rule this replaces,
`total * fraction - (total - free)`, charged every other process's memory to this one: a stage
restarted next to a running one saw its neighbour's cache as its own, got a budget <= 0, exited 2,
and `restart: unless-stopped` looped forever.

  own    = what this process's torch allocator holds (weights, buffers: process-local by
           construction) + what it grew outside torch since a baseline taken at start (CUDA
           modules, PyCUDA's cubin, library workspaces), when the caller took one
  share  = fraction * total - own
  cap    = free - margin        never ask for memory another process holds; the margin leaves
                                room for activations (and non-torch growth) after the cache
  budget = max(0, min(share, cap))

A fraction must be < 1: the cache is sized once, the activations of every later step need room.
Another process that allocates between the baseline and the measurement is counted as ours: that
can only lower this budget, never overcommit the device. Pure arithmetic on snapshots, tested with
a mocked `torch.cuda.mem_get_info` (tests/test_memory.py).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger("worker.memory")

GiB = 1 << 30
ACTIVATION_MARGIN_BYTES = 1 * GiB


def check_fraction(fraction: float) -> float:
    if not 0 < fraction < 1:
        raise ValueError(f"--kv-memory-fraction {fraction} must be in (0, 1): it is this process's "
                         "share of the device, and activations need room beyond the cache")
    return fraction


@dataclass(frozen=True)
class MemorySnapshot:
    total: int            # device bytes
    free: int             # free on the device now, whoever holds the rest
    torch_reserved: int   # held by this process's torch caching allocator

    @property
    def non_torch_used(self) -> int:
        """Used on the device but not by this process's torch: CUDA contexts, non-torch
        allocations of this process, and every other process."""
        return self.total - self.free - self.torch_reserved


def snapshot(device) -> MemorySnapshot:
    import torch
    dev = torch.device(device)
    free, total = torch.cuda.mem_get_info(dev)
    return MemorySnapshot(total=int(total), free=int(free),
                          torch_reserved=int(torch.cuda.memory_reserved(dev)))


def take_baseline(device) -> MemorySnapshot:
    """Call once at start, after CUDA is initialised and before the weights load."""
    return snapshot(device)


def own_usage(now: MemorySnapshot, baseline: MemorySnapshot | None = None) -> int:
    grown = 0 if baseline is None else max(0, now.non_torch_used - baseline.non_torch_used)
    return now.torch_reserved + grown


@dataclass(frozen=True)
class GpuBudget:
    bytes: int
    share: int            # fraction * total - own
    cap: int              # free - margin
    own: int

    def describe(self, fraction: float, now: MemorySnapshot) -> str:
        g = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
        return (f"K/V budget {g(self.bytes)} = min(share {fraction} x {g(now.total)} - own "
                f"{g(self.own)} = {g(self.share)}, free {g(now.free)} - margin "
                f"{g(now.free - self.cap)} = {g(self.cap)})")


def gpu_kv_budget(now: MemorySnapshot, fraction: float, baseline: MemorySnapshot | None = None,
                  margin: int = ACTIVATION_MARGIN_BYTES) -> GpuBudget:
    check_fraction(fraction)
    own = own_usage(now, baseline)
    share = int(now.total * fraction) - own
    cap = now.free - margin
    return GpuBudget(bytes=max(0, min(share, cap)), share=share, cap=cap, own=own)


def kv_budget_bytes(device: str, fraction: float | None, kv_cache_bytes: int | None,
                    num_blocks: int, *, default_gpu_fraction: float, default_cpu_bytes: int,
                    baseline: MemorySnapshot | None = None) -> int:
    """The worker's K/V byte budget once its weights are loaded (0 when --num-blocks fixes the
    capacity). A budget of 0 means the caller must refuse to start (it logs why here)."""
    if num_blocks:
        return 0
    if kv_cache_bytes is not None and fraction is None:
        return kv_cache_bytes
    if str(device).startswith("cuda"):
        frac = fraction or default_gpu_fraction
        now = snapshot(device)
        budget = gpu_kv_budget(now, frac, baseline)
        (log.info if budget.bytes > 0 else log.error)("%s", budget.describe(frac, now))
        return budget.bytes
    if fraction is not None:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * check_fraction(fraction))
    return default_cpu_bytes
