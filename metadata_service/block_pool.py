"""BlockPool: the mechanism under KVBlockManager (vLLM v1 split: manager = policy, pool = mechanism).

Owns the physical blocks: ref counts, the free stack, the LRU of unreferenced cached blocks and
the prefix cache. It knows nothing about sequences. Every block is in exactly one of three states:
  referenced      ref > 0 (may be cached: a live full block others can share)
  cached-free     ref == 0, holds a registered prefix; reusable by a hit until evicted (LRU)
  free            ref == 0, no content worth keeping
Allocation takes plain free blocks first and only then evicts cached ones, oldest first.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from metadata_service.prefix_cache import HashFn, PrefixCache


class BlockManagerError(Exception):
    """Base of every block-manager error."""


class OutOfBlocksError(BlockManagerError):
    def __init__(self, needed: int, free: int, what: str = ""):
        self.needed, self.free = needed, free
        super().__init__(f"out of KV blocks{' for ' + what if what else ''}: "
                         f"needed {needed}, free {free}")


class UnknownSequenceError(BlockManagerError, KeyError):
    def __str__(self):  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class DoubleReleaseError(UnknownSequenceError):
    """Release (or use) of an id that was already released."""


class DuplicateSequenceError(BlockManagerError):
    pass


class InvalidArgumentError(BlockManagerError, ValueError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, hash_fn: HashFn | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_count = np.zeros(num_blocks, dtype=np.int32)
        # Free stack: the top is the end; reversed so block 0 is handed out first.
        self._free = np.arange(num_blocks - 1, -1, -1, dtype=np.int32)
        self._n_free = num_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()   # cached-free, oldest first
        self.cache = PrefixCache(block_size, hash_fn)
        self.on_evict = None          # (block) -> None, before a cached block's hash is forgotten (KV tier)

    # ------------------------------------------------------------------ counts
    def block_states(self) -> np.ndarray:
        """uint8 per block: 0 free, 1 owned (one table), 2 shared (several), 3 cached-free (an
        unreferenced block holding a reusable prefix): the dashboard's colours."""
        st = np.minimum(self.ref_count, 2).astype(np.uint8)
        if self._lru:
            st[np.fromiter(self._lru, dtype=np.int64, count=len(self._lru))] = 3
        return st

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: free + cached-free."""
        return self._n_free + len(self._lru)

    @property
    def num_cached_free(self) -> int:
        return len(self._lru)

    def free_blocks(self) -> list[int]:
        return self._free[:self._n_free].tolist() + list(self._lru)

    def is_cached_free(self, block: int) -> bool:
        return block in self._lru

    # ------------------------------------------------------------------ alloc / ref
    def allocate(self, k: int) -> np.ndarray:
        """k fresh blocks with ref 1 (caller checked k <= num_free)."""
        take = min(k, self._n_free)
        top = self._n_free
        out = self._free[top - take:top][::-1].copy()
        self._n_free = top - take
        if take < k:                                   # evict cached prefixes, LRU first
            extra = []
            for _ in range(k - take):
                b, _ = self._lru.popitem(last=False)
                if self.on_evict is not None:
                    self.on_evict(b)
                self.cache.remove(b)                   # stale hash must not point at new content
                extra.append(b)
            out = np.concatenate([out, np.asarray(extra, dtype=np.int32)])
        self.ref_count[out] = 1
        return out

    def allocate_one(self) -> int:
        """allocate(1) without temporary arrays (the scalar append path)."""
        if self._n_free:
            self._n_free -= 1
            b = self._free.item(self._n_free)
        else:
            b, _ = self._lru.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(b)
            self.cache.remove(b)
        self.ref_count[b] = 1
        return b

    def touch(self, blocks) -> None:
        """A prefix hit takes a reference on each block (reviving cached-free ones)."""
        for b in blocks:
            if self.ref_count[b] == 0:
                del self._lru[b]
            self.ref_count[b] += 1

    def incref(self, blocks) -> None:
        self.ref_count[np.asarray(blocks, dtype=np.int64)] += 1

    def release(self, blocks) -> int:
        """Drop one reference on each block; returns how many became unreferenced.

        Pass blocks tail-first: the tail of a prefix then becomes the older LRU entry and is
        evicted before its head (the head is what other prompts share)."""
        freed = 0
        for b in blocks:
            b = int(b)
            r = self.ref_count[b] - 1
            self.ref_count[b] = r
            if r == 0:
                freed += 1
                if b in self.cache:
                    self._lru[b] = None
                else:
                    self._free[self._n_free] = b
                    self._n_free += 1
        return freed

    def reset_prefix_cache(self) -> None:
        """The data plane lost its KV content: every hash goes, cached-free blocks become free."""
        for b in self._lru:
            self._free[self._n_free] = b
            self._n_free += 1
        self._lru.clear()
        self.cache.clear()

    # ------------------------------------------------------------------ checks
    def check(self) -> list[str]:
        """Pool-local invariant violations (empty list = fine)."""
        errs = []
        # vectorized, no sorting: pools can be millions of blocks and Stats checks this every call
        free = self._free[:self._n_free]
        lru = np.fromiter(self._lru, dtype=np.int64, count=len(self._lru))
        allfree = np.concatenate([free.astype(np.int64), lru])
        if allfree.size and np.bincount(allfree, minlength=self.num_blocks).max() > 1:
            errs.append("a block is free twice")
        if (self.ref_count[allfree] != 0).any():
            errs.append("a free block has a reference")
        if int((self.ref_count > 0).sum()) + allfree.size != self.num_blocks:
            errs.append("referenced + free != all blocks (a block was lost)")
        if (self.ref_count < 0).any():
            errs.append("negative ref count")
        cached = np.zeros(self.num_blocks, dtype=bool)
        cached[np.fromiter(self.cache.hash_of, dtype=np.int64, count=len(self.cache.hash_of))] = True
        if not cached[lru].all() or cached[free].any():
            errs.append("cached-free / free split disagrees with the prefix cache")
        c = self.cache
        # the two maps are inverses; map() looks every hash up in a C loop (1.6x the generator's speed)
        if len(c.block_of) != len(c.hash_of) or list(map(c.block_of.get, c.hash_of.values())) != list(c.hash_of):
            errs.append("prefix cache maps are inconsistent")
        return errs
