"""Qwen3's `<think>...</think>` split out of a chat answer, streamed or whole.

What vLLM's `qwen3` reasoning parser returns, with one rule of ours for where reasoning starts:
- the output opens reasoning with `<think>` as its first non-blank text (Qwen3 templates up to
  the 2507 release, where the model writes `<think>` itself), or the prompt already left a
  `<think>` open (templates that put `<think>` in the prompt: the model writes only `</think>`);
- reasoning ends at `</think>`; everything after it is content (not stripped: vLLM keeps the
  "\\n\\n" the model writes after `</think>`, and so do we);
- an answer cut short inside its reasoning (no `</think>`) is all reasoning, as in vLLM;
- with `enable_thinking: false` the template writes `<think>\\n\\n</think>\\n\\n` into the prompt:
  the prompt has no open `<think>`, the answer is content.
vLLM's newest parser also calls an answer reasoning when the model never wrote `<think>` and the
prompt opened none; we call that content, because a model that did not think gave an answer.

`Reasoning(open_).feed(delta)` returns (reasoning delta, content delta) and holds back a tail that
may be the start of a tag, so deltas never split `<think>` or `</think>`; `finish()` flushes it.
Whole answers go through the same code (`split`), so a stream and a whole answer always agree."""
from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "none")
DEFAULT_PARSER = "qwen3"


TURN = "<|im_start|>"


def prompt_opens_reasoning(prompt: str) -> bool:
    """True when the rendered prompt ends inside a `<think>` block the template opened. Only the
    last turn counts (the generation prompt, or the assistant message being continued): a user or
    system message that merely mentions `<think>` opens nothing."""
    tail = prompt[prompt.rfind(TURN) + len(TURN):] if TURN in prompt else prompt
    return tail.rfind(START) > tail.rfind(END)


def tag_ids(tokenizer) -> tuple:
    """(id of `<think>`, id of `</think>`) in this tokenizer, None where a tag is not one token."""
    out = []
    for tag in (START, END):
        try:
            ids = tokenizer.encode(tag) if tokenizer is not None else []
        except Exception:  # noqa: BLE001 - a tokenizer that cannot: no count, not an error
            ids = []
        out.append(ids[0] if len(ids) == 1 else None)
    return tuple(out)


def count_reasoning_tokens(token_ids, start_id: int | None, end_id: int | None, open_: bool = False) -> int:
    """vLLM's usage.completion_tokens_details.reasoning_tokens: the tokens between `<think>` and
    `</think>` (the tags not counted; from the start when the prompt left `<think>` open)."""
    if end_id is None:
        return 0
    depth, count = int(open_), 0
    for t in token_ids:
        if t == start_id:
            depth += 1
        elif t == end_id:
            depth = max(0, depth - 1)
        elif depth:
            count += 1
    return count


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (held back)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class Reasoning:
    """One choice's split. States: "start" (nothing but blanks yet), "reasoning", "content"."""

    def __init__(self, open_: bool = False):
        self.state = "reasoning" if open_ else "start"
        self.buf = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        reasoning = content = ""
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(START):
                self.state, self.buf = "reasoning", head[len(START):]
            elif START.startswith(head):
                return "", ""              # blanks, or a part of "<think>": wait for more
            else:
                self.state = "content"
        if self.state == "reasoning":
            at = self.buf.find(END)
            if at < 0:
                keep = _partial_tail(self.buf, END)
                reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return reasoning, ""
            reasoning, self.buf, self.state = self.buf[:at], self.buf[at + len(END):], "content"
        if self.state == "content":
            content, self.buf = self.buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back: reasoning if inside `<think>`, else content."""
        rest, self.buf = self.buf, ""
        return (rest, "") if self.state == "reasoning" else ("", rest)


def split(text: str, open_: bool = False) -> tuple[str | None, str | None]:
    """A whole answer -> (reasoning or None, content or None)."""
    r = Reasoning(open_)
    a, b = r.feed(text)
    c, d = r.finish()
    return (a + c) or None, (b + d) or None
