"""How the kernels are launched, shared by both kernel backends: argument checks, grid and block,
CUDA's launch limits, the split-KV choice, workspace allocation.

The PyCUDA backend (real GPU) and the emulated backend (the same .cu compiled with g++ against
simt_cpu.h, run on the CPU) subclass `KernelBackendBase`; they differ only in `_launch`, so the
emulation tests exercise the exact launch configuration the GPU runs, split-KV included.
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass

import torch

from worker.kernels.source import DTYPE_SUFFIX, HEAD_DIMS

# Kept in step with the constants of the .cu files (mp::DEC_THREADS etc.).
CACHE_THREADS = 128
DEC_THREADS = 128
DEC_TILE = 32
MAX_GROUP = 16
PF_THREADS = 128
PF_ROWS = 32

# Split-KV policy: aim for SPLIT_WAVES CTAs per SM, never fewer than MIN_TOKENS_PER_SPLIT tokens per
# split (below that the reduce and the workspace cost more than the parallelism gains).
DEFAULT_NUM_SMS = 132            # H100/H200 SXM; the PyCUDA backend reads the real count
SPLIT_WAVES = 2
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 32

# CUDA's launch limits (every architecture since sm_30).
MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_BLOCK_THREADS = 1024


@dataclass(frozen=True)
class Launch:
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple            # tensors (passed as pointers), ints (int32), floats (float32)

    def __post_init__(self):
        # Checked on the host: past a limit the launch would fail on the GPU with a bare
        # "invalid argument", and the emulation would run it anyway.
        for axis, n, limit in zip("xyz", self.grid, MAX_GRID):
            if not 0 <= n <= limit:
                raise ValueError(f"{self.kernel}: grid {axis} = {n} is outside CUDA's limit "
                                 f"[0, {limit}] (grid {self.grid})")
        if math.prod(self.block) > MAX_BLOCK_THREADS:
            raise ValueError(f"{self.kernel}: block {self.block} has more than "
                             f"{MAX_BLOCK_THREADS} threads")


def unsupported_shape(head_dim: int, num_heads: int, num_kv_heads: int) -> str | None:
    """Why the kernels cannot run a model of this attention shape, or None when they can: they are
    instantiated for HEAD_DIMS and hold a KV head's whole query group (<= MAX_GROUP) in shared memory.
    Checked when a worker starts (flags.py, model_runner.py), not first at a step."""
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (the CUDA kernels are built for {HEAD_DIMS})"
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        return (f"{num_heads} query heads over {num_kv_heads} KV heads (the CUDA kernels take a "
                f"whole multiple, at most {MAX_GROUP} per KV head)")
    return None


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int,
                      num_sms: int = DEFAULT_NUM_SMS) -> int:
    """Split-KV factor for decode: enough CTAs to fill the GPU (SPLIT_WAVES per SM) when the batch
    alone does not, each split keeping at least MIN_TOKENS_PER_SPLIT tokens; 1 for short contexts
    or large batches. max_context is an upper bound on the context length (no device sync)."""
    ctas = max(1, batch * num_kv_heads)
    want = math.ceil(SPLIT_WAVES * num_sms / ctas)
    by_len = max_context // MIN_TOKENS_PER_SPLIT
    return max(1, min(want, by_len, MAX_SPLITS))


def prefill_q_tile(num_heads: int, num_kv_heads: int) -> int:
    return PF_ROWS // (num_heads // num_kv_heads)


class KernelBackendBase(abc.ABC):
    """The AttentionBackend interface on top of the .cu kernels; subclasses supply `_launch`,
    `device` and `num_sms`."""

    name = "kernels"
    device: torch.device
    num_sms: int = DEFAULT_NUM_SMS
    # Tests set this: outputs and split workspaces are filled with NaN when allocated, so an
    # element a kernel fails to write shows up as NaN instead of stale memory.
    poison_outputs: bool = False
    last_num_splits: int | None = None

    def _empty(self, *shape_or_like, dtype=None) -> torch.Tensor:
        if len(shape_or_like) == 1 and isinstance(shape_or_like[0], torch.Tensor):
            t = torch.empty_like(shape_or_like[0])
        else:
            t = torch.empty(*shape_or_like, dtype=dtype, device=self.device)
        if self.poison_outputs:
            t.fill_(float("nan"))
        return t

    @abc.abstractmethod
    def _launch(self, launch: Launch) -> None:
        """Run one planned kernel launch (PyCUDA on a GPU, fibers on the CPU)."""

    # -- checks -----------------------------------------------------------------------------
    def _check(self, what: str, t: torch.Tensor, dtype=None, ndim=None) -> None:
        if t.device != self.device and not (t.device.type == self.device.type and
                                            self.device.index is None):
            raise ValueError(f"{self.name}: {what} is on {t.device}, expected {self.device}")
        if dtype is not None and t.dtype != dtype:
            raise TypeError(f"{self.name}: {what} has dtype {t.dtype}, expected {dtype}")
        if ndim is not None and t.dim() != ndim:
            raise ValueError(f"{self.name}: {what} must be {ndim}-D, got shape {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{self.name}: {what} must be contiguous")
        if t.numel() and t.data_ptr() % 16:
            raise ValueError(f"{self.name}: {what} must be 16-byte aligned")

    def _check_cache(self, key_cache, value_cache):
        if key_cache.dtype not in DTYPE_SUFFIX:
            raise TypeError(f"{self.name}: cache dtype {key_cache.dtype} not supported "
                            f"(float32, float16, bfloat16)")
        self._check("key_cache", key_cache, ndim=4)
        self._check("value_cache", value_cache, key_cache.dtype, 4)
        if value_cache.shape != key_cache.shape:
            raise ValueError(f"{self.name}: value_cache shape {tuple(value_cache.shape)} != "
                             f"key_cache shape {tuple(key_cache.shape)}")
        return DTYPE_SUFFIX[key_cache.dtype]

    def _input(self, what: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """An input the kernel only reads: converted to dtype / made contiguous and 16-byte
        aligned when it is not already (a no-op in the usual case)."""
        if t.device.type != self.device.type:
            raise ValueError(f"{self.name}: {what} is on {t.device}, expected {self.device}")
        t = t.to(dtype).contiguous()
        if t.numel() and t.data_ptr() % 16:
            t = t.clone()
        return t

    def _check_attention(self, query, key_cache, value_cache, block_tables, seq_lens):
        sfx = self._check_cache(key_cache, value_cache)
        if query.dtype != key_cache.dtype:
            raise TypeError(f"{self.name}: query dtype {query.dtype} != cache dtype "
                            f"{key_cache.dtype}")
        if query.dim() != 3:
            raise ValueError(f"{self.name}: query must be 3-D, got shape {tuple(query.shape)}")
        query = self._input("query", query, query.dtype)
        _, num_kv_heads, block_size, head_dim = key_cache.shape
        num_heads = query.shape[1]
        if query.shape[2] != head_dim:
            raise ValueError(f"{self.name}: head_dim {query.shape[2]} (cache {head_dim})")
        why = unsupported_shape(head_dim, num_heads, num_kv_heads)
        if why is not None:
            raise ValueError(f"{self.name}: {why}")
        if block_tables.dim() != 2 or seq_lens.dim() != 1:
            raise ValueError(f"{self.name}: block_tables must be [B, max_blocks] and seq_lens "
                             f"[B], got {tuple(block_tables.shape)} / {tuple(seq_lens.shape)}")
        block_tables = self._input("block_tables", block_tables, torch.int32)
        seq_lens = self._input("seq_lens", seq_lens, torch.int32)
        if block_tables.shape[0] != seq_lens.shape[0]:
            raise ValueError(f"{self.name}: block_tables has {block_tables.shape[0]} rows, "
                             f"seq_lens {seq_lens.shape[0]}")
        return sfx, query, block_tables, seq_lens, (num_heads, num_kv_heads, block_size, head_dim)

    # -- the interface ----------------------------------------------------------------------
    def write_kv(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        sfx = self._check_cache(key_cache, value_cache)
        T = key.shape[0]
        _, num_kv_heads, block_size, head_dim = key_cache.shape
        if tuple(key.shape) != (T, num_kv_heads, head_dim) or value.shape != key.shape:
            raise ValueError(f"{self.name}: key/value must be [T, {num_kv_heads}, {head_dim}], "
                             f"got {tuple(key.shape)} / {tuple(value.shape)}")
        if T == 0:
            return
        key = self._input("key", key, key_cache.dtype)
        value = self._input("value", value, key_cache.dtype)
        slots = self._input("slot_mapping", slot_mapping, torch.int64)
        if slots.shape != (T,):
            raise ValueError(f"{self.name}: slot_mapping must be [{T}], got {tuple(slots.shape)}")
        vectorized = int(head_dim * key.element_size() % 16 == 0)
        self._launch(Launch(f"reshape_and_cache_{sfx}", (T, 1, 1), (CACHE_THREADS, 1, 1),
                            (key, value, key_cache, value_cache, slots,
                             num_kv_heads, head_dim, block_size, vectorized)))

    def plan_decode(self, batch: int, num_kv_heads: int, max_context: int) -> int:
        return choose_num_splits(batch, num_kv_heads, max_context, self.num_sms)

    def paged_decode(self, query, key_cache, value_cache, block_tables, seq_lens, scale):
        sfx, query, block_tables, seq_lens, (H, KVH, bs, D) = self._check_attention(
            query, key_cache, value_cache, block_tables, seq_lens)
        B = query.shape[0]
        if B != seq_lens.shape[0]:      # the grid is the query's rows: each reads its seq_lens entry
            raise ValueError(f"{self.name}: query has {B} rows, seq_lens {seq_lens.shape[0]}")
        out = self._empty(query)
        if B == 0:
            return out
        max_blocks = block_tables.shape[1]
        splits = self.plan_decode(B, KVH, max_blocks * bs)
        self.last_num_splits = splits
        if splits > 1:
            ws_m = self._empty(B, H, splits, dtype=torch.float32)
            ws_l = self._empty(B, H, splits, dtype=torch.float32)
            ws_acc = self._empty(B, H, splits, D, dtype=torch.float32)
        else:
            ws_m = ws_l = ws_acc = out    # unused by the kernel when num_splits == 1
        self._launch(Launch(f"paged_decode_{sfx}_d{D}", (B, KVH, splits), (DEC_THREADS, 1, 1),
                            (out, ws_m, ws_l, ws_acc, query, key_cache, value_cache, block_tables,
                             seq_lens, float(scale), H, KVH, bs, max_blocks, splits)))
        if splits > 1:
            self._launch(Launch(f"paged_decode_reduce_{sfx}_d{D}", (B, H, 1), (D, 1, 1),
                                (out, ws_m, ws_l, ws_acc, H, splits)))
        return out

    def paged_prefill(self, query, key_cache, value_cache, block_tables, seq_lens,
                      query_start_loc, max_query_len, scale):
        sfx, query, block_tables, seq_lens, (H, KVH, bs, D) = self._check_attention(
            query, key_cache, value_cache, block_tables, seq_lens)
        query_start_loc = self._input("query_start_loc", query_start_loc, torch.int32)
        B = seq_lens.shape[0]
        if query_start_loc.shape[0] != B + 1:
            raise ValueError(f"{self.name}: query_start_loc must have {B + 1} entries")
        out = self._empty(query)
        if B == 0 or query.shape[0] == 0 or max_query_len <= 0:
            return out
        q_tile = prefill_q_tile(H, KVH)
        q_tiles = math.ceil(int(max_query_len) / q_tile)
        if q_tiles > MAX_GRID[1]:
            raise ValueError(f"{self.name}: a prefill of {max_query_len} query tokens needs "
                             f"{q_tiles} tiles of {q_tile} (grid y), over CUDA's limit "
                             f"{MAX_GRID[1]}: chunk prefills to at most "
                             f"{MAX_GRID[1] * q_tile} tokens per sequence per step")
        self._launch(Launch(f"paged_prefill_{sfx}_d{D}", (B, q_tiles, KVH), (PF_THREADS, 1, 1),
                            (out, query, key_cache, value_cache, block_tables, seq_lens,
                             query_start_loc, float(scale), H, KVH, bs, block_tables.shape[1],
                             q_tile)))
        return out
