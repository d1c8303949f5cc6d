"""Disaggregated prefill/decode end to end (docs/architecture.md section 9): prefill workers and
decode workers (--role) in separate chains, float64, every token checked against Hugging Face
transformers. Prompts run on the prefill chain; their K/V move to the decode chain, which generates;
a prefill worker killed while moves are in flight loses nothing but cache (the moves that fail
recompute on the decode chain)."""
from __future__ import annotations

import signal
import time

import pytest

from client import LocalCluster
from tests.test_e2e import ckpt, load_oracle_ignore_eos, prompts, settle  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow
BLOCK = 4


def _cluster(ckpt, workers, num_blocks=64, lease_s=4.0, part_bytes=0):
    return LocalCluster(model=ckpt, workers=workers, replicas=2, roles=["prefill", "decode"], dtype="float64",
                        block_size=BLOCK, num_blocks=num_blocks,
                        extra_service_args=["--worker-lease", lease_s, "--kv-move-part-bytes", part_bytes])


def _check(client, ckpt, batch, n):
    job = client.submit([{"prompt_token_ids": p, "max_new_tokens": n, "ignore_eos": True} for p in batch])
    for p, r in zip(batch, client.wait(job)):
        assert r.token_ids == load_oracle_ignore_eos(ckpt, p, n), f"prompt {p}"


def _roles(st) -> dict:
    return {c["role"]: c for c in st.chains}


@pytest.mark.parametrize("workers,part_bytes", [(1, 0), (2, 1)])
def test_prompts_prefill_on_one_chain_and_decode_on_the_other(ckpt, workers, part_bytes):
    # part_bytes 1: every block moves in a Step of its own, between the decode steps
    with _cluster(ckpt, workers, part_bytes=part_bytes) as c:
        batch = prompts(6, 9, 30, seed=41)
        _check(c.client, ckpt, batch, 12)
        st = settle(c.client)
        chains = _roles(st)
        assert set(chains) == {"prefill", "decode"}, st.chains
        full = sum(len(p) // BLOCK for p in batch)
        assert st.kv_moves == len(batch) and st.kv_move_failures == 0
        assert st.kv_moved_blocks == full, "every full prompt block moves once"
        assert int(chains["decode"]["generated_tokens"]) > int(chains["prefill"]["generated_tokens"])
        assert st.invariants_ok and st.free_blocks == st.num_blocks, "holds are released on both ends"
        # the same prompts again: the decode chain has their blocks, nothing moves but the count
        _check(c.client, ckpt, batch[:2], 6)
        st2 = settle(c.client)
        assert st2.kv_moves == st.kv_moves + 2 and st2.kv_moved_blocks == st.kv_moved_blocks


def test_moves_from_a_prefill_worker_that_died_recompute_on_the_decode_chain(ckpt):
    # the decode worker is paused, so the moves wait in its pipe while the prefill worker dies and
    # comes back (another epoch): every move then fails, and its request recomputes exactly
    with _cluster(ckpt, 1, lease_s=30.0) as c:
        decode = c.processes[2]                           # worker 1: the decode chain
        batch = prompts(4, 20, 40, seed=47)
        decode.send_signal(signal.SIGSTOP)
        try:
            job = c.client.submit([{"prompt_token_ids": p, "max_new_tokens": 8, "ignore_eos": True} for p in batch])
            deadline = time.monotonic() + 60
            while _roles(c.client.stats())["prefill"]["generated_tokens"] in (0, "0"):
                assert time.monotonic() < deadline, "the prefill chain never sampled"
                time.sleep(0.05)
            time.sleep(0.5)                               # every prompt prefilled and handed over
            c.kill_worker(0, signal.SIGKILL)
            c.restart_worker(0, wait=False)
        finally:
            decode.send_signal(signal.SIGCONT)
        for p, r in zip(batch, c.client.wait(job)):
            assert r.token_ids == load_oracle_ignore_eos(ckpt, p, 8)
        st = settle(c.client)
        assert st.kv_move_failures == len(batch) and st.kv_moves == 0, (st.kv_moves, st.kv_move_failures)
        assert st.invariants_ok and st.free_blocks == st.num_blocks


def test_a_prefill_worker_killed_mid_job_loses_only_cache(ckpt):
    with _cluster(ckpt, 1) as c:
        batch = prompts(8, 20, 40, seed=43)
        job = c.client.submit([{"prompt_token_ids": p, "max_new_tokens": 16, "ignore_eos": True} for p in batch])
        time.sleep(0.4)                                   # mid-job (the paused test above makes moves fail for sure)
        c.kill_worker(0, signal.SIGKILL)                  # worker 0 is the prefill chain's
        c.restart_worker(0)
        for p, r in zip(batch, c.client.wait(job)):
            assert r.token_ids == load_oracle_ignore_eos(ckpt, p, 16)
        st = settle(c.client)
        assert st.invariants_ok and st.free_blocks == st.num_blocks
