"""The second KV tier end to end: workers with --kv-tier-bytes behind a pool too small for the
workload, float64, every token checked against Hugging Face transformers. A conversation's earlier
turn is evicted from the pool and its next turn loads it from the tier; preempted sequences come
back through the tier (swap out, swap in); a worker killed while steps carry tier moves loses
nothing but cache."""
from __future__ import annotations

import signal
import time

import pytest

from client import LocalCluster
from tests.test_e2e import ckpt, load_oracle_ignore_eos, prompts, settle  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow
BLOCK = 4
TIER_BYTES = 1 << 20          # 128+ blocks of the 4-layer test model: the whole workload fits


def _cluster(ckpt, workers, policy, num_blocks=16):
    return LocalCluster(model=ckpt, workers=workers, dtype="float64", block_size=BLOCK, num_blocks=num_blocks,
                        extra_worker_args=["--kv-tier-bytes", str(TIER_BYTES)],
                        extra_service_args=["--kv-tier-policy", policy])


def _run(client, ckpt, batch, n):
    job = client.submit([{"prompt_token_ids": p, "max_new_tokens": n, "ignore_eos": True} for p in batch])
    results = client.wait(job)
    for p, r in zip(batch, results):
        assert r.token_ids == load_oracle_ignore_eos(ckpt, p, n), f"prompt {p}"
    return [r.token_ids for r in results]


@pytest.mark.parametrize("workers,policy", [(1, "write-back"), (2, "write-through")])
def test_next_turn_loads_the_evicted_history_from_the_tier(ckpt, workers, policy):
    with _cluster(ckpt, workers, policy) as c:
        first = prompts(1, 30, 30, seed=21)[0]                  # 7 full blocks of 4
        out = _run(c.client, ckpt, [first], 8)[0]
        for p in prompts(3, 50, 56, seed=22):                   # each fills the 16-block pool: evicts ours
            _run(c.client, ckpt, [p], 4)
        before = c.client.stats()
        second = first + out + [7, 8, 9, 10, 11]
        _run(c.client, ckpt, [second], 8)
        st = settle(c.client)
        assert st.tier_blocks > 0 and st.invariants_ok
        assert st.tier_hits - before.tier_hits >= 9, "the history's 9+ full blocks come from the tier"
        assert st.tier_loaded_blocks > before.tier_loaded_blocks and st.tier_saved_blocks > 0


@pytest.mark.parametrize("workers", [1, 2])
def test_preempted_sequences_swap_out_and_back_in_through_the_tier(ckpt, workers):
    # 20 blocks of 4 tokens for 8 sequences of up to 30 + 32 tokens: some must be preempted, and their
    # full blocks, evicted while they wait, come back from the tier
    with _cluster(ckpt, workers, "write-back", num_blocks=20) as c:
        batch = prompts(8, 14, 30, seed=8)
        _run(c.client, ckpt, batch, 32)
        st = settle(c.client)
        assert st.preemptions > 0, "the pool was meant to force preemption"
        assert st.tier_hits > 0 and st.invariants_ok


def test_a_worker_killed_while_steps_carry_tier_moves_loses_only_cache(ckpt):
    with _cluster(ckpt, 2, "write-through") as c:
        batch = prompts(6, 20, 40, seed=31)
        _run(c.client, ckpt, batch[:2], 6)                      # the tier holds something
        job = c.client.submit([{"prompt_token_ids": p, "max_new_tokens": 24, "ignore_eos": True} for p in batch])
        time.sleep(0.5)                                         # mid-job: write-through saves every step
        c.kill_worker(1, signal.SIGKILL)
        c.restart_worker(1)
        results = c.client.wait(job)
        for p, r in zip(batch, results):
            assert r.token_ids == load_oracle_ignore_eos(ckpt, p, 24)
        st = settle(c.client)
        assert st.invariants_ok and st.free_blocks == st.num_blocks
