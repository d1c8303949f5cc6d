"""KVBlockManager: sequences, block tables and the address mapping (the seed's API, made fast).

Policy over BlockPool (mechanism). Per-sequence state lives in preallocated numpy arrays indexed by
a row per sequence id, so a batch decode step is a handful of vectorized ops:
  _tables   int32 [rows, cols]  block tables, -1 padded (grown by doubling)
  _nblocks  int32 [rows]        blocks held (>= ceil(len / B); more only after allocate_block)
  _lens     int32 [rows]        sequence lengths
  _tail     int32 [rows, B]     token ids of the current partial block (for hashing when it fills)
Address mapping (seed, section 3): slot = block_table[pos // B] * B + pos % B.

Prefix caching: every full block whose token ids are all known gets a chained hash (see
prefix_cache.py). On the decode path only sequences whose block just filled are hashed.
Fork is EAGER copy-on-write: full blocks are shared (ref + 1); a partial last block is copied to a
fresh block at fork time and the (src, dst) pair is returned for the data plane to copy.
Not thread-safe by design: the service holds one lock around the manager.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from metadata_service.block_pool import (BlockManagerError, BlockPool, DoubleReleaseError,  # noqa: F401
                                         DuplicateSequenceError, InvalidArgumentError, OutOfBlocksError,
                                         UnknownSequenceError)
from metadata_service.prefix_cache import HashFn
from minipaged.id_index import IdIndex, has_duplicates

_EMPTY = np.zeros(0, dtype=np.int32)
_RELEASED_MEMORY = 1 << 16     # remember this many released ids to tell double release apart


def slot_for(block_table: Sequence[int], pos: int, block_size: int) -> int:
    """The seed's address mapping for one position."""
    return int(block_table[pos // block_size]) * block_size + pos % block_size


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def kv_utilization(used_tokens: int, reserved_tokens: int) -> float:
    """Used slots / reserved slots (the seed's 300 of 4096 -> 7.3%); 0 when nothing is reserved."""
    return used_tokens / reserved_tokens if reserved_tokens else 0.0


@dataclass
class SequenceState:
    """Snapshot of one sequence; block_table is a read-only view into the manager's table."""
    sequence_id: int
    sequence_length: int = 0
    block_table: Sequence[int] = field(default_factory=list)


class _SequencesView(Mapping):
    """`manager.sequences[sid]` as in the seed, built on demand from the arrays."""

    def __init__(self, m: "KVBlockManager"):
        self._m = m

    def __getitem__(self, sid) -> SequenceState:
        m = self._m
        row = m._row(sid)
        table = m._tables[row, :m._nblocks[row]]
        table.flags.writeable = False
        return SequenceState(sid, int(m._lens[row]), table)

    def __contains__(self, sid) -> bool:
        return sid in self._m._row_of

    def __iter__(self):
        return iter(list(self._m._row_of))

    def __len__(self) -> int:
        return len(self._m._row_of)


class KVBlockManager:
    def __init__(self, num_physical_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 *, max_seqs: int = 64, hash_fn: HashFn | None = None):
        if num_physical_blocks <= 0 or block_size <= 0:
            raise InvalidArgumentError("num_physical_blocks and block_size must be positive")
        self.num_physical_blocks = num_physical_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_physical_blocks, block_size, hash_fn)
        rows, cols = max(1, max_seqs), min(num_physical_blocks, 64)
        self._tables = np.full((rows, cols), -1, dtype=np.int32)
        self._nblocks = np.zeros(rows, dtype=np.int32)
        self._lens = np.zeros(rows, dtype=np.int32)
        self._tail = np.zeros((rows, block_size), dtype=np.int32)
        self._hash_ok = np.zeros(rows, dtype=bool)        # all tokens so far known -> chain goes on
        self._prompt_len = np.zeros(rows, dtype=np.int32)
        self._prompts: dict[int, np.ndarray] = {}         # row -> prompt ids (known future tokens)
        self._last_hash: list = [None] * rows              # hash of the last full block
        self._row_of: dict[int, int] = {}
        self._index = IdIndex(self._row_of)               # batch lookups of _row_of (the step path)
        self._free_rows = list(range(rows - 1, -1, -1))
        self._released: OrderedDict[int, None] = OrderedDict()
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.sequences = _SequencesView(self)

    # ------------------------------------------------------------------ rows
    def _unknown(self, sid) -> UnknownSequenceError:
        if sid in self._released:
            return DoubleReleaseError(f"sequence {sid} was already released")
        return UnknownSequenceError(f"unknown sequence {sid}")

    def _row(self, sid) -> int:
        try:
            return self._row_of[sid]
        except (KeyError, TypeError):
            raise self._unknown(sid) from None

    def _rows(self, sids, unique: bool = True) -> np.ndarray:
        if isinstance(sids, np.ndarray) and sids.dtype == np.int64 and sids.ndim == 1 and sids.size:
            rows = self._index.lookup(sids)          # the step path: no per-id Python
            if (rows < 0).any():
                raise self._unknown(int(sids[np.argmax(rows < 0)]))
            if unique and has_duplicates(sids):
                raise InvalidArgumentError("a sequence id appears twice in one batch")
            return rows.astype(np.intp, copy=False)
        if isinstance(sids, np.ndarray):
            sids = sids.tolist()
        row_of = self._row_of
        try:
            rows = [row_of[s] for s in sids]
        except KeyError as e:
            raise self._unknown(e.args[0]) from None
        if not rows:
            raise InvalidArgumentError("empty batch of sequence ids")
        if unique and len(set(rows)) != len(rows):
            raise InvalidArgumentError("a sequence id appears twice in one batch")
        return np.array(rows, dtype=np.intp)

    def _new_row(self, sid) -> int:
        if not self._free_rows:
            n = len(self._lens)
            grow = lambda a, fill: np.concatenate([a, np.full((n,) + a.shape[1:], fill, a.dtype)])
            self._tables = grow(self._tables, -1)
            self._nblocks, self._lens = grow(self._nblocks, 0), grow(self._lens, 0)
            self._tail, self._hash_ok = grow(self._tail, 0), grow(self._hash_ok, False)
            self._prompt_len = grow(self._prompt_len, 0)
            self._last_hash += [None] * n
            self._free_rows = list(range(2 * n - 1, n - 1, -1))
        row = self._free_rows.pop()
        self._row_of[sid] = row
        self._index.changed()
        self._released.pop(sid, None)
        return row

    def _ensure_cols(self, n: int) -> None:
        cols = self._tables.shape[1]
        if n > cols:
            new = min(max(n, 2 * cols), self.num_physical_blocks)
            pad = np.full((self._tables.shape[0], new - cols), -1, dtype=np.int32)
            self._tables = np.concatenate([self._tables, pad], axis=1)

    def _check_free(self, needed: int, what: str, free: int | None = None) -> None:
        free = self.pool.num_free if free is None else free
        if needed > free:
            raise OutOfBlocksError(needed, free, what)

    @staticmethod
    def _tokens(token_ids, expected: int) -> np.ndarray | None:
        if token_ids is None:
            return None
        t = np.asarray(token_ids)
        if t.ndim != 1 or t.size != expected or (t.size and t.dtype.kind not in "iu"):
            raise InvalidArgumentError(f"token_ids: expected {expected} integer ids, got shape {t.shape}")
        return t.astype(np.int32, copy=False)

    # ------------------------------------------------------------------ create
    def create_sequence(self, sequence_id: int, prompt_token_ids=None, reuse_cached: bool = True) -> int:
        """New sequence; returns the prompt tokens served from the prefix cache (its start length).
        reuse_cached=False: no lookup (the sequence computes every token; its full blocks still
        enter the prefix cache for others)."""
        return self.create_and_append(sequence_id, prompt_token_ids, 0, reuse_cached)[0]

    def create_and_append(self, sequence_id: int, prompt_token_ids=None, num_tokens: int = 0,
                          reuse_cached: bool = True):
        """create_sequence + append num_tokens (ids from the prompt past the cached part), all or
        nothing. Returns (num_cached_tokens, slots of the appended tokens)."""
        if sequence_id in self._row_of:
            raise DuplicateSequenceError(f"sequence {sequence_id} already exists")
        if num_tokens < 0:
            raise InvalidArgumentError(f"num_tokens must be >= 0, got {num_tokens}")
        prompt = None
        if prompt_token_ids is not None and len(prompt_token_ids):
            prompt = self._tokens(prompt_token_ids, len(prompt_token_ids))
        hit, last_hash, max_hit = [], None, 0
        if prompt is not None and self.enable_prefix_caching and reuse_cached:
            max_hit = (len(prompt) - 1) // self.block_size      # always leave >= 1 token to compute
            hit, last_hash = self.pool.cache.match(prompt.tolist(), max_hit)
        cached = len(hit) * self.block_size
        needed = max(0, blocks_for_tokens(cached + num_tokens, self.block_size) - len(hit))
        revived = sum(1 for b in hit if self.pool.ref_count[b] == 0)  # hits leave the free pool
        self._check_free(needed, f"sequence {sequence_id}", self.pool.num_free - revived)
        # ---- commit
        self.prefix_cache_queries += max_hit
        self.prefix_cache_hits += len(hit)
        row = self._new_row(sequence_id)
        self.pool.touch(hit)
        self._ensure_cols(len(hit))
        self._tables[row, :len(hit)] = hit
        self._nblocks[row], self._lens[row] = len(hit), cached
        self._hash_ok[row] = self.enable_prefix_caching
        self._last_hash[row] = last_hash
        if prompt is not None:
            self._prompts[row] = prompt
            self._prompt_len[row] = len(prompt)
        return cached, self._append_row(row, num_tokens, None)

    # ------------------------------------------------------------------ append
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

    # ------------------------------------------------------------------ fork / release
    def fork(self, parent_id: int, child_id: int) -> list[tuple[int, int]]:
        """Child shares the parent's full blocks; a partial last block is copied now (eager CoW).
        Returns the (src, dst) block copies the data plane must do before the child's next step."""
        prow = self._row(parent_id)
        if child_id in self._row_of:
            raise DuplicateSequenceError(f"sequence {child_id} already exists")
        L = int(self._lens[prow])
        full, partial = divmod(L, self.block_size)
        self._check_free(1 if partial else 0, f"fork of {parent_id}")
        crow = self._new_row(child_id)
        shared = self._tables[prow, :full]
        self.pool.incref(shared)
        self._tables[crow, :full] = shared
        copies = []
        if partial:
            src, dst = int(self._tables[prow, full]), int(self.pool.allocate(1)[0])
            self._tables[crow, full] = dst
            copies.append((src, dst))
        self._nblocks[crow] = full + (1 if partial else 0)
        self._lens[crow] = L
        self._tail[crow] = self._tail[prow]
        self._hash_ok[crow] = self._hash_ok[prow]
        self._last_hash[crow] = self._last_hash[prow]
        self._prompt_len[crow] = self._prompt_len[prow]
        if prow in self._prompts:
            self._prompts[crow] = self._prompts[prow]
        return copies

    def release_sequence(self, sequence_id: int) -> int:
        """Drop the sequence; returns how many of its blocks became unreferenced."""
        row = self._row(sequence_id)
        nb = int(self._nblocks[row])
        freed = self.pool.release(self._tables[row, nb - 1::-1].tolist() if nb else [])
        self._tables[row, :nb] = -1
        self._nblocks[row] = self._lens[row] = self._prompt_len[row] = 0
        self._hash_ok[row] = False
        self._last_hash[row] = None
        self._prompts.pop(row, None)
        del self._row_of[sequence_id]
        self._index.changed()
        self._free_rows.append(row)
        self._released[sequence_id] = None
        if len(self._released) > _RELEASED_MEMORY:
            self._released.popitem(last=False)
        return freed

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

    # ------------------------------------------------------------------ prefix cache
    def prompt_cache_lookup(self, prompt_token_ids) -> int:
        """Prompt tokens a create_sequence would find cached now (no state change)."""
        if not self.enable_prefix_caching or prompt_token_ids is None or len(prompt_token_ids) == 0:
            return 0
        prompt = self._tokens(prompt_token_ids, len(prompt_token_ids)).tolist()
        hit, _ = self.pool.cache.match(prompt, (len(prompt) - 1) // self.block_size)
        return len(hit) * self.block_size

    def reset_prefix_cache(self) -> None:
        """The data plane lost its KV content: forget every hash. Live sequences stop hashing too
        (their content is gone; the scheduler recomputes them as new sequences)."""
        self.pool.reset_prefix_cache()
        self._hash_ok[:] = False

    # ------------------------------------------------------------------ accounting
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
                    prefix_cache_hits=self.prefix_cache_hits, live_sequences=len(self._row_of))

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> list[str]:
        """Every violated invariant, in words (empty = all hold). O(total blocks)."""
        errs = self.pool.check()
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
            counters=(self.prefix_cache_queries, self.prefix_cache_hits), stats=self.stats())
