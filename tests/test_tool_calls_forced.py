"""Forced tool calls end to end: tool_choice "required" and a named function are constrained by
the JSON schemas of gateway/tool_calls.py (structured outputs, the SDK's `json_schema=`), so even a
random-weight Qwen3 (Qwen's real tokenizer, vocab 151,936) returns calls whose arguments validate
against the function's parameters, through `minipaged serve` and the official `openai` client."""
from __future__ import annotations

import inspect
import json
import signal

import jsonschema
import openai
import pytest

from client.messages import build_generate_request
from tests.qwen_tokenizer import make_qwen3_checkpoint
from tests.test_serve import Serve

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    "json_schema" not in inspect.signature(build_generate_request).parameters,
    reason="needs structured outputs (the SDK's json_schema=), merged separately")]

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "required": ["zone"],
        "additionalProperties": False, "$defs": {"zone": {"enum": ["CET", "UTC"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
USER = [{"role": "user", "content": "Weather in Paris, and the time?"}]
BY_NAME = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def oai(tmp_path_factory):
    d = make_qwen3_checkpoint(str(tmp_path_factory.mktemp("qwen3-random")), seed=5)
    s = Serve(d, "--served-model-name", "x", "--dtype", "float32")
    try:
        s.wait_for("ready in")
        with openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="x", max_retries=0) as client:
            yield client
        s.p.send_signal(signal.SIGINT)
        assert s.p.wait(timeout=120) == 0
    finally:
        s.kill()


def valid(call) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, BY_NAME[call.function.name])
    return args


def test_named_function_is_called_with_valid_arguments(oai):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = oai.chat.completions.create(model="x", messages=USER, tools=TOOLS, tool_choice=choice, temperature=0,
                                    max_tokens=200)
    ch = r.choices[0]
    assert ch.finish_reason == "stop", ch         # a named function: "stop", as OpenAI's API and vLLM say
    [call] = ch.message.tool_calls
    assert call.function.name == "get_weather"
    args = valid(call)
    # streamed: the arguments arrive as deltas and concatenate to the same call
    name, pieces = None, []
    for chunk in oai.chat.completions.create(model="x", messages=USER, tools=TOOLS, tool_choice=choice,
                                             temperature=0, max_tokens=200, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or []:
            name = name or tc.function.name
            pieces.append(tc.function.arguments or "")
    assert name == "get_weather" and json.loads("".join(pieces)) == args


def test_required_returns_calls_that_validate(oai):
    for seed in range(3):
        r = oai.chat.completions.create(model="x", messages=USER, tools=TOOLS, tool_choice="required",
                                        temperature=1.0, seed=seed, max_tokens=300)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        assert ch.message.tool_calls
        for call in ch.message.tool_calls:
            valid(call)
    r = oai.chat.completions.create(model="x", messages=USER, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, temperature=0, max_tokens=300)
    assert len(r.choices[0].message.tool_calls) == 1
