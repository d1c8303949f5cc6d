"""The OpenAI API's shapes and their mapping onto our Generate request and back.

Pure functions and pydantic models only: no I/O here (app.py runs the requests). Field names
follow OpenAI's API, with vLLM's extensions where OpenAI has no word for ours (top_k, min_tokens,
repetition_penalty, stop_token_ids, ignore_eos, chat_template_kwargs, guided_json / guided_regex /
guided_choice / structured_outputs)."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from client.messages import StreamChunk, Usage
from minipaged.constants import OPENAI_MAX_TOP_LOGPROBS

from .errors import bad_request
from .structured import structured_kwargs

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's; others are a 400


# ---------------------------------------------------------------- requests

class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions. Unknown fields are ignored, as the
    OpenAI clients send some we have no use for (user, ...)."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None      # OpenAI's default is 1
    top_p: float | None = None
    top_k: int | None = None              # vLLM extension; 0 or -1 = off
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    return_tokens_as_token_ids: bool = False    # vLLM extension: logprob tokens as "token_id:N"
    # structured outputs (gateway/structured.py): OpenAI's response_format, vLLM's extensions
    response_format: dict[str, Any] | None = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    use_beam_search: bool = False               # vLLM extension: n beams (metadata_service/beam.py)
    length_penalty: float | None = None         # beam search: score = logprob / length ** length_penalty
    early_stopping: Union[bool, Literal["never"]] = False


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: passed to the template

    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True          # vLLM extension
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension (e.g. enable_thinking)


def _check_common(req: _Sampling) -> None:
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if req.n < 1:
        raise bad_request(f"n must be >= 1, got {req.n}", "n")
    if req.best_of is not None and req.best_of < req.n:
        raise bad_request(f"best_of must be >= n, got best_of={req.best_of} n={req.n}", "best_of")
    if req.stream and req.best_of is not None and req.best_of > req.n:
        raise bad_request("best_of > n cannot stream (the best choices are known only at the end)", "best_of")


def sampling_kwargs(req: _Sampling, max_tokens: int | None, default_max_tokens: int) -> dict:
    """OpenAI sampling fields -> SDK keyword arguments (build_generate_request's names)."""
    _check_common(req)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    kw = dict(max_new_tokens=default_max_tokens if max_tokens is None else max_tokens,
              temperature=1.0 if req.temperature is None else req.temperature,
              top_k=0 if req.top_k is None or req.top_k < 0 else req.top_k,
              seed=req.seed, stop=stop or None, ignore_eos=req.ignore_eos, n=req.n, best_of=req.best_of,
              min_new_tokens=req.min_tokens, presence_penalty=req.presence_penalty,
              frequency_penalty=req.frequency_penalty,
              repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty)
    if req.top_p is not None:
        kw["top_p"] = req.top_p  # the SDK refuses 0 (400) as the server does
    if req.stop_token_ids:
        kw["stop_token_ids"] = req.stop_token_ids
    kw.update(structured_kwargs(req))
    if req.use_beam_search:
        _beam_kwargs(req, kw)
    return kw


def _beam_kwargs(req: _Sampling, kw: dict) -> None:
    """vLLM's use_beam_search: `n` beams, all returned best first. Beam search is greedy: an unset
    temperature means 0; a set one > 0 (or top_p / top_k, best_of) the service refuses (400)."""
    kw.update(beam_width=req.n, n=None, early_stopping=req.early_stopping)
    if req.temperature is None:
        kw["temperature"] = 0.0
    if req.length_penalty is not None:
        kw["length_penalty"] = req.length_penalty


def completion_prompts(req: CompletionRequest) -> list[dict]:
    """prompt as a string, a list of strings, token ids, or a list of token-id lists -> one dict
    per prompt ({"prompt": str} or {"prompt_token_ids": [...]})."""
    p = req.prompt
    if isinstance(p, str):
        return [{"prompt": p}]
    if not p:
        raise bad_request("prompt must not be empty", "prompt")
    if all(isinstance(x, str) for x in p):
        return [{"prompt": x} for x in p]
    if all(isinstance(x, int) for x in p):
        return [{"prompt_token_ids": list(p)}]
    if all(isinstance(x, list) for x in p):
        if any(not x for x in p):
            raise bad_request("a token-id prompt must not be empty", "prompt")
        return [{"prompt_token_ids": list(x)} for x in p]
    raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of "
                      "token-id lists", "prompt")


def completion_kwargs(req: CompletionRequest) -> dict:
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.logprobs is not None and not 0 <= req.logprobs <= OPENAI_MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {OPENAI_MAX_TOP_LOGPROBS}], got {req.logprobs}", "logprobs")
    kw = sampling_kwargs(req, req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS)
    if req.logprobs is not None:
        kw["logprobs"] = req.logprobs
    if req.echo and (req.logprobs is not None or kw["max_new_tokens"] == 0):
        # the prompt's own logprobs (max_tokens 0: the prompt is the whole answer, and only a
        # request with prompt logprobs may ask for no token)
        kw["prompt_logprobs"] = req.logprobs or 0
    return kw


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """Messages as plain dicts for the template; text parts of multi-part content are joined."""
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            raise bad_request(f"messages[{i}].role {m.role!r} is not one of {', '.join(CHAT_ROLES)}", "messages")
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text":
                    raise bad_request(f"messages[{i}]: only text content parts are supported, got "
                                      f"{part.get('type')!r}", "messages")
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        d = {k: v for k, v in (m.model_extra or {}).items()}
        d.update(role=m.role, content=content if content is not None else "")
        out.append(d)
    return out


def chat_kwargs(req: ChatCompletionRequest, default_max_tokens: int) -> dict:
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if not 0 <= req.top_logprobs <= OPENAI_MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {OPENAI_MAX_TOP_LOGPROBS}], got {req.top_logprobs}",
                              "top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    kw = sampling_kwargs(req, max_tokens, default_max_tokens)
    if req.logprobs:
        kw["logprobs"] = req.top_logprobs or 0
    return kw


# ---------------------------------------------------------------- per choice state

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
    usage: Usage | None = None
    prompt_logprobs: list | None = None   # echo + logprobs: [None, lp_1, ...] (the request's first chunk)
    prompt_top: list | None = None

    def add(self, c: StreamChunk) -> None:
        if c.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top = c.prompt_logprobs, c.prompt_top_logprobs
        self.token_ids += c.token_ids
        self.text.append(c.text)
        self.logprobs += c.logprobs or []
        self.top += c.top_logprobs or []
        if c.finish_reason:
            self.finish_reason = FINISH_REASONS.get(c.finish_reason, c.finish_reason)
        if c.usage is not None:
            self.usage = c.usage


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

def completion_logprobs(choice: Choice, token_text, offset0: int = 0) -> dict | None:
    """OpenAI legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    if not choice.logprobs:
        return None
    tokens = [token_text(t) for t in choice.token_ids]
    offsets, pos = [], offset0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    top = None
    if choice.top:
        top = [{token_text(t): lp for t, lp in alts.items()} for alts in choice.top]
    return {"tokens": tokens, "token_logprobs": choice.logprobs[:len(tokens)], "top_logprobs": top,
            "text_offset": offsets}


def echo_logprobs(prompt_ids: list[int], logprobs: list, top: list | None, token_text) -> dict:
    """The echoed prompt's part of the legacy logprobs: token_logprobs and top_logprobs are null
    for the first token (nothing comes before it), as OpenAI's are."""
    tokens = [token_text(t) for t in prompt_ids]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    alts = None
    if top is not None:
        alts = [None]
        for d in top[1:]:
            row: dict[str, float] = {}
            for t, lp in d.items():       # best first: two ids of one text keep the better logprob
                row.setdefault(token_text(t), lp)
            alts.append(row)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": alts, "text_offset": offsets}


def join_logprobs(prompt: dict | None, completion: dict | None) -> dict | None:
    """Echoed prompt + completion logprobs as one legacy logprobs object."""
    if prompt is None or completion is None:
        return prompt or completion
    out = {k: prompt[k] + completion[k] for k in ("tokens", "token_logprobs", "text_offset")}
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


def chat_logprobs(choice: Choice, token_text) -> dict | None:
    if not choice.logprobs:
        return None
    # the token's raw bytes where token_text knows them (gateway/token_bytes.py), else its text's
    raw = getattr(token_text, "raw_bytes", None) or (lambda t: list(token_text(t).encode("utf-8")))
    content = []
    for k, (t, lp) in enumerate(zip(choice.token_ids, choice.logprobs)):
        s = token_text(t)
        alts = choice.top[k] if k < len(choice.top) else {}
        content.append({"token": s, "logprob": lp, "bytes": raw(t),
                        "top_logprobs": [{"token": token_text(a), "logprob": alp, "bytes": raw(a)}
                                         for a, alp in alts.items()]})
    return {"content": content}


# ---------------------------------------------------------------- responses

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


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
                    "finish_reason": ch.finish_reason})
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": out, "usage": total_usage(per_prompt)}


def chat_response(rid: str, model: str, choices: list[Choice], token_text, output=None) -> dict:
    """`output`: gateway.chat_output.OutputOptions (reasoning and tool calls parsed out)."""
    out = []
    for ch in choices:
        message, finish = {"role": "assistant", "content": "".join(ch.text)}, ch.finish_reason
        if output is not None:
            parsed = output.new()
            message = parsed.message("".join(ch.text))
            finish = parsed.finish_reason(finish)
        out.append({"index": ch.index, "message": message, "logprobs": chat_logprobs(ch, token_text),
                    "finish_reason": finish})
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": out, "usage": total_usage([choices])}


def completion_chunk(rid: str, created: int, model: str, index: int, text: str, logprobs: dict | None,
                     finish_reason: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict, logprobs: dict | None,
               finish_reason: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, created: int, model: str, obj: Literal["text_completion", "chat.completion.chunk"],
                usage: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage}
