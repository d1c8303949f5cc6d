"""KVBlockManager: sequences, block tables and the address mapping (the seed's API, made fast).

Policy over BlockPool (mechanism). Per-sequence state lives in preallocated numpy arrays indexed by
a row per sequence id, so a batch decode step is a handful of vectorized ops:
  _tables   int32 [rows, cols]  block tables, -1 padded (grown by doubling)
  _nblocks  int32 [rows]        blocks held (>= ceil(len / B); more only after allocate_block)
  _lens     int32 [rows]        sequence lengths
  _tail     int32 [rows, B]     token ids of the current partial block (for hashing when it fills)
Address mapping (seed, section 3): slot = block_table[pos // B] * B + pos % B.

This file holds the tables and a sequence's life (rows, create, fork, release). The other verbs
are methods of the same class, kept in a file per job (plain mixins over these arrays, so a call
costs what it did when they were one class):
  block_append.py      appending tokens: slots for prefill chunks and decode steps, step tensors
  block_hashing.py     prefix caching: hashing the blocks tokens fill, cache lookups
  block_accounting.py  usage stats, invariants, the debug snapshot tests compare
  block_tiering.py     the second KV tier's saves and loads
  block_moves.py       blocks held for prefill -> decode moves

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

from metadata_service.block_accounting import PoolAccounting, kv_utilization  # noqa: F401
from metadata_service.block_append import TokenAppend, blocks_for_tokens, slot_for  # noqa: F401
from metadata_service.block_hashing import PrefixHashing
from metadata_service.block_moves import MoveHolds
from metadata_service.block_tiering import TierMoves
from metadata_service.block_pool import (BlockManagerError, BlockPool, DoubleReleaseError,  # noqa: F401
                                         DuplicateSequenceError, InvalidArgumentError, OutOfBlocksError,
                                         UnknownSequenceError)
from metadata_service.prefix_cache import HashFn
from minipaged.id_index import IdIndex, has_duplicates

_RELEASED_MEMORY = 1 << 16     # remember this many released ids to tell double release apart


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


class KVBlockManager(TokenAppend, PrefixHashing, TierMoves, MoveHolds, PoolAccounting):
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
        # the second KV tier (block_tiering.py, attach_tier): none until a chain has one
        self.tier = None
        self.tier_policy = ""
        self._tier_saves: list[tuple[int, int]] = []     # (pool block, tier slot) for the next Step
        self._tier_loads: list[tuple[int, int]] = []     # (tier slot, pool block) for the next Step
        self._through_new: dict[int, int] = {}           # write-through: block -> slot, hashed this step
        self._through_old: dict[int, int] = {}           # ... hashed before it: saved by the next Step
        self.tier_queries = self.tier_hits = self.tier_saved_blocks = self.tier_loaded_blocks = 0
        self.held: dict[object, list[int]] = {}          # key -> blocks a K/V move reads or writes
        self._move_keys: dict[object, list] = {}         # key -> (fresh block, its prefix-cache key)
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
        hit, last_hash, max_hit, tier_slots = [], None, 0, []
        if prompt is not None and self.enable_prefix_caching and reuse_cached:
            max_hit = (len(prompt) - 1) // self.block_size      # always leave >= 1 token to compute
            prompt_list = prompt.tolist()
            hit, last_hash = self.pool.cache.match(prompt_list, max_hit)
            tier_slots, _ = self._tier_match(prompt_list, hit, last_hash, max_hit)
        revived = sum(1 for b in hit if self.pool.ref_count[b] == 0)  # hits leave the free pool
        if tier_slots:   # loads take fresh blocks: only as many as fit beside the appended tokens
            room = self.pool.num_free - revived - blocks_for_tokens(num_tokens, self.block_size)
            tier_slots = tier_slots[:max(0, room)]
        cached = (len(hit) + len(tier_slots)) * self.block_size
        needed = max(0, blocks_for_tokens(cached + num_tokens, self.block_size) - len(hit))
        self._check_free(needed, f"sequence {sequence_id}", self.pool.num_free - revived)
        # ---- commit
        self.prefix_cache_queries += max_hit
        self.prefix_cache_hits += len(hit)
        if self.tier is not None:
            self.tier_queries += max_hit - len(hit)
        row = self._new_row(sequence_id)
        self.pool.touch(hit)
        if tier_slots:                               # loaded, not recomputed: they join the prefix
            loaded, last_hash = self._tier_load(prompt_list, tier_slots, len(hit), last_hash)
            hit = hit + loaded
        self._ensure_cols(len(hit))
        self._tables[row, :len(hit)] = hit
        self._nblocks[row], self._lens[row] = len(hit), cached
        self._hash_ok[row] = self.enable_prefix_caching
        self._last_hash[row] = last_hash
        if prompt is not None:
            self._prompts[row] = prompt
            self._prompt_len[row] = len(prompt)
        return cached, self._append_row(row, num_tokens, None)

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
