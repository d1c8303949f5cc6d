"""A chain's figures for Stats and the seed's pool view (a mixin of ChainRunner), and the block
manager's invariants check.

Other threads call `stats()` and `snapshot()`; both read under the chain's lock. invariants_ok is
O(pool) in Python, so it is checked by the chain's own thread when the chain goes idle (or by
`stats()` on an idle chain whose last step was not checked yet), never on the step path nor on
every Stats call (the gateway polls Stats for /health and /metrics)."""
from __future__ import annotations

import logging
import time

import numpy as np

from minipaged.v1 import metadata_pb2
from minipaged.wire import pack

log = logging.getLogger("metadata_service.chain")

# Stats' monotone counts (Prometheus counters); the rest are gauges of the pools as they are now
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "preemptions", "steps", "generated_tokens", "tier_queries",
            "tier_hits", "tier_saved_blocks", "tier_loaded_blocks", "kv_moves", "kv_moved_blocks", "kv_move_failures")


class ChainStats:
    """Mixed into ChainRunner: reads its manager, scheduler, stages and step counters."""

    def _check_invariants(self) -> None:
        with self.lock:
            ok = bool(self.manager.invariants_ok())
        if not ok and self.invariants_checked:
            log.error("chain %d: block manager invariants violated: %s", self.chain_id,
                      "; ".join(self.manager.check_invariants()[:5]))
        self.invariants_checked, self._invariants_dirty = ok, False

    def counters(self) -> dict:
        """The chain's monotone counts (COUNTERS), read without the lock: when the chain is lost the
        service adds them to its totals, so Stats and /metrics counters never go down."""
        m = self.manager
        return dict(prefix_cache_queries=m.prefix_cache_queries, prefix_cache_hits=m.prefix_cache_hits,
                    preemptions=self.scheduler.num_preemptions, steps=self.steps,
                    generated_tokens=self.generated_tokens, tier_queries=m.tier_queries, tier_hits=m.tier_hits,
                    tier_saved_blocks=m.tier_saved_blocks, tier_loaded_blocks=m.tier_loaded_blocks,
                    kv_moves=self.moves_in, kv_moved_blocks=self.moved_blocks, kv_move_failures=self.moves_failed)

    def stats(self) -> dict:
        with self.lock:
            st = dict(self.manager.stats())
            if self._invariants_dirty and not self.inflight and not self.scheduler.has_work():
                self._check_invariants()      # idle since its last step: check the final state now
            # else as of the chain's last idle moment (a busy chain's figure is from before its work)
            st["invariants_ok"] = self.invariants_checked
            st["running"], st["waiting"] = len(self.scheduler.running), len(self.scheduler.waiting)
            st.update(self.counters())
        wall = max(time.monotonic() - self.started, 1e-9)
        st.update(chain_id=self.chain_id, ready=self.alive, group=self.group,
                  steps_per_second=self.steps / wall, tokens_per_second=self.generated_tokens / wall,
                  cache_epoch=self.epoch, micro_batches=self.micro_batches, metadata_s=self.metadata_s,
                  wire_bytes=self.wire_bytes, role=self.role,
                  tier_block_bytes=sum(w.block_bytes(self.cfg.block_size) for w in self.stages),
                  stages=[dict(address=w.address, layer_start=w.info.layer_start, layer_end=w.info.layer_end,
                               busy_fraction=min(1.0, busy / 1e3 / wall),
                               step_ms=busy / self.steps if self.steps else 0.0)
                          for w, busy in zip(self.stages, self.stage_busy_ms)])
        return st

    def snapshot(self, max_blocks: int, max_sequences: int) -> metadata_pb2.ChainSnapshot:
        """The pool as the seed's article draws it: every block's state (sampled with a stride when
        the pool is larger than max_blocks), exact counts, and the first sequences' tables."""
        with self.lock:
            states = self.manager.pool.block_states()
            refs = self.manager.pool.ref_count
            running = list(self.scheduler.running[:max_sequences])
            waiting = list(self.scheduler.waiting)[:max(0, max_sequences - len(running))]
            seqs = []
            for s, state in [(s, "running") for s in running] + [(s, "waiting") for s in waiting]:
                whole = (self.manager.sequences[s.seq_id].block_table
                         if s.seq_id in self.manager.sequences else np.zeros(0, np.int32))
                label = "stream" if s.tag is None else f"{s.tag[0].job_id[:8]}:{s.tag[1]}"
                seqs.append(metadata_pb2.SequenceSnapshot(   # the first 64 blocks; num_blocks counts all
                    sequence_id=s.seq_id, state=state, length=s.num_computed_tokens, num_blocks=len(whole),
                    block_table=pack(whole[:64]), num_cached_tokens=s.num_cached_tokens, label=label))
            counts = np.bincount(states, minlength=4)
            stride = max(1, -(-len(states) // max_blocks))
            return metadata_pb2.ChainSnapshot(
                chain_id=self.chain_id, num_blocks=len(states), block_size=self.cfg.block_size, stride=stride,
                block_state=states[::stride].tobytes(), ref_counts=np.minimum(refs[::stride], 255).astype(np.uint8).tobytes(),
                free_blocks=int(counts[0] + counts[3]), owned_blocks=int(counts[1]), shared_blocks=int(counts[2]),
                cached_blocks=int(counts[3]), sequences=seqs, running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting))
