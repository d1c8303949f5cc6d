"""The paged K/V cache: per layer one key and one value tensor [num_blocks, Hkv, block_size, D].

One block id names the same slots in every layer (docs/architecture.md section 1), so a single block table from
the metadata service addresses all layers of this stage. The cache holds data only: which block
belongs to whom is the metadata plane's business.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from minipaged.constants import kv_bytes_per_block
from worker import huge_pages

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
           "float16": torch.float16}


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (expected one of {sorted(_DTYPES)})")
    return _DTYPES[dtype]


def bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int, head_dim: int,
                    dtype: torch.dtype | str) -> int:
    """K and V, every layer of the stage (minipaged.constants.kv_bytes_per_block, which the
    metadata service uses too, for a torch dtype or its name)."""
    itemsize = torch.empty((), dtype=as_dtype(dtype)).element_size()
    return kv_bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, itemsize)


def blocks_for_budget(budget_bytes: int, num_layers: int, num_kv_heads: int, block_size: int,
                      head_dim: int, dtype: torch.dtype | str) -> int:
    return int(budget_bytes) // bytes_per_block(num_layers, num_kv_heads, block_size, head_dim, dtype)


def _zeros(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed cache tensor; on the CPU in 2 MiB pages (worker/huge_pages.py: a decode step reads
    blocks scattered over the whole cache; a tiny-model decode layer of 59 sequences x ~400 tokens
    1.30-1.38 ms -> 1.13-1.26 ms on a 2-core EPYC)."""
    if torch.device(device).type == "cpu":
        return huge_pages.empty(shape, dtype).zero_()
    return torch.zeros(shape, dtype=dtype, device=device)


def _ids(ids, device) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        return ids.reshape(-1).to(device=device, dtype=torch.long)
    return torch.tensor(np.asarray(ids, dtype=np.int64).reshape(-1), device=device)


def _host_bytes(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes as numpy [n, ...] uint8, sharing its memory. K/V moves run on threads of
    their own (the PullQueue, the data link's block reads): a torch copy there opens an OpenMP
    parallel region, and libgomp then keeps a second pool of helpers beside the step thread's,
    which stops them spinning between the step's regions (worker/omp_pool.py). numpy copies on the
    calling thread."""
    return t.view(torch.uint8).numpy()


@dataclass
class PagedKVCache:
    num_layers: int
    num_blocks: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype | str = torch.float32
    device: torch.device | str = "cpu"
    key_cache: list[torch.Tensor] = field(init=False, repr=False)
    value_cache: list[torch.Tensor] = field(init=False, repr=False)

    blocks_for_budget = staticmethod(blocks_for_budget)

    def __post_init__(self):
        self.dtype = as_dtype(self.dtype)
        shape = (self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim)
        # Zeroed so that a fresh cache has a well-defined checksum (and no NaN garbage).
        self.key_cache = [_zeros(shape, self.dtype, self.device) for _ in range(self.num_layers)]
        self.value_cache = [_zeros(shape, self.dtype, self.device) for _ in range(self.num_layers)]

    @property
    def nbytes(self) -> int:
        return self.num_blocks * bytes_per_block(self.num_layers, self.num_kv_heads,
                                                 self.block_size, self.head_dim, self.dtype)

    def copy_blocks(self, src, dst) -> None:
        """Copy whole blocks src[i] -> dst[i] in every layer (copy-on-write of a shared block)."""
        if not self.num_layers:
            return
        device = self.key_cache[0].device
        src = _ids(src, device)
        dst = _ids(dst, device)
        if src.shape != dst.shape:
            raise ValueError(f"copy_blocks: {src.numel()} sources but {dst.numel()} destinations")
        if src.numel() == 0:
            return
        ids = torch.cat([src, dst])
        if int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks:
            raise IndexError(f"copy_blocks: block ids must be in [0, {self.num_blocks})")
        for cache in (*self.key_cache, *self.value_cache):
            cache[dst] = cache[src]                           # gather first: overlapping pairs are safe

    # ---- the second KV tier (docs/architecture.md section 9): host RAM, slot-granular -------------
    def attach_tier(self, num_slots: int) -> None:
        """Tier tensors, per layer K and V [num_slots, Hkv, block_size, D] in host RAM (pinned when
        the cache is on a GPU, so copies are DMA transfers). The metadata plane owns the slots."""
        shape = (num_slots, self.num_kv_heads, self.block_size, self.head_dim)
        pin = torch.device(self.device).type == "cuda"
        self.tier_key = [torch.zeros(shape, dtype=self.dtype, pin_memory=pin) for _ in range(self.num_layers)]
        self.tier_value = [torch.zeros(shape, dtype=self.dtype, pin_memory=pin) for _ in range(self.num_layers)]

    @property
    def tier_slots(self) -> int:
        tk = getattr(self, "tier_key", None)
        return tk[0].shape[0] if tk else 0

    def tier_moves(self, save_blocks, save_slots, load_slots, load_blocks) -> None:
        """Saves (pool block -> tier slot) first, then loads (tier slot -> pool block), every layer.
        Ids were validated by the caller (worker/validate_cache.py)."""
        if not self.num_layers:
            return
        dev = self.key_cache[0].device
        on_gpu = dev.type == "cuda"
        sb, ss = _ids(save_blocks, dev), _ids(save_slots, "cpu")
        ls, lb = _ids(load_slots, "cpu"), _ids(load_blocks, dev)
        pairs = list(zip(self.key_cache, self.tier_key)) + list(zip(self.value_cache, self.tier_value))
        if ss.numel():
            for cache, tier in pairs:
                tier[ss] = cache[sb].to("cpu")       # a gather on the device, one transfer down
        if ls.numel():
            for cache, tier in pairs:
                rows = tier[ls]                        # a gather in host RAM, one transfer up
                cache[lb] = rows.pin_memory().to(dev, non_blocking=True) if on_gpu else rows

    # ---- disaggregated prefill/decode (docs/architecture.md section 9): blocks as bytes ------------
    def read_blocks(self, ids) -> bytes:
        """Blocks `ids` of every layer of this stage, as one byte string: all layers' K, then all V,
        each [n, Hkv, block_size, D] (the layout write_blocks expects of a stage with equal layers)."""
        idx = _ids(ids, self.key_cache[0].device) if self.num_layers else None
        if idx is None or idx.numel() == 0:
            return b""
        caches = (*self.key_cache, *self.value_cache)
        if idx.device.type == "cpu":     # numpy: no OpenMP region on the move's thread (see _host_bytes)
            rows = idx.numpy()
            out = bytearray(rows.size * (self.nbytes // self.num_blocks))   # all layers' K, then all V
            view = np.frombuffer(out, dtype=np.uint8).reshape(len(caches), rows.size, -1)
            for i, c in enumerate(caches):
                view[i] = _host_bytes(c).reshape(self.num_blocks, -1)[rows]
            return out
        parts = [c.index_select(0, idx).reshape(-1) for c in caches]
        return torch.cat(parts).view(torch.uint8).cpu().numpy().tobytes()

    def check_block_bytes(self, n: int, nbytes: int) -> None:
        """ValueError unless nbytes is what read_blocks gives for n blocks of this stage's layout."""
        want = n * bytes_per_block(self.num_layers, self.num_kv_heads, self.block_size, self.head_dim, self.dtype)
        if nbytes != want:
            raise ValueError(f"{nbytes} bytes of K/V for {n} blocks, expected {want} ({self.num_layers} layers, "
                             f"{self.dtype}): the source's layout differs")

    def write_blocks(self, ids, data) -> None:
        """The inverse of read_blocks (the size is checked first: a source whose layout differs
        leaves this cache untouched)."""
        n = len(ids)
        self.check_block_bytes(n, len(data))
        if not n:
            return
        dev = self.key_cache[0].device
        buf = data if isinstance(data, bytearray) else bytearray(data)   # (the link's buffer: no copy)
        rows = torch.frombuffer(buf, dtype=torch.uint8).view(self.dtype)
        rows = rows.view(2 * self.num_layers, n, self.num_kv_heads, self.block_size, self.head_dim)
        idx = _ids(ids, dev)
        for i, cache in enumerate((*self.key_cache, *self.value_cache)):
            if dev.type == "cpu":
                _host_bytes(cache)[idx.numpy()] = _host_bytes(rows[i])
            else:
                cache[idx] = rows[i].to(dev, non_blocking=True)

    def checksum(self) -> float:
        """Cheap fingerprint of all K/V: per-block sums and norms weighted by block id (so moving
        data between blocks shows), accumulated in float64 without copying the cache."""
        total = 0.0
        if not self.num_layers:
            return total
        weights = torch.arange(1, self.num_blocks + 1, dtype=torch.float64,
                               device=self.key_cache[0].device)
        for i, cache in enumerate((*self.key_cache, *self.value_cache)):
            sums = cache.sum(dim=(1, 2, 3), dtype=torch.float64)
            norms = torch.linalg.vector_norm(cache, dim=(1, 2, 3), dtype=torch.float64)
            total += float(((sums + 3.0 * norms) * weights).sum()) * (i + 1)
        return total
