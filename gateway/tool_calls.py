"""Tool calls on /v1/chat/completions: the request's `tools` and `tool_choice` checked, the model's
`<tool_call>{...}</tool_call>` output parsed (vLLM's `hermes` parser, the format Qwen3's template
asks for), and the JSON schemas that force a call (vLLM's approach for "required" and a named
function).

- `plan(tools, tool_choice, parallel_tool_calls)` checks the request (400 with the reason) and
  says what to do: "none" (tools rendered, output not parsed), "auto" (parse `<tool_call>` blocks),
  "named" or "required" (generation constrained by `forced_schema(plan)`, output wrapped by
  `forced_calls(plan, text)`).
- `HermesParser().feed(text)` turns streamed text into ("content", str) and ("call", dict)
  events: text outside the blocks stays content (held back while it may be the start of
  `<tool_call>`), each block becomes one call when its `</tool_call>` arrives. A block that is not
  a JSON object with a "name" stays content, as written. Whole answers use the same code, so a
  stream and a whole answer always agree."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from .errors import bad_request
from .reasoning import _partial_tail

START, END = "<tool_call>", "</tool_call>"


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's form


def tool_call(name: str, arguments: str) -> dict:
    """One entry of message.tool_calls (arguments is a JSON string, as OpenAI sends it)."""
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class ToolPlan:
    mode: str = "none"
    functions: dict[str, dict] = field(default_factory=dict)  # name -> {"name", "parameters", ...}
    name: str | None = None                                   # the named function
    parallel: bool = True


def _check_schema(schema, where: str) -> None:
    if not isinstance(schema, dict):
        raise bad_request(f"{where}: parameters must be a JSON schema object", "tools")
    try:
        import jsonschema
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise bad_request(f"{where}: parameters is not a valid JSON schema: {e.message}", "tools") from None


def _functions(tools) -> dict[str, dict]:
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    out: dict[str, dict] = {}
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise bad_request(f"{where}: only tools of type \"function\" are supported", "tools")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{where}: missing the \"function\" object", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{where}: function.name must be a non-empty string", "tools")
        if name in out:
            raise bad_request(f"{where}: function name {name!r} is given twice", "tools")
        if "parameters" in fn and fn["parameters"] is not None:
            _check_schema(fn["parameters"], f"{where} ({name})")
        out[name] = fn
    return out


def plan(tools, tool_choice, parallel_tool_calls: bool | None = None) -> ToolPlan:
    """Check `tools` and `tool_choice` (OpenAI's shapes) -> what to do with them."""
    functions = _functions(tools) if tools else {}
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    if tool_choice is None:
        return ToolPlan("auto" if functions else "none", functions, parallel=parallel)
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise bad_request(f"tool_choice must be \"none\", \"auto\", \"required\" or "
                              f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {tool_choice!r}",
                              "tool_choice")
        if tool_choice == "required" and not functions:
            raise bad_request("tool_choice \"required\" needs tools", "tool_choice")
        mode = "none" if tool_choice == "auto" and not functions else tool_choice
        return ToolPlan(mode, functions, parallel=parallel)
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request("a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                          "tool_choice")
    if name not in functions:
        known = ", ".join(sorted(functions)) or "none"
        raise bad_request(f"tool_choice names the function {name!r}, which is not in tools (tools: {known})",
                          "tool_choice")
    return ToolPlan("named", functions, name=name, parallel=parallel)


# ---------------------------------------------------------------- forced calls

_EMPTY_OBJECT = {"type": "object", "properties": {}}


def _params(fn: dict) -> dict:
    return fn.get("parameters") or _EMPTY_OBJECT


def forced_schema(p: ToolPlan) -> dict | None:
    """The JSON schema the output must match: a named function's own parameters; for "required"
    an array of {"name", "parameters"} objects, anyOf over the tools (vLLM's). Each tool's `$defs`
    move to the root, where their "#/$defs/..." references point once the schema is nested."""
    if p.mode == "named":
        return _params(p.functions[p.name])
    if p.mode != "required":
        return None
    defs: dict = {}
    options = []
    for name, fn in p.functions.items():
        params = dict(_params(fn))
        for key in ("$defs", "definitions"):
            found = params.pop(key, None)
            for dname, dschema in (found.items() if isinstance(found, dict) else ()):
                have = defs.setdefault(key, {})
                if dname in have and have[dname] != dschema:   # one root for all: they would clash
                    raise ValueError(f"Tool definition {dname!r} has multiple schemas, which is not supported.")
                have[dname] = dschema
        options.append({"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                         "parameters": params},
                        "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if not p.parallel:
        schema["maxItems"] = 1
    schema.update(defs)
    return schema


def forced_calls(p: ToolPlan, text: str) -> list[dict]:
    """A constrained output -> message.tool_calls. A named function's call holds the text as its
    arguments even when cut short (vLLM's, and what a stream sends); for "required", ValueError
    when it does not parse (a length cut): the caller then returns the text as content."""
    # strict=False: a string may hold raw control characters, which the grammar lets through
    # (xgrammar's string with maxLength allows U+0000-U+001F); a length cut still fails to parse
    if p.mode == "named":     # vLLM's: the call, whatever was generated (a length cut: partial arguments)
        return [tool_call(p.name, text.strip())]
    calls = json.loads(text, strict=False)
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                              for c in calls):
        raise ValueError("not an array of {name, parameters} objects")
    return [tool_call(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in calls]


# ---------------------------------------------------------------- auto: the hermes format

def parse_block(block: str) -> dict | None:
    """The JSON inside one <tool_call> block -> a tool call, or None when it is not one."""
    try:
        obj = json.loads(block.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
        return None      # (vLLM's hermes parser reads obj["arguments"]: without it the text stays content)
    args = obj["arguments"]
    return tool_call(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class HermesParser:
    """Streamed text -> events. States: "text" (content, watching for <tool_call>), "call" (inside
    a block). As vLLM's hermes parser, content is the text before the first call: text between or
    after calls is dropped."""

    def __init__(self):
        self.state, self.buf, self.calls = "text", "", 0

    def feed(self, delta: str) -> list[tuple[str, object]]:
        self.buf += delta
        events: list[tuple[str, object]] = []
        while True:
            if self.state == "text":
                at = self.buf.find(START)
                if at < 0:
                    keep = _partial_tail(self.buf, START)
                    text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                    if text and not self.calls:   # after a call, text is not content (vLLM's hermes)
                        events.append(("content", text))
                    return events
                text = self.buf[:at]
                if text and not self.calls:
                    events.append(("content", text))
                self.state, self.buf = "call", self.buf[at + len(START):]
            else:
                at = self.buf.find(END)
                if at < 0:
                    return events
                block, self.buf, self.state = self.buf[:at], self.buf[at + len(END):], "text"
                events.append(self._block(block, closed=True))

    def _block(self, block: str, closed: bool) -> tuple[str, object]:
        call = parse_block(block)
        if call is None:    # not a call: text, which after a call is not content either
            return "content", "" if self.calls else START + block + (END if closed else "")
        self.calls += 1
        return "call", call

    def finish(self) -> list[tuple[str, object]]:
        """An unterminated last block is still a call when its JSON is whole (as vLLM's regex)."""
        rest, self.buf = self.buf, ""
        if self.state == "call":
            self.state = "text"
            return [self._block(rest, closed=False)]
        if rest and not self.calls:
            return [("content", rest)]
        return []


def parse(text: str) -> tuple[str | None, list[dict]]:
    """A whole answer -> (content or None, tool calls)."""
    p = HermesParser()
    events = p.feed(text) + p.finish()
    content = "".join(v for k, v in events if k == "content")
    return content or None, [v for k, v in events if k == "call"]
