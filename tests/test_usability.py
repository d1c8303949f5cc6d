"""What a new user meets in the first hour (issue 21), end to end on loopback: best_of without
streaming on every path, the gateway's model identity checked against the service, the OpenAI
surface's small promises (models/{id}, max_model_len, error params, roles, logprob bytes).

One float64 worker of a random checkpoint with its own tokenizer, as tests/test_gateway.py."""
from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

import client
from client import AsyncClient, LocalCluster
from client.cluster import free_port
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


# ---------------------------------------------------------------- the gateway's model identity

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def gateway(cluster, *args):
    """A second gateway process against the cluster's service; yields its URL once it answers."""
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "gateway", "--metadata", cluster.address, "--port", str(port),
                          *args], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    url, end = f"http://127.0.0.1:{port}", time.monotonic() + 60
    try:
        while True:
            try:
                httpx.get(url + "/health")
                break
            except httpx.TransportError:
                assert p.poll() is None and time.monotonic() < end, p.stdout.read()
                time.sleep(0.2)
        yield url, p
    finally:
        p.terminate()
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_gateway_refuses_a_missing_or_broken_model_at_start(tmp_path):
    missing = str(tmp_path / "no-such-checkpoint")       # (not /nonexistent: a process may have made it)
    for model, match in ((missing, f"--model {missing}: no such directory"),
                         (str(tmp_path), "config.json")):
        if model == str(tmp_path):
            (tmp_path / "config.json").write_text('{"vocab_size": 64,\n "hidden_size": }')
        r = subprocess.run([sys.executable, "-m", "gateway", "--model", model, "--port", str(free_port())],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and match in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "not valid JSON (Expecting value at line 2 column 17)" in r.stderr


def test_gateway_checks_model_against_the_service(cluster, ckpt, tmp_path):
    other = str(tmp_path / "other")
    make_checkpoint(num_layers=2, hidden=32, heads=2, kv_heads=1, head_dim=16, vocab=VOCAB, seed=3,
                    directory=other, max_positions=512)
    with gateway(cluster, "--model", other) as (url, p):
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "is not the model the workers serve" in health.json()["reason"]
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        err = r.json()["error"]
        assert r.status_code == 503 and err["code"] == "model_mismatch" and err["param"] == "model"
        assert ckpt in err["message"] and other in err["message"] and "hidden 32" in err["message"]
        assert httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"] == 4096  # the service's, not 512


def test_gateway_without_model_takes_it_from_the_service(cluster, ckpt, oai):
    with gateway(cluster) as (url, p):
        card = httpx.get(url + "/v1/models").json()["data"][0]
        assert (card["id"], card["max_model_len"]) == (ckpt, 4096)
        assert httpx.get(url + "/health").json()["ready"] is True
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "temperature": 0,
                "logprobs": True}
        mine = httpx.post(url + "/v1/chat/completions", json=body).json()
        ref = httpx.post(cluster.http_url + "/v1/chat/completions", json=body).json()  # started with --model
        assert mine["choices"][0]["message"] == ref["choices"][0]["message"]          # the same template
        tokens = [t["token"] for t in mine["choices"][0]["logprobs"]["content"]]
        assert tokens == [t["token"] for t in ref["choices"][0]["logprobs"]["content"]]
        assert not any(t.startswith("token_id:") for t in tokens)                       # and tokenizer


def test_models_retrieve(oai, ckpt):
    m = oai.models.retrieve(ckpt)
    assert m.id == ckpt and m.model_extra["max_model_len"] == 4096
    assert oai.models.list().data[0].model_extra["max_model_len"] == 4096
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.models.retrieve("no-such-model")


# ---------------------------------------------------------------- the OpenAI surface's small promises

def test_errors_roles_and_logprob_bytes_over_http(cluster, oai, ckpt):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=ckpt, prompt="hello", max_tokens=0)
    assert info.value.body["param"] == "max_tokens" and "max_tokens must be >= 1" in info.value.body["message"]
    assert "max_new_tokens" not in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:                      # the service's check, not ours
        oai.completions.create(model=ckpt, prompt="hello", max_tokens=2, extra_body={"top_k": -1, "n": 129})
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as info:                      # vLLM's rule: -1 is off, -5 nothing
        oai.completions.create(model=ckpt, prompt="hello", max_tokens=2, extra_body={"top_k": -5})
    assert info.value.body["param"] == "top_k"
    with pytest.raises(openai.BadRequestError, match="role 'wizard' is not one of") as info:
        oai.chat.completions.create(model=ckpt, messages=[{"role": "wizard", "content": "hi"}], max_tokens=2)
    assert info.value.body["param"] == "messages"
    # the route wires the tokens' raw bytes in (tests/test_usability_unit.py checks them byte by byte):
    # with token ids as token strings, bytes are still the token's own, not the UTF-8 of "token_id:N"
    from gateway.token_bytes import token_bytes
    from minipaged.tokenizer import load_tokenizer
    tok = load_tokenizer(ckpt)
    r = oai.chat.completions.create(model=ckpt, messages=[{"role": "user", "content": "hello"}], max_tokens=6,
                                    temperature=0, logprobs=True, top_logprobs=2,
                                    extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    for c in r.choices[0].logprobs.content:
        assert c.bytes == list(token_bytes(tok, int(c.token.split(":")[1])))
        assert [a.bytes for a in c.top_logprobs] == [list(token_bytes(tok, int(a.token.split(":")[1])))
                                                     for a in c.top_logprobs]
    settle(cluster.client)


def test_malformed_bodies_unsupported_fields_and_echoed_specials_over_http(cluster, oai, ckpt):
    url, json_type = cluster.http_url, {"content-type": "application/json"}
    # valid JSON that is no text (a lone surrogate) or nested past the parser: a 400 error object, not a 500
    for body in ('{"model": "%s", "messages": [{"role": "user", "content": "\\udc00"}]}' % ckpt, "[" * 100_000):
        r = httpx.post(url + "/v1/chat/completions", content=body, headers=json_type, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    # an int past the wire's range names its own field
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=ckpt, prompt="hello", max_tokens=2, seed=2**70)
    assert info.value.body["param"] == "seed"
    # a vLLM field that would change the answer is refused by name, not ignored
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=ckpt, prompt="hello", max_tokens=2, extra_body={"prompt_logprobs": 1})
    assert info.value.body["param"] == "prompt_logprobs"
    # continue_final_message: the prompt ends with the assistant's text (transformers' rendering)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    r = oai.chat.completions.create(model=ckpt, messages=msgs, max_tokens=1, extra_body={
        "continue_final_message": True, "add_generation_prompt": False})
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(ckpt)
    text = tok.apply_chat_template(msgs, continue_final_message=True, tokenize=False)
    assert text.endswith("hello there") and r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))
    with pytest.raises(openai.BadRequestError):     # with a generation prompt after it: contradictory
        oai.chat.completions.create(model=ckpt, messages=msgs, max_tokens=1, extra_body={"continue_final_message": True})
    # an echoed special token shows its text, so the offsets add up to the echoed prompt
    r = oai.completions.create(model=ckpt, prompt="<|im_start|>user\nhi", max_tokens=1, echo=True, logprobs=0)
    lp = r.choices[0].logprobs
    assert lp.tokens[0] == "<|im_start|>"
    assert all(r.choices[0].text[o:].startswith(t) for t, o in zip(lp.tokens, lp.text_offset))
    settle(cluster.client)
