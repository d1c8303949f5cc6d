"""The gateway's chat route with tools and reasoning, over HTTP but without processes: the app runs
in-process (httpx's ASGI transport) and its SDK client is replaced by one that replays a scripted
stream of text chunks, as the service sends them (several chunks per token group, n choices
interleaved). Checks the SSE deltas and the whole answer agree, the finish reasons, and
`--reasoning-parser none`."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from client.messages import Stats, StreamChunk, Usage
from gateway import app as app_module
from gateway.app import GatewayConfig, create_app
from tests.qwen_tokenizer import qwen3_tokenizer_dir

ANSWER = ['<think>', '\nhmm', '\n</think>', '\n\nSure', '.\n\n<tool_call>', '\n{"name": "get_weather", ',
          '"arguments": {"city": "Paris"}}', '\n</tool_call>']
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


class FakeClient:
    """AsyncClient's stream() / chunks() and stats(), replaying ANSWER for each of the n choices."""
    seen: list[dict] = []
    stop_reason = None     # what the last chunk carries (vLLM's stop_reason)

    def __init__(self, *a, **kw):
        pass

    async def stats(self, timeout=None):
        return Stats(ready=True)

    async def stream(self, **kw):
        FakeClient.seen.append(kw)
        n = kw.get("n", 1)
        for k, text in enumerate(ANSWER):
            for i in range(n):
                last = k == len(ANSWER) - 1
                yield StreamChunk(token_ids=[k], text=text, index=i, finish_reason="stop" if last else None,
                                  usage=Usage(10, len(ANSWER)) if last else None,
                                  stop_reason=FakeClient.stop_reason if last else None)
                await asyncio.sleep(0)

    chunks = stream   # the gateway's path (AsyncClient.chunks: best_of > n whole at the end)

    async def close(self):
        pass


async def _post(config: GatewayConfig, body: dict, path: str = "/v1/chat/completions"):
    app = create_app(config)
    inner = app.app  # the FastAPI app under the counting middleware: its lifespan builds the client
    async with inner.router.lifespan_context(inner):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
            r = await h.post(path, json=body)
            return r.status_code, r.text


def post(monkeypatch, body: dict, path: str = "/v1/chat/completions", **config) -> tuple[int, str]:
    monkeypatch.setattr(app_module, "AsyncClient", FakeClient)
    cfg = GatewayConfig(metadata="127.0.0.1:1", model=qwen3_tokenizer_dir(), **config)
    return asyncio.run(_post(cfg, body, path))


def sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_tools_and_reasoning_stream_and_whole_agree(monkeypatch):
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "n": 2, "max_tokens": 20}
    status, text = post(monkeypatch, body)
    assert status == 200, text
    whole = json.loads(text)
    for ch in whole["choices"]:
        msg = ch["message"]
        assert ch["finish_reason"] == "tool_calls"
        assert msg["reasoning"] == msg["reasoning_content"] == "\nhmm\n"
        assert msg["content"] == "\n\nSure.\n\n"
        [call] = msg["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert "<tool_call>" in FakeClient.seen[-1]["prompt"] or "# Tools" in FakeClient.seen[-1]["prompt"]
    status, text = post(monkeypatch, {**body, "stream": True})
    assert status == 200
    for i in range(2):
        deltas = [c["choices"][0] for c in sse(text) if c["choices"] and c["choices"][0]["index"] == i]
        got = {"reasoning": "", "content": "", "calls": []}
        for d in deltas:
            got["reasoning"] += d["delta"].get("reasoning") or ""
            got["content"] += d["delta"].get("content") or ""
            got["calls"] += [c["function"] for c in d["delta"].get("tool_calls", [])]
        assert got == {"reasoning": "\nhmm\n", "content": "\n\nSure.\n\n",
                       "calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]}
        assert [d["finish_reason"] for d in deltas if d["finish_reason"]] == ["tool_calls"]


def test_reasoning_parser_none_and_tool_choice_none(monkeypatch):
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "none"}
    status, text = post(monkeypatch, body, reasoning_parser="none")
    msg = json.loads(text)["choices"][0]
    assert status == 200 and msg["finish_reason"] == "stop"
    assert msg["message"] == {"role": "assistant", "content": "".join(ANSWER), "reasoning": None,
                              "reasoning_content": None}   # null, as vLLM's ChatMessage has them


@pytest.mark.parametrize("reason", [None, 151643, "</tool_call>"])
def test_stop_reason_where_vllm_puts_it(monkeypatch, reason):
    """vLLM's stop_reason: in every whole choice; in chat streams on the last chunk of a choice only;
    in completion streams on every chunk (null until the last)."""
    monkeypatch.setattr(FakeClient, "stop_reason", reason)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", {"prompt": "hi", "max_tokens": 20})):
        status, text = post(monkeypatch, body, path, reasoning_parser="none")
        [choice] = json.loads(text)["choices"]
        assert status == 200 and choice["finish_reason"] == "stop" and choice["stop_reason"] == reason
        status, text = post(monkeypatch, {**body, "stream": True}, path, reasoning_parser="none")
        rows = [c["choices"][0] for c in sse(text) if c["choices"]]
        assert rows[-1]["finish_reason"] == "stop" and rows[-1]["stop_reason"] == reason
        if path == "/v1/completions":
            assert all("stop_reason" in r and r["stop_reason"] is None for r in rows[:-1])
        else:
            assert not any("stop_reason" in r for r in rows[:-1])


@pytest.mark.parametrize("body,needle", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope', which is not in tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
     "not a valid JSON schema"),
])
def test_bad_tools_are_400_before_any_generation(monkeypatch, body, needle):
    FakeClient.seen.clear()
    status, text = post(monkeypatch, {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **body})
    assert status == 400 and needle in json.loads(text)["error"]["message"], text
    assert FakeClient.seen == []


def test_a_stream_that_fails_to_start_answers_instead_of_hanging(monkeypatch):
    def broken(self, **kw):
        raise RuntimeError("the SDK could not start the stream")
    monkeypatch.setattr(FakeClient, "chunks", broken)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with pytest.raises(RuntimeError, match="could not start"):   # (the server's 500; it used to hang)
        post(monkeypatch, body)


def test_vllm_chat_fields_echo_parts_and_refusals(monkeypatch):
    """vLLM's chat `echo` (the continued message before the answer, whole and streamed), text parts
    joined by "\\n" as vLLM joins them, and vLLM fields this server does not implement refused."""
    FakeClient.seen.clear()
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]},
            {"role": "assistant", "content": "Well,"}]
    body = {"messages": msgs, "max_tokens": 4, "echo": True, "add_generation_prompt": False,
            "continue_final_message": True, "chat_template_kwargs": {"enable_thinking": False}}
    status, text = post(monkeypatch, body, reasoning_parser="none")
    assert status == 200, text
    assert json.loads(text)["choices"][0]["message"]["content"] == "Well," + "".join(ANSWER)
    assert "Hi\n there" in FakeClient.seen[-1]["prompt"]
    status, text = post(monkeypatch, {**body, "stream": True}, reasoning_parser="none")
    deltas = [c["choices"][0]["delta"] for c in sse(text) if c["choices"]]
    assert deltas[1] == {"content": "Well,"} and "".join(d.get("content") or "" for d in deltas) == "Well," + "".join(ANSWER)
    status, text = post(monkeypatch, {**body, "add_generation_prompt": True, "continue_final_message": False,
                                      "messages": msgs[:1]}, reasoning_parser="none")
    assert json.loads(text)["choices"][0]["message"]["content"] == "".join(ANSWER)   # a user turn: no echo
    for extra, field in (({"return_token_ids": True}, "return_token_ids"),
                         ({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
                          "stream_options")):
        status, text = post(monkeypatch, {"messages": msgs[:1], **extra})
        assert status == 400 and json.loads(text)["error"]["param"] == field, text


def test_legacy_logprobs_name_special_tokens_and_hold_the_chosen_one():
    """Special tokens by name in logprobs (they decoded to "" and two of them collided in one
    top_logprobs row), and vLLM's rows: the chosen token first, then the k best."""
    from gateway import openai_api as oa
    from minipaged.tokenizer import HFTokenizer

    tok = HFTokenizer(qwen3_tokenizer_dir())
    text = lambda t, context=None: tok.decode([t], skip_special_tokens=False)  # noqa: E731 (the gateway's rule)
    hello = tok.encode("Hello")[0]
    ch = oa.Choice(0, token_ids=[hello, 151645], logprobs=[-0.5, -0.1],
                   top=[{151643: -0.2, 151644: -3.0}, {151645: -0.1}])
    lp = oa.completion_logprobs(ch, text)
    assert lp["tokens"] == ["Hello", "<|im_end|>"]
    assert lp["top_logprobs"][0] == {"Hello": -0.5, "<|endoftext|>": -0.2, "<|im_start|>": -3.0}
    assert list(lp["top_logprobs"][0])[0] == "Hello" and lp["top_logprobs"][1] == {"<|im_end|>": -0.1}
    assert oa.completion_logprobs(oa.Choice(0, token_ids=[hello], logprobs=[-0.5]), text)["top_logprobs"] == \
        [{"Hello": -0.5}]                                                  # logprobs 0: the token alone
