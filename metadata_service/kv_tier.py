"""KVTier: the second KV tier behind one chain's device pool (docs/architecture.md section 9).

The metadata plane owns the tier's slot ids, free stack, LRU and hash index (this file); the workers
only hold the bytes (worker/paged_cache.py) and run the Step's "save pool block b to tier slot t" /
"load tier slot t into pool block b" lists before that step's compute, saves first, then loads.
Slots are keyed by the same chained block hash as the prefix cache, and, as there, every entry keeps
the (parent_hash, tokens) it was made from: a hash collision is a miss, never a wrong block.

A slot is in one of four states:
  free      no content
  unsaved   holds a hash whose save has not gone out in a Step yet: not loadable, not evictable
  filled    saved; loadable; in the LRU (oldest first), evicted when a save needs a slot
  pinned    filled, and the Step being built loads it: not evictable until that Step is taken
Every Step runs in order on every stage, so a load issued with or after a slot's save reads what
the save wrote, and a save into a slot issued after a load of its old content runs after that load.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

BlockKey = tuple   # (parent_hash | None, tuple[int, ...]), as in prefix_cache.py


class KVTier:
    def __init__(self, num_blocks: int, block_size: int, hash_fn):
        self.num_blocks, self.block_size, self.hash_fn = num_blocks, block_size, hash_fn
        self._free = list(range(num_blocks - 1, -1, -1))
        self._lru: OrderedDict[int, None] = OrderedDict()   # filled slots, oldest first
        self.slot_of: dict[int, int] = {}                     # hash -> slot (every non-free slot)
        self.hash_of: dict[int, int] = {}                     # slot -> hash
        self.key_of: dict[int, BlockKey] = {}                 # slot -> (parent_hash, tokens)
        self.unsaved: set[int] = set()
        self.pinned: set[int] = set()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.slot_of)

    def __contains__(self, h: int) -> bool:
        return h in self.slot_of

    @property
    def num_used(self) -> int:
        return len(self.hash_of)

    def put(self, h: int, key: BlockKey) -> int | None:
        """A slot for new content named h (state unsaved), or None: h is already here, or every
        slot is busy (unsaved or pinned). Takes a free slot first, else evicts the oldest filled one."""
        if h in self.slot_of or not self.num_blocks:
            return None
        if self._free:
            slot = self._free.pop()
        else:
            slot = next((s for s in self._lru if s not in self.pinned), None)
            if slot is None:
                return None
            del self._lru[slot]
            del self.slot_of[self.hash_of.pop(slot)]
            del self.key_of[slot]
            self.evictions += 1
        self.slot_of[h], self.hash_of[slot], self.key_of[slot] = slot, h, key
        self.unsaved.add(slot)
        return slot

    def saved(self, slots) -> None:
        """Their saves went out in a Step: loadable from now on."""
        for s in slots:
            if s in self.unsaved:
                self.unsaved.discard(s)
                self._lru[s] = None

    def match(self, tokens: Sequence[int], first: int, parent, max_blocks: int) -> tuple[list[int], object]:
        """Filled slots holding the prompt's blocks first, first + 1, ... (chained from `parent`,
        the hash of block first - 1), up to max_blocks of them. No state change."""
        B = self.block_size
        slots: list[int] = []
        for j in range(first, first + max_blocks):
            toks = tuple(tokens[j * B:(j + 1) * B])
            h = self.hash_fn(parent, toks)
            s = self.slot_of.get(h)
            if s is None or s in self.unsaved or self.key_of[s] != (parent, toks):
                break
            slots.append(s)
            parent = h
        return slots, parent

    def pin(self, slots) -> None:
        """The Step being built loads them: most recently used, and kept until it is taken."""
        for s in slots:
            self._lru.move_to_end(s)
            self.pinned.add(s)

    def forget(self, slots) -> None:
        """Their saves never ran (the Step carrying them failed): the slots hold nothing."""
        for s in slots:
            h = self.hash_of.pop(s, None)
            if h is None:
                continue
            del self.slot_of[h]
            del self.key_of[s]
            self._lru.pop(s, None)
            self.unsaved.discard(s)
            self.pinned.discard(s)
            self._free.append(s)

    def clear(self) -> None:
        """The workers' tier content is gone (a new cache epoch): forget every slot."""
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._lru.clear()
        self.slot_of.clear()
        self.hash_of.clear()
        self.key_of.clear()
        self.unsaved.clear()
        self.pinned.clear()

    def check(self) -> list[str]:
        """Tier-local invariant violations (empty = fine)."""
        errs = []
        used = set(self.hash_of)
        if len(self._free) != len(set(self._free)) or used & set(self._free):
            errs.append("tier: a slot is free twice, or free and used")
        if len(used) + len(self._free) != self.num_blocks:
            errs.append("tier: used + free != all slots (a slot was lost)")
        if set(self._lru) | self.unsaved != used or set(self._lru) & self.unsaved:
            errs.append("tier: every used slot is either filled (in the LRU) or unsaved")
        if any(self.slot_of.get(h) != s for s, h in self.hash_of.items()) or len(self.slot_of) != len(used):
            errs.append("tier: hash index and slots disagree")
        if not self.pinned <= set(self._lru):
            errs.append("tier: a pinned slot is not filled")
        return errs
