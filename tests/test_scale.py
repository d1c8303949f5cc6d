"""Scale-out, end to end: pipelined micro-batches, replicas with routing, async scheduling, the loss
of a replica mid-job, and simulated workers. Tokens are checked against transformers in float64;
after each run every block of every pool is free and every invariant holds."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import time

import pytest

from client import LocalCluster
from tests.test_e2e import EOS, VOCAB, ckpt, oracle, prompts, settle  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow


def exact_job(client, oracle, batch, n):
    job = client.submit([{"prompt_token_ids": p, "max_new_tokens": n} for p in batch])
    results = client.wait(job, timeout=300)
    for p, r in zip(batch, results):
        assert r.token_ids == oracle(p, n), f"prompt {p}"


def settle_all(client):
    st = settle(client)
    for ch in st.chains:
        assert ch["invariants_ok"] and int(ch["free_blocks"]) == int(ch["num_blocks"]), ch
    return st


def test_three_stages_keep_nine_micro_batches_in_flight_exactly(ckpt, oracle):
    """More micro-batches than stages, each with its next step sent ahead (async scheduling: stage 0
    embeds the -1 inputs from the last stage's tokens), still gives transformers' tokens."""
    # 4 layers over 3 stages; a small per-step budget so prompts are chunked across micro-batches
    with LocalCluster(model=ckpt, workers=3, dtype="float64", block_size=4,
                      extra_service_args=["--max-num-batched-tokens", "24", "--micro-batches", "9"]) as c:
        exact_job(c.client, oracle, prompts(20, 1, 40, seed=31), 10)
        st = settle_all(c.client)
        (chain,) = st.chains
        assert chain["micro_batches"] == 9 and len(chain["stages"]) == 3   # more than the default (4)
        assert all(s["busy_fraction"] > 0 for s in chain["stages"])


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_cpu_pipelines_overlap_steps_exactly(ckpt, oracle, micro_batches):
    """CPU stages keep N micro-batches (the default here: 2) with async scheduling across the chain:
    a micro-batch's next step goes out before its tokens are back (inputs -1), and stage 0 fills
    them in from the replies, which come back up the chain. One micro-batch once hung: stage 0
    never saw the tokens it was to fill in."""
    extra = ["--max-num-batched-tokens", "24"] + (["--micro-batches", "1"] if micro_batches == 1 else [])
    with LocalCluster(model=ckpt, workers=2, dtype="float64", block_size=4, extra_service_args=extra) as c:
        exact_job(c.client, oracle, prompts(14, 1, 40, seed=33), 12)
        st = settle_all(c.client)
        assert st.chains[0]["micro_batches"] == micro_batches


@pytest.mark.parametrize("replicas", [2, 3])
def test_replicas_share_the_work_exactly(ckpt, oracle, replicas):
    with LocalCluster(model=ckpt, workers=1, replicas=replicas, dtype="float64") as c:
        st = c.client.stats()
        assert st.num_chains == replicas and st.standby_workers == 0
        batch = prompts(8 * replicas, 1, 30, seed=40 + replicas)
        exact_job(c.client, oracle, batch, 8)
        # shared system prompts: requests that share one go to the chain that has it cached
        systems = prompts(replicas, 33, 33, seed=50)
        shared = [s + p for s in systems for p in prompts(6, 1, 6, seed=51)]
        random.Random(1).shuffle(shared)
        exact_job(c.client, oracle, shared, 4)
        st = settle_all(c.client)
        assert all(int(ch["steps"]) > 0 for ch in st.chains), "every replica must have run some steps"
        assert st.prefix_cache_hits > 0


def test_a_lost_replica_recomputes_elsewhere_and_rejoins(ckpt, oracle):
    with LocalCluster(model=ckpt, workers=1, replicas=2, dtype="float64",
                      extra_service_args=["--max-num-seqs", "3"]) as c:
        batch = prompts(16, 4, 30, seed=61)
        job = c.client.submit([{"prompt_token_ids": p, "max_new_tokens": 24} for p in batch])
        deadline = time.monotonic() + 60
        while c.client.get_job(job).completed < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        c.kill_worker(0)                                  # replica 0 goes away mid-job
        results = c.client.wait(job, timeout=300)
        for p, r in zip(batch, results):
            assert r.token_ids == oracle(p, 24) and not r.error
        assert c.client.stats().num_chains == 1
        c.restart_worker(0)                               # it comes back and rejoins as a replica
        deadline = time.monotonic() + 60
        while c.client.stats().num_chains != 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        exact_job(c.client, oracle, prompts(6, 1, 20, seed=62), 6)
        settle_all(c.client)


@pytest.mark.parametrize("workers", [1, 2])
def test_seeded_sampling_is_the_same_with_and_without_async_scheduling(ckpt, workers):
    """Token i of a seeded request uses randomness (seed, i) however the steps were scheduled."""
    reqs = [{"prompt_token_ids": p, "max_new_tokens": 16, "temperature": 1.0, "top_k": 20, "seed": 7 + i,
             "ignore_eos": True} for i, p in enumerate(prompts(6, 2, 20, seed=81))]
    outs = []
    for extra in ([], ["--no-async-scheduling"]):
        with LocalCluster(model=ckpt, workers=workers, dtype="float64", extra_service_args=extra) as c:
            outs.append([r.token_ids for r in c.client.wait(c.client.submit(reqs))])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("workers", [1, 2])
def test_stop_strings_and_cancels_race_the_overlap(ckpt, oracle, workers):
    """With async scheduling one extra token may be computed after a stop; it is never returned."""
    with LocalCluster(model=ckpt, workers=workers, dtype="float64") as c:
        cl = c.client
        prompt = [40, 41, 42, 43, 44]
        full = cl.generate(prompt_token_ids=prompt, max_new_tokens=30, ignore_eos=True)
        # stop strings that end at different steps; the first, 5 characters long, matches at the very
        # start of the output (it once leaked length-3 characters into the stream)
        for k, n in ((0, 5), (1, 3), (4, 3), (9, 3)):
            stop = full.text[k:k + n]
            r = cl.generate(prompt_token_ids=prompt, max_new_tokens=30, ignore_eos=True, stop=[stop])
            streamed = "".join(ch.text for ch in cl.stream(prompt_token_ids=prompt, max_new_tokens=30,
                                                           ignore_eos=True, stop=[stop]))
            job = cl.wait(cl.submit([{"prompt_token_ids": prompt, "max_new_tokens": 30, "ignore_eos": True,
                                      "stop": [stop]}]))[0]
            assert r.text == streamed == job.text == full.text[:full.text.index(stop)]
            assert r.token_ids == job.token_ids == full.token_ids[:len(r.token_ids)]
        stop_tok = full.token_ids[3]                       # a stop token: the stream ends there exactly
        r = cl.generate(prompt_token_ids=prompt, max_new_tokens=30, ignore_eos=True, stop_token_ids=[stop_tok])
        assert r.token_ids == full.token_ids[:full.token_ids.index(stop_tok) + 1]

        def cancel_early(p):
            it = cl.stream(prompt_token_ids=p, max_new_tokens=200, ignore_eos=True)
            got = next(it).token_ids + next(it).token_ids
            it.close()
            return got
        batch = prompts(12, 1, 20, seed=71)
        with cf.ThreadPoolExecutor(12) as pool:
            for p, got in zip(batch, pool.map(cancel_early, batch)):
                assert got == oracle(p, len(got))[:len(got)] or EOS in got
        settle_all(cl)


QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "eos_token_id": 151645}


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    """A checkpoint directory with config.json and nothing else: a simulated worker needs no weights."""
    d = tmp_path_factory.mktemp("qwen3-8b-config")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(QWEN3_8B, f)
    return str(d)


def test_simulated_workers_are_deterministic_across_layouts(config_only, tmp_path):
    fast = tmp_path / "fast.json"
    fast.write_text(json.dumps({"fixed_step_s": 0.002}))
    reqs = [{"prompt_token_ids": list(range(1000 + i, 1000 + i + 40 + 7 * i)), "max_new_tokens": 12}
            for i in range(10)] + [{"prompt_token_ids": [5, 6, 7], "max_new_tokens": 12, "temperature": 0.8,
                                   "seed": 3}]
    outs = []
    for stages, replicas in ((1, 1), (2, 2)):
        with LocalCluster(model=config_only, workers=stages, replicas=replicas, simulate=str(fast),
                          dtype=None) as c:
            st = c.client.stats()
            assert st.num_chains == replicas and st.num_blocks >= 40_000 * replicas  # (141 GB x 0.9 - weights) / 2.4 MB a block
            outs.append([r.token_ids for r in c.client.wait(c.client.submit(reqs))])
            assert all(len(t) == 12 and 151645 not in t for t in outs[-1])
            settle_all(c.client)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("router, hits", [("exact", 40), ("round_robin", 0)])
def test_exact_routing_sends_a_prompt_where_its_prefix_is_cached(config_only, tmp_path, router, hits):
    """Three requests sharing a 20-block system prompt, one after another, over 3 replicas: the
    exact router reads each chain's prefix cache and sends the second and third where the first
    left its blocks (20 hits each); round-robin spreads them over the three pools (none)."""
    fast = tmp_path / "fast.json"
    fast.write_text(json.dumps({"fixed_step_s": 0.002}))
    system = list(range(2000, 2000 + 16 * 20))
    with LocalCluster(model=config_only, workers=1, replicas=3, simulate=str(fast), dtype=None,
                      extra_service_args=["--router", router]) as c:
        for i in range(3):
            c.client.generate(prompt_token_ids=system + [7 + i], max_new_tokens=2)
        st = c.client.stats()
    assert st.num_chains == 3 and st.prefix_cache_hits == hits


def test_more_open_streams_than_the_old_thread_pool_keep_the_chain(config_only, tmp_path):
    """A sync gRPC server holds a thread per open Generate stream. With a fixed pool of 128, the
    129th stream on left the worker's heartbeat queued until its lease ran out: the chain was
    dropped under the requests it was serving, and they waited for a chain that could not register.
    The pool is sized from --max-waiting now: 160 streams of 5 s (longer than the 4 s lease) all end."""
    import asyncio

    from client import AsyncClient
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps({"fixed_step_s": 0.02}))
    with LocalCluster(model=config_only, workers=1, simulate=str(slow), dtype=None,
                      extra_service_args=["--max-waiting", "200"]) as c:
        async def run():
            async with AsyncClient(c.address) as ac:
                return await asyncio.gather(*(ac.generate(prompt_token_ids=[1000 + i, 7, 8], max_new_tokens=250,
                                                          ignore_eos=True) for i in range(160)))
        results = asyncio.run(run())
        st = c.client.stats()
    assert [len(r.token_ids) for r in results] == [250] * 160
    assert st.num_chains == 1 and st.preemptions == 0
