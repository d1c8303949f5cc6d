"""The second KV tier on the metadata plane (kv_tier.py, block_tiering.py): what it saves, loads and
forgets, checked against a simulated data plane that runs each step's moves in the workers' order
(saves, loads, copies, then the step's writes). End-to-end parity through a real tier is in
test_kv_tier_e2e.py."""
import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import initialize

from metadata_service.block_manager import KVBlockManager
from metadata_service.kv_tier import KVTier
from metadata_service.prefix_cache import default_block_hash
from metadata_service.chain_upkeep import load_beats_recompute
from metadata_service.workers import WorkerHandle
from minipaged.v1 import worker_pb2
from tests.test_block_manager_stateful import BlockManagerMachine

B = 4


def _manager(blocks=4, tier=8, policy="write-back"):
    m = KVBlockManager(blocks, B, max_seqs=4)
    m.attach_tier(tier, policy)
    return m


def test_write_back_saves_an_evicted_prefix_and_a_later_prompt_loads_it():
    m = _manager()
    prompt = list(range(13))                               # 3 full blocks + 1 token
    m.create_and_append(1, prompt, 13)
    first = list(m.sequences[1].block_table)
    assert m.take_tier_moves() == ([], [])                 # write-back: nothing moves while there is room
    m.release_sequence(1)
    m.create_and_append(2, [99] * 16, 16)                  # needs every block: evicts the cached three
    saves, loads = m.take_tier_moves()
    assert sorted(b for b, _ in saves) == sorted(first[:3]) and loads == []
    m.release_sequence(2)
    cached = m.create_sequence(3, prompt)                  # device cache: the 99s; the tier: our prefix
    assert cached == 12
    saves, loads = m.take_tier_moves()
    slots = {b: s for b, s in saves}
    assert [s for s, _ in loads] == [s for s in (slots.get(b) for b in first[:3]) if s is not None] or len(loads) == 3
    assert [b for _, b in loads] == list(m.sequences[3].block_table[:3])
    assert m.stats()["tier_hits"] == 3 and m.check_invariants() == []


def test_write_through_saves_a_block_one_step_after_it_is_hashed():
    m = _manager(policy="write-through")
    m.create_and_append(1, list(range(8)), 8)              # hashes two blocks in this step
    assert m.take_tier_moves() == ([], [])                 # their K/V are computed by this step
    saves, _ = m.take_tier_moves()                         # the next step saves them
    assert [b for b, _ in saves] == list(m.sequences[1].block_table[:2])
    assert m.take_tier_moves() == ([], [])                 # once


def test_write_through_block_evicted_before_its_save_is_saved_with_the_eviction():
    m = _manager(blocks=2, policy="write-through")
    m.create_and_append(1, list(range(8)), 8)
    m.take_tier_moves()                                    # step k: computes the two blocks
    m.release_sequence(1)
    m.create_and_append(2, [50] * 8, 8)                    # step k + 1 evicts them: saved first
    saves, _ = m.take_tier_moves()
    assert len(saves) == 2 and m.check_invariants() == []


def test_a_full_tier_evicts_its_oldest_slot_but_never_one_this_step_loads():
    t = KVTier(2, B, default_block_hash)
    a = t.put(1, (None, (1,)))
    b = t.put(2, (None, (2,)))
    t.saved([a, b])
    t.pin([a])                                             # loaded by the step being built
    c = t.put(3, (None, (3,)))
    assert c == b and 2 not in t and 1 in t                # the unpinned one goes, oldest or not
    assert t.put(4, (None, (4,))) is None                  # a pinned + an unsaved slot: no room
    assert t.check() == []


def test_reset_prefix_cache_forgets_the_tier_and_its_pending_moves():
    m = _manager(blocks=2)
    m.create_and_append(1, list(range(8)), 8)
    m.release_sequence(1)
    m.create_and_append(2, [7] * 8, 8)                     # evictions queue saves
    m.reset_prefix_cache()
    assert m.take_tier_moves() == ([], []) and len(m.tier) == 0 and m.check_invariants() == []


def test_a_collision_in_the_tier_is_a_miss():
    m = KVBlockManager(2, B, max_seqs=4, hash_fn=lambda parent, toks: 7)   # every block: one hash
    m.attach_tier(4)
    m.create_and_append(1, [1, 2, 3, 4, 5], 5)
    m.release_sequence(1)
    m.create_and_append(2, [9] * 8, 8)                     # evicts block [1, 2, 3, 4] into the tier
    m.take_tier_moves()
    m.release_sequence(2)
    assert m.create_sequence(3, [5, 6, 7, 8, 9]) == 0      # same hash, other tokens: no load
    assert m.take_tier_moves()[1] == []


class TieredMachine(BlockManagerMachine):
    """The block manager's state machine with a tier behind the pool. Each rule is one step: its
    writes and copies wait until the step's tier moves have run (flush)."""

    @initialize(block_size=st.sampled_from([1, 2, 3, 4]), num_blocks=st.integers(3, 12),
                tier_blocks=st.integers(0, 10), policy=st.sampled_from(["write-back", "write-through"]))
    def setup(self, block_size, num_blocks, tier_blocks, policy):
        super().setup(block_size, num_blocks)
        self.m.attach_tier(tier_blocks, policy)
        self.tier_kv: dict = {}       # tier slot -> the block's tokens, as the workers hold them
        self.pending: list = []       # ("w", slots, values) | ("c", src, dst), in order

    def store(self, slots, values):
        self.pending.append(("w", list(slots), list(values)))

    def copy(self, src, dst):
        self.pending.append(("c", src, dst))

    def flush(self):
        if not hasattr(self, "m"):
            return
        saves, loads = self.m.take_tier_moves()
        Bs = self.B
        for block, slot in saves:                      # the workers' order: saves, loads, copies, compute
            self.tier_kv[slot] = [self.kv.get(block * Bs + o) for o in range(Bs)]
        for slot, block in loads:
            for o, v in enumerate(self.tier_kv[slot]):
                self.kv[block * Bs + o] = v
        for op in self.pending:
            if op[0] == "w":
                super().store(op[1], op[2])
            else:
                super().copy(op[1], op[2])
        self.pending = []
        t = self.m.tier
        for slot, (_, toks) in t.key_of.items():      # every loadable slot holds its tokens
            if slot not in t.unsaved:
                assert self.tier_kv[slot] == list(toks), f"tier slot {slot} holds the wrong K/V"


TieredMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_tiered_block_manager_stateful = TieredMachine.TestCase


@pytest.mark.parametrize("policy", ["write-back", "write-through"])
def test_tier_hit_counts_as_cached_and_the_router_view_includes_it(policy):
    m = _manager(blocks=3, policy=policy)
    m.create_and_append(1, list(range(9)), 9)
    m.take_tier_moves()
    m.release_sequence(1)
    m.create_and_append(2, [42] * 12, 12)
    m.take_tier_moves()
    m.release_sequence(2)
    m.take_tier_moves()
    assert m.prompt_tier_lookup(list(range(9))) == 8      # gone from the device pool, in the tier
    assert m.prompt_cache_lookup(list(range(9))) == 8
    assert m.create_sequence(3, list(range(9))) == 8       # ... but loaded from the tier
    st_ = m.stats()
    assert st_["tier_hits"] == 2 and st_["tier_queries"] >= 2
    assert np.all(np.asarray(m.sequences[3].block_table) >= 0)


def test_an_empty_tier_is_still_a_tier_for_stats_and_the_router_view():
    # the router reads cached_hashes() once, when the chain starts: its tier is empty then
    m = _manager(blocks=3)
    view = m.cached_hashes()
    assert m.stats()["tier_blocks"] == 8 and m.stats()["tier_used_blocks"] == 0
    m.create_and_append(1, list(range(9)), 9)
    m.release_sequence(1)
    m.create_and_append(2, [42] * 12, 12)                  # evicts the first prompt's blocks to the tier
    m.take_tier_moves()
    m.release_sequence(2)
    first = m.tier.hash_of
    assert first and all(h in view for h in first.values())  # the view the router kept sees the tier


def test_a_load_dropped_before_its_step_is_no_tier_hit():
    m = _manager(blocks=3)
    m.create_and_append(1, list(range(9)), 9)
    m.release_sequence(1)
    m.create_and_append(2, [42] * 12, 12)
    m.take_tier_moves()
    m.release_sequence(2)
    assert m.create_sequence(3, list(range(9))) == 8       # two blocks to load from the tier
    assert m.stats()["tier_hits"] == 2
    m.release_sequence(3)                                  # gone before its step went out
    m.create_and_append(4, [7] * 12, 12)                   # the pool reuses the loaded blocks
    saves, loads = m.take_tier_moves()
    assert loads == [] and m.stats()["tier_hits"] == m.stats()["tier_loaded_blocks"] == 0
    assert m.check_invariants() == []


def _stage(layers, kv_heads, params, link, flops):
    return WorkerHandle("w", worker_pb2.WorkerInfo(layer_start=0, layer_end=layers, num_kv_heads=kv_heads, head_dim=128,
                                                   dtype_bytes=2, weight_bytes=int(2 * params),
                                                   host_link_bytes_per_s=link, peak_flops=flops))


def test_the_tier_loads_only_when_the_copy_beats_the_recompute():
    h200 = dict(link=55e9, flops=989e12 * 0.6)
    # Qwen3-8B: a block of 16 is 2.25 MiB (41 us at 55 GB/s) against 0.26 ms of GEMMs
    assert load_beats_recompute([_stage(36, 8, 8.2e9, **h200)], 16)
    # a 0.2B model with the 8B's K/V width: the copy (1.8 MiB) is slower than 11 us of GEMMs
    assert not load_beats_recompute([_stage(28, 8, 0.2e9, **h200)], 16)
    # two stages load at once but recompute one after the other
    half = _stage(18, 8, 0.15e9, **h200)
    assert load_beats_recompute([half, half], 16) == (half.load_seconds(16) < 2 * half.recompute_seconds(16))
    # unknown figures (a CPU worker: the tier is its own RAM): load
    assert load_beats_recompute([_stage(28, 8, 0.6e9, link=0.0, flops=0.0)], 16)
