"""Tool calls and reasoning in the gateway, without processes: the tool_choice checks, the
schemas that force a call, the hermes parser and the <think> split, streamed in every possible
cut and whole (they must agree), and the Qwen3 template rendering tools as transformers does."""
from __future__ import annotations

import json

import jsonschema
import pytest

from gateway import reasoning as rs
from gateway import tool_calls as tc
from gateway.chat_output import OutputOptions, merge
from gateway.errors import GatewayError

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "required": ["zone"],
    "$defs": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}}
NOARGS = {"type": "function", "function": {"name": "ping"}}


def cuts(text: str):
    """Every way to stream `text` in two or three pieces (and one char at a time)."""
    yield [text]
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    for i in range(0, len(text) + 1, 3):
        for j in range(i, len(text) + 1, 5):
            yield [text[:i], text[i:j], text[j:]]


def stream(opts: OutputOptions, pieces, reason="stop"):
    out = opts.new()
    delta = {}
    for p in pieces:
        delta = merge(delta, out.feed(p))
    return merge(delta, out.finish()), out.finish_reason(reason)


# ---------------------------------------------------------------- tool_choice and tools

def test_plan_defaults_and_modes():
    assert tc.plan(None, None).mode == "none"
    assert tc.plan([WEATHER], None).mode == "auto"
    assert tc.plan([WEATHER], "none").mode == "none"
    assert tc.plan([WEATHER], "required").mode == "required"
    p = tc.plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert (p.mode, p.name) == ("named", "get_time")
    assert tc.plan(None, "auto").mode == "none"


@pytest.mark.parametrize("tools,choice,needle", [
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "'nope', which is not in tools"),
    ([WEATHER], "sometimes", "tool_choice must be"),
    (None, "required", "needs tools"),
    (None, {"type": "function", "function": {"name": "get_weather"}}, "not in tools"),
    ([WEATHER], {"type": "function"}, "a named tool_choice is"),
    ([{"type": "retrieval"}], None, "only tools of type"),
    ([{"type": "function"}], None, "missing the \"function\" object"),
    ([{"type": "function", "function": {"name": ""}}], None, "non-empty string"),
    ([WEATHER, WEATHER], None, "given twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}], None,
     "not a valid JSON schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None, "JSON schema object"),
    ({"name": "f"}, None, "tools must be a list"),
])
def test_bad_tools_are_400_with_the_reason(tools, choice, needle):
    with pytest.raises(GatewayError) as e:
        tc.plan(tools, choice)
    assert e.value.status == 400 and needle in e.value.message


# ---------------------------------------------------------------- forced calls

def test_named_schema_is_the_functions_parameters_and_wraps_the_output():
    p = tc.plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    assert tc.forced_schema(p) == WEATHER["function"]["parameters"]
    [call] = tc.forced_calls(p, '{"city": "Paris"}')
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    np_ = tc.plan([NOARGS], {"type": "function", "function": {"name": "ping"}})
    assert tc.forced_schema(np_) == {"type": "object", "properties": {}}
    [call] = tc.forced_calls(p, '{"city": "Par')       # cut by max_tokens: the call, partial (vLLM's; the stream's)
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}
    # a raw control character in a string (xgrammar lets U+0000-U+001F through a string with
    # maxLength): still the call, as the model wrote it (before: returned as content, 13 of 20 seeds)
    [call] = tc.forced_calls(p, '{"city": "C\x0ew"}')
    assert call["function"]["arguments"] == '{"city": "C\x0ew"}'
    [call] = tc.forced_calls(tc.plan([WEATHER], "required"), '[{"name": "get_weather", "parameters": {"city": "\x03"}}]')
    assert json.loads(call["function"]["arguments"]) == {"city": "\x03"}


def test_required_schema_accepts_exactly_valid_calls():
    p = tc.plan([WEATHER, TIME, NOARGS], "required")
    schema = tc.forced_schema(p)
    jsonschema.Draft202012Validator.check_schema(schema)
    v = jsonschema.Draft202012Validator(schema)
    good = [{"name": "get_weather", "parameters": {"city": "Oslo"}},
            {"name": "get_time", "parameters": {"zone": "CET"}}, {"name": "ping", "parameters": {}}]
    assert v.is_valid(good)
    for bad in ([], [{"name": "get_weather", "parameters": {}}],            # required city missing
                [{"name": "get_time", "parameters": {"zone": "cet"}}],      # $defs pattern kept
                [{"name": "other", "parameters": {}}], [{"name": "ping"}], {"name": "ping"}):
        assert not v.is_valid(bad), bad
    calls = tc.forced_calls(p, json.dumps(good))
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time", "ping"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [g["parameters"] for g in good]
    assert len({c["id"] for c in calls}) == 3
    one = tc.forced_schema(tc.plan([WEATHER], "required", parallel_tool_calls=False))
    assert one["maxItems"] == 1


def test_forced_choices_stream_and_whole_agree():
    named = OutputOptions(reasoning=True, tools=tc.plan([WEATHER], {"type": "function",
                                                                      "function": {"name": "get_weather"}}))
    text = '{"city": "Paris", "unit": "c"}'
    for pieces in cuts(text):
        delta, finish = stream(named, pieces)
        assert finish == "stop"             # a named function: "stop", as OpenAI's API and vLLM say
        calls = delta["tool_calls"]
        assert calls[0]["function"]["name"] == "get_weather" and calls[0]["index"] == 0
        assert "".join(c["function"]["arguments"] for c in calls) == text
        assert all("id" not in c for c in calls[1:])
    msg = named.new().message(text)
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": text}
    req = OutputOptions(tools=tc.plan([WEATHER, NOARGS], "required"))
    text = '[{"name": "ping", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]'
    delta, finish = stream(req, [text[:10], text[10:]])
    assert finish == "tool_calls" and [c["index"] for c in delta["tool_calls"]] == [0, 1]
    assert req.new().message(text)["tool_calls"][1]["function"]["arguments"] == '{"city": "Rome"}'
    assert stream(req, ['[{"name": "pi'], "length") == ({"content": '[{"name": "pi'}, "length")
    cut = named.new().message('{"city": "Pa')              # named, cut short: a call whole as streamed
    assert cut["content"] == "" and cut["tool_calls"][0]["function"]["arguments"] == '{"city": "Pa'


# ---------------------------------------------------------------- auto: hermes

def test_hermes_whole_answers_as_vllm():
    assert tc.parse("no call here") == ("no call here", [])
    content, [call] = tc.parse('Sure.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                               '\n</tool_call>')
    assert content == "Sure.\n\n"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    content, calls = tc.parse('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
                              '<tool_call>\n{"name": "b", "arguments": {"x": "é"}}\n</tool_call>\n')
    assert content is None and [c["function"]["arguments"] for c in calls] == ["{}", '{"x": "é"}']
    content, [call] = tc.parse('<tool_call>{"name": "a", "arguments": {"k": 1}}')   # unterminated, whole
    assert content is None and call["function"]["arguments"] == '{"k": 1}'
    bad = '<tool_call>{"name": "a", "argu</tool_call>'
    assert tc.parse(bad) == (bad, [])                                              # kept as written
    assert tc.parse('<tool_call>{"name": "a", "argu') == ('<tool_call>{"name": "a", "argu', [])
    # text after a call is not content: vLLM's content is what came before the first call
    content, [call] = tc.parse('Sure!<tool_call>{"name": "a", "arguments": {}}</tool_call>Waiting.')
    assert content == "Sure!" and call["function"]["name"] == "a"


AUTO_TEXTS = [
    "plain answer with < and <tool and </think> text",
    'Sure.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": '
    '{"y": [1, 2]}}\n</tool_call>\n',
    '<tool_call>{"name": "a"} </tool_call> and then text',
    'Sure!<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>Waiting.',
    '<tool_call>not json</tool_call>',
    '<think>\nI should call it.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Oslo"}}\n</tool_call>',
    "<think>\nonly thinking, cut short",
    "  <think>x</think>answer",
]


@pytest.mark.parametrize("text", AUTO_TEXTS)
@pytest.mark.parametrize("think", [False, True])
def test_auto_stream_equals_whole_for_every_cut(text, think):
    opts = OutputOptions(reasoning=think, tools=tc.plan([WEATHER], "auto"))
    msg = opts.new().message(text)
    want_calls = [c["function"] for c in msg.get("tool_calls", [])]
    for pieces in cuts(text):
        delta, finish = stream(opts, pieces)
        # the whole answer says null for blank content around calls (as vLLM); the stream sent the blanks
        blank_around_calls = want_calls and msg["content"] is None and not (delta.get("content") or "").strip()
        assert blank_around_calls or delta.get("content") == msg["content"], pieces
        assert delta.get("reasoning") == msg.get("reasoning") == delta.get("reasoning_content")
        assert [c["function"] for c in delta.get("tool_calls", [])] == want_calls
        assert [c["index"] for c in delta.get("tool_calls", [])] == list(range(len(want_calls)))
        assert finish == ("tool_calls" if want_calls else "stop")


# ---------------------------------------------------------------- reasoning

@pytest.mark.parametrize("text,open_,want", [
    ("<think>\nhmm\n</think>\n\nHello", False, ("\nhmm\n", "\n\nHello")),
    ("Hello <think>x</think>", False, (None, "Hello <think>x</think>")),   # not at the start: content
    ("hmm</think>Hello", True, ("hmm", "Hello")),                           # the template opened <think>
    ("<think>cut short", False, ("cut short", None)),                      # max_tokens inside reasoning
    ("still thinking", True, ("still thinking", None)),
    ("Hello", False, (None, "Hello")),                                      # enable_thinking false
    ("\n<think></think>", False, (None, None)),
    ("<thin", False, (None, "<thin")),
])
def test_reasoning_split(text, open_, want):
    assert rs.split(text, open_) == want
    for pieces in cuts(text):
        r = rs.Reasoning(open_)
        parts = [r.feed(p) for p in pieces] + [r.finish()]
        got = ("".join(a for a, _ in parts) or None, "".join(b for _, b in parts) or None)
        assert got == want, pieces


def test_prompt_opens_reasoning():
    assert rs.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not rs.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not rs.prompt_opens_reasoning("<|im_start|>assistant\n")


def test_reasoning_off_keeps_everything_in_content():
    msg = OutputOptions(reasoning=False).new().message("<think>x</think>y")
    assert msg == {"role": "assistant", "content": "<think>x</think>y", "reasoning": None, "reasoning_content": None}
    assert OutputOptions(reasoning=True).new().message("") == {"role": "assistant", "content": "", "reasoning": None, "reasoning_content": None}
    msg = OutputOptions(reasoning=True).new().message("<think>x</think>y")
    assert (msg["reasoning"], msg["reasoning_content"], msg["content"]) == ("x", "x", "y")


# ---------------------------------------------------------------- Qwen3's own template

HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
           {"role": "assistant", "content": "", "reasoning_content": "Use the tool.", "tool_calls": [
               {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
               {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "rain"},
           {"role": "tool", "tool_call_id": "c2", "content": "12:00"}]


@pytest.fixture(scope="module")
def qwen3_templates():
    """transformers' tokenizer, and our ChatTemplate on both of its rendering paths."""
    from transformers import AutoTokenizer

    from gateway.chat_template import ChatTemplate, _template_in
    from tests.qwen_tokenizer import qwen3_tokenizer_dir
    src = qwen3_tokenizer_dir()
    with_tok = ChatTemplate(src)
    bare = ChatTemplate(src)                              # the path taken when no tokenizer loads
    bare._tokenizer, bare._jinja = None, ChatTemplate._compile(_template_in(src), src)
    return AutoTokenizer.from_pretrained(src), with_tok, bare


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
@pytest.mark.parametrize("history", [HISTORY[1:2], HISTORY])
def test_qwen3_template_renders_tools_as_transformers(qwen3_templates, kwargs, history):
    """Both of our rendering paths (the tokenizer's apply_chat_template, and jinja2 alone when no
    tokenizer loads) give transformers' text for tools, tool calls and tool results."""
    tok, with_tok, bare = qwen3_templates
    want = tok.apply_chat_template(history, tools=[WEATHER, TIME], tokenize=False, add_generation_prompt=True,
                                   **kwargs)
    assert "<tools>" in want and ("<tool_response>" in want) == (len(history) > 2)
    assert with_tok.thinks and "tokenizer" in with_tok.source
    assert with_tok.render(history, True, tools=[WEATHER, TIME], **kwargs) == want
    assert bare.render(history, True, tools=[WEATHER, TIME], **kwargs) == want


def test_a_forced_tool_choice_does_not_mix_with_another_constraint():
    from gateway.app import _forced_tool_kwargs
    assert _forced_tool_kwargs(tc.plan([WEATHER], "auto"), {}) == {}
    for other in ({"regex": "a+"}, {"json_schema": {}}, {"choice": ["a"]}, {"json_object": True}):
        with pytest.raises(GatewayError) as e:
            _forced_tool_kwargs(tc.plan([WEATHER], "required"), other)
        assert e.value.status == 400 and "cannot be combined with response_format" in e.value.message


# ---------------------------------------------------------------- as vLLM's server answers (probe V)

def test_a_message_that_mentions_think_opens_no_reasoning():
    """Only the last turn (the generation prompt, or the message being continued) can leave
    <think> open: a user or system message quoting the tag does not."""
    assert not rs.prompt_opens_reasoning("<|im_start|>user\nWhat does <think> do?<|im_end|>\n<|im_start|>assistant\n")
    assert rs.prompt_opens_reasoning("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nso")


def test_a_call_without_arguments_stays_content():
    """vLLM's hermes parser reads obj["arguments"]: a block that says "parameters" is no call."""
    text = '<tool_call>{"name": "get_weather", "parameters": {"city": "Paris"}}</tool_call>'
    assert tc.parse(text) == (text, [])


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = AUTO_TEXTS[2]                  # two calls
    opts = OutputOptions(tools=tc.plan([WEATHER], "auto", parallel_tool_calls=False))
    assert [c["function"]["name"] for c in opts.new().message(text)["tool_calls"]] == ["a"]
    for pieces in cuts(text):
        delta, finish = stream(opts, pieces)
        assert [c["index"] for c in delta["tool_calls"]] == [0] and finish == "tool_calls"


def test_include_reasoning_false_and_reasoning_tokens():
    text = "<think>\nhmm\n</think>\n\nanswer"
    opts = OutputOptions(reasoning=True, include_reasoning=False)
    msg = opts.new().message(text)
    assert msg == {"role": "assistant", "content": "\n\nanswer", "reasoning": None, "reasoning_content": None}
    assert "reasoning" not in stream(opts, list(text))[0]
    assert rs.count_reasoning_tokens([5, 1, 2, 3, 6, 9], 5, 6) == 3
    assert rs.count_reasoning_tokens([1, 2, 6, 9], 5, 6, open_=True) == 2      # the prompt opened it
    assert OutputOptions(reasoning=False).reasoning_tokens([5, 1, 6]) is None  # no parser: no details


def test_same_named_defs_of_two_tools_are_refused():
    other = {"type": "function", "function": {"name": "get_date", "parameters": {
        "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}},
        "$defs": {"zone": {"type": "integer"}}}}}
    with pytest.raises(ValueError, match="'zone' has multiple schemas"):
        tc.forced_schema(tc.plan([TIME, other], "required"))
    same = json.loads(json.dumps(TIME))
    same["function"]["name"] = "get_time2"
    assert tc.forced_schema(tc.plan([TIME, same], "required"))["$defs"] == TIME["function"]["parameters"]["$defs"]


def test_developer_messages_and_string_arguments_render_as_vllm(qwen3_templates):
    from gateway import openai_api as oa
    tok, with_tok, bare = qwen3_templates
    assert not with_tok.knows_developer
    dev = with_tok.render([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert dev == with_tok.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    req = oa.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "", "tool_calls": [call]}])
    [_, assistant] = oa.chat_messages(req)
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
