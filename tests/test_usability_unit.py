"""Issue 21's rough edges that need no cluster: bad checkpoints as one line, the worker without
torch, console-script names, the gateway's OpenAI wording of errors, chat roles, logprob bytes,
the byte-level fallback's vocab limit, the client's hints. (tests/test_usability.py runs the
rest end to end.)"""
from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import types

import pytest

import client
from client import Client
from client.__main__ import main as cli_main
from gateway import openai_api as oa
from gateway.errors import GatewayError, as_gateway_error, openai_wording
from gateway.token_bytes import TokenStrings, token_bytes
from minipaged.cli import prog_name
from minipaged.config import check_weights_present, config_shape, load_model_config
from minipaged.tokenizer import ByteTokenizer, byte_fallback_problem, load_tokenizer
from tests.test_client_unit import fake  # noqa: F401 (fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOOD = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}


def _ckpt(tmp_path, cfg) -> str:
    d = tmp_path / "ckpt"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return str(d)


# ---------------------------------------------------------------- bad checkpoints: one line each

@pytest.mark.parametrize("cfg, match", [
    ('{"vocab_size": 512,\n "hidden_size": }', r"config.json: not valid JSON \(Expecting value at line 2 column 17\)"),
    ({k: v for k, v in GOOD.items() if k != "num_hidden_layers"}, "config.json: missing required field 'num_hidden_layers'"),
    (dict(GOOD, hidden_size="big"), "config.json: field 'hidden_size' must be a positive integer, got 'big'"),
    (dict(GOOD, num_key_value_heads=0), "field 'num_key_value_heads' must be a positive integer"),
    (dict(GOOD, num_attention_heads=3, num_key_value_heads=2), r"num_attention_heads \(3\) must be a multiple of num_key_value_heads"),
    (dict(GOOD, rope_theta="x"), "field 'rope_theta' must be a positive number"),
    ("[1, 2]", "expected a JSON object, got list"),
    (dict(GOOD, hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(GOOD, use_sliding_window=True, sliding_window=64, max_window_layers=1),
     r"sliding-window attention \(1 layers of 2: use_sliding_window, sliding_window 64\) is not supported"),
    (dict(GOOD, use_sliding_window=True, sliding_window=64, layer_types=["full_attention", "sliding_attention"]),
     "sliding-window attention"),
    (dict(GOOD, rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope type 'dynamic' is not supported"),
    # present as null (transformers refuses these too; a null num_key_value_heads / head_dim is derived)
    (dict(GOOD, rms_norm_eps=None), "field 'rms_norm_eps' is null"),
    (dict(GOOD, max_position_embeddings=None), "field 'max_position_embeddings' is null"),
    (dict(GOOD, rope_theta=None), "field 'rope_theta' is null and no rope_parameters give it"),
    (dict(GOOD, quantization_config={"quant_method": "bitsandbytes", "load_in_8bit": True}),
     "quantized checkpoint \\(bitsandbytes\\)"),
])
def test_bad_config_names_the_file_and_field(tmp_path, cfg, match):
    d = _ckpt(tmp_path, cfg)
    with pytest.raises(ValueError, match=match):
        load_model_config(d)
    r = subprocess.run([sys.executable, "-m", "worker", "--model", d, "--standalone"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and os.path.join(d, "config.json") in r.stderr, r.stderr



def test_a_checkpoint_directory_it_cannot_enter_says_so(tmp_path, monkeypatch):
    """A container user who cannot enter the mounted folder was told "no config.json there"."""
    d = _ckpt(tmp_path, GOOD)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if p == d else real(p, mode))  # (we run as root)
    with pytest.raises(PermissionError, match=f"uid {os.getuid()}"):
        load_model_config(d)

def test_a_null_num_key_value_heads_is_the_head_count_as_in_transformers(tmp_path):
    assert load_model_config(_ckpt(tmp_path, dict(GOOD, num_key_value_heads=None, head_dim=None))).num_key_value_heads == 2


def test_a_checkpoint_without_weights_is_one_line(tmp_path):
    d = _ckpt(tmp_path, GOOD)
    assert config_shape(load_model_config(d)) == "vocab 512, hidden 64, 2 layers, 2 heads / 1 KV heads of 32"
    with pytest.raises(FileNotFoundError, match="no weights"):
        check_weights_present(d)
    r = subprocess.run([sys.executable, "-m", "worker", "--model", d, "--standalone"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and f"{d}: no weights (expected one of" in r.stderr
    check_weights_present("tiny")


def test_worker_without_torch_says_to_install_the_extra():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from worker.__main__ import main\n"
            "sys.exit(main(['--model', 'tiny', '--standalone']))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "the worker needs PyTorch" in r.stderr and "[worker]" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_prog_names(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/minipaged-worker", "--help"])
    assert prog_name("worker") == "minipaged-worker"
    monkeypatch.setattr(sys, "argv", [os.path.join(ROOT, "worker", "__main__.py")])
    assert prog_name("worker") == "python -m worker"


# ---------------------------------------------------------------- the byte-level fallback's vocab

def test_byte_fallback_needs_vocab_256(tmp_path):
    small = _ckpt(tmp_path, dict(GOOD, vocab_size=200))
    why = byte_fallback_problem(small, 200)
    assert why and "vocab_size 200 is under 256" in why and "prompt_token_ids" in why
    assert byte_fallback_problem(small, 300) is None and byte_fallback_problem("tiny", 512) is None
    from metadata_service.requests import RequestError, normalize
    from minipaged.v1 import metadata_pb2 as pb
    engine = types.SimpleNamespace(model_name=small, text_prompt_problem=why, tokenizer=ByteTokenizer())
    with pytest.raises(RequestError, match="byte-level fallback tokenizer needs vocab_size >= 256"):
        normalize(pb.GenerateRequest(prompt="hi", max_new_tokens=2), engine)


def test_a_text_prompt_past_the_context_whatever_its_tokens_is_refused_before_tokenizing():
    """Probe K: a 60 MB text prompt was tokenized into a Python list before its length was checked:
    seconds under the interpreter lock, a worker's heartbeat missed, the chain dropped. Now a text
    longer than max_model_len tokens of the longest piece is refused unread; a shorter one is
    tokenized into an array."""
    from metadata_service.requests import RequestError, normalize
    from minipaged.tokenizer import HFTokenizer
    from minipaged.v1 import metadata_pb2 as pb
    from tests.qwen_tokenizer import qwen3_tokenizer_dir

    def never(text):
        raise AssertionError("tokenized")
    for tok, limit in ((ByteTokenizer(), 4096), (HFTokenizer(qwen3_tokenizer_dir()), 1024)):
        engine = types.SimpleNamespace(model_name="m", text_prompt_problem=None, tokenizer=tok, max_model_len=limit,
                                       vocab_size=10 ** 6, grammar_problem=None,
                                       block_size=16, max_pool_blocks=10 ** 6)
        assert normalize(pb.GenerateRequest(prompt="héllo", max_new_tokens=2), engine).prompt_token_ids
        tok.encode_array = never
        long = "x" * (limit * tok.max_token_bytes + 1)
        with pytest.raises(RequestError, match="maximum context length is .* your prompt is at least"):
            normalize(pb.GenerateRequest(prompt=long, max_new_tokens=2), engine)


# ---------------------------------------------------------------- the gateway's wording

def test_errors_use_openai_names_and_fill_param():
    assert openai_wording("max_new_tokens must be >= 1, got 0") == ("max_tokens must be >= 1, got 0", "max_tokens")
    assert openai_wording("max_new_tokens must be >= 1 (0 only with prompt_logprobs), got 0")[0] == \
        "max_tokens must be >= 1 (0 only with echo, on /v1/completions), got 0"   # (a field HTTP refuses)
    assert openai_wording("min_new_tokens must be in [0, max_new_tokens = 4], got 5") == \
        ("min_tokens must be in [0, max_tokens = 4], got 5", "min_tokens")
    assert openai_wording("temperature must be a finite number >= 0, got -1.0")[1] == "temperature"
    assert openai_wording("queue full: 3 requests pending")[1] is None
    g = as_gateway_error(client.InvalidArgument("n must be in [1, 16], got 17"))
    assert (g.status, g.param, g.body()["error"]["param"]) == (400, "n", "n")
    busy = as_gateway_error(client.ResourceExhausted("queue full: top_p ..."))
    assert busy.status == 429 and busy.param is None


def test_unknown_chat_role_is_a_400():
    req = oa.ChatCompletionRequest(messages=[{"role": "wizard", "content": "hi"}])
    with pytest.raises(GatewayError, match=r"messages\[0\].role 'wizard' is not one of system") as info:
        oa.chat_messages(req)
    assert (info.value.status, info.value.param) == (400, "messages")
    for role in oa.CHAT_ROLES:
        oa.chat_messages(oa.ChatCompletionRequest(messages=[{"role": role, "content": "x"}]))


def test_logprob_bytes_are_the_tokens_raw_bytes(tmp_path):
    from tests.test_gateway import VOCAB, add_tokenizer
    add_tokenizer(str(tmp_path), VOCAB)
    tok = load_tokenizer(str(tmp_path))
    text = "é€"                                   # not in the BPE's corpus: one token per byte
    ids = tok.encode(text)
    assert len(ids) > 2 and "\ufffd" in tok.decode(ids[:1])
    assert b"".join(token_bytes(tok, i) for i in ids) == text.encode("utf-8")
    strings = TokenStrings(lambda t: tok.decode([t]), tok)
    choice = oa.Choice(0, token_ids=ids, logprobs=[-0.5] * len(ids), top=[{i: -0.5} for i in ids])
    content = oa.chat_logprobs(choice, strings)["content"]
    assert bytes(b for c in content for b in c["bytes"]) == text.encode("utf-8")
    assert [c["top_logprobs"][0]["bytes"] for c in content] == [c["bytes"] for c in content]
    # the token strings, as vLLM's: "" for a byte that leaves its character unfinished, the whole
    # character on the byte that completes it, so they add up to the text (and text_offset with them)
    assert [c["token"] for c in content] == ["", "é", "", "", "€"]
    assert [c["top_logprobs"][0]["token"] for c in content] == ["", "é", "", "", "€"]
    legacy = oa.completion_logprobs(choice, strings)
    assert "".join(legacy["tokens"]) == text and legacy["text_offset"] == [0, 0, 1, 1, 1]
    # a stream's later chunk reads its context from the chunks before it
    tail = oa.Choice(0, token_ids=ids[3:], logprobs=[-0.5] * 2, top=[{}, {}])
    assert oa.completion_logprobs(tail, strings, 1, context=ids[:3])["tokens"] == ["", "€"]
    assert list(token_bytes(ByteTokenizer(), 0xE9)) == [0xE9] and token_bytes(None, 5) is None
    bt = ByteTokenizer()
    assert bt.decode([0xC3, 0xA9, 257], skip_special_tokens=False) == "é<|im_start|>"   # (was "��<|im_start|>")


# ---------------------------------------------------------------- the client's hints and CLI

def test_stats_at_an_http_port_says_so(capsys):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{server.server_address[1]}"
    try:
        with Client(address, timeout=10) as c, pytest.raises(client.Unavailable, match="answers HTTP/1.1, not gRPC"):
            c.stats()
        assert cli_main(["stats", "--address", address, "--timeout", "10"]) == 1
        assert "is it the gateway's HTTP port" in capsys.readouterr().err
    finally:
        server.shutdown()
        server.server_close()


def test_stream_refuses_best_of_before_any_rpc():
    with Client("127.0.0.1:1") as c, pytest.raises(client.InvalidArgument, match=r"best_of \(3\) > n \(1\)"):
        list(c.stream("x", best_of=3))


def test_cli_stream_json_prints_json_lines(fake, capsys):  # noqa: F811
    _, address = fake
    assert cli_main(["generate", "--address", address, "--prompt-ids", "1,2", "--max-new-tokens", "3",
                     "--stream", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert "".join(x["text"] for x in lines) == "def" and lines[-1]["finish_reason"] == "length"
    assert set(lines[0]) >= {"token_ids", "text", "finish_reason", "usage", "index"}


def test_local_cluster_keeps_the_logs_of_a_failed_run(tmp_path, capsys):
    """`make demo` (scripts/demo.py) printed a log directory that it deleted on failure too."""
    import shutil

    from client import LocalCluster
    from tests.test_client_unit import FAKE_SERVICE, FAKE_WORKER, REPO
    import textwrap
    for pkg, src in (("metadata_service", FAKE_SERVICE), ("worker", FAKE_WORKER)):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
        (tmp_path / pkg / "__main__.py").write_text(textwrap.dedent(src))
    with pytest.raises(RuntimeError, match="the demo failed"):
        with LocalCluster(model="tiny", workers=1, root=str(tmp_path), env={"PYTHONPATH": REPO},
                          startup_timeout=60, grace=2) as cluster:
            raise RuntimeError("the demo failed")
    assert os.path.isfile(os.path.join(cluster.log_dir, "metadata_service.log")), os.listdir(cluster.log_dir)
    assert f"logs of this failed run are kept in {cluster.log_dir}" in capsys.readouterr().err
    shutil.rmtree(cluster.log_dir)


def test_stop_reason_follows_vllm():
    """The stop string, the stop token id, or an EOS id of generation_config.json other than the
    tokenizer's own (vLLM folds those into stop_token_ids); nothing for the tokenizer's EOS."""
    from types import SimpleNamespace

    from metadata_service.results import set_stop_reason
    from metadata_service.stop import StopChecker
    from minipaged.v1 import metadata_pb2

    engine = SimpleNamespace(tokenizer=SimpleNamespace(eos_token_ids=[7]), eos_ids={7, 9})

    def reason(out, finish="stop", stop_ids=(), ignore_eos=False, checker=None):
        seq = SimpleNamespace(output_token_ids=out, stop_checker=checker,
                              params=SimpleNamespace(stop_token_ids=stop_ids, ignore_eos=ignore_eos))
        msg = metadata_pb2.GenerationResult()
        set_stop_reason(msg, seq, engine, finish)
        return msg.stop_str or (msg.stop_token_id if msg.HasField("stop_token_id") else None)

    assert reason([1, 7]) is None                      # the tokenizer's EOS
    assert reason([1, 7], stop_ids=(7,)) is None       # ... even when listed as a stop token too
    assert reason([1, 9]) == 9                         # generation_config's other EOS
    assert reason([1, 0], stop_ids=(0,)) == 0          # token 0 is an id like any other
    assert reason([1, 9], finish="length") is None
    checker = StopChecker(SimpleNamespace(decode=lambda ids: "".join(chr(97 + i) for i in ids)), ("cd", "zz"))
    assert [checker.push(t) for t in (1, 2, 3)] == [False, False, True] and checker.matched == "cd"
    assert reason([1, 2, 3], checker=checker) == "cd"


def test_a_base_model_export_without_the_model_prefix_loads_the_same_weights(tmp_path):
    """AutoModel / sentence-transformers exports name tensors `layers.0...`, `embed_tokens.weight`
    (no "model."): transformers loads them, and so does the worker (found by probing)."""
    from safetensors.torch import load_file, save_file

    from tests.checkpoints import make_checkpoint
    from worker.weights import load_state_dict, tensor_names
    d = make_checkpoint(num_layers=2, tie=True, directory=str(tmp_path / "full"))
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in os.listdir(d):
        if f != "model.safetensors":
            os.link(os.path.join(d, f), bare / f)
    state = load_file(os.path.join(d, "model.safetensors"))
    save_file({k.removeprefix("model."): v.contiguous() for k, v in state.items()}, str(bare / "model.safetensors"))
    cfg = load_model_config(d)
    want = load_state_dict(d, cfg, 0, 2)
    got = load_state_dict(str(bare), cfg, 0, 2)
    assert sorted(got) == sorted(want) and all(bool((got[k] == want[k]).all()) for k in want)
    assert "model.embed_tokens.weight" in tensor_names(str(bare))


@pytest.mark.parametrize("argv, env, needle", [
    (["worker", "--device", "cuda"], {}, "this torch sees no CUDA device"),
    (["worker", "--device", "tpu"], {}, "--device must be cpu, cuda or cuda:N"),
    (["worker", "--simulate", "{path}"], {}, "not a readable JSON profile"),
    (["gateway", "--metadata", "127.0.0.1:notaport"], {}, "the port must be a number in 1-65535"),
    (["client", "stats", "--address", ""], {}, "the address is empty"),
    (["worker", "--model", "tiny", "--metadata", "127.0.0.1:1"], {"MINIPAGED_PANEL_ROWS": "abc"},
     "MINIPAGED_PANEL_ROWS must be a whole number of rows"),
])
def test_the_wrong_environment_is_one_line_naming_it(tmp_path, argv, env, needle):
    """Probe M: each of these ended in a traceback, or in words that named no flag or variable."""
    import subprocess
    import sys
    bad = tmp_path / "profile.json"
    bad.write_text("{not json")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", *[a.replace("{path}", str(bad)) for a in argv]]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=root,
                       env={**os.environ, "PYTHONPATH": root, **env})
    assert r.returncode != 0 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr[-800:]


def test_simulated_workers_refuse_prompt_logprobs_at_admission():
    """Probe M: a simulated worker's refusal came back as INTERNAL (HTTP 500) from a failed step,
    which fails every request of that step; the service knows its workers are simulated."""
    from client import InvalidArgument, LocalCluster
    with LocalCluster(model="tiny", simulate="h200") as c:
        with pytest.raises(InvalidArgument, match="workers are simulated"):
            c.client.generate(prompt_token_ids=[1, 2, 3], max_new_tokens=2, prompt_logprobs=1)
        assert len(c.client.generate(prompt_token_ids=[1, 2, 3], max_new_tokens=2).token_ids) == 2
