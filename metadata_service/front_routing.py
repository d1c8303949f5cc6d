"""Which shard a Generate stream goes to: the prefix it shares with what went there, against load.

A conversation's next turn repeats the whole history as its prompt, so it must go where the last
turn went or the shard recomputes all of it. The front cannot see the shards' pools (each shard
routes exactly among its own chains); it keeps the approximate index of router.py's "prefix"
policy per shard (an LRU of the prompt blocks routed there, the size of the shard's pools and KV
tiers) and weighs overlap against load with the same score. A text prompt is hashed as its UTF-8
bytes, four to a "token": the front has no tokenizer, and equal text prefixes are what matter."""
from __future__ import annotations

import itertools
import threading

import numpy as np

from .router import PrefixIndex, block_hashes, score

TEXT_BLOCK_CHARS = 64      # a text prompt's bytes per hashed block (16 "tokens" of 4 bytes)


def prompt_blocks(request, block_size: int) -> list[int]:
    """Chained hashes of the request's full prompt blocks (token ids, or its text's bytes)."""
    if request.prompt_token_ids:
        ids = np.frombuffer(request.prompt_token_ids, dtype=np.int32)
        return block_hashes(ids.tolist(), block_size)
    raw = request.prompt.encode("utf-8", "replace")
    raw += b"\0" * (-len(raw) % 4)
    return block_hashes(np.frombuffer(raw, dtype="<u4").tolist(), TEXT_BLOCK_CHARS // 4)


class ShardRouter:
    def __init__(self, n: int):
        self.index = [PrefixIndex(1024) for _ in range(n)]
        self.routed = [0.0] * n        # blocks of streams routed since the shard's last Stats, still running
        self.lock = threading.Lock()
        self._rr = itertools.count()

    def polled(self, k: int) -> None:
        """Shard k's Stats were just read: its load figure now counts what was routed before."""
        with self.lock:
            self.routed[k] = 0.0

    def choose(self, request, stats: list) -> tuple[int, float]:
        """The shard for one stream (and the blocks it adds to that shard's load): overlap (x OVERLAP_WEIGHT) against blocks in use per chain, among
        the ready shards (all of them while none is)."""
        ready = [k for k, s in enumerate(stats) if s is not None and s.ready] or list(range(len(stats)))
        block_size = next((s.block_size for s in stats if s is not None and s.block_size), 16)
        hashes = prompt_blocks(request, block_size)
        new = len(hashes) + (request.max_new_tokens + block_size - 1) // block_size
        with self.lock:
            rr = next(self._rr)
            costs = []
            for k in ready:
                s = stats[k]
                if s is not None and s.num_blocks:      # what the shard holds: its pools and tiers
                    self.index[k].capacity = s.num_blocks + s.tier_blocks
                chains = max(1, s.num_chains) if s is not None else 1
                load = ((s.used_blocks if s is not None else 0) + self.routed[k]) / chains
                overlap = self.index[k].overlap(hashes)
                costs.append((score(overlap, len(hashes), load), (k - rr) % len(stats), k))
            _, _, best = min(costs)
            self.index[best].insert(hashes)
            self.routed[best] += new
        return best, new

    def finished(self, k: int, blocks: float) -> None:
        """A stream routed to shard k ended: its blocks leave the load figure at once, not at the
        next poll (a burst of short streams would otherwise pile up on one shard's figure and push
        a conversation's next turn away from the shard that holds its history)."""
        with self.lock:
            self.routed[k] = max(0.0, self.routed[k] - blocks)
