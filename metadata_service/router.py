"""Which replica chain a new sequence goes to: prefix-cache overlap weighed against load.

Dynamo's KV router is the model: for each chain, the blocks of this prompt it has cached (overlap)
and the work it already has (load); the cost is the prefill blocks the chain would still have to
compute (weighted, OVERLAP_WEIGHT) plus its load, and the cheapest chain wins. `score` is that pure
function.

Where overlap comes from is the policy:
  - "exact" (the default): what the chain's pool and KV tier hold now. The metadata plane owns
    every chain's KVBlockManager, so the router reads each prefix cache's index (hash -> block,
    prefix_cache.py) and the tier's (kv_tier.py) itself, with no events and no guess: a block
    evicted a moment ago is gone from it, a block computed a moment ago is there. To that it adds
    the blocks of sequences already routed to the chain and not finished (`pending`), so a burst
    of requests sharing a system prompt all go where the first one went, before any of them ran.
  - "prefix" (approximate, Dynamo's mode without KV events; kept to compare): a PrefixIndex per
    chain, an LRU of the hashes of the full prompt blocks routed there, the size of the chain's
    pool plus its tier. It predicts the caches from the routing decisions, and drifts from them
    once they evict for other reasons (decode tokens, other prompts).
Load is counted in blocks: each unfinished sequence adds the blocks it will allocate beyond its
cached prefix. A chain whose batch slots (max_num_seqs x micro-batches) are all taken is chosen
only when every chain's are: a sequence sent there waits for a whole request to finish while
another chain could run it now (1024 short requests over 4 chains of 256 slots, balanced by blocks
alone, put 258 on two of them, and the 2 left over decoded alone for 125 steps after the rest).

Policies: "exact", "prefix", "round_robin" and "least_loaded" (the last three to compare)."""
from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Container

from .prefix_cache import default_block_hash

POLICIES = ("exact", "prefix", "round_robin", "least_loaded")


def block_hashes(tokens, block_size: int) -> list[int]:
    """Chained hashes of the prompt's full blocks, as the chains' prefix caches name them (a
    block's hash names its whole prefix; prefix_cache.py). Only blocks before the last prompt token
    can be cache hits (that token is always computed), as in KVBlockManager.create_sequence."""
    tokens = tokens.tolist() if hasattr(tokens, "tolist") else tokens
    out, parent = [], None
    for i in range((len(tokens) - 1) // block_size):
        parent = default_block_hash(parent, tuple(tokens[i * block_size:(i + 1) * block_size]))
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


# A prompt block the chain must compute weighs this many blocks of its queued load (Dynamo's
# overlap score weight). Load counts every block of the chain's unfinished sequences, decode blocks
# and prefixes computed long ago included, so at 1 a tenant's request left the chain holding its
# prompt for an idle one whenever that chain's queue was longer than the prompt: a quarter of such
# routes in bench/kv_tiers.py. At 2, measured on its tenants under cache pressure (open and closed
# loop) and on bench/scale.py's shared prefixes: hit rate 0.44-0.47 -> 0.61-0.65 and 0.90 -> 0.92,
# TTFT p90 -14% to -49%, for both overlap policies. `--router-overlap-weight` sets it.
OVERLAP_WEIGHT = 2.0


def score(overlap_blocks: int, prompt_blocks: int, load_blocks: float, weight: float = OVERLAP_WEIGHT) -> float:
    """Cost of sending a prompt of `prompt_blocks` full blocks to a chain that caches
    `overlap_blocks` of them and already has `load_blocks` of work: lower is better."""
    return weight * (prompt_blocks - overlap_blocks) + load_blocks


@dataclass
class Route:
    """What choosing a chain charged it, given back by `done` when the sequence ends."""
    load: float                  # blocks beyond the cached prefix
    hashes: tuple = ()           # its prompt blocks, pending on the chain ("exact")


@dataclass
class _ChainLoad:
    index: PrefixIndex                    # "prefix": hashes routed here, an LRU of pool + tier size
    cached: Container = ()                # "exact": the chain's prefix cache index, read live
    pending: Counter = field(default_factory=Counter)   # "exact": prompt blocks of unfinished sequences
    blocks: float = 0.0
    sequences: int = 0
    max_sequences: int = 0       # batch slots (max_num_seqs x micro-batches); 0: no limit

    def exact_overlap(self, hashes: list[int]) -> int:
        """Leading prompt blocks the pool holds, or that a sequence routed here will compute."""
        n = 0
        for h in hashes:
            if h not in self.cached and not self.pending[h]:
                break
            n += 1
        return n


class Router:
    def __init__(self, policy: str = "exact", block_size: int = 16, overlap_weight: float = OVERLAP_WEIGHT):
        if policy not in POLICIES:
            raise ValueError(f"router policy {policy!r}: choose one of {POLICIES}")
        if not overlap_weight >= 0:
            raise ValueError(f"router overlap weight {overlap_weight!r}: must be >= 0")
        self.policy, self.block_size, self.overlap_weight = policy, block_size, overlap_weight
        self._chains: dict[int, _ChainLoad] = {}
        self._rr = itertools.count()

    def add_chain(self, chain_id: int, num_blocks: int, max_sequences: int = 0, cached: Container = ()) -> None:
        """`cached`: the chain's prefix-cache index (hashes of the blocks its pool holds), which
        the "exact" policy reads at each choice (a dict read under the GIL: safe while the chain's
        thread changes it)."""
        self._chains[chain_id] = _ChainLoad(PrefixIndex(num_blocks), cached, max_sequences=max_sequences)

    def remove_chain(self, chain_id: int) -> None:
        self._chains.pop(chain_id, None)

    def choose(self, chain_ids: list[int], prompt, max_new_tokens: int) -> tuple[int, Route]:
        """(chosen chain id, what it was charged). The caller calls `done` with both when the
        sequence ends."""
        bs, policy = self.block_size, self.policy
        hashes = block_hashes(prompt, bs) if policy in ("exact", "prefix") else []
        total = -(-(len(prompt) + max_new_tokens) // bs)
        if policy == "round_robin":
            best = chain_ids[next(self._rr) % len(chain_ids)]
            overlap = 0
        else:
            costs = []
            for cid in chain_ids:
                c = self._chains[cid]
                if not hashes:
                    ov = 0
                else:
                    ov = c.exact_overlap(hashes) if policy == "exact" else c.index.overlap(hashes)
                cost = c.blocks if policy == "least_loaded" else score(ov, len(hashes), c.blocks, self.overlap_weight)
                # a chain whose batch slots are all taken makes the sequence wait for one to free up
                # (a whole request's decode, while the other chains have room): chosen only when
                # every chain is full
                full = 0 < c.max_sequences <= c.sequences
                costs.append((full, cost, c.sequences, ov, cid))
            rr = next(self._rr)  # ties go round the chains rather than all to the first
            _, cost, _, overlap, best = min(costs, key=lambda t: (t[0], t[1], t[2], (t[4] - rr) % (1 << 30)))
        c = self._chains[best]
        route = Route(float(total - overlap))
        if policy == "prefix" and hashes:
            c.index.insert(hashes)
        elif policy == "exact" and hashes:
            route.hashes = tuple(hashes)
            c.pending.update(route.hashes)
        c.blocks += route.load
        c.sequences += 1
        return best, route

    def done(self, chain_id: int, route: Route | None) -> None:
        c = self._chains.get(chain_id)
        if c is not None and route is not None:
            c.blocks = max(0.0, c.blocks - route.load)
            c.sequences = max(0, c.sequences - 1)
            for h in route.hashes:          # its blocks are no longer pending here
                c.pending[h] -= 1
                if c.pending[h] <= 0:
                    del c.pending[h]
