"""Blocks held for a prefill -> decode K/V move (docs/architecture.md section 9), in KVBlockManager.

Both ends of a move keep blocks that no block table holds:
  the prefill end   `hold` the prompt's full blocks while the decode chain reads them, so no step
                    writes them and the pool does not hand them out;
  the decode end    `reserve_move`: for each prompt block, the block this pool already caches under
                    its hash (held, so the reservations cannot evict it) or a fresh one (held, and
                    named only by `finish_move(ok=True)`, once the move Step came back: a failed move
                    must leave no name on a block whose content never arrived).
A hold counts as a reference in the invariants, like a block table's. Methods of KVBlockManager
(block_manager.py sets `held` and `_move_keys`)."""
from __future__ import annotations


class MoveHolds:
    def hold(self, key, blocks) -> None:
        """A reference on each of `blocks` (cached-free ones revive)."""
        self.pool.touch(blocks)
        self.held[key] = list(blocks)

    def unhold(self, key) -> int:
        """Drop a hold (tail first, as a sequence's release); returns how many blocks became free."""
        self._move_keys.pop(key, None)
        blocks = self.held.pop(key, None)
        return self.pool.release(blocks[::-1]) if blocks else 0

    def reserve_move(self, key, prompt, num_blocks: int) -> tuple[list[int], list[int]]:
        """The decode end of a move of the prompt's first `num_blocks` full blocks: returns (indexes
        of the blocks to move, the fresh blocks they go into). Stops at the first block that finds
        no room (the rest recompute: a prefix hit needs every block before it)."""
        B, cache = self.block_size, self.pool.cache
        hits, todo, fresh, keys, parent = [], [], [], [], None
        for j in range(num_blocks):
            k = (parent, tuple(prompt[j * B:(j + 1) * B]))
            parent = cache.hash_fn(*k)
            b = cache.block_of.get(parent)
            if b is not None and cache.key_of[b] == k:
                self.pool.touch([b])
                hits.append(b)
            elif self.pool.num_free:
                fresh.append(self.pool.allocate_one())   # an eviction's tier save goes with the move
                todo.append(j)
                keys.append(k)
            else:
                break
        self.held[key] = hits + fresh
        self._move_keys[key] = list(zip(fresh, keys))
        return todo, fresh

    def finish_move(self, key, ok: bool) -> int:
        """The move Step came back: when it worked, its blocks enter the prefix cache under the
        prompt's hashes (a hash named meanwhile by another block keeps that one); then the hold goes.
        Returns the blocks moved in."""
        named = self._move_keys.get(key, [])
        if ok:
            for b, (parent, toks) in named:
                self.pool.cache.register(b, parent, toks)
        self.unhold(key)
        return len(named) if ok else 0
