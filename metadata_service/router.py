"""Which replica chain a new sequence goes to: prefix-cache overlap weighed against load.

Dynamo's KV router is the model: for each chain, the blocks of this prompt it probably has cached
(overlap) and the work it already has (load); the cost is the prefill blocks the chain would still
have to compute plus its load, and the cheapest chain wins. `score` is that pure function.

Overlap comes from a PrefixIndex per chain: the chained hashes of the full prompt blocks recently
routed there, an LRU the size of the chain's pool. It predicts the chain's prefix cache from the
routing decisions themselves (Dynamo's "approximate" mode), so a burst of requests sharing a system
prompt all go where the first one went, before any of them has run. Load is counted in blocks:
each unfinished sequence adds the blocks it will allocate beyond its cached prefix. A chain whose
batch slots (max_num_seqs x micro-batches) are all taken is chosen only when every chain's are: a
sequence sent there waits for a whole request to finish while another chain could run it now (1024
short requests over 4 chains of 256 slots, balanced by blocks alone, put 258 on two of them, and the
2 left over decoded alone for 125 steps after the rest had finished).

Policies: "prefix" (the above), "round_robin" and "least_loaded" (for comparison)."""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

POLICIES = ("prefix", "round_robin", "least_loaded")


def block_hashes(tokens: list[int], block_size: int) -> list[int]:
    """Chained hashes of the prompt's full blocks (a block's hash names its whole prefix)."""
    out, parent = [], 0
    for i in range(len(tokens) // block_size):
        parent = hash((parent, tuple(tokens[i * block_size:(i + 1) * block_size])))
        out.append(parent)
    return out


class PrefixIndex:
    def __init__(self, capacity_blocks: int):
        self.capacity = max(1, capacity_blocks)
        self._lru: OrderedDict[int, None] = OrderedDict()

    def overlap(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def insert(self, hashes: list[int]) -> None:
        lru = self._lru
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        while len(lru) > self.capacity:
            lru.popitem(last=False)


def score(overlap_blocks: int, prompt_blocks: int, load_blocks: float) -> float:
    """Cost of sending a prompt of `prompt_blocks` full blocks to a chain that probably caches
    `overlap_blocks` of them and already has `load_blocks` of work: lower is better."""
    return (prompt_blocks - overlap_blocks) + load_blocks


@dataclass
class _ChainLoad:
    index: PrefixIndex
    blocks: float = 0.0
    sequences: int = 0
    max_sequences: int = 0       # batch slots (max_num_seqs x micro-batches); 0: no limit


class Router:
    def __init__(self, policy: str = "prefix", block_size: int = 16):
        if policy not in POLICIES:
            raise ValueError(f"router policy {policy!r}: choose one of {POLICIES}")
        self.policy, self.block_size = policy, block_size
        self._chains: dict[int, _ChainLoad] = {}
        self._rr = itertools.count()

    def add_chain(self, chain_id: int, num_blocks: int, max_sequences: int = 0) -> None:
        self._chains[chain_id] = _ChainLoad(PrefixIndex(num_blocks), max_sequences=max_sequences)

    def remove_chain(self, chain_id: int) -> None:
        self._chains.pop(chain_id, None)

    def choose(self, chain_ids: list[int], prompt: list[int], max_new_tokens: int) -> tuple[int, float]:
        """(chosen chain id, the load it took on). The caller calls `done` with it when the
        sequence ends."""
        bs = self.block_size
        hashes = block_hashes(prompt, bs) if self.policy == "prefix" else []
        total = -(-(len(prompt) + max_new_tokens) // bs)
        if self.policy == "round_robin":
            best = chain_ids[next(self._rr) % len(chain_ids)]
            overlap = 0
        else:
            costs = []
            for cid in chain_ids:
                c = self._chains[cid]
                ov = c.index.overlap(hashes) if hashes else 0
                cost = score(ov, len(hashes), c.blocks) if self.policy == "prefix" else c.blocks
                # a chain whose batch slots are all taken makes the sequence wait for one to free up
                # (a whole request's decode, while the other chains have room): chosen only when
                # every chain is full
                full = 0 < c.max_sequences <= c.sequences
                costs.append((full, cost, c.sequences, ov, cid))
            rr = next(self._rr)  # ties go round the chains rather than all to the first
            _, cost, _, overlap, best = min(costs, key=lambda t: (t[0], t[1], t[2], (t[4] - rr) % (1 << 30)))
        c = self._chains[best]
        if hashes:
            c.index.insert(hashes)
        load = float(total - overlap)
        c.blocks += load
        c.sequences += 1
        return best, load

    def done(self, chain_id: int, load: float) -> None:
        c = self._chains.get(chain_id)
        if c is not None:
            c.blocks = max(0.0, c.blocks - load)
            c.sequences = max(0, c.sequences - 1)
