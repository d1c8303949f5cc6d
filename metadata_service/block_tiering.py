"""The second KV tier in KVBlockManager: what to save and load, and when (policy over kv_tier.py).

Policies (`--kv-tier-policy`):
  write-back     a cached block is saved when the pool evicts it (its last chance), if the tier
                 does not hold its hash yet. Nothing moves while the pool has room.
  write-through  every full block is saved once hashed, one step after the step that computes it;
                 an eviction before that step saves it at once.
A prompt whose blocks continue past the device prefix in the tier loads them into fresh pool blocks
(registered in the prefix cache, so they count as computed) instead of recomputing them. Preemption
needs nothing of its own: a preempted sequence's full blocks stay cached, so the pool saves them as
it evicts them and its readmission loads them back ("swap" at block granularity; only the partial
last block is recomputed).

When a save may go out: a block hashed while step k is built is written by step k's compute, so its
save waits for step k + 1 (`_through_new` -> `_through_old` -> the Step). An eviction in step k
saves at once: an evicted block is unreferenced, so its content is from an earlier step, and step k
runs its saves before anything it writes. Methods of KVBlockManager (block_manager.py)."""
from __future__ import annotations

from metadata_service.kv_tier import KVTier

POLICIES = ("write-back", "write-through")


class _Either:
    """`h in view`: in one of two live containers."""
    __slots__ = ("a", "b")

    def __init__(self, a, b):
        self.a, self.b = a, b

    def __contains__(self, h) -> bool:
        return h in self.a or h in self.b


class TierMoves:
    """KVBlockManager's tier verbs (mixin; block_manager.py sets tier = None and the counters)."""

    def attach_tier(self, num_blocks: int, policy: str = "write-back") -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown KV tier policy {policy!r} (expected one of {', '.join(POLICIES)})")
        self.tier = KVTier(num_blocks, self.block_size, self.pool.cache.hash_fn)
        self.tier_policy = policy
        self.pool.on_evict = self._tier_on_evict
        self.pool.cache.on_register = self._tier_on_register if policy == "write-through" else None

    def _tier_on_register(self, block: int, h: int, key) -> None:
        slot = self.tier.put(h, key)
        if slot is not None:
            self._through_new[block] = slot

    def _tier_on_evict(self, block: int) -> None:
        """The pool is about to reuse a cached block (its hash still known): save it now if the
        policy keeps it and the tier lacks it."""
        if self._tier_loads:          # a block loaded for a sequence that left before its step went out:
            kept = [(s, b) for s, b in self._tier_loads if b != block]
            self.tier_hits -= len(self._tier_loads) - len(kept)   # not loaded after all (tier_hits counts loads)
            self._tier_loads = kept
        for pending in (self._through_new, self._through_old):
            slot = pending.pop(block, None)
            if slot is not None:
                self._tier_saves.append((block, slot))
                return
        if self.tier_policy == "write-back":
            cache = self.pool.cache
            slot = self.tier.put(cache.hash_of[block], cache.key_of[block])
            if slot is not None:
                self._tier_saves.append((block, slot))

    def _tier_match(self, prompt: list, hit: list, last_hash, max_hit: int):
        """The tier's slots for the prompt's blocks right after the device prefix."""
        if self.tier is None or len(hit) >= max_hit:
            return [], last_hash
        return self.tier.match(prompt, len(hit), last_hash, max_hit - len(hit))

    def _tier_load(self, prompt: list, slots: list[int], first: int, parent) -> tuple[list[int], object]:
        """Fresh pool blocks for tier slots (caller checked the room), named in the prefix cache:
        the Step loads them before its compute, so they hold that content for any reader."""
        self.tier.pin(slots)                     # a save this step must not take the slot we read
        blocks = self.pool.allocate(len(slots)).tolist()
        B = self.block_size
        for j, (slot, b) in enumerate(zip(slots, blocks)):
            parent = self.pool.cache.register(b, parent, tuple(prompt[(first + j) * B:(first + j + 1) * B]))
            self._tier_loads.append((slot, b))
        self.tier_hits += len(slots)
        return blocks, parent

    def take_tier_moves(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The (pool block, tier slot) saves and (tier slot, pool block) loads the Step being sent
        carries; the workers run the saves first."""
        if self.tier is None:
            return [], []
        saves = self._tier_saves + list(self._through_old.items())
        loads = self._tier_loads
        self._through_old, self._through_new = self._through_new, {}
        self._tier_saves, self._tier_loads = [], []
        self.tier.saved(s for _, s in saves)
        self.tier.pinned.clear()
        self.tier_saved_blocks += len(saves)
        self.tier_loaded_blocks += len(loads)
        return saves, loads

    def cached_hashes(self):
        """The exact router's view: hashes this chain's pool or tier holds (read live)."""
        if self.tier is None:         # (not `if not self.tier`: an empty tier is falsy, and this
            return self.pool.cache.block_of   # view is read once, when the chain starts)
        return _Either(self.pool.cache.block_of, self.tier.slot_of)

    def reset_tier(self) -> None:
        """The workers' tier is gone with their cache (a new epoch, a failed step): never guess."""
        if self.tier is not None:
            self.tier.clear()
            self.tier_hits -= len(self._tier_loads)   # counted, never to run: recomputed instead
            self._tier_saves, self._tier_loads = [], []
            self._through_new, self._through_old = {}, {}

    def tier_stats(self) -> dict:
        t = self.tier                 # (an empty tier is falsy: it has a __len__)
        return dict(tier_blocks=0 if t is None else t.num_blocks, tier_used_blocks=0 if t is None else t.num_used,
                    tier_queries=self.tier_queries, tier_hits=self.tier_hits,
                    tier_saved_blocks=self.tier_saved_blocks, tier_loaded_blocks=self.tier_loaded_blocks)

    def check_tier(self) -> list[str]:
        """The tier's own invariants, and that no pending move names a slot it does not hold."""
        if self.tier is None:
            return []
        errs = self.tier.check()
        pending = list(self._through_new.values()) + list(self._through_old.values())
        pending += [s for _, s in self._tier_saves]
        if any(s not in self.tier.unsaved for s in pending):
            errs.append("tier: a pending save names a slot that is not waiting for it")
        if any(s not in self.tier.pinned for s, _ in self._tier_loads):
            errs.append("tier: a pending load reads a slot that is not pinned")
        return errs
