"""The server's sampling defaults (minipaged/generation_defaults.py): a request's unset sampling
fields take the checkpoint's generation_config.json, as vLLM's `--generation-config auto` does;
`vllm` gives OpenAI's; `--override-generation-config` merges over either. Checked token for token
against the SDK with the same values sent explicitly (seeded), and against transformers' greedy
tokens where the defaults make sampling greedy (top_k 1)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch

from client import LocalCluster
from client.cluster import free_port
from minipaged import generation_defaults as gd
from gateway import openai_requests as oa
from tests.checkpoints import load_oracle, make_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3_GENERATION = {"bos_token_id": 0, "do_sample": True, "eos_token_id": [1], "pad_token_id": 0,
                    "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}


def _write(directory, cfg) -> str:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump(cfg, f)
    return str(directory)


# ---------------------------------------------------------------- unit: the file, the flags, the mapping

def test_load_takes_the_sampling_fields_the_file_sets(tmp_path):
    d = _write(tmp_path / "m", {**QWEN3_GENERATION, "max_new_tokens": 50, "repetition_penalty": 1.05})
    assert gd.load("auto", d) == dict(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.05,
                                      max_tokens=50)
    assert gd.load("vllm", d) == {}
    assert gd.load("auto", d, {"temperature": 0.2, "top_k": -1}) == dict(
        temperature=0.2, top_p=0.95, top_k=-1, repetition_penalty=1.05, max_tokens=50)
    assert gd.load("vllm", d, {"top_k": 1}) == {"top_k": 1}
    other = _write(tmp_path / "other", {"temperature": 0.3})
    assert gd.load(other, d) == {"temperature": 0.3}          # a directory of its own
    assert gd.load("auto", None) == {} and gd.load("auto", "tiny") == {}
    assert gd.load("auto", str(tmp_path / "none-here")) == {}  # no file: no defaults
    assert gd.load("auto", _write(tmp_path / "z", {"min_p": 0.05})) == {"min_p": 0.05}


@pytest.mark.parametrize("cfg, words", [
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"top_p": True}, "top_p must be a number"),
    ({"min_p": 1.5}, "min_p 1.5 is out of range"),
    ({"top_p": 0}, "top_p 0.0 is out of range"),
    ({"max_new_tokens": 0}, "max_new_tokens 0 is out of range"),
])
def test_load_refuses_what_it_cannot_apply(tmp_path, cfg, words):
    d = _write(tmp_path / "m", cfg)
    with pytest.raises(ValueError, match=words):
        gd.load("auto", d)


def test_override_and_source_errors(tmp_path):
    assert gd.parse_override(None) == {} and gd.parse_override('{"temperature": 0.7}') == {"temperature": 0.7}
    for bad, words in (("{", "not valid JSON"), ("[1]", "expected a JSON object"), ('{"seed": 1}', "unknown field")):
        with pytest.raises(ValueError, match=words):
            gd.parse_override(bad)
    with pytest.raises(ValueError, match="expected auto, vllm or a directory"):
        gd.load("greedy", None)
    # a bad override is the flag's error, not the checkpoint file's; the file's fields it names give way
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.9}')
    with pytest.raises(ValueError, match=r"^--override-generation-config: temperature -1.0 is out of range"):
        gd.load("auto", str(tmp_path), {"temperature": -1})
    assert gd.load("auto", str(tmp_path), {"temperature": 0.2}) == {"temperature": 0.2, "top_p": 0.9}
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        gd.load("auto", str(tmp_path))


def test_unset_fields_take_the_defaults_set_ones_win():
    defaults = dict(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.05, presence_penalty=0.5,
                    max_tokens=50)
    kw = oa.completion_kwargs(oa.CompletionRequest(prompt="hi"), defaults)
    assert (kw["temperature"], kw["top_p"], kw["top_k"], kw["repetition_penalty"], kw["presence_penalty"],
            kw["frequency_penalty"]) == (0.6, 0.95, 20, 1.05, 0.5, 0.0)
    assert kw["max_new_tokens"] == 16              # a completion's default max_tokens stays OpenAI's (vLLM too)
    kw = oa.completion_kwargs(oa.CompletionRequest(prompt="hi", temperature=0, top_p=1.0, top_k=-1,
                                                   presence_penalty=0), defaults)
    assert (kw["temperature"], kw["top_p"], kw["top_k"], kw["presence_penalty"]) == (0, 1.0, 0, 0)
    kw = oa.completion_kwargs(oa.CompletionRequest(prompt="hi"), None)   # no defaults: OpenAI's
    assert kw["temperature"] == 1.0 and "top_p" not in kw and kw["top_k"] == 0
    # beam search keeps its own rule: an unset temperature is 0 and nothing else is filled in
    kw = oa.completion_kwargs(oa.CompletionRequest(prompt="hi", n=2, use_beam_search=True), defaults)
    assert kw["temperature"] == 0.0 and "top_p" not in kw and kw["top_k"] == 0 and kw["repetition_penalty"] == 1.0
    assert oa.completion_kwargs(oa.CompletionRequest(prompt="hi", min_p=0.1), defaults)["min_p"] == 0.1
    assert oa.completion_kwargs(oa.CompletionRequest(prompt="hi"), {**defaults, "min_p": 0.2})["min_p"] == 0.2
    assert oa.completion_kwargs(oa.CompletionRequest(prompt="hi"), defaults)["min_p"] == 0.0


@pytest.mark.parametrize("args, words", [
    (["--override-generation-config", "{"], "not valid JSON"),
    (["--generation-config", "greedy"], "expected auto, vllm or a directory"),
])
def test_gateway_refuses_to_start_with_bad_defaults(args, words):
    r = subprocess.run([sys.executable, "-m", "gateway", "--port", str(free_port()), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and words in r.stderr, r.stderr


# ---------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ckpt-gencfg"))
    make_checkpoint(num_layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32, vocab=320, seed=5, directory=d)
    return _write(d, {**QWEN3_GENERATION, "max_new_tokens": 5})


def _gateway(address: str, ckpt: str, *args: str):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "--metadata", address, "--port", str(port),
                             "--model", ckpt, *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url, end = f"http://127.0.0.1:{port}", time.monotonic() + 60
    while time.monotonic() < end:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the gateway did not become healthy")


def _ids(oai_client, ckpt, **kw) -> list[int]:
    r = oai_client.completions.create(model=ckpt, prompt=[[5, 6, 7, 8]], max_tokens=8, seed=7, logprobs=0,
                                      extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True,
                                                  **kw.pop("extra_body", {})}, **kw)
    return [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]


@pytest.mark.slow
def test_requests_take_the_checkpoints_sampling_defaults(ckpt):
    with LocalCluster(model=ckpt, workers=1, dtype="float64", http=True) as c:
        sdk = c.client
        same = dict(prompt_token_ids=[5, 6, 7, 8], max_new_tokens=8, seed=7, ignore_eos=True)
        card = sdk.generate(**same, temperature=0.6, top_p=0.95, top_k=20).token_ids
        plain = sdk.generate(**same, temperature=1.0).token_ids
        greedy = sdk.generate(**same, temperature=0.0).token_ids
        assert len({tuple(card), tuple(plain), tuple(greedy)}) == 3    # (this seed tells the three apart)
        with openai.OpenAI(base_url=c.http_url + "/v1", api_key="x", max_retries=0) as oai:
            assert _ids(oai, ckpt) == card                               # auto: Qwen3's card from the file
            assert _ids(oai, ckpt, temperature=1.0, top_p=1.0, extra_body={"top_k": -1}) == plain
            assert _ids(oai, ckpt, temperature=0) == greedy
            chat = oai.chat.completions.create(model=ckpt, messages=[{"role": "user", "content": "hi"}],
                                               extra_body={"ignore_eos": True})
            assert chat.usage.completion_tokens == 5                     # max_new_tokens: chat's default
            beams = oai.completions.create(model=ckpt, prompt=[[5, 6, 7]], max_tokens=3, n=2,
                                           extra_body={"use_beam_search": True, "ignore_eos": True})
            assert len(beams.choices) == 2                               # the defaults do not reach beams
        vllm_gw, vllm_url = _gateway(c.address, ckpt, "--generation-config", "vllm")
        greedy_gw, greedy_url = _gateway(c.address, ckpt, "--generation-config", "vllm",
                                         "--override-generation-config", '{"top_k": 1}')
        try:
            with openai.OpenAI(base_url=vllm_url + "/v1", api_key="x", max_retries=0) as oai:
                assert _ids(oai, ckpt) == plain                          # vllm: OpenAI's temperature 1
            with openai.OpenAI(base_url=greedy_url + "/v1", api_key="x", max_retries=0) as oai:
                got = _ids(oai, ckpt)
        finally:
            for p in (vllm_gw, greedy_gw):
                p.terminate()
                p.wait(timeout=30)
    oracle = load_oracle(ckpt, torch.float64)
    with torch.no_grad():
        want = oracle.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, 4:].tolist()
    assert got == want == greedy                                         # top_k 1 over temperature 1: greedy


def test_bad_values_are_one_line_errors_and_bounds_are_the_wires(tmp_path):
    """JSON's Infinity / NaN, ints past int32, an unreadable file: ValueError naming the field or
    file (python -m gateway and minipaged serve print it and exit), never another exception."""
    for cfg, words in (({"top_k": float("inf")}, "top_k must be finite"), ({"temperature": float("nan")}, "finite"),
                       ({"top_k": 2**31}, "top_k 2147483648 is out of range"),
                       ({"max_new_tokens": 10**12}, "out of range")):
        d = _write(tmp_path / f"m{len(words)}{cfg}", cfg)
        with pytest.raises(ValueError, match=words):
            gd.load("auto", d)
    d = tmp_path / "unreadable"
    d.mkdir()
    (d / "generation_config.json").write_bytes(b"\xff\xfe{")   # not UTF-8 text
    with pytest.raises(ValueError, match="generation_config.json: not UTF-8 text"):
        gd.load("auto", str(d))


def test_chat_default_max_tokens_precedence():
    """--default-max-tokens when given, else the file's max_new_tokens (not for beam search), else 256."""
    from gateway.app import _default_max_tokens
    from gateway.state import GatewayConfig

    class Gw:
        max_model_len, tokenizer = None, None

        def __init__(self, flag, defaults):
            self.config, self.sampling_defaults = GatewayConfig(metadata="x", default_max_tokens=flag), defaults

        def prompt_len(self, item):
            return None               # no tokenizer: the length is unknown

    assert _default_max_tokens(Gw(None, {"max_tokens": 50}), "p") == 50
    assert _default_max_tokens(Gw(None, {"max_tokens": 50}), "p", beams=True) == 256
    assert _default_max_tokens(Gw(None, {}), "p") == 256
    assert _default_max_tokens(Gw(77, {"max_tokens": 50}), "p") == 77


def test_the_log_line_credits_each_default_to_where_it_came_from():
    line = gd.describe({"top_p": 0.9, "temperature": 0.7}, "auto", {"temperature": 0.7})
    assert "top_p 0.9 (from generation_config.json)" in line
    assert "temperature 0.7 (from --override-generation-config)" in line
    only = gd.describe({"temperature": 0.7}, "vllm", {"temperature": 0.7})
    assert "from vllm" not in only and "--generation-config vllm" not in only   # that flag is already set
