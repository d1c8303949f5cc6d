"""OpenAI request bodies (pydantic models) and their mapping onto the SDK's keyword arguments
(build_generate_request's names). Pure: no I/O. Field names follow OpenAI's API, with vLLM's
extensions where OpenAI has no word for ours (top_k, min_tokens, repetition_penalty,
stop_token_ids, ignore_eos, chat_template_kwargs, guided_json / guided_regex / guided_choice /
structured_outputs). A value the API cannot take is a 400 naming the field (errors.bad_request)."""
from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from minipaged.constants import OPENAI_MAX_TOP_LOGPROBS

from .errors import bad_request
from .structured import structured_kwargs

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's; others are a 400


class _NullIsUnset(BaseModel):
    """A field sent as JSON null takes its default, as vLLM's Optional fields do (clients that send
    every field, unset ones as null: `"stream": null`, `"n": null`)."""

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data):
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items()
                    if not (v is None and k in fields and fields[k].default is not None)}
        return data


class StreamOptions(_NullIsUnset):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk (refused: usage comes at the end)


# vLLM request fields this server does not implement, with the value that asks for nothing: any
# other value is a 400 naming the field, where ignoring it would answer another question.
UNSUPPORTED_VLLM_FIELDS = {"prompt_logprobs": None, "skip_special_tokens": True, "allowed_token_ids": None,
                           "bad_words": None, "truncate_prompt_tokens": None, "guided_grammar": None,
                           "logits_processors": None, "spaces_between_special_tokens": True,
                           "return_token_ids": False}


class _Sampling(_NullIsUnset):
    """Fields shared by completions and chat completions. Unknown fields are ignored, as the
    OpenAI clients send some we have no use for (user, ...), except vLLM's that would change the
    answer (UNSUPPORTED_VLLM_FIELDS)."""
    model_config = ConfigDict(extra="allow")

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
    presence_penalty: float | None = None       # unset: the server's default (minipaged/generation_defaults.py), else 0
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None                  # vLLM extension: keep p >= min_p x max p (0 = off)
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
    include_stop_str_in_output: bool = False    # vLLM extension: the stop string / stop token's text stays
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
    continue_final_message: bool = False        # vLLM extension: the last (assistant) message is continued
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension (e.g. enable_thinking)
    echo: bool = False      # vLLM extension: the last message's content before the answer, when its role answers
    include_reasoning: bool = True   # vLLM extension: false drops the reasoning (and, as vLLM, the logprobs)


def _check_common(req: _Sampling) -> None:
    for name, neutral in UNSUPPORTED_VLLM_FIELDS.items():
        value = (req.model_extra or {}).get(name)
        if value not in (None, neutral, [], {}):    # null and empty ask for nothing (vLLM's bad_words: [])
            raise bad_request(f"{name} is not supported by this server", name)
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        raise bad_request("stream_options.continuous_usage_stats is not supported: usage comes in the last "
                          "chunk (include_usage)", "stream_options")
    if req.n < 1:
        raise bad_request(f"n must be >= 1, got {req.n}", "n")
    if req.best_of is not None and req.best_of < req.n:
        raise bad_request(f"best_of must be >= n, got best_of={req.best_of} n={req.n}", "best_of")
    if req.stream and req.best_of is not None and req.best_of > req.n:
        raise bad_request("best_of > n cannot stream (the best choices are known only at the end)", "best_of")


def sampling_kwargs(req: _Sampling, max_tokens: int | None, default_max_tokens: int,
                    defaults: dict | None = None) -> dict:
    """OpenAI sampling fields -> SDK keyword arguments (build_generate_request's names). A field the
    request leaves unset takes `defaults` (the server's: minipaged/generation_defaults.py), else
    OpenAI's; beam search takes none of them (its unset temperature is 0)."""
    _check_common(req)
    d = {} if req.use_beam_search else (defaults or {})

    def pick(name: str, neutral):
        value = getattr(req, name)
        return value if value is not None else d.get(name, neutral)

    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    top_k = pick("top_k", 0)
    if top_k < -1:
        raise bad_request(f"top_k must be -1 or 0 (off) or at least 1, got {top_k}", "top_k")
    kw = dict(max_new_tokens=default_max_tokens if max_tokens is None else max_tokens,
              temperature=pick("temperature", 1.0), top_k=0 if top_k < 0 else top_k,
              seed=req.seed, stop=stop or None, ignore_eos=req.ignore_eos, n=req.n, best_of=req.best_of,
              min_new_tokens=req.min_tokens, presence_penalty=pick("presence_penalty", 0.0),
              frequency_penalty=pick("frequency_penalty", 0.0),
              repetition_penalty=pick("repetition_penalty", 1.0), min_p=pick("min_p", 0.0),
              include_stop_str_in_output=req.include_stop_str_in_output)
    if req.n > 1 and not req.use_beam_search and kw["temperature"] < 1e-5:
        # vLLM's server refuses it (n identical greedy choices are a mistake, not a request)
        raise bad_request(f"n must be 1 when using greedy sampling, got {req.n}", "n")
    top_p = pick("top_p", None)
    if top_p is not None:
        kw["top_p"] = top_p  # the SDK refuses 0 (400) as the server does
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


def completion_kwargs(req: CompletionRequest, defaults: dict | None = None) -> dict:
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.logprobs is not None and not 0 <= req.logprobs <= OPENAI_MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {OPENAI_MAX_TOP_LOGPROBS}], got {req.logprobs}", "logprobs")
    kw = sampling_kwargs(req, req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, defaults)
    if req.logprobs is not None:
        kw["logprobs"] = req.logprobs
    if req.echo and (req.logprobs is not None or kw["max_new_tokens"] == 0):
        # the prompt's own logprobs (max_tokens 0: the prompt is the whole answer, and only a
        # request with prompt logprobs may ask for no token)
        kw["prompt_logprobs"] = req.logprobs or 0
    return kw


# chat_template_kwargs that the request's own fields set: those fields win, as in vLLM's
# build_chat_params (merge_kwargs); and the two vLLM refuses (resolve_chat_template_kwargs)
_OWN_TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "tools")
_REFUSED_TEMPLATE_KWARGS = ("chat_template", "tokenize", "messages", "conversation")


def template_kwargs(req: ChatCompletionRequest) -> dict:
    """The chat template's extra variables: chat_template_kwargs, less what the request says itself."""
    given = dict(req.chat_template_kwargs or {})
    refused = sorted(k for k in given if k in _REFUSED_TEMPLATE_KWARGS)
    if refused:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(refused)}: the request's own "
                          f"fields do", "chat_template_kwargs")
    out = {k: v for k, v in given.items() if k not in _OWN_TEMPLATE_FIELDS}
    if req.tools:
        out["tools"] = req.tools
    elif "tools" in given:
        out["tools"] = given["tools"]
    return out


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
                if not isinstance(part.get("text"), str):
                    raise bad_request(f"messages[{i}]: a text part needs a string \"text\"", "messages")
                texts.append(part["text"])
            content = "\n".join(texts)      # as vLLM joins text parts
        d = {k: v for k, v in (m.model_extra or {}).items()}
        d.update(role=m.role, content=content if content is not None else "")
        if m.role == "assistant" and isinstance(d.get("tool_calls"), list):
            d["tool_calls"] = [_parsed_arguments(c) for c in d["tool_calls"]]
        out.append(d)
    return out


def _parsed_arguments(call):
    """An earlier call's JSON `arguments` string as an object, as vLLM hands it to the template
    (Qwen3's writes objects with `tojson`, strings verbatim: the same call, other spacing)."""
    fn = call.get("function") if isinstance(call, dict) else None
    args = fn.get("arguments") if isinstance(fn, dict) else None
    if isinstance(args, str):
        try:
            parsed = json.loads(args) if args.strip() else {}
        except ValueError:
            return call              # not JSON: the template gets the text as it was
        return {**call, "function": {**fn, "arguments": parsed}}
    return call


def chat_kwargs(req: ChatCompletionRequest, default_max_tokens: int, defaults: dict | None = None) -> dict:
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if not 0 <= req.top_logprobs <= OPENAI_MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {OPENAI_MAX_TOP_LOGPROBS}], got {req.top_logprobs}",
                              "top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    kw = sampling_kwargs(req, max_tokens, default_max_tokens, defaults)
    if req.logprobs:
        kw["logprobs"] = req.top_logprobs or 0
    return kw
