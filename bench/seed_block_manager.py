"""The anchor: a plain-list port of the seed article's KVBlockManager.

Free list as a Python list, one Python list per block table, tensors built with torch.tensor on
every call. No ref counts, no prefix cache: bench/block_manager.py measures our manager against
this in the same run. SeedPrefixIndex is the obvious list-era prefix cache (a dict keyed by the
whole prefix as a tuple) for the lookup anchor.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SequenceState:
    sequence_id: int
    sequence_length: int = 0
    block_table: list[int] = field(default_factory=list)


class KVBlockManager:
    def __init__(self, num_physical_blocks: int, block_size: int):
        self.num_physical_blocks = num_physical_blocks
        self.block_size = block_size
        self.free_blocks = list(range(num_physical_blocks - 1, -1, -1))
        self.sequences: dict[int, SequenceState] = {}

    def create_sequence(self, sequence_id: int) -> None:
        if sequence_id in self.sequences:
            raise ValueError(f"sequence {sequence_id} already exists")
        self.sequences[sequence_id] = SequenceState(sequence_id)

    def allocate_block(self, sequence_id: int) -> int:
        if not self.free_blocks:
            raise RuntimeError("out of KV blocks")
        block = self.free_blocks.pop()
        self.sequences[sequence_id].block_table.append(block)
        return block

    def append_token(self, sequence_id: int) -> int:
        seq = self.sequences[sequence_id]
        pos = seq.sequence_length
        if pos // self.block_size >= len(seq.block_table):
            self.allocate_block(sequence_id)
        seq.sequence_length += 1
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def slot_mapping_for_append(self, sequence_ids: list[int]) -> torch.Tensor:
        return torch.tensor([self.append_token(s) for s in sequence_ids], dtype=torch.int32)

    def release_sequence(self, sequence_id: int) -> None:
        seq = self.sequences.pop(sequence_id)
        self.free_blocks.extend(reversed(seq.block_table))

    def get_block_table_tensor(self, sequence_ids: list[int]) -> torch.Tensor:
        tables = [self.sequences[s].block_table for s in sequence_ids]
        width = max(len(t) for t in tables)
        return torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)

    def get_seq_lens_tensor(self, sequence_ids: list[int]) -> torch.Tensor:
        return torch.tensor([self.sequences[s].sequence_length for s in sequence_ids], dtype=torch.int32)

    def internal_fragmentation_tokens(self) -> int:
        return sum(len(s.block_table) * self.block_size - s.sequence_length for s in self.sequences.values())

    def invariants_ok(self) -> bool:
        used = [b for s in self.sequences.values() for b in s.block_table]
        every = used + self.free_blocks
        return len(every) == self.num_physical_blocks == len(set(every))


class SeedPrefixIndex:
    """Whole-prefix tuple -> block: correct, but hashing k blocks costs O(k^2) tokens."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.index: dict[tuple, int] = {}

    def insert(self, tokens: list[int], blocks: list[int]) -> None:
        for j, b in enumerate(blocks):
            self.index[tuple(tokens[:(j + 1) * self.block_size])] = b

    def lookup(self, tokens: list[int]) -> int:
        hit = 0
        for j in range((len(tokens) - 1) // self.block_size):
            if tuple(tokens[:(j + 1) * self.block_size]) not in self.index:
                break
            hit += 1
        return hit * self.block_size
