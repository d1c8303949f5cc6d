"""Prompt logprobs (issue 23): every prompt token's logprob given the tokens before it, as
evaluation harnesses ask for it. In float64 each one equals log_softmax of transformers' forward on
the same checkpoint to 1e-10, on 1 and 2 stages, across chunked prefill, with a cached prefix
present, through the SDK, jobs, streams and the OpenAI API (`echo` + `logprobs`)."""
from __future__ import annotations

import random

import numpy as np
import openai
import pytest
import torch

from client import LocalCluster
from client.errors import InvalidArgument
from metadata_service import prompt_logprobs as mplp
from minipaged import wire
from minipaged.v1 import worker_pb2
from tests.checkpoints import load_oracle, make_checkpoint
from worker import prompt_logprobs as wplp

VOCAB = 320
TOL = 1e-10
BUDGET = ["--max-num-batched-tokens", "16"]   # prompts past 16 tokens prefill in several chunks


# ---------------------------------------------------------------- in process: the worker's rows

def _step(counts, targets, k=0, qlens=(5, 3)):
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    req = worker_pb2.StepRequest(prompt_logprob_rows=wire.pack(counts), prompt_logprob_targets=wire.pack(targets),
                                 prompt_top_logprobs=k)
    return req, qsl


def test_rows_are_each_sequences_leading_query_rows():
    req, qsl = _step([2, 3], [7, 8, 9, 10, 11], k=2)
    p = wplp.parse(req, qsl, vocab=50)
    assert p.rows.tolist() == [0, 1, 5, 6, 7] and p.targets.tolist() == [7, 8, 9, 10, 11] and p.top_k == 2
    assert wplp.parse(worker_pb2.StepRequest(), qsl, 50) is None        # a step that asks for none


@pytest.mark.parametrize("counts,targets,k,match", [
    ([6, 0], [1] * 6, 0, r"prompt_logprob_rows\[0\] = 6 must be in \[0, query length 5\]"),
    ([-1, 0], [], 0, r"prompt_logprob_rows\[0\] = -1"),
    ([1, 1], [1, 50], 0, r"prompt_logprob_targets must be in \[0, 50\)"),
    ([1, 1], [1], 0, "prompt_logprob_targets"),
    ([1, 1], [1, 2], 21, r"prompt_top_logprobs = 21 must be in \[0, 20\]"),
])
def test_bad_rows_are_rejected_with_the_reason(counts, targets, k, match):
    req, qsl = _step(counts, targets, k)
    with pytest.raises((ValueError, wire.WireError), match=match):
        wplp.parse(req, qsl, vocab=50)


def test_row_chunks_equal_one_full_log_softmax(monkeypatch):
    """Row chunks of 1 row (a tiny byte budget) give what one [R, vocab] pass gives (to the last
    bits a matmul of another shape may round differently)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 16, generator=g, dtype=torch.float64)
    head = torch.randn(40, 16, generator=g, dtype=torch.float64)
    logits = lambda h: h @ head.T                                        # noqa: E731
    req, qsl = _step([4, 3], [3, 1, 4, 1, 5, 9, 2], k=3, qlens=(5, 4))
    p = wplp.parse(req, qsl, vocab=40)
    monkeypatch.setattr(wplp, "CHUNK_BYTES", 1)
    assert wplp.chunk_rows(40, 8) == 1
    lp, ids, top = wplp.compute(logits, hidden, p, vocab=40)
    full = torch.log_softmax(logits(hidden[torch.as_tensor(p.rows)]), -1)
    assert np.allclose(lp, full.gather(1, torch.as_tensor(p.targets)[:, None]).squeeze(1).numpy(), rtol=0, atol=1e-12)
    ref = full.topk(3)
    assert ids.tolist() == ref.indices.tolist() and np.allclose(top, ref.values.numpy(), rtol=0, atol=1e-12)


# ---------------------------------------------------------------- in process: the metadata plan

class _Seq:
    def __init__(self, prompt, k=0, max_new_tokens=1):
        from metadata_service.sequence import SamplingParams, SeqStatus
        self.prompt_token_ids, self.gen, self.status = list(prompt), 0, SeqStatus.RUNNING
        self.params = SamplingParams(max_new_tokens=max_new_tokens)
        self.prompt_lp = None if k is None else mplp.PromptState.new(len(prompt), k)


def test_plan_scores_the_prompt_tokens_each_chunk_reaches():
    a, b, c = _Seq(range(10, 20)), _Seq(range(30, 33), k=None), _Seq(range(40, 46), max_new_tokens=0)
    # a: positions 8..11 of 10 (only position 8 scores a prompt token, 19); b: none; c: positions 0..4
    rows = mplp.plan([b, a, c], np.array([2, 8, 0]), np.array([1, 4, 5]), first=1)
    assert rows.counts.tolist() == [0, 1, 5] and rows.targets.tolist() == [19, 41, 42, 43, 44, 45]
    assert mplp.plan([b, a], np.array([0, 0]), np.array([1, 3]), first=2) is None   # decodes only
    one = _Seq([9], k=2, max_new_tokens=3)                  # a one-token prompt scores nothing
    assert mplp.plan([one], np.array([0]), np.array([1]), first=0) is None


def test_apply_writes_by_position_and_ends_max_tokens_zero():
    from types import SimpleNamespace
    c = _Seq(range(40, 46), k=1, max_new_tokens=0)
    batch = SimpleNamespace(seqs=[c], gens=[0])
    for start, n in ((0, 3), (3, 3)):                   # two chunks: the second completes the prompt
        batch.prompt_rows = mplp.plan([c], np.array([start]), np.array([n]), first=0)
        R = int(batch.prompt_rows.counts.sum())
        vals = -np.arange(start, start + R, dtype=np.float64) - 0.5
        reply = worker_pb2.StepReply(prompt_logprobs=wire.pack(vals, wire.FLOAT64),
                                     prompt_top_logprob_ids=wire.pack(np.full(R, 7)),
                                     prompt_top_logprobs=wire.pack(vals, wire.FLOAT64))
        done = mplp.apply(batch, reply)
        assert done == ([] if start == 0 else [c])
    assert c.prompt_lp.logprobs[1:].tolist() == [-0.5, -1.5, -2.5, -3.5, -4.5]
    assert np.isnan(c.prompt_lp.logprobs[0]) and c.prompt_lp.top_ids[:, 0].tolist() == [-1] + [7] * 5


# ---------------------------------------------------------------- end to end

def add_tokenizer(directory: str) -> None:
    from tests.test_gateway import add_tokenizer as add
    add(directory, VOCAB)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ckpt-plp"))
    make_checkpoint(num_layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, tie=False, vocab=VOCAB, seed=23,
                    directory=d)
    add_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def oracle(ckpt):
    model = load_oracle(ckpt, torch.float64)

    def logprobs(prompt: list[int]) -> torch.Tensor:
        """[P, vocab]: row i is log_softmax after tokens 0..i."""
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([prompt])).logits[0].to(torch.float64), -1)
    return logprobs


def check(prompt, got_own, got_top, ref, k):
    assert len(got_own) == len(prompt) and got_own[0] is None
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)].numpy()
    assert np.max(np.abs(np.asarray(got_own[1:]) - want), initial=0.0) < TOL
    if k:
        assert got_top[0] is None and len(got_top) == len(prompt)
        best = ref[:-1].topk(k)
        for i, alts in enumerate(got_top[1:]):
            assert list(alts) == best.indices[i].tolist()
            assert np.max(np.abs(np.asarray(list(alts.values())) - best.values[i].numpy())) < TOL
    else:
        assert got_top is None


def prompts(n, lo, hi, seed, prefix=()):
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(2, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module", params=[1, 2], ids=["1stage", "2stages"])
def cluster(request, ckpt):
    with LocalCluster(model=ckpt, workers=request.param, dtype="float64", block_size=4, http=True,
                      extra_service_args=BUDGET) as c:
        yield c


@pytest.mark.slow
def test_prompt_logprobs_equal_transformers(cluster, oracle):
    cl = cluster.client
    # a one-token prompt with max_new_tokens 0 and with 3 (k=3 both), two-token prompts
    batch = prompts(6, 1, 40, seed=5) + [[9], [9], [9, 10], [9, 11]]
    # one job: prompt-logprob requests share steps with each other and with requests without them
    items = [dict(prompt_token_ids=p, max_new_tokens=(0, 3)[i % 2], prompt_logprobs=(0, 3)[(i // 2) % 2])
             for i, p in enumerate(batch)] + [dict(prompt_token_ids=p, max_new_tokens=4) for p in batch[:3]]
    results = cl.wait(cl.submit(items))
    for item, r in zip(items, results):
        p = item["prompt_token_ids"]
        if "prompt_logprobs" not in item:
            assert r.prompt_logprobs is None and len(r.token_ids) == 4
            continue
        check(p, r.prompt_logprobs, r.prompt_top_logprobs, oracle(p), item["prompt_logprobs"])
        assert len(r.token_ids) == item["max_new_tokens"] and r.finish_reason == "length"
        assert r.usage.prompt_tokens == len(p) and r.usage.completion_tokens == item["max_new_tokens"]
    # a stream carries them on its first chunk only; generate() collects them
    p = batch[0]
    chunks = list(cl.stream(prompt_token_ids=p, max_new_tokens=3, prompt_logprobs=2))
    assert chunks[0].prompt_logprobs is not None and all(c.prompt_logprobs is None for c in chunks[1:])
    check(p, chunks[0].prompt_logprobs, chunks[0].prompt_top_logprobs, oracle(p), 2)
    r = cl.generate(prompt_token_ids=p, max_new_tokens=0, prompt_logprobs=1)
    assert r.token_ids == [] and r.finish_reason == "length"
    check(p, r.prompt_logprobs, r.prompt_top_logprobs, oracle(p), 1)
    # best_of > n (the winners come whole at the end) and n choices, by generate() and as a job:
    # the request's prompt logprobs on the result and on every choice
    for kw in (dict(best_of=2), dict(n=2, best_of=3), dict(n=2)):
        args = dict(prompt_token_ids=p, max_new_tokens=2, temperature=1.0, seed=3, prompt_logprobs=1, **kw)
        for r in (cl.generate(**args), cl.wait(cl.submit([args]))[0]):
            for one in [r, *(r.choices or [])]:
                check(p, one.prompt_logprobs, one.prompt_top_logprobs, oracle(p), 1)
    st = cl.stats()
    assert st.invariants_ok


@pytest.mark.slow
def test_a_cached_prefix_loses_no_prompt_logprob(cluster, oracle):
    cl = cluster.client
    prefix = prompts(1, 24, 24, seed=8)[0]                         # 6 full blocks of 4
    cl.generate(prompt_token_ids=prefix + [5, 6], max_new_tokens=1)
    warm = cl.generate(prompt_token_ids=prefix + [7, 8], max_new_tokens=1)
    assert warm.usage.cached_tokens >= 20                           # the prefix is cached now
    p = prefix + [11, 12, 13]
    r = cl.generate(prompt_token_ids=p, max_new_tokens=2, prompt_logprobs=2)
    assert r.usage.cached_tokens == 0                               # computed, not reused
    check(p, r.prompt_logprobs, r.prompt_top_logprobs, oracle(p), 2)
    after = cl.generate(prompt_token_ids=prefix + [14, 15], max_new_tokens=1)
    assert after.usage.cached_tokens >= 20                          # and the cache still serves others


@pytest.mark.slow
def test_bad_prompt_logprobs_requests_are_rejected(cluster):
    cl = cluster.client
    for kw, match in ((dict(prompt_logprobs=21), r"prompt_logprobs must be in \[0, 20\]"),
                      (dict(max_new_tokens=0), r"0 only with prompt_logprobs"),
                      (dict(max_new_tokens=0, prompt_logprobs=0, n=2), "n and best_of must be 1")):
        with pytest.raises(InvalidArgument, match=match):
            cl.generate(prompt_token_ids=[3, 4, 5], **{"max_new_tokens": 2, **kw})
    with pytest.raises(InvalidArgument, match="prompt_logprobs must be >= 0"):
        cl.generate(prompt_token_ids=[3, 4, 5], prompt_logprobs=-1)
    with pytest.raises(TypeError, match="prompt_logprobs"):
        cl.generate(prompt_token_ids=[3, 4, 5], prompt_logprobs=True)


# ---------------------------------------------------------------- the OpenAI API

@pytest.mark.slow
def test_openai_echo_with_logprobs(cluster, oracle, ckpt):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(ckpt)
    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0) as oai:
        batch = prompts(2, 3, 30, seed=12)
        for max_tokens in (0, 1):
            r = oai.completions.create(model=ckpt, prompt=batch, max_tokens=max_tokens, echo=True, logprobs=2,
                                       temperature=0)
            for p, ch in zip(batch, sorted(r.choices, key=lambda c: c.index)):
                lp, ref = ch.logprobs, oracle(p)
                assert len(lp.tokens) == len(p) + max_tokens and lp.token_logprobs[0] is None
                assert lp.top_logprobs[0] is None and all(len(t) <= 3 for t in lp.top_logprobs[1:])
                # vLLM's rows: the prompt's own token first, then the 2 best
                assert all(next(iter(row)) == t for row, t in zip(lp.top_logprobs[1:len(p)], lp.tokens[1:]))
                want = ref[torch.arange(len(p) - 1), torch.tensor(p[1:])].numpy()
                assert np.max(np.abs(np.asarray(lp.token_logprobs[1:len(p)]) - want)) < TOL
                # each token's text, except vLLM's rule for a byte of an unfinished character: "" until
                # the token that completes it, which shows the whole character
                alone = [tok.decode([t], skip_special_tokens=False) for t in p]
                assert all(got == want_ or (k > 0 and want_.endswith("\ufffd") and not got.endswith("\ufffd"))
                           for k, (got, want_) in enumerate(zip(lp.tokens, alone)))
                assert lp.text_offset[:len(p)] == list(np.cumsum([0] + [len(t) for t in lp.tokens[:len(p) - 1]]))
                assert ch.text.startswith(tok.decode(p, skip_special_tokens=False)) and len(lp.text_offset) == len(lp.tokens)
        # a text prompt: the gateway tokenizes it, so tokens and logprobs line up with the text
        text = "the paged cache maps tokens"
        ids = tok.encode(text, add_special_tokens=False)
        r = oai.completions.create(model=ckpt, prompt=text, max_tokens=0, echo=True, logprobs=0)
        ch = r.choices[0]
        assert ch.text == text and ch.logprobs.tokens == [tok.decode([t], skip_special_tokens=False) for t in ids]
        # logprobs 0: each row holds the token itself alone, as vLLM's do
        assert ch.logprobs.top_logprobs[1:] == [{t: lp} for t, lp in zip(ch.logprobs.tokens[1:], ch.logprobs.token_logprobs[1:])]
        assert r.usage.completion_tokens == 0
        want = oracle(ids)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
        assert np.max(np.abs(np.asarray(ch.logprobs.token_logprobs[1:]) - want)) < TOL
        # streamed: the echo chunk carries the prompt's logprobs
        p = batch[0]
        events = list(oai.completions.create(model=ckpt, prompt=p, max_tokens=2, echo=True, logprobs=1,
                                             temperature=0, stream=True))
        first = events[0].choices[0]
        assert first.text == tok.decode(p, skip_special_tokens=False) and first.logprobs.token_logprobs[0] is None
        assert len(first.logprobs.tokens) == len(p)
        want = oracle(p)[torch.arange(len(p) - 1), torch.tensor(p[1:])].numpy()
        assert np.max(np.abs(np.asarray(first.logprobs.token_logprobs[1:]) - want)) < TOL


@pytest.mark.slow
def test_preempted_requests_keep_every_prompt_logprob(ckpt, oracle):
    """A pool too small for all of them at once: preempted requests recompute their prompts and
    rewrite the same positions (values by position, never appended twice)."""
    with LocalCluster(model=ckpt, workers=1, dtype="float64", block_size=4, num_blocks=24,
                      extra_service_args=BUDGET) as c:
        batch = prompts(8, 14, 30, seed=9)
        results = c.client.wait(c.client.submit([dict(prompt_token_ids=p, max_new_tokens=12, ignore_eos=True,
                                                       prompt_logprobs=2) for p in batch]))
        for p, r in zip(batch, results):
            check(p, r.prompt_logprobs, r.prompt_top_logprobs, oracle(p), 2)
            assert len(r.token_ids) == 12
        assert c.client.stats().preemptions > 0, "the pool was meant to force preemption"


def test_a_prompt_that_fills_the_pool_exactly_is_scored_once(ckpt, oracle):
    """Probe L: max_new_tokens 0 still sampled at the prompt's end, so async scheduling sent a
    decode ahead into the slot past the prompt; a prompt filling the pool exactly was preempted by
    it again and again (1,632 times in 30 s). Nothing is sampled now: it is scored once."""
    with LocalCluster(model=ckpt, workers=1, dtype="float64", block_size=4, num_blocks=8) as c:
        p = prompts(1, 32, 32, seed=5)[0]                 # 32 tokens: the 8 blocks of 4, exactly
        r = c.client.generate(prompt_token_ids=p, max_new_tokens=0, prompt_logprobs=1, timeout=120)
        check(p, r.prompt_logprobs, r.prompt_top_logprobs, oracle(p), 1)
        st = c.client.stats()
        assert r.token_ids == [] and st.preemptions == 0 and st.free_blocks == st.num_blocks
