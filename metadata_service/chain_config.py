"""What shapes a replica chain before it runs: its settings (ChainConfig, from the service's flags),
how many micro-batches it keeps in flight (default_micro_batches), and what it records of each step
it has sent (InflightStep: the batch, for when the reply comes, and when it left, for the deadline)."""
from __future__ import annotations

from dataclasses import dataclass

from .scheduler import ScheduledBatch


@dataclass
class ChainConfig:
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256          # per micro-batch
    micro_batches: int = 0           # 0: default_micro_batches(stages)
    async_scheduling: bool = True
    enable_prefix_caching: bool = True
    full_block_tables: bool = False  # send whole tables every step (the pre-delta wire, to compare)
    worker_token: str = ""
    step_timeout_s: float = 120.0    # --step-timeout: the deadline's fixed part (0: no deadline)
    kv_tier_policy: str = "write-back"   # --kv-tier-policy (block_tiering.py); "off": no tier
    kv_move_part_bytes: int = 0          # --kv-move-part-bytes: a prefill -> decode move's read size, 0 = one


def default_micro_batches(stages: int, host_compute: bool = False) -> int:
    """Micro-batches a chain keeps in flight. One stage: 1 (its two overlapped steps hide the host).
    Stages that compute on the host's own cores (CPU workers): N, with async scheduling across the
    pipeline. A GPU runs beside the host, so extra micro-batches hide the host's work; on a CPU the
    cores that would hide it are the ones computing, and each extra micro-batch only makes every
    one smaller (tiny model, 2 stages on 2 cores: 3 micro-batches 0.84-0.92x of one worker, 2 with
    overlap 0.89-1.08x). GPU (and simulated) stages: N + 1. A micro-batch's round trip crosses
    every stage's host path, so more than N must be in flight, but each one more makes every
    micro-batch smaller (weights read per token go up). Since a step's header goes ahead of its
    hidden states (worker/link_frames.py: a hop 0.8 -> 0.4 ms), one more is enough. Measured on 2
    cores with simulated H200 stages (bench/results/step-headers-2026-12-06.md), median of 3 jobs,
    2 rounds: 4 stages 5 / 6 micro-batches 51.4 / 49.0k tok/s short prompts, 13.6 / 13.35k long;
    8 stages 9 / 12: 57.9 / 54.3k short. (Before the split headers N + N // 2 was best: 4 stages
    5 / 6 / 8 / 12 -> 3.20 / 3.38 / 3.26 / 3.02x, long prompts.)
    `--micro-batches` overrides."""
    if stages == 1:
        return 1
    return stages if host_compute else stages + 1


@dataclass
class InflightStep:
    batch: ScheduledBatch
    step_id: int
    sent_at: float
