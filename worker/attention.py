"""The attention-backend contract (docs/architecture.md section 4) and the factory that picks one.

Every backend reads and writes the same paged layout, so backends are interchangeable per step:
  key_cache / value_cache: [num_blocks, num_kv_heads, block_size, head_dim]   (one pair per layer)
  slot s  -> (block s // block_size, offset s % block_size); slot -1 = padding, skipped
  context position p of sequence b -> block_tables[b, p // block_size], offset p % block_size
  GQA: kv_head = q_head // (num_heads // num_kv_heads)
"""
from __future__ import annotations

import inspect
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class AttentionBackend(Protocol):
    name: str

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Scatter key/value [T, num_kv_heads, head_dim] into the caches at slot_mapping [T]."""

    def paged_decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """query [B, num_heads, head_dim], one new token per sequence whose K/V is already written.
        Attends over the first seq_lens[b] context positions. Returns [B, num_heads, head_dim]."""

    def paged_prefill(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, max_query_len: int,
                      scale: float) -> torch.Tensor:
        """query [T, num_heads, head_dim] packed for B sequences (query_start_loc [B+1]). Sequence
        b's queries are the LAST qlen_b positions of its context of seq_lens[b] tokens (a cached
        prefix precedes them); causal. Returns [T, num_heads, head_dim]."""


def get_backend(name: str, device: torch.device | str | None = None) -> AttentionBackend:
    """"torch" works everywhere; on a CPU device its decode runs one compiled loop
    (worker/attention_cpu.py; pure torch where no compiler is found or MINIPAGED_CPU_KERNELS=0).
    The CUDA ones are imported lazily so that CPU machines never import PyCUDA."""
    if name == "torch":
        if device is None or torch.device(device).type == "cpu":
            from worker.attention_cpu import CpuTorchBackend
            return CpuTorchBackend()
        from worker.attention_torch import TorchBackend
        return TorchBackend()
    if name == "pycuda":
        from worker.kernels.pycuda_backend import PyCudaBackend
        return _construct(PyCudaBackend, device)
    if name == "emulated":
        from worker.kernels.emulated import EmulatedBackend
        return _construct(EmulatedBackend, device)
    raise ValueError(f"unknown attention backend {name!r} (expected 'torch', 'pycuda' or 'emulated')")


def _construct(cls, device):
    # Kernel backends are written elsewhere; pass the device only to a constructor that takes one.
    params = inspect.signature(cls).parameters
    return cls(device) if device is not None and params else cls()
