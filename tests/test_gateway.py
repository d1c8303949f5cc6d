"""The HTTP gateway end to end, through the official `openai` package: real processes on loopback
(metadata service, a float64 worker of a random Qwen3 checkpoint with its own tokenizer and chat
template, the gateway), compared token for token with the SDK and with transformers."""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch

from client import AsyncClient, InvalidArgument, LocalCluster
from client.cluster import free_port
from tests.checkpoints import load_oracle, make_checkpoint
from tests.freeze import FREEZE_SERVICE_ARGS, frozen

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 320
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def add_tokenizer(directory: str, vocab: int) -> None:
    """A tiny BPE with Qwen's chat special tokens and a ChatML chat template, saved beside the
    weights as the checkpoint's own tokenizer (tokenizer_config.json carries chat_template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<|endoftext|>", "<|im_start|>",
                                                                    "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["the paged cache maps tokens to slots", "a block table per sequence", "hello world",
              "user assistant system"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHATML
    fast.save_pretrained(directory)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ckpt-chat"))
    make_checkpoint(num_layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32, vocab=VOCAB, seed=11, directory=d,
                    max_positions=4096)
    add_tokenizer(d, VOCAB)
    return d


@pytest.fixture(scope="module")
def tok(ckpt):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def cluster(ckpt):
    with LocalCluster(model=ckpt, workers=1, dtype="float64", http=True, extra_service_args=FREEZE_SERVICE_ARGS) as c:
        yield c


@pytest.fixture(scope="module")
def oai(cluster):
    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def settle(client, timeout=60.0):
    """Wait for the engine to drain, then check nothing leaked."""
    end = time.monotonic() + timeout
    while True:
        st = client.stats()
        if st.running == 0 and st.waiting == 0 and st.free_blocks == st.num_blocks:
            break
        assert time.monotonic() < end, st
        time.sleep(0.05)
    assert st.invariants_ok
    return st


def ids_of(logprobs_tokens) -> list[int]:
    assert all(t.startswith("token_id:") for t in logprobs_tokens)
    return [int(t.split(":", 1)[1]) for t in logprobs_tokens]


def prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(n)]


# ---------------------------------------------------------------- API surface

def test_models_health_and_errors_are_openai_shaped(cluster, oai, ckpt):
    models = oai.models.list().data
    assert [m.id for m in models] == [ckpt] and models[0].owned_by == "minipaged"
    assert httpx.get(cluster.http_url + "/health").json()["ready"] is True

    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.completions.create(model="no-such-model", prompt="hello", max_tokens=2)
    # the basename of the checkpoint path is accepted too
    oai.completions.create(model=os.path.basename(ckpt), prompt="hello", max_tokens=1)
    for bad, match in ((dict(max_tokens=0), "max_tokens must be >= 1"),
                       (dict(max_tokens=2, top_p=0), r"top_p must be in \(0, 1\]"),
                       (dict(max_tokens=2, n=0), "n must be >= 1"),
                       (dict(max_tokens=2, temperature=-1), "temperature"),
                       (dict(max_tokens=2, logit_bias={"5": 1.0}), "logit_bias"),
                       (dict(max_tokens=5000), "max_model_len")):
        with pytest.raises(openai.BadRequestError, match=match) as info:
            oai.completions.create(model=ckpt, prompt="hello", **bad)
        body = info.value.body
        assert set(body) >= {"message", "type"} and body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="out of range|must be in"):
        oai.completions.create(model=ckpt, prompt=[[1, VOCAB + 5]], max_tokens=2)
    # no max_tokens: OpenAI's 16, cut to what the context leaves (vLLM's rule), not a 400
    limit = models[0].model_extra["max_model_len"]
    r = oai.completions.create(model=ckpt, prompt=[[5 + i % 300 for i in range(limit - 3)], [7, 8]], temperature=0,
                               extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 + 16
    assert [c.finish_reason for c in r.choices] == ["length", "length"]
    r = httpx.post(cluster.http_url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(cluster.http_url + "/v1/completions", content=b" " * (17 << 20),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "at most" in r.json()["error"]["message"]
    r = httpx.post(cluster.http_url + "/v1/completions", json={"prompt": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.get(cluster.http_url + "/v1/nope")
    assert r.status_code == 404 and "error" in r.json()
    settle(cluster.client)


# ---------------------------------------------------------------- parity

def test_hostile_bodies_and_fields_are_refused_in_the_requests_words(cluster, ckpt):
    """Probe K: a chunked body past the limit stops at the limit (not buffered whole); a body that is
    not application/json is vLLM's 400; chat_template_kwargs cannot override the request's own
    fields or the conversation; service errors name the field this request used."""
    url = cluster.http_url
    before = cluster.client.stats()

    def chunks():                         # no Content-Length: counted as it arrives
        for _ in range(40):
            yield b" " * (1 << 20)
    r = httpx.post(url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]
    body = json.dumps({"model": ckpt, "prompt": "hi", "max_tokens": 1}).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": ctype} if ctype else {})
        assert r.status_code == 400 and "Only 'application/json' is allowed" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200
    chat = {"model": ckpt, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
    for kw in ({"add_generation_prompt": False}, {"add_generation_prompt": True}, {"continue_final_message": True}):
        r = httpx.post(url + "/v1/chat/completions", json={**chat, "chat_template_kwargs": kw})
        assert r.status_code == 200, r.text               # the request's own fields win, as in vLLM
    for key in ("messages", "tokenize", "chat_template"):
        r = httpx.post(url + "/v1/chat/completions", json={**chat, "chat_template_kwargs": {key: 1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
    for path, extra, param in (("/v1/completions", {"prompt": "hi", "use_beam_search": True, "n": 1000}, "n"),
                               ("/v1/completions", {"prompt": [2 ** 40]}, "prompt"),
                               ("/v1/completions", {"prompt": "hi", "guided_regex": "(("}, "guided_regex"),
                               ("/v1/chat/completions", {"messages": chat["messages"],
                                                         "structured_outputs": {"regex": "(("}},
                                "structured_outputs.regex"),
                               ("/v1/chat/completions", {"messages": chat["messages"], "max_tokens": 5000},
                                "messages")):
        r = httpx.post(url + path, json={"model": ckpt, "max_tokens": 2, **extra})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param, (extra, err)
    assert "n must be in [1, 16] with use_beam_search" in httpx.post(url + "/v1/completions", json={
        "model": ckpt, "prompt": "hi", "use_beam_search": True, "n": 1000}).json()["error"]["message"]
    settle(cluster.client)
    after = cluster.client.stats()
    assert after.invariants_ok and after.free_blocks == before.free_blocks


def test_greedy_http_equals_sdk_and_transformers(cluster, oai, ckpt, tok):
    batch = prompts(4, seed=1)
    r = oai.completions.create(model=ckpt, prompt=batch, max_tokens=12, temperature=0, logprobs=0,
                               extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    sdk = cluster.client.generate([{"prompt_token_ids": p} for p in batch], max_new_tokens=12, temperature=0.0,
                                  ignore_eos=True, logprobs=True)
    for c, s in zip(r.choices, sdk):
        assert ids_of(c.logprobs.tokens) == s.token_ids and c.text == s.text
        assert c.logprobs.token_logprobs == pytest.approx(s.logprobs, abs=1e-6)
        assert c.finish_reason == "length"
    assert r.usage.prompt_tokens == sum(map(len, batch)) and r.usage.completion_tokens == 48

    # a text prompt, tokenized by the service with the checkpoint's tokenizer, against the oracle
    oracle = load_oracle(ckpt, torch.float64)
    text = "the paged cache maps"
    ids = tok.encode(text, add_special_tokens=False)
    with torch.no_grad():
        want = oracle.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(ids):].tolist()
    r = oai.completions.create(model=ckpt, prompt=text, max_tokens=10, temperature=0, logprobs=0,
                               extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    assert ids_of(r.choices[0].logprobs.tokens) == want
    assert r.usage.prompt_tokens == len(ids)
    settle(cluster.client)


def test_streaming_matches_non_streaming(cluster, oai, ckpt):
    batch = prompts(2, seed=2)
    kw = dict(model=ckpt, prompt=batch, max_tokens=9, temperature=0, extra_body={"ignore_eos": True})
    whole = oai.completions.create(**kw)
    texts, finish, usage = {0: "", 1: ""}, {}, None
    for chunk in oai.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if not chunk.choices:
            usage = chunk.usage
            continue
        c = chunk.choices[0]
        texts[c.index] += c.text
        if c.finish_reason:
            finish[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert finish == {0: "length", 1: "length"}
    assert usage.completion_tokens == 18 and usage.prompt_tokens == whole.usage.prompt_tokens

    msgs = [{"role": "user", "content": "hello world"}]
    chat = oai.chat.completions.create(model=ckpt, messages=msgs, max_tokens=7, temperature=0)
    parts, roles = [], []
    for chunk in oai.chat.completions.create(model=ckpt, messages=msgs, max_tokens=7, temperature=0, stream=True):
        d = chunk.choices[0].delta
        roles += [d.role] if d.role else []
        parts.append(d.content or "")
    assert roles == ["assistant"] and "".join(parts) == chat.choices[0].message.content
    settle(cluster.client)


def test_chat_renders_the_checkpoints_template(cluster, oai, ckpt, tok):
    msgs = [{"role": "system", "content": "a block table per sequence"},
            {"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}]
    plain = [msgs[0], {"role": "user", "content": "hello \nworld"}]   # parts joined by "\n", as vLLM joins them
    ids = tok.apply_chat_template(plain, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok.convert_tokens_to_ids("<|im_start|>") in ids  # the special tokens are single ids
    r = oai.chat.completions.create(model=ckpt, messages=msgs, max_tokens=8, temperature=0, logprobs=True,
                                    extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    assert r.usage.prompt_tokens == len(ids)
    got = [int(c.token.split(":")[1]) for c in r.choices[0].logprobs.content]
    assert got == cluster.client.generate(prompt_token_ids=ids, max_new_tokens=8, ignore_eos=True).token_ids
    assert r.choices[0].message.role == "assistant"
    with pytest.raises(openai.BadRequestError, match="only text content parts"):
        oai.chat.completions.create(model=ckpt, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    settle(cluster.client)


def test_async_client_concurrent_requests(cluster, ckpt):
    batch = prompts(5, seed=3)

    async def go():
        async with openai.AsyncOpenAI(base_url=cluster.http_url + "/v1", api_key="x", max_retries=0) as c:
            rs = await asyncio.gather(*[
                c.completions.create(model=ckpt, prompt=p, max_tokens=6, temperature=0, logprobs=0,
                                     extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
                for p in batch])
            streamed = ""
            async for chunk in await c.completions.create(model=ckpt, prompt=batch[0], max_tokens=6, temperature=0,
                                                          stream=True, extra_body={"ignore_eos": True}):
                streamed += chunk.choices[0].text
            return rs, streamed
    rs, streamed = asyncio.run(go())
    for p, r in zip(batch, rs):
        assert ids_of(r.choices[0].logprobs.tokens) == cluster.client.generate(
            prompt_token_ids=p, max_new_tokens=6, ignore_eos=True).token_ids
    assert streamed == rs[0].choices[0].text
    settle(cluster.client)


def test_async_client_with_thousands_of_calls_at_once(cluster):
    """Probe K: 3,000 generate() calls at once on one AsyncClient had gRPC end ~500 of them
    CANCELLED, which nobody asked for; it keeps MAX_OPEN_STREAMS open and queues the rest."""
    async def main():
        async with AsyncClient(cluster.address) as c:
            return await asyncio.gather(*(c.generate(prompt_token_ids=[1 + i % 200, 2, 3], max_new_tokens=1,
                                                     temperature=0) for i in range(3000)), return_exceptions=True)
    results = asyncio.run(main())
    assert [r for r in results if isinstance(r, BaseException)] == []
    settle(cluster.client)


def test_seeded_sampling_is_reproducible_over_http(cluster, oai, ckpt):
    kw = dict(model=ckpt, prompt=[[5, 6, 7]], max_tokens=10, temperature=0.9, top_p=0.9, seed=77, logprobs=0,
              extra_body={"return_tokens_as_token_ids": True, "top_k": 20, "ignore_eos": True})
    a, b = oai.completions.create(**kw), oai.completions.create(**kw)
    assert a.choices[0].logprobs.tokens == b.choices[0].logprobs.tokens
    sdk = cluster.client.generate(prompt_token_ids=[5, 6, 7], max_new_tokens=10, temperature=0.9, top_p=0.9,
                                  top_k=20, seed=77, ignore_eos=True)
    assert ids_of(a.choices[0].logprobs.tokens) == sdk.token_ids


def test_echo(cluster, oai, ckpt):
    r = oai.completions.create(model=ckpt, prompt="hello world", max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith("hello world")
    # echo + logprobs: the prompt's own logprobs first (tests/test_prompt_logprobs.py checks the values)
    r = oai.completions.create(model=ckpt, prompt="hello", max_tokens=3, echo=True, logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == r.usage.prompt_tokens + 3 and all(x is not None for x in lp.token_logprobs[1:])


# ---------------------------------------------------------------- disconnects

def gateway_counts(cluster) -> dict:
    """The gateway's request counters: {(name, finished_reason or ""): value}."""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(cluster.http_url + "/metrics").text
    return {(s.name, s.labels.get("finished_reason", "")): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name in ("vllm:request_success_total", "vllm:generation_tokens_total",
                                             "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total")}


def test_client_disconnect_frees_blocks(cluster, ckpt):
    c = cluster.client
    before = settle(c)
    counts = gateway_counts(cluster)
    budget = 3000  # far more than the few chunks read below: only a cancel stops it early
    # (logprobs: an event per token; the random model's text can be bytes that no event may show yet)
    body = {"model": ckpt, "prompt": [[9, 10, 11, 12]] , "max_tokens": budget, "temperature": 0, "stream": True,
            "ignore_eos": True, "logprobs": 0}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", cluster.http_url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(x.startswith("data: ") for x in got)
            assert c.stats().running == 1
        # leaving the block closed the connection mid-stream
    after = settle(c)
    assert after.generated_tokens - before.generated_tokens < budget  # stopped, not finished

    # a non-streaming request whose client gives up (read timeout) is cancelled too
    body.update(stream=False)
    with httpx.Client(timeout=httpx.Timeout(30, read=1.0)) as h, pytest.raises(httpx.ReadTimeout):
        h.post(cluster.http_url + "/v1/completions", json=body)
    after2 = settle(c)
    assert after2.generated_tokens - after.generated_tokens < budget
    # the gateway's metrics count both, as cut short ("abort", vLLM's reason) with what they got
    now = gateway_counts(cluster)
    delta = {k: v - counts.get(k, 0) for k, v in now.items()}
    assert delta[("vllm:request_success_total", "abort")] == 2
    assert delta[("vllm:e2e_request_latency_seconds_count", "")] == 2
    assert delta[("vllm:generation_tokens_total", "")] > 0
    # the stream's 4 prompt tokens count from its first token, as vLLM counts them (no final usage came)
    assert delta[("vllm:prompt_tokens_total", "")] >= 4


# ---------------------------------------------------------------- features waiting for the server

def test_n_choices_share_the_prompt(cluster, oai, ckpt):
    r = oai.completions.create(model=ckpt, prompt=[[3, 4, 5, 6]] * 2, max_tokens=5, n=3, temperature=1.0, seed=5,
                               extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == list(range(6))
    assert r.usage.completion_tokens == 30 and r.usage.prompt_tokens == 8
    chat = oai.chat.completions.create(model=ckpt, messages=[{"role": "user", "content": "hello"}], n=2,
                                       max_tokens=4, temperature=1.0, seed=3)
    assert [c.index for c in chat.choices] == [0, 1]
    res = cluster.client.generate(prompt_token_ids=[3, 4, 5, 6], max_new_tokens=5, n=3, temperature=1.0, seed=5,
                                  ignore_eos=True)
    assert len(res.choices) == 3 and res.token_ids == res.choices[0].token_ids
    settle(cluster.client)


def test_min_tokens_masks_stop_tokens(cluster, oai, ckpt):
    first = cluster.client.generate(prompt_token_ids=[7, 8, 9], max_new_tokens=1).token_ids[0]
    r = oai.completions.create(model=ckpt, prompt=[[7, 8, 9]], max_tokens=8, temperature=0, logprobs=0,
                               extra_body={"stop_token_ids": [first], "min_tokens": 4,
                                           "return_tokens_as_token_ids": True})
    assert len(r.choices[0].logprobs.tokens) >= 4


def test_top_logprobs(cluster, oai, ckpt):
    r = oai.completions.create(model=ckpt, prompt=[[7, 8, 9]], max_tokens=4, temperature=0, logprobs=3,
                               extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    assert lp.top_logprobs is not None and all(len(t) == 3 for t in lp.top_logprobs)
    for tok_, chosen, alts in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        best = max(alts.values())
        assert alts[tok_] == pytest.approx(chosen) and chosen == pytest.approx(best)  # greedy: the best one
    chat = oai.chat.completions.create(model=ckpt, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       temperature=0, logprobs=True, top_logprobs=2)
    assert all(len(c.top_logprobs) == 2 for c in chat.choices[0].logprobs.content)


def test_penalties_change_greedy_output(cluster, oai, ckpt):
    kw = dict(model=ckpt, prompt=[[7, 8, 9]], max_tokens=24, temperature=0, logprobs=0)
    plain = oai.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    ids = ids_of(plain.choices[0].logprobs.tokens)
    assert len(set(ids)) < len(ids)  # the random model repeats itself greedily...
    pen = oai.completions.create(**kw, frequency_penalty=2.0,
                                 extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True,
                                             "repetition_penalty": 1.5})
    assert ids_of(pen.choices[0].logprobs.tokens) != ids  # ...and stops doing so when penalised


# ---------------------------------------------------------------- metrics

def _scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (comments dropped)."""
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def _one(metrics: dict, name: str, **labels) -> float:
    hits = [v for k, v in metrics.items() if k.split("{")[0] == name
            and all(f'{lk}="{lv}"' in k for lk, lv in labels.items())]
    assert len(hits) == 1, (name, labels, [k for k in metrics if k.startswith(name)])
    return hits[0]


def test_metrics_agree_with_stats(cluster, oai, ckpt):
    c = cluster.client
    settle(c)
    m0 = _scrape(cluster.http_url)
    rs = [oai.completions.create(model=ckpt, prompt=p, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
          for p in prompts(3, seed=4)]
    m1 = _scrape(cluster.http_url)

    def delta(name, **labels):
        return _one(m1, name, **labels) - (_one(m0, name, **labels) if any(
            k.split("{")[0] == name and all(f'{a}="{b}"' in k for a, b in labels.items()) for k in m0) else 0.0)
    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:prompt_tokens_total") == sum(r.usage.prompt_tokens for r in rs)
    assert delta("vllm:generation_tokens_total") == 15
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert delta("vllm:inter_token_latency_seconds_count") == 12
    assert _one(m1, "minipaged:gateway_http_requests_total", endpoint="/v1/completions", status="200") >= 3

    # during a job, its workers held still so that Stats and the scrape see the same moment
    job = c.submit([{"prompt_token_ids": [5] * 40 + [i], "max_new_tokens": 200, "ignore_eos": True}
                    for i in range(6)])
    try:
        with frozen(cluster, until=lambda st: st.running >= 2 and st.used_blocks > 0) as st:
            m = _scrape(cluster.http_url)
        for name in ("used_blocks", "free_blocks", "cached_blocks", "shared_blocks", "num_blocks",
                     "internal_fragmentation_tokens"):
            assert _one(m, f"minipaged:{name}") == getattr(st, name), name
        assert _one(m, "minipaged:cache_epoch") == pytest.approx(st.cache_epoch, rel=1e-12)
        assert _one(m, "vllm:kv_cache_usage_perc") == pytest.approx(st.used_blocks / st.num_blocks)
        assert _one(m, "vllm:num_requests_running") == st.running >= 2
        assert _one(m, "vllm:num_requests_waiting") == st.waiting
        assert _one(m, "minipaged:ready") == 1 and _one(m, "minipaged:metadata_up") == 1
        for ch in st.chains:
            chain = str(ch["chain_id"])
            assert _one(m, "minipaged:chain_free_blocks", chain=chain) == ch["free_blocks"]
            assert _one(m, "minipaged:chain_running", chain=chain) == ch["running"]
    finally:
        c.wait(job)
    settle(c)


# ---------------------------------------------------------------- auth, queue full, no chain

@pytest.fixture(scope="module")
def guarded():
    """tiny, a token on the service and the gateway, and a queue of one request."""
    with LocalCluster(model="tiny", workers=1, token="sekrit", http=True,
                      extra_service_args=["--max-waiting", "1"]) as c:
        yield c


def test_token_and_queue_full(guarded):
    url = guarded.http_url + "/v1"
    with openai.OpenAI(base_url=url, api_key="wrong", max_retries=0) as bad, \
            pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert httpx.get(url + "/models").status_code == 401
    with openai.OpenAI(base_url=url, api_key="sekrit", max_retries=0) as good:
        # ignore_eos: the tiny model samples at temperature 1, and an early EOS would end it at 1 token
        assert good.completions.create(model="tiny", prompt="hi", max_tokens=2,
                                       extra_body={"ignore_eos": True}).usage.completion_tokens == 2
        # one long request holds the only place in the queue: the next is refused with 429
        body = {"model": "tiny", "prompt": "hold", "max_tokens": 3000, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=30, headers={"Authorization": "Bearer sekrit"}) as h:
            with h.stream("POST", url + "/completions", json=body) as r:
                lines = r.iter_lines()
                first = [next(lines) for _ in range(4)]
                assert first[0].startswith("data: ") and guarded.client.stats().running == 1, first
                with pytest.raises(openai.RateLimitError, match="queue full") as info:
                    good.completions.create(model="tiny", prompt="hi", max_tokens=2)
                assert info.value.response.headers["retry-after"] == "1"
        # more prompts (a job: more requests) than the queue ever holds is a 400, not "retry"
        with pytest.raises(openai.BadRequestError, match="admits at most 1 at a time"):
            good.completions.create(model="tiny", prompt=["a", "b"], max_tokens=2)
    with pytest.raises(InvalidArgument, match="2 requests in one call"):
        guarded.client.submit([{"prompt": "a", "max_new_tokens": 2}] * 2)
    assert guarded.client.stats().max_waiting == 1
    # the SDK's list of prompts keeps no more in flight than the queue admits (Probe R: it was refused
    # "queue full: retry" however often retried)
    assert [len(r.token_ids) for r in guarded.client.generate(["a", "b", "c"], max_new_tokens=2, ignore_eos=True)] == [2] * 3
    settle(guarded.client)


def test_no_worker_chain_is_503(tmp_path):
    port, http_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": ROOT}
    procs = [subprocess.Popen([sys.executable, "-m", "metadata_service", "--port", str(port), "--db",
                               str(tmp_path / "jobs.db")], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT)]
    procs.append(subprocess.Popen([sys.executable, "-m", "gateway", "--metadata", f"127.0.0.1:{port}", "--port",
                                   str(http_port), "--model", "tiny"], cwd=ROOT, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
    try:
        url, end = f"http://127.0.0.1:{http_port}", time.monotonic() + 60
        while True:
            try:
                health = httpx.get(url + "/health")
                if health.json().get("status") != "unavailable":
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < end and all(p.poll() is None for p in procs)
            time.sleep(0.2)
        assert health.status_code == 503 and health.json()["ready"] is False
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
            with pytest.raises(openai.InternalServerError) as info:
                c.completions.create(model="tiny", prompt="hi", max_tokens=2)
            assert info.value.status_code == 503 and "no worker chain" in str(info.value)
            assert info.value.response.headers["retry-after"] == "5"
        assert "minipaged:ready" in httpx.get(url + "/metrics").text
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_a_gateway_stopped_ends_what_outlives_its_grace_with_an_error(cluster, ckpt):
    """Probe J: SIGTERM gave requests a fixed ~10 s whatever the grace, then uvicorn cancelled them:
    a stream stopped mid-body (no [DONE], no error: a client could not tell) and a whole request got
    a plain-text 500. With --grace 1 both still running then end as OpenAI errors, and it exits 0."""
    http_port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT}
    gw = subprocess.Popen([sys.executable, "-m", "gateway", "--metadata", cluster.address, "--port", str(http_port),
                           "--model", ckpt, "--grace", "1"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{http_port}/v1/completions"
    body = {"model": ckpt, "prompt": [5, 6, 7], "max_tokens": 3900, "temperature": 0, "ignore_eos": True}
    out: dict = {}
    try:
        end = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{http_port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < end and gw.poll() is None
            time.sleep(0.2)

        def stream():
            with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
                out["events"] = [line for line in r.iter_lines() if line.startswith("data: ")]

        def whole():
            r = httpx.post(url, json=body, timeout=60)
            out["whole"] = (r.status_code, r.headers.get("content-type"), r.json())
        threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        gw.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert gw.wait(30) == 0
    finally:
        if gw.poll() is None:
            gw.kill()
    events = out["events"]
    assert events[-1] == "data: [DONE]" and "shutting down" in events[-2], events[-3:]
    status, ctype, err = out["whole"]
    assert status == 503 and ctype == "application/json" and "shutting down" in err["error"]["message"]
    assert "Traceback" not in gw.stderr.read()
    settle(cluster.client)


# ---------------------------------------------------------------- the SDK against the real service

def test_sdk_jobs_list_delete_snapshot_and_worker_port(cluster, capsys):
    import client
    from client.__main__ import main as cli_main
    c = cluster.client
    job = c.submit([{"prompt_token_ids": [4, 5, 6], "max_new_tokens": 2}])
    c.wait(job)
    listed = c.list_jobs(limit=10)
    assert listed[0].job_id == job and listed[0].state == "done" and listed[0].created > 0
    assert [j.job_id for j in c.list_jobs(state="done")][:1] == [job]
    assert cli_main(["jobs", "--address", cluster.address, "--json", "--limit", "1"]) == 0
    assert job in capsys.readouterr().out
    assert c.delete_job(job).job_id == job
    with pytest.raises(client.NotFound):
        c.get_job(job)
    assert job not in [j.job_id for j in c.list_jobs()]

    snap, st = c.pool_snapshot(), c.stats()
    assert len(snap.chains) == st.num_chains == 1 and snap.chains[0].num_blocks == st.num_blocks
    assert sum(snap.chains[0].block_state[i] == 0 for i in range(len(snap.chains[0].block_state))) > 0

    worker = cluster.processes[1].args
    address = f"127.0.0.1:{worker[worker.index('--port') + 1]}"
    with client.Client(address) as w, pytest.raises(client.Unimplemented, match="is a MiniPaged worker"):
        w.stats()
    assert cli_main(["generate", "--address", address, "--prompt", "x"]) == 1
    assert "not the metadata service" in capsys.readouterr().err


def test_vllm_utility_routes_request_ids_and_nulls(cluster, ckpt, tok):
    """Probe S: vLLM's /ping, /version, /tokenize and /detokenize were a bare 404; X-Request-Id was
    ignored; fields sent as null (vLLM's Optional ones) and `bad_words: []` were a 400."""
    url = cluster.http_url
    assert httpx.get(url + "/ping").status_code == 200 and httpx.post(url + "/ping").status_code == 200
    assert httpx.get(url + "/version").json()["version"]
    text = "Hello there, world"
    t = httpx.post(url + "/tokenize", json={"model": ckpt, "prompt": text, "return_token_strs": True}).json()
    assert t["tokens"] == tok.encode(text, add_special_tokens=False) and t["count"] == len(t["tokens"])
    assert t["token_strs"] == tok.convert_ids_to_tokens(t["tokens"]) and t["max_model_len"] > 0
    chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    want = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True)
    assert chat["tokens"] == list(getattr(want, "input_ids", want))
    assert httpx.post(url + "/detokenize", json={"tokens": t["tokens"]}).json() == {"prompt": text}
    assert httpx.post(url + "/detokenize", json={"tokens": [-3]}).status_code == 400
    assert httpx.post(url + "/tokenize", json={}).json()["error"]["param"] == "prompt"
    r = httpx.post(url + "/v1/completions", headers={"X-Request-Id": "trace-42"}, timeout=60, json={
        "prompt": "hi", "max_tokens": 2, "n": None, "stream": None, "echo": None, "logprobs": None,
        "stream_options": None, "return_token_ids": None, "bad_words": [], "best_of": None})
    assert r.status_code == 200 and r.json()["id"] == "cmpl-trace-42"
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": None, "stream": None,
        "logprobs": None, "return_tokens_as_token_ids": None, "stream_options": {"include_usage": None}})
    assert r.status_code == 200 and r.json()["id"].startswith("chatcmpl-")
    assert httpx.post(url + "/v1/completions", json={"prompt": "hi", "bad_words": ["x"]}).status_code == 400
    assert httpx.get(url + "/v1/models/").json()["object"] == "list"
    assert httpx.get(url + "/v1/models").json()["data"][0]["permission"][0]["object"] == "model_permission"
