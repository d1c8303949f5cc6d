"""OpenAI response bodies from our stream chunks: a choice being assembled (Choice), usage, the
legacy and chat logprobs objects, whole responses and stream chunks. Pure: no I/O."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

from client.messages import StreamChunk, Usage

FINISH_REASONS = {"length": "length", "stop": "stop", "cancelled": "abort", "": None}


@dataclass
class Choice:
    """One choice being assembled (index = prompt index * n + choice index within the prompt)."""
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string / stop token id that ended it
    usage: Usage | None = None
    prompt_logprobs: list | None = None   # echo + logprobs: [None, lp_1, ...] (the request's first chunk)
    prompt_top: list | None = None

    def __post_init__(self):
        self.logprobs, self.top = _floored(self.logprobs), _floored_top(self.top)

    def add(self, c: StreamChunk) -> None:
        if c.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top = c.prompt_logprobs, c.prompt_top_logprobs
        self.token_ids += c.token_ids
        self.text.append(c.text)
        self.logprobs += _floored(c.logprobs or [])
        self.top += _floored_top(c.top_logprobs or [])
        if c.finish_reason:
            self.finish_reason = FINISH_REASONS.get(c.finish_reason, c.finish_reason)
            self.stop_reason = c.stop_reason
        if c.usage is not None:
            self.usage = c.usage


LOGPROB_FLOOR = -9999.0   # vLLM's: JSON has no -inf (a grammar's disallowed alternatives are -inf)


def _floored(lps: list) -> list:
    return [lp if lp >= LOGPROB_FLOOR else LOGPROB_FLOOR for lp in lps]


def _floored_top(top: list) -> list:
    return [{t: (lp if lp >= LOGPROB_FLOOR else LOGPROB_FLOOR) for t, lp in alts.items()} for alts in top]


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def total_usage(per_prompt: list[list[Choice]]) -> dict:
    """Prompt tokens once per prompt (its choices share the prompt's blocks), completion tokens of
    every choice."""
    p = c = cached = 0
    for choices in per_prompt:
        usages = [ch.usage for ch in choices if ch.usage is not None]
        if usages:
            p += usages[0].prompt_tokens
            cached += usages[0].cached_tokens
        c += sum(len(ch.token_ids) for ch in choices)
    return usage_dict(p, c, cached)


# ---------------------------------------------------------------- logprobs

def completion_logprobs(choice: Choice, token_text, offset0: int = 0, context=()) -> dict | None:
    """OpenAI legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset.
    `context`: the choice's tokens before these (a stream's earlier chunks). Offsets count the token
    strings, as vLLM's do."""
    if not choice.logprobs:
        return None
    ids = list(context) + list(choice.token_ids)
    before = len(context)
    tokens = [token_text(t, _last4(ids, before + k)) for k, t in enumerate(choice.token_ids)]
    top = [_top_row(t, lp, choice.top[k] if k < len(choice.top or ()) else {}, token_text, _last4(ids, before + k))
           for k, (t, lp) in enumerate(zip(choice.token_ids, choice.logprobs))]
    return {"tokens": tokens, "token_logprobs": choice.logprobs[:len(tokens)], "top_logprobs": top,
            "text_offset": _offsets(tokens, offset0)}


def _last4(ids: list[int], end: int, start: int = 0) -> list[int]:
    """The context a token string may read (TokenStrings: at most 4 tokens before it)."""
    return ids[max(start, end - 4):end]


def _offsets(tokens: list[str], start: int = 0) -> list[int]:
    out, pos = [], start
    for t in tokens:
        out.append(pos)
        pos += len(t)
    return out


def logprobs_end(lp: dict) -> int:
    """Where the next token's text_offset starts after these legacy logprobs."""
    return lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp["tokens"] else 0


def echo_logprobs(prompt_ids: list[int], logprobs: list, top: list | None, token_text) -> dict:
    """The echoed prompt's part of the legacy logprobs: token_logprobs and top_logprobs are null
    for the first token (nothing comes before it), as OpenAI's are. Special tokens show their names,
    as the echoed text does. A later token's context is the prompt after its first token (vLLM's:
    the first position has no logprobs entry to read it from)."""
    tokens = [token_text(t, None if k == 0 else _last4(prompt_ids, k, 1)) for k, t in enumerate(prompt_ids)]
    alts = [None] + [_top_row(t, lp, (top[k] if top and k < len(top) else None) or {}, token_text,
                              _last4(prompt_ids, k, 1))
                     for k, (t, lp) in enumerate(zip(prompt_ids, logprobs)) if k > 0]
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": alts,
            "text_offset": _offsets(tokens)}


def _top_row(token: int, logprob: float, alts: dict, token_text, context=None) -> dict[str, float]:
    """One legacy top_logprobs row as vLLM writes it: the chosen token first, then the k best (so k + 1
    entries when the chosen one is not among them; logprobs 0: the chosen one alone); two ids of
    one text keep the first."""
    row = {token_text(token, context): logprob}
    for t, lp in alts.items():
        row.setdefault(token_text(t, context), lp)
    return row


def join_logprobs(prompt: dict | None, completion: dict | None) -> dict | None:
    """Echoed prompt + completion logprobs as one legacy logprobs object (the completion's offsets
    go on from the prompt's token strings, as vLLM's)."""
    if prompt is None or completion is None:
        return prompt or completion
    out = {k: prompt[k] + completion[k] for k in ("tokens", "token_logprobs")}
    out["text_offset"] = _offsets(out["tokens"])
    if prompt["top_logprobs"] is None and completion["top_logprobs"] is None:
        out["top_logprobs"] = None
    else:
        out["top_logprobs"] = (prompt["top_logprobs"] or [None] * len(prompt["tokens"])) + \
            (completion["top_logprobs"] or [None] * len(completion["tokens"]))
    return out


def prompt_logprobs_of(choices: list[Choice], prompt_index: int, n: int) -> tuple[list | None, list | None]:
    """The prompt logprobs of a prompt, from whichever of its choices got the first chunk."""
    for ch in choices:
        if ch.index // n == prompt_index and ch.prompt_logprobs is not None:
            return ch.prompt_logprobs, ch.prompt_top
    return None, None


def chat_logprobs(choice: Choice, token_text, context=()) -> dict | None:
    """`context`: the choice's tokens before these (a stream's earlier chunks)."""
    if not choice.logprobs:
        return None
    # the token's raw bytes where token_text knows them (gateway/token_bytes.py), else its text's
    raw = getattr(token_text, "raw_bytes", None) or (lambda t: list(token_text(t).encode("utf-8")))
    ids, before = list(context) + list(choice.token_ids), len(context)
    content = []
    for k, (t, lp) in enumerate(zip(choice.token_ids, choice.logprobs)):
        ctx = _last4(ids, before + k)
        alts = choice.top[k] if k < len(choice.top) else {}
        content.append({"token": token_text(t, ctx), "logprob": lp, "bytes": raw(t),
                        "top_logprobs": [{"token": token_text(a, ctx), "logprob": alp, "bytes": raw(a)}
                                         for a, alp in alts.items()]})
    return {"content": content}


# ---------------------------------------------------------------- responses

def new_id(prefix: str, request=None) -> str:
    """`prefix-<the caller's X-Request-Id>` when it sent one (vLLM's rule, for tracing through
    proxies), else `prefix-<random hex>`."""
    given = request.headers.get("x-request-id", "").strip() if request is not None else ""
    return f"{prefix}-{given[:200] if given else uuid.uuid4().hex}"


def completion_response(rid: str, model: str, choices: list[Choice], per_prompt: list[list[Choice]],
                        token_text, echo_texts: list[str] | None = None, n: int = 1,
                        prompt_ids: list[list[int]] | None = None) -> dict:
    out = []
    for ch in choices:
        prefix = echo_texts[ch.index // n] if echo_texts else ""
        lp = completion_logprobs(ch, token_text, len(prefix))
        if prompt_ids is not None:        # echo + logprobs: the prompt's tokens come first
            own, top = prompt_logprobs_of(choices, ch.index // n, n)
            if own is not None:
                lp = join_logprobs(echo_logprobs(prompt_ids[ch.index // n], own, top, token_text), lp)
        out.append({"index": ch.index, "text": prefix + "".join(ch.text), "logprobs": lp,
                    "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason})
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": out, "usage": total_usage(per_prompt)}


def chat_usage(choices: list[Choice], output=None) -> dict:
    """Usage of a chat answer; with a reasoning parser, vLLM's completion_tokens_details too."""
    usage = total_usage([choices])
    if output is not None and output.reasoning:
        usage["completion_tokens_details"] = {
            "reasoning_tokens": sum(output.reasoning_tokens(ch.token_ids) or 0 for ch in choices)}
    return usage


def chat_response(rid: str, model: str, choices: list[Choice], token_text, output=None) -> dict:
    """`output`: gateway.chat_output.OutputOptions (reasoning and tool calls parsed out)."""
    out = []
    for ch in choices:
        message = {"role": output.role if output is not None else "assistant", "content": "".join(ch.text)}
        finish = ch.finish_reason
        if output is not None:
            parsed = output.new()
            message = parsed.message("".join(ch.text))
            finish = parsed.finish_reason(finish)
        out.append({"index": ch.index, "message": message, "logprobs": chat_logprobs(ch, token_text),
                    "finish_reason": finish, "stop_reason": ch.stop_reason})
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": out, "usage": chat_usage(choices, output)}


def completion_chunk(rid: str, created: int, model: str, index: int, text: str, logprobs: dict | None,
                     finish_reason: str | None, stop_reason: str | int | None = None) -> dict:
    """vLLM's completion chunks carry stop_reason on every chunk (null until the last)."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                         "stop_reason": stop_reason}]}


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict, logprobs: dict | None,
               finish_reason: str | None, stop_reason: str | int | None = None) -> dict:
    """vLLM's chat chunks carry stop_reason on a choice's last chunk only."""
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid: str, created: int, model: str, obj: Literal["text_completion", "chat.completion.chunk"],
                usage: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage}
