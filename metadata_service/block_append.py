"""Appending tokens to KVBlockManager's sequences: the slots of prefill chunks and decode steps,
and the per-step tensors (table deltas, lengths).

Methods of KVBlockManager (block_manager.py, which owns the arrays they use), kept in a file of their
own. Two entries for the same work: by sequence id (the seed's API and the block API: ids checked
each call) and by row (`*_rows`: the scheduler's decode step, rows looked up once).
Address mapping (seed, section 3): slot = block_table[pos // B] * B + pos % B.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from metadata_service.block_pool import InvalidArgumentError

_EMPTY = np.zeros(0, dtype=np.int32)


def slot_for(block_table: Sequence[int], pos: int, block_size: int) -> int:
    """The seed's address mapping for one position."""
    return int(block_table[pos // block_size]) * block_size + pos % block_size


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def kv_tokens(prompt_len: int, max_new_tokens: int) -> int:
    """The most K/V slots a request fills: its last sampled token is never fed back."""
    return prompt_len + max(max_new_tokens - 1, 0)


class TokenAppend:
    """KVBlockManager's append verbs (mixin: state and row lookups live in block_manager.py)."""

    def allocate_block(self, sequence_id: int) -> int:
        """Seed primitive: reserve one more (empty) block at the end of the table."""
        row = self._row(sequence_id)
        self._check_free(1, f"sequence {sequence_id}")
        nb = int(self._nblocks[row])
        self._ensure_cols(nb + 1)
        b = int(self.pool.allocate(1)[0])
        self._tables[row, nb] = b
        self._nblocks[row] = nb + 1
        return b

    def blocks_needed(self, sequence_id: int, num_tokens: int) -> int:
        row = self._row(sequence_id)
        if num_tokens < 0:
            raise InvalidArgumentError(f"num_tokens must be >= 0, got {num_tokens}")
        end = int(self._lens[row]) + num_tokens
        return max(0, blocks_for_tokens(end, self.block_size) - int(self._nblocks[row]))

    def can_append(self, sequence_id: int, num_tokens: int = 1) -> bool:
        return self.blocks_needed(sequence_id, num_tokens) <= self.pool.num_free

    def append_token(self, sequence_id: int, token_id: int | None = None) -> int:
        """Seed API: one token, returns its slot. Scalar path: no temporary arrays."""
        row = self._row(sequence_id)
        B = self.block_size
        L = self._lens.item(row)
        idx, off = divmod(L, B)
        if idx >= self._nblocks.item(row):
            self._check_free(1, f"sequence {sequence_id}")
            self._ensure_cols(idx + 1)
            block = self.pool.allocate_one()
            self._tables[row, idx] = block
            self._nblocks[row] = idx + 1
        else:
            block = self._tables.item(row, idx)
        self._lens[row] = L + 1
        if self._hash_ok[row]:
            if token_id is None:
                p = self._prompts.get(row)
                token_id = int(p[L]) if p is not None and L < len(p) else None
            if token_id is None:
                self._hash_ok[row] = False
            else:
                self._tail[row, off] = token_id
                if off == B - 1:
                    self._last_hash[row] = self.pool.cache.register(
                        block, self._last_hash[row], tuple(self._tail[row].tolist()))
        return block * B + off

    def append_tokens(self, sequence_id: int, num_tokens: int, token_ids=None) -> np.ndarray:
        """A prefill chunk for one sequence; returns int32 slots."""
        row = self._row(sequence_id)
        if num_tokens < 0:
            raise InvalidArgumentError(f"num_tokens must be >= 0, got {num_tokens}")
        toks = self._tokens(token_ids, num_tokens)
        self._check_free(self.blocks_needed(sequence_id, num_tokens), f"sequence {sequence_id}")
        return self._append_row(row, num_tokens, toks)

    def append_tokens_batch(self, sequence_ids, num_tokens, token_ids=None) -> np.ndarray:
        """Several sequences, num_tokens each (int or [B]); concatenated slots; all or nothing."""
        rows = self._rows(sequence_ids)
        nt = np.asarray(num_tokens)
        if nt.ndim == 0:
            nt = np.full(len(rows), int(nt))
        if nt.shape != rows.shape or (nt.size and nt.dtype.kind not in "iu") or (nt < 0).any():
            raise InvalidArgumentError(f"num_tokens: expected {len(rows)} counts >= 0")
        nt = nt.astype(np.int64)
        if (nt == 1).all():
            return self.slot_mapping_for_append(sequence_ids, token_ids)
        toks = self._tokens(token_ids, int(nt.sum()))
        ends = self._lens[rows].astype(np.int64) + nt
        need = np.maximum(-(-ends // self.block_size) - self._nblocks[rows], 0)
        self._check_free(int(need.sum()), f"a batch of {len(rows)} sequences")
        starts = np.concatenate([[0], np.cumsum(nt)])
        out = [self._append_row(int(r), int(n), None if toks is None else toks[starts[i]:starts[i + 1]])
               for i, (r, n) in enumerate(zip(rows, nt))]
        return np.concatenate(out) if out else _EMPTY

    def slot_mapping_for_append(self, sequence_ids, token_ids=None) -> np.ndarray:
        """One decode step for a batch: one token each, vectorized; all or nothing. A token id of -1
        is not known yet (async scheduling): fill_tokens gives it once it is sampled."""
        rows = self._rows(sequence_ids)
        return self.append_decode_rows(rows, self._tokens(token_ids, len(rows)))

    def rows_of(self, sequence_ids: np.ndarray) -> np.ndarray:
        """The rows of a batch of live sequence ids (int64, distinct), for the *_rows calls below:
        the scheduler's steady decode state looks them up once, not every step."""
        return self._rows(np.asarray(sequence_ids, dtype=np.int64))

    def append_decode_rows(self, rows: np.ndarray, toks: np.ndarray | None) -> np.ndarray:
        """slot_mapping_for_append by rows (of live sequences, distinct; toks checked by the caller)."""
        B = self.block_size
        lens = self._lens[rows]
        nb = self._nblocks[rows]
        need = lens >= nb * B                      # next position falls past the last block
        k = int(np.count_nonzero(need))
        if k:
            self._check_free(k, f"a decode step of {len(rows)} sequences")
            nr, col = rows[need], nb[need]
            self._ensure_cols(int(col.max()) + 1)
            self._tables[nr, col] = self.pool.allocate(k)
            self._nblocks[nr] = col + 1
        off = lens % B
        slots = self._tables[rows, lens // B] * B + off
        self._lens[rows] = lens + 1
        if self.enable_prefix_caching:
            self._record_decode(rows, lens, off, toks)
        return slots

    # ------------------------------------------------------------------ token bookkeeping
    def _append_row(self, row: int, n: int, toks: np.ndarray | None) -> np.ndarray:
        """Append n tokens to one row (capacity already checked)."""
        if n == 0:
            return _EMPTY
        B = self.block_size
        start = int(self._lens[row])
        end = start + n
        nb, nb_need = int(self._nblocks[row]), blocks_for_tokens(end, B)
        if nb_need > nb:
            self._ensure_cols(nb_need)
            self._tables[row, nb:nb_need] = self.pool.allocate(nb_need - nb)
            self._nblocks[row] = nb_need
        pos = np.arange(start, end, dtype=np.int32)
        slots = self._tables[row, pos // B] * B + pos % B
        self._lens[row] = end
        if self._hash_ok[row]:
            self._record_tokens(row, start, n, toks)
        return slots

    def block_table_delta(self, sequence_ids, known_blocks) -> tuple[np.ndarray, np.ndarray]:
        """For block tables sent as deltas: each sequence's blocks past the first known_blocks[i]
        (what the data plane already holds). Returns (counts int32 [B], blocks int32 [sum]); the work
        is proportional to the new blocks, not to the tables' length."""
        return self.table_delta_rows(self._rows(sequence_ids, unique=False), known_blocks)

    def table_delta_rows(self, rows: np.ndarray, known_blocks) -> tuple[np.ndarray, np.ndarray]:
        """block_table_delta by rows."""
        base = np.asarray(known_blocks, dtype=np.int64)
        counts = np.maximum(self._nblocks[rows] - base, 0)
        total = int(counts.sum())
        if total == 0:
            return counts.astype(np.int32), _EMPTY
        first = np.repeat(np.cumsum(counts) - counts, counts)
        cols = np.repeat(base, counts) + (np.arange(total) - first)
        return counts.astype(np.int32), self._tables[np.repeat(rows, counts), cols]

    # ------------------------------------------------------------------ tensors for a step
    def get_block_table_tensor(self, sequence_ids) -> np.ndarray:
        """int32 [B, max_blocks of the batch], -1 padded."""
        rows = self._rows(sequence_ids, unique=False)
        width = int(self._nblocks[rows].max())
        return self._tables[rows, :width]

    def get_seq_lens_tensor(self, sequence_ids) -> np.ndarray:
        return self._lens[self._rows(sequence_ids, unique=False)]

    def lens_of_rows(self, rows: np.ndarray) -> np.ndarray:
        return self._lens[rows]

    def slot_for_position(self, sequence_id: int, pos: int) -> int:
        row = self._row(sequence_id)
        nb = int(self._nblocks[row])
        if not 0 <= pos < nb * self.block_size:
            raise InvalidArgumentError(f"position {pos} outside the {nb} blocks of sequence {sequence_id}")
        return slot_for(self._tables[row], pos, self.block_size)
