"""End to end: metadata service + worker processes on loopback, float64, checked token for token
against Hugging Face transformers' `generate` on the same checkpoint (docs/architecture.md section 6)."""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import random
import time

import pytest
import torch

from client import LocalCluster
from tests.checkpoints import load_oracle, make_checkpoint

pytestmark = pytest.mark.slow
VOCAB = 96
EOS = 1


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # 4 layers so two workers split them; GQA 2; untied head; eos id 1 (the service stops on it)
    return make_checkpoint(num_layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, tie=False,
                           vocab=VOCAB, seed=7, directory=str(tmp_path_factory.mktemp("ckpt")))


@pytest.fixture(scope="module")
def oracle(ckpt):
    model = load_oracle(ckpt, torch.float64)
    cache = {}

    def generate(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                     eos_token_id=EOS, pad_token_id=EOS)
            toks = out[0, len(prompt):].tolist()
            if EOS in toks:  # HF pads after EOS; we stop at it (and keep it)
                toks = toks[:toks.index(EOS) + 1]
            cache[key] = toks
        return cache[key]
    return generate


def prompts(n, lo, hi, seed, prefix=()):
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(2, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def settle(client, timeout=30.0):
    """Wait for the engine to drain, then check nothing leaked."""
    end = time.monotonic() + timeout
    while True:
        st = client.stats()
        if st.running == 0 and st.waiting == 0:
            break
        assert time.monotonic() < end, st
        time.sleep(0.05)
    assert st.invariants_ok
    assert st.free_blocks == st.num_blocks, f"leaked blocks: {st.free_blocks} free of {st.num_blocks}"
    return st


def check_job(client, oracle, batch, n):
    job = client.submit([{"prompt_token_ids": p, "max_new_tokens": n} for p in batch])
    results = client.wait(job)
    assert len(results) == len(batch)
    for p, r in zip(batch, results):
        assert r.token_ids == oracle(p, n), f"prompt {p}"
        assert r.finish_reason == ("stop" if r.token_ids[-1:] == [EOS] else "length")


@pytest.fixture(scope="module")
def one_worker(ckpt):
    with LocalCluster(model=ckpt, workers=1, dtype="float64", block_size=16) as c:
        yield c


@pytest.fixture(scope="module")
def two_workers(ckpt):
    # block size 1 and an 8-token budget: every prompt is chunked over several steps
    with LocalCluster(model=ckpt, workers=2, dtype="float64", block_size=1,
                      extra_service_args=["--max-num-batched-tokens", "8"]) as c:
        yield c


def test_e2e_one_worker_matches_transformers(one_worker, oracle):
    check_job(one_worker.client, oracle, prompts(12, 1, 40, seed=1), 10)
    settle(one_worker.client)


def test_e2e_prompts_of_length_one(one_worker, oracle):
    check_job(one_worker.client, oracle, [[5], [17], [90]], 8)
    settle(one_worker.client)


def test_e2e_shared_prefixes_hit_the_cache(one_worker, oracle):
    before = one_worker.client.stats().prefix_cache_hits
    shared = prompts(1, 40, 40, seed=3)[0]
    batch = prompts(6, 1, 10, seed=4, prefix=shared)
    check_job(one_worker.client, oracle, batch[:1], 6)        # fills the cache
    check_job(one_worker.client, oracle, batch[1:], 6)        # reuses its full blocks
    st = settle(one_worker.client)
    assert st.prefix_cache_hits > before


def test_e2e_seeded_sampling_is_reproducible(one_worker):
    c = one_worker.client
    req = dict(prompt_token_ids=[3, 4, 5, 6], max_new_tokens=12, temperature=0.9, top_p=0.95, top_k=40, seed=1234)
    alone = c.generate(**req).token_ids
    others = [dict(prompt_token_ids=p, max_new_tokens=12, temperature=1.0, seed=i)
              for i, p in enumerate(prompts(5, 1, 30, seed=9))]
    job = c.submit(others[:2] + [req] + others[2:])
    mixed = c.wait(job)[2].token_ids
    assert alone == mixed == c.generate(**req).token_ids
    settle(c)



def test_e2e_every_int64_seed_is_its_own(one_worker):
    """seed and seed + 2^63 once aliased (the service kept 63 bits); the whole int64 range counts,
    as in vLLM, for the request's choice and for its other choices (n = 2)."""
    c = one_worker.client
    req = dict(prompt_token_ids=[3, 4, 5, 6], max_new_tokens=12, temperature=1.0, n=2)
    for low in (-1, -12345, -2**63):
        a, b = ([x.token_ids for x in c.generate(**req, seed=s).choices] for s in (low, low + 2**63))
        assert a[0] != b[0] and a[1] != b[1]
        assert a == [x.token_ids for x in c.generate(**req, seed=low).choices]
    settle(c)

def test_e2e_two_workers_chunked_prefill_block_size_1(two_workers, oracle):
    check_job(two_workers.client, oracle, prompts(6, 1, 30, seed=5), 8)
    st = settle(two_workers.client)
    assert st.num_workers == 2 and st.block_size == 1


def test_e2e_32_concurrent_streams(two_workers, oracle):
    batch = prompts(32, 1, 20, seed=6)

    def run(p):
        chunks = list(two_workers.client.stream(prompt_token_ids=p, max_new_tokens=6))
        return [t for ch in chunks for t in ch.token_ids], chunks[-1].finish_reason

    with cf.ThreadPoolExecutor(32) as pool:
        outs = list(pool.map(run, batch))
    for p, (toks, reason) in zip(batch, outs):
        assert toks == oracle(p, 6)
        assert reason in ("stop", "length")
    settle(two_workers.client)


def test_e2e_pipeline_preempts_while_its_tokens_are_in_flight(ckpt):
    # Two stages, async scheduling (inputs -1), a pool where the longest sequence needs every block:
    # sequences are preempted while steps that sample them are still downstream, and come back
    # under the same id. Their old tokens must not become the new run's input -1, and the two
    # micro-batches must not take turns preempting each other's oldest (it once took thousands).
    with LocalCluster(model=ckpt, workers=2, dtype="float64", block_size=4, num_blocks=16) as c:
        batch = prompts(6, 20, 40, seed=31)
        job = c.client.submit([{"prompt_token_ids": p, "max_new_tokens": 24, "ignore_eos": True} for p in batch])
        results = c.client.wait(job)
        assert [r.token_ids for r in results] == [load_oracle_ignore_eos(ckpt, p, 24) for p in batch]
        st = settle(c.client)
        assert 0 < st.preemptions < 60, st.preemptions


def test_e2e_preemption_under_a_tiny_pool(ckpt, oracle):
    # 24 blocks of 4 tokens for 8 sequences of up to 30 + 12 tokens: some must be preempted
    with LocalCluster(model=ckpt, workers=2, dtype="float64", block_size=4, num_blocks=24) as c:
        batch = prompts(8, 14, 30, seed=8)
        job = c.client.submit([{"prompt_token_ids": p, "max_new_tokens": 12, "ignore_eos": True} for p in batch])
        results = c.client.wait(job)
        hf = [load_oracle_ignore_eos(ckpt, p, 12) for p in batch]
        assert [r.token_ids for r in results] == hf
        st = settle(c.client)
        assert st.preemptions > 0, "the pool was meant to force preemption"
        from client.errors import ResourceExhausted
        with pytest.raises(ResourceExhausted, match="24"):   # 90 + 20 tokens > 24 blocks x 4: never fits
            c.client.generate(prompt_token_ids=[5] * 90, max_new_tokens=20)
        assert settle(c.client).free_blocks == 24


def load_oracle_ignore_eos(ckpt, prompt, n, _cache={}):
    """Plain greedy decoding with the HF model, no EOS rule at all (the request sets ignore_eos)."""
    if ckpt not in _cache:
        _cache[ckpt] = load_oracle(ckpt, torch.float64)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            nxt = _cache[ckpt](ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


def test_e2e_stop_strings_stop_tokens_and_logprobs(one_worker):
    c = one_worker.client
    prompt = [40, 41, 42, 43, 44]
    full = c.generate(prompt_token_ids=prompt, max_new_tokens=24, ignore_eos=True, return_logprobs=True)
    assert len(full.token_ids) == 24 and len(full.logprobs) == 24
    assert all(lp <= 0.0 for lp in full.logprobs)
    # a stop token id: generation ends at its first occurrence, and keeps it
    stop_tok = full.token_ids[5]
    r = c.generate(prompt_token_ids=prompt, max_new_tokens=24, ignore_eos=True, stop_token_ids=[stop_tok])
    assert r.token_ids == full.token_ids[:full.token_ids.index(stop_tok) + 1] and r.finish_reason == "stop"
    # a stop string: the text is cut before it, streamed text never shows it
    stop = full.text[8:11]
    r = c.generate(prompt_token_ids=prompt, max_new_tokens=24, ignore_eos=True, stop=[stop])
    assert r.finish_reason == "stop" and r.text == full.text[:full.text.index(stop)]
    assert full.token_ids[:len(r.token_ids)] == r.token_ids
    streamed = "".join(ch.text for ch in c.stream(prompt_token_ids=prompt, max_new_tokens=24, ignore_eos=True,
                                                  stop=[stop]))
    assert streamed == r.text
    # a stop string that never matches: runs to the length limit
    r = c.generate(prompt_token_ids=prompt, max_new_tokens=6, stop=["\x00never\x00"], ignore_eos=True)
    assert r.finish_reason == "length" and len(r.token_ids) == 6
    settle(c)


def test_e2e_admission_errors_leave_nothing_behind(one_worker):
    from client.errors import InvalidArgument
    c = one_worker.client
    before = c.stats()
    with pytest.raises(InvalidArgument, match="max_model_len"):
        c.generate(prompt_token_ids=[5] * 500, max_new_tokens=100)     # 600 > 512 positions
    with pytest.raises(InvalidArgument, match="max_new_tokens"):
        c.generate(prompt_token_ids=[5], max_new_tokens=0)
    with pytest.raises(InvalidArgument, match=r"\[0, 96\)"):
        c.generate(prompt_token_ids=[500], max_new_tokens=2)
    with pytest.raises(InvalidArgument, match="empty"):
        c.generate(prompt_token_ids=[], max_new_tokens=2)
    with pytest.raises(InvalidArgument, match="byte-level fallback tokenizer needs vocab_size >= 256"):
        c.generate(prompt="hi", max_new_tokens=2)                        # vocab 96, no tokenizer files
    with pytest.raises(InvalidArgument):
        c.submit([{"prompt_token_ids": [5], "max_new_tokens": 2}, {"prompt_token_ids": [5], "top_p": 2.0}])
    with pytest.raises(InvalidArgument, match="top_k must be -1 or 0"):
        c.generate(prompt_token_ids=[5], max_new_tokens=2, top_k=-2)
    # top_k -1 is "off" (vLLM's spelling), as over HTTP: the same draws as 0
    seeded = dict(prompt_token_ids=[5, 6], max_new_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    assert c.generate(top_k=-1, **seeded).token_ids == c.generate(top_k=0, **seeded).token_ids
    # a batch: the first failure cancels the others' RPCs at once (it waited for their single final chunk)
    for batch in (c.generate, lambda items, **kw: asyncio.run(_agenerate(one_worker.address, items, **kw))):
        with pytest.raises(InvalidArgument, match=r"\[0, 96\)"):
            batch([[5, 6, 7], [1, 500]], max_new_tokens=400, ignore_eos=True)
        assert c.stats().generated_tokens - before.generated_tokens < 200
    after = c.stats()
    assert (after.free_blocks, after.running, after.waiting) == (before.free_blocks, 0, 0)


async def _agenerate(address, items, **kw):
    from client import AsyncClient
    async with AsyncClient(address) as ac:
        return await ac.generate(items, **kw)
