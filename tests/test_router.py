"""Router: prefix overlap (exact: the pools' own index; approximate: routing history) against load,
and batch slots (a full chain only when all are full)."""
from __future__ import annotations

import random

from metadata_service.router import Router


def test_a_chain_with_free_batch_slots_wins_over_a_full_one():
    """Blocks alone would put more short prompts on some chains than their batch slots hold; with
    slots counted every chain gets exactly its share, and only then does any chain go over."""
    rng = random.Random(0)
    router = Router("prefix", block_size=16)
    for cid in (1, 2, 3, 4):
        router.add_chain(cid, num_blocks=50_000, max_sequences=256)
    counts = {cid: 0 for cid in (1, 2, 3, 4)}
    for _ in range(1024):
        prompt = [rng.randrange(1000, 150000) for _ in range(rng.randint(64, 256))]
        cid, _ = router.choose([1, 2, 3, 4], prompt, 128)
        counts[cid] += 1
    assert counts == {1: 256, 2: 256, 3: 256, 4: 256}
    cid, route = router.choose([1, 2, 3, 4], [5] * 40, 8)     # every chain full: the cheapest still
    assert cid in counts and route.load > 0


def test_without_a_slot_limit_blocks_decide():
    router = Router("least_loaded", block_size=16)
    router.add_chain(1, 1000)
    router.add_chain(2, 1000)
    a, route_a = router.choose([1, 2], list(range(160)), 0)    # 10 blocks on one chain
    b, _ = router.choose([1, 2], list(range(16)), 0)           # the next goes to the other
    assert a != b and route_a.load == 10
    router.done(a, route_a)
    c, _ = router.choose([1, 2], list(range(16)), 0)           # a's blocks came back: it is lighter now
    assert c == a


def test_exact_hashes_are_the_pools_own():
    """The exact policy names blocks as the chains' prefix caches do: after a sequence's prompt
    is appended, every full block before its last token is in the pool's index under the hash
    block_hashes gives, and a second manager that never saw the prompt has none of them."""
    from metadata_service.block_manager import KVBlockManager
    from metadata_service.router import block_hashes
    prompt = list(range(100, 181))                       # 81 ids: 5 full blocks of 16, the 5th the last
    m, other = KVBlockManager(64, 16), KVBlockManager(64, 16)
    m.create_sequence(1, prompt)
    m.append_tokens(1, len(prompt), prompt)
    hashes = block_hashes(prompt, 16)
    assert len(hashes) == 5 and all(h in m.pool.cache.block_of for h in hashes)
    assert not any(h in other.pool.cache.block_of for h in hashes)


def test_exact_routing_follows_what_each_pool_holds_now():
    """A prompt goes to the chain whose pool holds its prefix, read at the moment of the choice:
    once that pool evicts the blocks, the chain is no better than the others."""
    from metadata_service.router import block_hashes
    router = Router("exact", block_size=16)
    pools = {1: {}, 2: {}, 3: {}}
    for cid, pool in pools.items():
        router.add_chain(cid, 1000, 64, cached=pool)
    prompt = list(range(320))
    for i, h in enumerate(block_hashes(prompt, 16)):
        pools[2][h] = i                                   # chain 2 computed this prefix earlier
    cid, route = router.choose([1, 2, 3], prompt + [7, 8], 4)
    assert cid == 2 and route.load == -(-(322 + 4) // 16) - 19
    router.done(cid, route)
    pools[2].clear()                                      # evicted: the pool no longer has it
    cid, route = router.choose([1, 2, 3], prompt + [9], 4)
    assert route.load == -(-(321 + 4) // 16)              # charged the whole prompt, wherever it went
    pools[3].update((h, i) for i, h in enumerate(block_hashes(prompt, 16)))   # chain 3 computed it since
    router.done(cid, route)
    cid, _ = router.choose([1, 2, 3], prompt + [10], 4)
    assert cid == 3


def test_exact_routing_counts_blocks_routed_but_not_computed():
    """A request sharing a prefix with one routed a moment ago (nothing computed yet) is charged
    only its own blocks there, and goes there; when those sequences end their pending blocks are
    forgotten (from then on the pool's index alone says what is cached)."""
    router = Router("exact", block_size=16)
    for cid in (1, 2):
        router.add_chain(cid, 1000, 64, cached={})
    busy, busy_route = router.choose([1, 2], list(range(50_000, 51_600)), 0)   # 100 blocks on one chain
    other = 3 - busy
    system = list(range(1000, 1640))                      # 40 blocks
    a, ra = router.choose([1, 2], system + [1], 8)
    b, rb = router.choose([1, 2], system + [2, 3], 8)
    assert a == b == other and ra.load == 41 and rb.load == 41 - 40
    for cid, route in ((a, ra), (b, rb), (busy, busy_route)):
        router.done(cid, route)
    chain = router._chains[other]
    assert not chain.pending and chain.blocks == 0 and chain.sequences == 0


def test_a_prompt_block_to_compute_weighs_more_than_a_block_of_queue():
    """The chain holding a 40-block prompt has 60 blocks of queued work, another chain none: at
    overlap weight 1 the prompt goes to the idle chain (60 > 40) and is computed again; at the
    default (2) it stays where its blocks are, until the queue passes twice the prompt."""
    from metadata_service.router import block_hashes
    prompt = list(range(640))
    for weight, want in ((1.0, 1), (2.0, 2)):
        router = Router("exact", block_size=16, overlap_weight=weight)
        pools = {1: {}, 2: {h: i for i, h in enumerate(block_hashes(prompt + [0], 16))}}
        for cid, pool in pools.items():
            router.add_chain(cid, 1000, 64, cached=pool)
        router.choose([2], list(range(9000, 9960)), 0)                       # 60 blocks queued on chain 2
        assert router.choose([1, 2], prompt + [1], 0)[0] == want


def test_a_request_the_pools_outgrew_ends_with_an_error_instead_of_waiting_forever():
    """Admission checks a request against the pools of its time. One restored from the job store,
    or rerouted after its chain was lost, may find only smaller pools (a worker replaced by one with
    --num-blocks 3): it ends RESOURCE_EXHAUSTED rather than wait forever (found by probing)."""
    from types import SimpleNamespace

    from metadata_service.sequence import SamplingParams, Sequence
    from metadata_service.sequence_routing import SequenceRouting

    class Engine(SequenceRouting):
        block_size = 16
    chain = SimpleNamespace(manager=SimpleNamespace(pool=SimpleNamespace(num_blocks=3)))
    small = Sequence([1] * 4, SamplingParams(max_new_tokens=40))      # 44 tokens: 3 blocks
    large = Sequence([1] * 4, SamplingParams(max_new_tokens=60))      # 64 tokens: 4 blocks
    fit, never = Engine()._fitting([small, large], [chain])
    assert fit == [(small, 3)] and never == [(large, 4, 3)]


def test_a_request_goes_only_to_a_replica_whose_pool_can_hold_it():
    """Replicas with pools of 100 and 10 blocks: a 15-block request on the small one was preempted
    and requeued forever while the large one idled (found by probing)."""
    import threading
    from types import SimpleNamespace

    from metadata_service.sequence import SamplingParams, Sequence
    from metadata_service.sequence_routing import SequenceRouting

    got: dict[int, list] = {1: [], 2: []}

    def chain(cid, blocks):
        return SimpleNamespace(chain_id=cid, alive=True, role="both", add=got[cid].append,
                               manager=SimpleNamespace(pool=SimpleNamespace(num_blocks=blocks)))

    class Engine(SequenceRouting):
        block_size = 4
    engine = Engine()
    engine.route_lock, engine.parked = threading.Lock(), []
    engine.chains = {1: chain(1, 100), 2: chain(2, 10)}
    engine.router = Router("exact", block_size=4)
    for cid, blocks in ((1, 100), (2, 10)):
        engine.router.add_chain(cid, num_blocks=blocks, max_sequences=64)
    engine._route([Sequence([7, i] * 15, SamplingParams(max_new_tokens=30)) for i in range(6)])   # 15 blocks
    assert len(got[1]) == 6 and got[2] == []
    engine._route([Sequence([9, i], SamplingParams(max_new_tokens=6)) for i in range(6)])          # 2 blocks
    assert got[2]                                                   # small ones may still go there
