"""Router: prefix overlap against load, and batch slots (a full chain only when all are full)."""
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
    cid, load = router.choose([1, 2, 3, 4], [5] * 40, 8)      # every chain full: the cheapest still
    assert cid in counts and load > 0


def test_without_a_slot_limit_blocks_decide():
    router = Router("least_loaded", block_size=16)
    router.add_chain(1, 1000)
    router.add_chain(2, 1000)
    a, load_a = router.choose([1, 2], list(range(160)), 0)     # 10 blocks on one chain
    b, _ = router.choose([1, 2], list(range(16)), 0)           # the next goes to the other
    assert a != b and load_a == 10
    router.done(a, load_a)
    c, _ = router.choose([1, 2], list(range(16)), 0)           # a's blocks came back: it is lighter now
    assert c == a
