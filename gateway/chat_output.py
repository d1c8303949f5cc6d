"""One chat choice's generated text -> the assistant message's fields: `reasoning` (and
`reasoning_content`, the same text under the older name many clients read), `content` and
`tool_calls`, as stream deltas or as the whole message.

The reasoning split (reasoning.py) runs first; its content goes to the tool-call parser
(tool_calls.py) when tool_choice is "auto". With a forced choice ("required" or a named function)
the output is the JSON the schema forced: no reasoning split, it becomes the calls. A choice that
made calls and stopped by itself finishes with "tool_calls", as in OpenAI's API and vLLM (a named
tool_choice: "stop", as theirs)."""
from __future__ import annotations

from dataclasses import dataclass

from . import reasoning as rs
from . import tool_calls as tc

REASONING_FIELDS = ("reasoning", "reasoning_content")  # vLLM's current name, and its former one


@dataclass
class OutputOptions:
    reasoning: bool = False          # split <think>...</think> out
    reasoning_open: bool = False     # the prompt left <think> open
    tools: tc.ToolPlan | None = None
    include_reasoning: bool = True   # vLLM's include_reasoning: false drops the reasoning (and logprobs)
    think_ids: tuple = (None, None)  # the ids of <think> and </think> (usage's reasoning_tokens)
    role: str = "assistant"          # vLLM's: the last message's role when no generation prompt is added

    def reasoning_tokens(self, token_ids) -> int | None:
        """vLLM's completion_tokens_details.reasoning_tokens (None when no reasoning parser runs)."""
        if not self.reasoning:
            return None
        return rs.count_reasoning_tokens(token_ids, *self.think_ids, open_=self.reasoning_open)

    def new(self) -> "ChatOutput":
        return ChatOutput(self)


def merge(a: dict, b: dict) -> dict:
    """Two deltas as one (text fields concatenated, tool call lists joined)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out[k] + v if k in out else v
    return out


class ChatOutput:
    def __init__(self, opts: OutputOptions):
        self.mode = opts.tools.mode if opts.tools else "none"
        self.plan = opts.tools
        self.reasoning = rs.Reasoning(opts.reasoning_open) if opts.reasoning and self.mode in ("none", "auto") else None
        self.include_reasoning = opts.include_reasoning
        self.role = opts.role
        self.hermes = tc.HermesParser() if self.mode == "auto" else None
        self.text = ""               # everything generated (forced modes parse it at the end)
        self.calls = 0               # tool calls sent so far (their stream indices)
        self.named_id: str | None = None

    # ------------------------------------------------------------ streaming

    def feed(self, text: str) -> dict:
        self.text += text
        if self.mode == "named":
            return self._named_delta(text)
        if self.mode == "required":
            return {}                # parsed whole at the end
        r, c = self.reasoning.feed(text) if self.reasoning else ("", text)
        return merge(self._reasoning_delta(r), self._content_delta(c, final=False))

    def finish(self) -> dict:
        if self.mode == "named":
            return {}
        if self.mode == "required":
            try:
                return self._calls_delta(tc.forced_calls(self.plan, self.text))
            except ValueError:
                return {"content": self.text} if self.text else {}
        r, c = self.reasoning.finish() if self.reasoning else ("", "")
        return merge(self._reasoning_delta(r), self._content_delta(c, final=True))

    def finish_reason(self, reason: str | None) -> str | None:
        """"tool_calls" for calls the model chose to make; a named tool_choice stays "stop", as in
        OpenAI's API and vLLM."""
        return "tool_calls" if self.calls and reason == "stop" and self.mode != "named" else reason

    def _reasoning_delta(self, r: str) -> dict:
        return {k: r for k in REASONING_FIELDS} if r and self.include_reasoning else {}

    def _content_delta(self, c: str, final: bool) -> dict:
        if self.hermes is None:
            return {"content": c} if c else {}
        events = self.hermes.feed(c) + (self.hermes.finish() if final else [])
        text = "".join(v for k, v in events if k == "content")
        delta = {"content": text} if text else {}
        calls = [v for k, v in events if k == "call"]
        return merge(delta, self._calls_delta(calls)) if calls else delta

    def _calls_delta(self, calls: list[dict]) -> dict:
        if self.plan is not None and not self.plan.parallel:
            calls = calls[:max(0, 1 - self.calls)]   # parallel_tool_calls false: the first call only (vLLM's)
        out = []
        for call in calls:
            out.append({"index": self.calls, **call})
            self.calls += 1
        return {"tool_calls": out} if out else {}

    def _named_delta(self, text: str) -> dict:
        """A named call streams its arguments as the model writes them (the first delta carries
        the id and the name), as vLLM does."""
        if self.named_id is None:
            call = tc.tool_call(self.plan.name, "")
            self.named_id, self.calls = call["id"], 1
            return {"tool_calls": [{"index": 0, **call, "function": {"name": self.plan.name,
                                                                      "arguments": text}}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}

    # ------------------------------------------------------------ whole answers

    def message(self, text: str) -> dict:
        """The whole message for a non-streamed choice (same parsers as the stream). `reasoning` is
        always there, null without any (vLLM's ChatMessage has the field: clients read
        `message.reasoning`, and the openai SDK has no attribute for a key that never came)."""
        msg: dict = {"role": self.role, "content": None, **dict.fromkeys(REASONING_FIELDS)}
        if self.mode in ("named", "required"):
            try:
                calls = tc.forced_calls(self.plan, text)
            except ValueError:
                msg["content"] = text    # cut short: the text as it is
                return msg
            self.calls = len(calls)
            msg["content"], msg["tool_calls"] = "", calls
            return msg
        delta = merge(self.feed(text), self.finish())
        for k in REASONING_FIELDS:
            if k in delta:
                msg[k] = delta[k]
        msg["content"] = delta.get("content")
        if msg["content"] is None and not delta.get("tool_calls") and not any(k in delta for k in REASONING_FIELDS):
            msg["content"] = ""          # an empty answer stays "", as before
        if delta.get("tool_calls"):
            if not (msg["content"] or "").strip():
                msg["content"] = None    # only the blank lines around the calls: vLLM says null too
            msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in delta["tool_calls"]]
        return msg
