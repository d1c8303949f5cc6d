"""KVBlockManager unit tests: the seed's worked examples, every method and error, prefix caching,
fork + copy-on-write, and 'a failed operation changes nothing'."""
import numpy as np
import pytest

from metadata_service.block_manager import (BlockManagerError, DoubleReleaseError, DuplicateSequenceError,
                                            InvalidArgumentError, KVBlockManager, OutOfBlocksError,
                                            SequenceState, UnknownSequenceError, blocks_for_tokens,
                                            kv_utilization, slot_for)


def ok(m):
    assert m.check_invariants() == []
    assert m.invariants_ok()


def filled(m, sid, tokens, prompt=None):
    """Create sid (prefix lookup with prompt) and append the uncached rest of tokens."""
    cached = m.create_sequence(sid, prompt if prompt is not None else tokens)
    m.append_tokens(sid, len(tokens) - cached, tokens[cached:])
    return cached


# ---------------------------------------------------------------- seed worked examples
def test_seed_slot_example():
    assert slot_for([5, 2, 9, 1], 6, 4) == 10


def test_seed_slot_example_through_manager():
    # Make the pool hand out 5, 2, 9, 1: one block per sequence, then release those four so the
    # free stack (LIFO) pops them in that order.
    m = KVBlockManager(10, 4)
    for s in range(10):
        m.create_sequence(s)
        assert m.allocate_block(s) == s
    for s in (1, 9, 2, 5):
        assert m.release_sequence(s) == 1
    m.create_sequence("x")
    m.append_tokens("x", 16)
    assert list(m.sequences["x"].block_table) == [5, 2, 9, 1]
    assert m.slot_for_position("x", 6) == 10
    assert m.append_tokens("x", 0).size == 0
    ok(m)


def test_seed_fragmentation_example():
    m = KVBlockManager(8, 4)
    m.create_sequence(1)
    m.append_tokens(1, 10)
    assert m.internal_fragmentation_tokens() == 2
    assert m.stats()["internal_fragmentation_tokens"] == 2


def test_seed_seven_tokens_two_blocks():
    m = KVBlockManager(8, 4)
    m.create_sequence(1)
    slots = [m.append_token(1) for _ in range(7)]
    assert blocks_for_tokens(7, 4) == 2
    st = m.sequences[1]
    assert isinstance(st, SequenceState) and st.sequence_length == 7 and len(st.block_table) == 2
    b0, b1 = st.block_table[0], st.block_table[1]
    assert slots == [b0 * 4 + i for i in range(4)] + [b1 * 4 + i for i in range(3)]


def test_seed_utilisation_example():
    # A static reservation of 4096 slots serving a 300-token sequence: 7.3 % utilised.
    m = KVBlockManager(256, 16)
    m.create_sequence(1)
    for _ in range(256):
        m.allocate_block(1)
    m.append_tokens(1, 300)
    assert len(m.sequences[1].block_table) == 256        # reserved blocks are used before new ones
    assert round(m.stats()["kv_utilization"] * 100, 1) == 7.3
    assert round(kv_utilization(300, 4096) * 100, 1) == 7.3
    ok(m)


# ---------------------------------------------------------------- methods
def test_append_and_tensors():
    m = KVBlockManager(16, 4)
    for s, n in [(1, 5), (2, 1), (3, 8)]:
        m.create_sequence(s)
        m.append_tokens(s, n)
    t = m.get_block_table_tensor([3, 1, 2])
    assert t.dtype == np.int32 and t.shape == (3, 2)
    assert t[2, 1] == -1 and t[1].tolist() == list(m.sequences[1].block_table)
    assert m.get_seq_lens_tensor([1, 2, 3]).tolist() == [5, 1, 8]
    assert m.get_seq_lens_tensor([1, 2, 3]).dtype == np.int32
    slots = m.slot_mapping_for_append([1, 2, 3])
    assert slots.dtype == np.int32
    assert slots[0] == m.slot_for_position(1, 5) and slots[2] == m.slot_for_position(3, 8)
    assert m.get_seq_lens_tensor([1, 2, 3]).tolist() == [6, 2, 9]
    batch = m.append_tokens_batch([1, 2], [3, 0])
    assert batch.tolist() == [m.slot_for_position(1, p) for p in (6, 7, 8)]
    assert m.append_tokens_batch([1, 2], 1).size == 2
    ok(m)


def test_capacity_queries():
    m = KVBlockManager(4, 4)
    m.create_sequence(1)
    m.append_tokens(1, 5)
    assert m.num_free_blocks == 2
    assert m.blocks_needed(1, 3) == 0 and m.blocks_needed(1, 4) == 1 and m.blocks_needed(1, 12) == 3
    assert m.can_append(1, 11) and not m.can_append(1, 12)


def test_release_returns_blocks():
    m = KVBlockManager(8, 4, enable_prefix_caching=False)
    m.create_sequence(1, list(range(9)))
    m.append_tokens(1, 9)
    assert m.release_sequence(1) == 3
    assert m.num_free_blocks == 8 and m.stats()["live_sequences"] == 0
    ok(m)


def test_stats_keys():
    m = KVBlockManager(8, 4)
    s = m.stats()
    assert set(s) == {"num_blocks", "block_size", "used_blocks", "free_blocks", "cached_blocks",
                      "internal_fragmentation_tokens", "kv_utilization", "prefix_cache_queries",
                      "prefix_cache_hits", "live_sequences", "shared_blocks", "kv_used_tokens",
                      "kv_allocated_tokens", "tier_blocks", "tier_used_blocks", "tier_queries", "tier_hits",
                      "tier_saved_blocks", "tier_loaded_blocks"}
    assert s["kv_utilization"] == 0.0 and s["free_blocks"] == 8  # nothing reserved: nothing used


def test_tables_grow():
    m = KVBlockManager(400, 1, max_seqs=2)
    for s in range(7):
        m.create_sequence(s)
        m.append_tokens(s, 40)                   # > the initial 64 columns after a few appends
    m.append_tokens(0, 100)
    assert len(m.sequences[0].block_table) == 140
    assert m.get_block_table_tensor([0, 6]).shape == (2, 140)
    ok(m)


# ---------------------------------------------------------------- errors
def test_errors_are_typed():
    m = KVBlockManager(2, 4)
    m.create_sequence(1)
    with pytest.raises(DuplicateSequenceError):
        m.create_sequence(1)
    with pytest.raises(UnknownSequenceError):
        m.append_token(99)
    with pytest.raises(UnknownSequenceError):
        m.get_block_table_tensor([1, 99])
    with pytest.raises(InvalidArgumentError):
        m.append_tokens(1, -1)
    with pytest.raises(InvalidArgumentError):
        m.append_tokens(1, 2, [1, 2, 3])
    with pytest.raises(InvalidArgumentError):
        m.slot_mapping_for_append([])
    with pytest.raises(InvalidArgumentError):
        m.slot_mapping_for_append([1, 1])
    with pytest.raises(InvalidArgumentError):
        m.append_tokens_batch([1], [1, 2])
    with pytest.raises(OutOfBlocksError, match=r"needed 3, free 2"):
        m.append_tokens(1, 9)
    m.release_sequence(1)
    with pytest.raises(DoubleReleaseError):
        m.release_sequence(1)
    with pytest.raises(UnknownSequenceError):
        m.release_sequence(7)
    assert issubclass(OutOfBlocksError, BlockManagerError) and issubclass(DoubleReleaseError, BlockManagerError)


def _failing_ops(m):
    yield lambda: m.append_tokens(1, 100)
    yield lambda: m.append_tokens_batch([1, 2], [1, 100])
    yield lambda: m.append_tokens_batch([1, 2], [1, 2], [1, 2])      # token count mismatch
    yield lambda: m.slot_mapping_for_append([1, 2, 99])
    yield lambda: m.slot_mapping_for_append([1, 2], [5])
    yield lambda: m.create_sequence(1)
    yield lambda: m.fork(99, 5)
    yield lambda: m.fork(1, 2)
    yield lambda: m.release_sequence(42)
    yield lambda: m.allocate_block(42)


def test_failed_operations_change_nothing():
    m = KVBlockManager(6, 4)
    filled(m, 1, list(range(9)))
    filled(m, 2, list(range(9)))                 # hits two blocks of 1
    for op in _failing_ops(m):
        before = m.debug_state()
        with pytest.raises(BlockManagerError):
            op()
        assert m.debug_state() == before
        ok(m)


def test_full_decode_step_is_all_or_nothing():
    m = KVBlockManager(3, 2)
    for s in (1, 2, 3):
        m.create_sequence(s)
        m.append_tokens(s, 2)                    # every sequence is at a block boundary
    before = m.debug_state()
    with pytest.raises(OutOfBlocksError, match="needed 3, free 0"):
        m.slot_mapping_for_append([1, 2, 3])
    assert m.debug_state() == before


def test_create_and_append_all_or_nothing():
    m = KVBlockManager(4, 4)
    filled(m, 1, list(range(9)))
    m.release_sequence(1)                        # two cached-free blocks + two free
    before = m.debug_state()
    with pytest.raises(OutOfBlocksError):
        m.create_and_append(2, list(range(9)), 20)   # hit 8 tokens, 20 more need 5 > 2 free blocks
    assert m.debug_state() == before
    cached, slots = m.create_and_append(2, list(range(9)), 1 + 4)
    assert cached == 8 and len(slots) == 5
    ok(m)


# ---------------------------------------------------------------- prefix cache
def test_prefix_hit_and_at_least_one_token_rule():
    m = KVBlockManager(16, 4)
    p = list(range(12))
    assert filled(m, 1, p) == 0
    assert m.prompt_cache_lookup(p) == 8                 # 12 tokens cached, but one must be computed
    assert m.prompt_cache_lookup(p + [99]) == 12
    assert m.prompt_cache_lookup(p[:5]) == 4
    assert m.prompt_cache_lookup([7] + p[1:]) == 0
    before = m.debug_state()
    m.prompt_cache_lookup(p)
    assert m.debug_state() == before
    assert m.create_sequence(2, p + [99]) == 12
    st = m.sequences[2]
    assert st.sequence_length == 12 and list(st.block_table) == list(m.sequences[1].block_table)
    assert m.pool.ref_count[st.block_table[0]] == 2
    s = m.stats()
    assert s["prefix_cache_queries"] == 2 + 3 and s["prefix_cache_hits"] == 3
    slot = m.append_token(2, 99)                         # the computed token goes to a new block
    assert slot // 4 not in list(m.sequences[1].block_table)
    ok(m)


def test_cached_blocks_survive_release_and_are_revived():
    m = KVBlockManager(8, 4)
    p = list(range(9))
    filled(m, 1, p)
    m.release_sequence(1)
    s = m.stats()
    assert s["cached_blocks"] == 2 and s["free_blocks"] == 8 and s["used_blocks"] == 0
    assert filled(m, 2, p) == 8
    assert m.stats()["cached_blocks"] == 0
    ok(m)


@pytest.mark.parametrize("corrupt, message", [
    (lambda pool: pool.cache.block_of.update({next(iter(pool.cache.block_of)): 7}), "prefix cache maps"),
    (lambda pool: pool.cache.hash_of.pop(next(iter(pool.cache.hash_of))), "prefix cache"),
    (lambda pool: pool.ref_count.__setitem__(int(pool._free[0]), 1), "a free block has a reference"),
])
def test_pool_check_catches_each_corruption(corrupt, message):
    """Each pool check names its own broken invariant (a check that can never fail proves nothing)."""
    m = KVBlockManager(8, 4)
    filled(m, 1, list(range(9)))
    m.release_sequence(1)                 # two cached-free blocks: both prefix-cache maps are non-empty
    ok(m)
    corrupt(m.pool)
    assert any(message in e for e in m.check_invariants()), m.check_invariants()
    assert not m.invariants_ok()


def test_decode_tokens_are_hashed():
    m = KVBlockManager(8, 4)
    m.create_sequence(1)
    for t in range(8):
        m.slot_mapping_for_append([1], [t])
    assert m.prompt_cache_lookup(list(range(9))) == 8
    m.append_token(1)                                    # unknown token: chain stops here
    m.append_tokens(1, 3, [1, 2, 3])
    assert m.prompt_cache_lookup(list(range(8)) + [0, 1, 2, 3, 4]) == 8
    ok(m)


def test_prompt_supplies_token_ids():
    m = KVBlockManager(8, 4)
    m.create_sequence(1, list(range(10)))
    m.append_tokens(1, 6)                                # ids taken from the stored prompt
    m.slot_mapping_for_append([1])
    m.append_token(1)
    assert m.prompt_cache_lookup(list(range(10)) + [0]) == 8


def test_lru_eviction_order_and_stale_entry_removal():
    m = KVBlockManager(4, 2)
    a, b = [1, 2, 3], [4, 5, 6]
    filled(m, "a", a)
    filled(m, "b", b)
    m.release_sequence("a")                              # a's block cached first: least recent
    m.release_sequence("b")
    assert m.stats()["cached_blocks"] == 2
    old_a = m.pool.cache.block_of.copy()
    m.create_sequence("c")
    m.append_tokens("c", 6, [9, 9, 8, 8, 7, 7])          # 2 free + evicts one cached: a's
    assert m.prompt_cache_lookup(a) == 0 and m.prompt_cache_lookup(b) == 2
    assert len(m.pool.cache) == 4                       # b + c's three full blocks
    for h, blk in old_a.items():                         # a's stale hash no longer points anywhere
        if h not in m.pool.cache.block_of:
            assert blk in m.sequences["c"].block_table
    ok(m)


def test_hit_refreshes_lru_position():
    m = KVBlockManager(4, 2)
    filled(m, "a", [1, 2, 3])
    filled(m, "b", [4, 5, 6])
    m.release_sequence("a")
    m.release_sequence("b")
    filled(m, "a2", [1, 2, 3])                           # touch a's block
    m.release_sequence("a2")                             # now b's block is the oldest
    m.create_sequence("c")
    m.append_tokens("c", 6)
    assert m.prompt_cache_lookup([1, 2, 3]) == 2 and m.prompt_cache_lookup([4, 5, 6]) == 0


def test_forced_hash_collision_is_a_miss():
    m = KVBlockManager(8, 2, hash_fn=lambda parent, tokens: 7)   # every block collides
    filled(m, 1, [1, 2, 3])
    assert m.prompt_cache_lookup([1, 2, 3]) == 2
    assert m.prompt_cache_lookup([5, 6, 3]) == 0                  # same hash, other tokens
    assert m.create_sequence(2, [5, 6, 3]) == 0
    m.append_tokens(2, 3, [5, 6, 3])
    filled(m, 3, [1, 2, 5, 6, 7])                                 # second block collides with the first
    assert m.prompt_cache_lookup([1, 2, 5, 6, 7]) == 2
    ok(m)


def test_reset_prefix_cache():
    m = KVBlockManager(8, 4)
    filled(m, 1, list(range(9)))
    filled(m, 2, list(range(100, 109)))
    m.release_sequence(1)
    m.reset_prefix_cache()
    s = m.stats()
    assert s["cached_blocks"] == 0 and s["free_blocks"] == 5 and len(m.pool.cache) == 0
    assert m.prompt_cache_lookup(list(range(9))) == 0
    m.append_tokens(2, 8, list(range(8)))                # live sequence no longer registers blocks
    assert len(m.pool.cache) == 0
    ok(m)


def test_prefix_caching_disabled():
    m = KVBlockManager(8, 4, enable_prefix_caching=False)
    filled(m, 1, list(range(9)))
    assert m.prompt_cache_lookup(list(range(9))) == 0 and m.create_sequence(2, list(range(9))) == 0


# ---------------------------------------------------------------- fork
def test_fork_copies_partial_last_block():
    m = KVBlockManager(8, 4)
    filled(m, 1, list(range(6)))
    parent = list(m.sequences[1].block_table)
    pairs = m.fork(1, 2)
    child = list(m.sequences[2].block_table)
    assert child[0] == parent[0] and child[1] != parent[1]
    assert pairs == [(parent[1], child[1])]
    assert m.pool.ref_count[parent[0]] == 2 and m.pool.ref_count[child[1]] == 1
    s1, s2 = m.append_token(1, 6), m.append_token(2, 6)
    assert s1 != s2 and s1 // 4 == parent[1] and s2 // 4 == child[1]
    # both children keep hashing their own content
    m.append_tokens(2, 1, [7])
    assert m.prompt_cache_lookup(list(range(8)) + [0]) == 8
    ok(m)
    m.release_sequence(1)
    assert m.pool.ref_count[parent[0]] == 1
    ok(m)


def test_fork_at_block_boundary_copies_nothing():
    m = KVBlockManager(8, 4)
    filled(m, 1, list(range(8)))
    assert m.fork(1, 2) == []
    assert list(m.sequences[1].block_table) == list(m.sequences[2].block_table)
    a, b = m.append_token(1), m.append_token(2)
    assert a // 4 != b // 4
    ok(m)


def test_fork_out_of_blocks():
    m = KVBlockManager(2, 4)
    filled(m, 1, list(range(6)))
    before = m.debug_state()
    with pytest.raises(OutOfBlocksError):
        m.fork(1, 2)
    assert m.debug_state() == before
