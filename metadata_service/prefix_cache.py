"""Prefix cache: chained content hashes of full blocks -> physical block ids.

A full block's hash is hash_fn(parent_hash, tokens), where parent_hash is the hash of the block
before it (None for the first block), so one hash names a whole prefix. A hash is only a name:
every entry also stores the (parent_hash, tokens) it was made from, and a lookup accepts a block
only when both equal the query's, so a hash collision gives a miss, never a wrong block.
One hash maps to at most one block; a second block with the same content stays unregistered.
"""
from __future__ import annotations

from typing import Callable, Hashable, Sequence

BlockKey = tuple  # (parent_hash | None, tuple[int, ...])
HashFn = Callable[[Hashable, tuple], int]


def default_block_hash(parent_hash, tokens: tuple) -> int:
    # Python's tuple/int hash is deterministic across runs (no PYTHONHASHSEED for ints) and fast.
    return hash((parent_hash, tokens))


class PrefixCache:
    """hash -> block, and block -> (hash, key) for verification and eviction."""

    def __init__(self, block_size: int, hash_fn: HashFn | None = None):
        self.block_size = block_size
        self.hash_fn: HashFn = hash_fn or default_block_hash
        self.block_of: dict[int, int] = {}           # hash -> block id
        self.hash_of: dict[int, int] = {}            # block id -> hash
        self.key_of: dict[int, BlockKey] = {}        # block id -> (parent_hash, tokens)
        self.on_register = None                      # (block, hash, key) -> None: the KV tier's write-through

    def __len__(self) -> int:
        return len(self.block_of)

    def __contains__(self, block: int) -> bool:
        return block in self.hash_of

    def register(self, block: int, parent_hash, tokens: tuple) -> int:
        """Name a just-filled block; returns its hash (registered or not: the chain goes on)."""
        h = self.hash_fn(parent_hash, tokens)
        if h not in self.block_of and block not in self.hash_of:
            self.block_of[h] = block
            self.hash_of[block] = h
            self.key_of[block] = (parent_hash, tokens)
            if self.on_register is not None:
                self.on_register(block, h, (parent_hash, tokens))
        return h

    def remove(self, block: int) -> None:
        """Forget a block's content (it is about to hold something else)."""
        h = self.hash_of.pop(block, None)
        if h is not None:
            del self.block_of[h]
            del self.key_of[block]

    def clear(self) -> None:
        self.block_of.clear()
        self.hash_of.clear()
        self.key_of.clear()

    def match(self, tokens: Sequence[int], max_blocks: int) -> tuple[list[int], object]:
        """Longest verified chain of cached full blocks for a prompt, up to max_blocks.

        Returns (block ids, hash of the last matched block or None). No state change."""
        B = self.block_size
        tokens = tuple(tokens)                       # slicing a tuple yields the key directly
        blocks: list[int] = []
        parent = None
        for j in range(max_blocks):
            toks = tokens[j * B:(j + 1) * B]
            h = self.hash_fn(parent, toks)
            b = self.block_of.get(h)
            if b is None or self.key_of[b] != (parent, toks):
                break                                # miss, or a collision caught by the key
            blocks.append(b)
            parent = h
        return blocks, parent
