"""What a new user meets in the first hour (issue 21), end to end on loopback: best_of without
streaming on every path, the gateway's model identity checked against the service, the OpenAI
surface's small promises (models/{id}, max_model_len, error params, roles, logprob bytes).

One float64 worker of a random checkpoint with its own tokenizer, as tests/test_gateway.py."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

import client
from client import AsyncClient, LocalCluster
from tests.checkpoints import make_checkpoint
from tests.freeze import FREEZE_SERVICE_ARGS
from tests.test_gateway import VOCAB, add_tokenizer, settle

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ckpt-ux"))
    make_checkpoint(num_layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32, vocab=VOCAB, seed=12, directory=d,
                    max_positions=4096)
    add_tokenizer(d, VOCAB)
    return d


@pytest.fixture(scope="module")
def cluster(ckpt):
    with LocalCluster(model=ckpt, workers=1, dtype="float64", http=True,
                      extra_service_args=FREEZE_SERVICE_ARGS) as c:
        yield c


@pytest.fixture(scope="module")
def oai(cluster):
    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


# ---------------------------------------------------------------- best_of without streaming

def _ids(r):
    return [ch.token_ids for ch in r.choices]


def test_best_of_without_streaming_on_every_path(cluster, oai, ckpt):
    c = cluster.client
    kw = dict(prompt_token_ids=[5, 6, 7, 8, 9], max_new_tokens=6, temperature=1.0, seed=21, ignore_eos=True,
              logprobs=True)
    every = c.generate(**kw, n=4)                 # the same 4 candidates (choice seeds depend on seed, i)
    assert len({tuple(t) for t in _ids(every)}) > 1
    best = sorted(every.choices, key=lambda ch: -ch.cumulative_logprob)[:2]

    r = c.generate(**kw, n=2, best_of=4)
    assert _ids(r) == [ch.token_ids for ch in best]
    scores = [ch.cumulative_logprob for ch in r.choices]
    assert scores == sorted(scores, reverse=True) and [ch.choice for ch in r.choices] == [0, 1]
    assert min(scores) >= max(ch.cumulative_logprob for ch in every.choices if ch.token_ids not in _ids(r))
    job = c.wait(c.submit([dict(kw, n=2, best_of=4)]))[0]       # the job path chooses the same
    assert _ids(job) == _ids(r)
    one = c.generate(**dict(kw, logprobs=None), n=1, best_of=4)  # logprobs not asked: none shown
    assert one.token_ids == best[0].token_ids and one.logprobs is None and one.choices is None

    async def via_async():
        async with AsyncClient(cluster.address) as ac:
            return await ac.generate(**kw, n=2, best_of=4)
    assert _ids(asyncio.run(via_async())) == _ids(r)

    # streaming it stays refused, with the reason and the way out
    with pytest.raises(client.InvalidArgument, match=r"best_of \(4\) > n \(2\) cannot be streamed.*generate\(\)"):
        list(c.stream(**kw, n=2, best_of=4))

    # the gateway's non-streaming completions and chat
    tok_ids = [[int(t.split(":")[1]) for t in ch.logprobs.tokens]
               for ch in oai.completions.create(model=ckpt, prompt=[5, 6, 7, 8, 9], max_tokens=6, temperature=1.0,
                                                seed=21, n=2, best_of=4, logprobs=0,
                                                extra_body={"ignore_eos": True,
                                                            "return_tokens_as_token_ids": True}).choices]
    assert tok_ids == _ids(r)
    chat = oai.chat.completions.create(model=ckpt, messages=[{"role": "user", "content": "hello"}], n=1,
                                       max_tokens=4, temperature=1.0, seed=3, extra_body={"best_of": 3})
    assert len(chat.choices) == 1 and chat.choices[0].finish_reason in ("length", "stop")
    resp = httpx.post(cluster.http_url + "/v1/completions",
                      json={"prompt": "hi", "best_of": 3, "stream": True, "max_tokens": 2})
    assert resp.status_code == 400 and "cannot stream" in resp.json()["error"]["message"]
    assert resp.json()["error"]["param"] == "best_of"
    settle(c)
