"""Prefix caching in KVBlockManager: hashing the blocks appended tokens fill, and cache lookups.

Every full block whose token ids are all known gets a chained hash (see prefix_cache.py). On the
decode path only sequences whose block just filled are hashed. A token appended as -1 (async
scheduling: not sampled yet) is recorded later by fill_tokens / fill_rows.

Methods of KVBlockManager (block_manager.py, which owns the arrays they use).
"""
from __future__ import annotations

import numpy as np


class PrefixHashing:
    """KVBlockManager's token recording and prefix-cache verbs (mixin)."""

    def _known_tokens(self, row: int, start: int, n: int, toks) -> list:
        if toks is not None:
            return toks.tolist()
        p = self._prompts.get(row)                  # positions inside the prompt are known
        return p[start:start + n].tolist() if p is not None else []

    def _record_tokens(self, row: int, start: int, n: int, toks) -> None:
        """Hash every block the appended tokens completed; keep the rest as the partial tail."""
        B = self.block_size
        known = self._known_tokens(row, start, n, toks)
        off = start % B
        buf = self._tail[row, :off].tolist() + known
        parent = self._last_hash[row]
        first = start // B
        for j in range(len(buf) // B):
            block = int(self._tables[row, first + j])
            parent = self.pool.cache.register(block, parent, tuple(buf[j * B:(j + 1) * B]))
        self._last_hash[row] = parent
        rest = buf[len(buf) // B * B:]
        self._tail[row, :len(rest)] = rest
        if len(known) < n:
            self._hash_ok[row] = False              # an unknown token breaks the chain for good

    def _record_decode(self, rows, lens, off, toks) -> None:
        if toks is not None:
            known = toks >= 0                        # -1: sampled later, given by fill_tokens
            if not known.all():
                rows, lens, off, toks = rows[known], lens[known], off[known], toks[known]
            self._tail[rows, off] = toks
        else:
            inprompt = lens < self._prompt_len[rows]
            for r, pos in zip(rows[inprompt].tolist(), lens[inprompt].tolist()):
                self._tail[r, pos % self.block_size] = self._prompts[r][pos]
            self._hash_ok[rows[~inprompt]] = False
        full = ((lens + 1) % self.block_size == 0) & self._hash_ok[rows]
        if full.any():                              # only the few rows whose block just filled
            for r, L in zip(rows[full].tolist(), lens[full].tolist()):
                block = int(self._tables[r, L // self.block_size])
                self._last_hash[r] = self.pool.cache.register(
                    block, self._last_hash[r], tuple(self._tail[r].tolist()))

    def fill_tokens(self, sequence_ids, token_ids) -> None:
        """The token of each sequence's last appended position, appended earlier as -1 (the engine
        scheduled the step that reads it before the step that samples it came back): record it,
        and hash the block if it is now full."""
        rows = self._rows(sequence_ids)
        if self.enable_prefix_caching:
            self.fill_rows(rows, self._tokens(token_ids, len(rows)))

    def fill_rows(self, rows: np.ndarray, toks: np.ndarray) -> None:
        """fill_tokens by rows."""
        if not self.enable_prefix_caching:
            return
        lens = self._lens[rows] - 1
        self._record_decode(rows, lens, lens % self.block_size, toks)

    # ------------------------------------------------------------------ prefix cache
    def prompt_cache_lookup(self, prompt_token_ids) -> int:
        """Prompt tokens a create_sequence would find cached now, in the pool or the tier (no
        state change)."""
        return sum(self._lookup(prompt_token_ids))

    def prompt_tier_lookup(self, prompt_token_ids) -> int:
        """The part of prompt_cache_lookup that the tier would load."""
        return self._lookup(prompt_token_ids)[1]

    def _lookup(self, prompt_token_ids) -> tuple[int, int]:
        if not self.enable_prefix_caching or prompt_token_ids is None or len(prompt_token_ids) == 0:
            return 0, 0
        prompt = self._tokens(prompt_token_ids, len(prompt_token_ids)).tolist()
        max_hit = (len(prompt) - 1) // self.block_size
        hit, parent = self.pool.cache.match(prompt, max_hit)
        slots, _ = self._tier_match(prompt, hit, parent, max_hit)
        return len(hit) * self.block_size, len(slots) * self.block_size

    def reset_prefix_cache(self) -> None:
        """The data plane lost its KV content: forget every hash. Live sequences stop hashing too
        (their content is gone; the scheduler recomputes them as new sequences)."""
        self.pool.reset_prefix_cache()
        self.reset_tier()                           # the tier goes with the cache: never guessed
        self._hash_ok[:] = False
