"""KVBlockManager's accounting: pool usage stats, invariants and the debug snapshot.

check_invariants is O(total blocks) in Python: for tests and explicit checks, not the step path.
Methods of KVBlockManager (block_manager.py, which owns the arrays they use).
"""
from __future__ import annotations

import numpy as np

from metadata_service.block_append import blocks_for_tokens


def kv_utilization(used_tokens: int, reserved_tokens: int) -> float:
    """Used slots / reserved slots (the seed's 300 of 4096 -> 7.3%); 0 when nothing is reserved."""
    return used_tokens / reserved_tokens if reserved_tokens else 0.0


class PoolAccounting:
    """KVBlockManager's read-only views of its pool and tables (mixin)."""

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def _live_rows(self) -> np.ndarray:
        return np.fromiter(self._row_of.values(), dtype=np.intp, count=len(self._row_of))

    def internal_fragmentation_tokens(self) -> int:
        rows = self._live_rows()
        return int(self._nblocks[rows].sum()) * self.block_size - int(self._lens[rows].sum())

    def stats(self) -> dict:
        rows = self._live_rows()
        allocated = int(self._nblocks[rows].sum()) * self.block_size
        used = int(self._lens[rows].sum())
        free = self.pool.num_free
        return dict(num_blocks=self.num_physical_blocks, block_size=self.block_size,
                    used_blocks=self.num_physical_blocks - free, free_blocks=free,
                    cached_blocks=self.pool.num_cached_free,
                    shared_blocks=int(np.count_nonzero(self.pool.ref_count > 1)),
                    kv_used_tokens=used, kv_allocated_tokens=allocated,
                    internal_fragmentation_tokens=allocated - used,
                    kv_utilization=kv_utilization(used, allocated),
                    prefix_cache_queries=self.prefix_cache_queries,
                    prefix_cache_hits=self.prefix_cache_hits, live_sequences=len(self._row_of),
                    **self.tier_stats())

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> list[str]:
        """Every violated invariant, in words (empty = all hold). O(total blocks)."""
        errs = self.pool.check() + self.check_tier()
        N, B = self.num_physical_blocks, self.block_size
        counts = np.zeros(N, dtype=np.int64)
        for sid, row in self._row_of.items():
            nb, L = int(self._nblocks[row]), int(self._lens[row])
            t = self._tables[row, :nb]
            if (t < 0).any() or (t >= N).any() or len(np.unique(t)) != nb:
                errs.append(f"sequence {sid}: bad block table {t.tolist()}")
                continue
            if (self._tables[row, nb:] != -1).any():
                errs.append(f"sequence {sid}: table not -1 padded")
            if nb < blocks_for_tokens(L, B):
                errs.append(f"sequence {sid}: {nb} blocks hold fewer than {L} tokens")
            counts[t] += 1
            writable = t[L // B:]                   # partial last block and reserved blocks
            if (self.pool.ref_count[writable] != 1).any():
                errs.append(f"sequence {sid}: a block it still writes is shared")
            if any(int(b) in self.pool.cache for b in writable):
                errs.append(f"sequence {sid}: a block it still writes is in the prefix cache")
        for blocks in self.held.values():           # prefill -> decode moves in progress
            np.add.at(counts, np.asarray(blocks, dtype=np.int64), 1)
        if not np.array_equal(counts, self.pool.ref_count):
            errs.append("ref counts differ from the number of tables holding each block")
        free_rows = set(self._free_rows)
        if free_rows & set(self._row_of.values()) or (self._nblocks[list(free_rows)] != 0).any():
            errs.append("row bookkeeping is inconsistent")
        return errs

    def invariants_ok(self) -> bool:
        return not self.check_invariants()

    def debug_state(self) -> dict:
        """A deep snapshot of everything observable (tests compare before/after a failed op)."""
        c = self.pool.cache
        return dict(
            tables={s: self._tables[r, :self._nblocks[r]].tolist() for s, r in self._row_of.items()},
            lens={s: int(self._lens[r]) for s, r in self._row_of.items()},
            tails={s: (bool(self._hash_ok[r]), self._last_hash[r],
                       self._tail[r, :self._lens[r] % self.block_size].tolist())
                   for s, r in self._row_of.items()},
            ref_count=self.pool.ref_count.tolist(), free=self.pool.free_blocks(),
            cache=dict(c.block_of), keys=dict(c.key_of),
            counters=(self.prefix_cache_queries, self.prefix_cache_hits), stats=self.stats(),
            tier=None if self.tier is None else (dict(self.tier.slot_of), sorted(self.tier.unsaved),
                                                 list(self._tier_saves), list(self._tier_loads)))
