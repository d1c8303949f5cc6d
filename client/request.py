"""Keyword arguments -> GenerateRequest / SubmitJobRequest, for `Client`, `AsyncClient` and the CLI.

Only type checks and the few value checks the wire cannot express are made here; the service
validates every value and answers INVALID_ARGUMENT, so the two cannot disagree."""
from __future__ import annotations

import functools
import json
import numbers
from typing import Sequence

import numpy as np

from minipaged import wire
from minipaged.constants import MAX_CHOICES, OPENAI_MAX_TOP_LOGPROBS
from minipaged.v1 import metadata_pb2 as pb

from .errors import InvalidArgument, MiniPagedError

# Keys a generate() call / a submit() item may carry (timeout is per call, not per request).
REQUEST_KEYS = ("prompt", "prompt_token_ids", "max_new_tokens", "temperature", "top_p", "top_k",
                "seed", "stop", "stop_token_ids", "ignore_eos", "return_logprobs", "logprobs", "n", "best_of",
                "min_new_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p",
                "json_schema", "regex", "choice", "json_object", "beam_width", "length_penalty", "early_stopping",
                "prompt_logprobs", "include_stop_str_in_output", "grammar_after_token_id")


def _int_array(name: str, values) -> bytes:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise TypeError(f"{name} must be a flat sequence of ints, got {values!r:.80}")
    if arr.size and (int(arr.min()) < -2**31 or int(arr.max()) >= 2**31):  # would wrap silently
        raise InvalidArgument(f"{name}: values must fit int32, got min {arr.min()} max {arr.max()}")
    return wire.pack(arr, wire.INT32)


def _before_rpc(build):
    """The SDK's own refusals (InvalidArgument before any call) say so: `before_rpc`."""
    @functools.wraps(build)
    def checked(*args, **kwargs):
        try:
            return build(*args, **kwargs)
        except MiniPagedError as e:
            e.before_rpc = True
            raise
    return checked


def _logprob_fields(logprobs, return_logprobs) -> tuple[bool, int]:
    """`logprobs=True` (or the older `return_logprobs=True`): the sampled tokens' logprobs;
    `logprobs=k` (an int >= 0): also the k best alternatives per token (OpenAI's `logprobs=k`)."""
    if logprobs is None or logprobs is False:
        return bool(return_logprobs), 0
    if logprobs is True:
        return True, 0
    if isinstance(logprobs, (int, np.integer)):
        if not 0 <= logprobs <= OPENAI_MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"logprobs must be True or an int in [0, {OPENAI_MAX_TOP_LOGPROBS}] (alternatives "
                                  f"per token), got {logprobs}")
        return True, int(logprobs)
    raise TypeError(f"logprobs must be a bool or an int, got {logprobs!r}")


@_before_rpc
def refuse_unstreamable(request: pb.GenerateRequest) -> None:
    """stream() with best_of > n: the winners are known only when every candidate has ended, so
    there is nothing to stream (generate() and the gateway's non-streaming path wait for them)."""
    n = max(1, request.n)
    if request.best_of > n:
        raise InvalidArgument(f"best_of ({request.best_of}) > n ({n}) cannot be streamed: which choices win "
                              f"is known only at the end; use generate() (it waits for them) or submit() a job")


@_before_rpc
def build_generate_request(prompt: str | None = None, prompt_token_ids: Sequence[int] | None = None,
                           max_new_tokens: int = 32, temperature: float = 0.0, top_p: float | None = None,
                           top_k: int = 0, seed: int | None = None, stop: str | Sequence[str] | None = None,
                           stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
                           return_logprobs: bool = False, logprobs: bool | int | None = None,
                           n: int | None = None, best_of: int | None = None, min_new_tokens: int = 0,
                           repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                           frequency_penalty: float = 0.0, min_p: float = 0.0, json_schema: dict | str | None = None,
                           regex: str | None = None, choice: Sequence[str] | None = None,
                           json_object: bool = False, beam_width: int = 0,
                           length_penalty: float | None = None,
                           early_stopping: bool | str = False,
                           prompt_logprobs: int | None = None,
                           include_stop_str_in_output: bool = False,
                           grammar_after_token_id: int | None = None) -> pb.GenerateRequest:
    """Type checks and the few value checks the wire cannot express (top_p=0, both prompt forms);
    the server validates every value and answers INVALID_ARGUMENT.

    Structured outputs (at most one): `json_schema` (a dict or its JSON text), `regex`, `choice` (a
    list of strings), `json_object=True` (any JSON object); `grammar_after_token_id`: the constraint
    starts after that token is generated (a reasoning model's </think>). beam_width=K: beam search
    (transformers' num_beams=K, num_return_sequences=K): K choices, best first, each with its
    cumulative_logprob and beam_score; n must then be unset or K. include_stop_str_in_output
    (vLLM's): the text keeps the matched stop string, or the stop token's text."""
    _check_prompt_and_ints(prompt, prompt_token_ids, (
        ("max_new_tokens", max_new_tokens), ("top_k", top_k), ("seed", seed), ("n", n),
        ("best_of", best_of), ("min_new_tokens", min_new_tokens), ("beam_width", beam_width)))
    _check_numbers(("temperature", temperature), ("repetition_penalty", repetition_penalty),
                   ("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty),
                   ("min_p", min_p), ("top_p", top_p, None), ("length_penalty", length_penalty, None))
    if top_p is not None and not 0 < float(top_p) <= 1:  # also catches NaN
        raise InvalidArgument(f"top_p must be in (0, 1], got {top_p}")
    _check_wire_zeros(n, best_of, repetition_penalty)
    if not 0 <= float(min_p) <= 1:   # (also catches NaN)
        raise InvalidArgument(f"min_p must be in [0, 1] (0 = off), got {min_p}")
    stops = [stop] if isinstance(stop, str) else [] if stop is None else \
        list(stop) if isinstance(stop, (list, tuple)) else [stop]
    if not all(isinstance(s, str) for s in stops):
        raise TypeError(f"stop must be a str or a list of str, got {stop!r}")
    _check_text(("prompt", [prompt] if prompt else []), ("stop", stops), ("regex", [regex] if regex else []),
                ("choice", list(choice) if choice and not isinstance(choice, str) else []),
                ("json_schema", [json_schema] if isinstance(json_schema, str) else []))
    want_logprobs, top_logprobs = _logprob_fields(logprobs, return_logprobs)
    if early_stopping not in (True, False, "never"):
        raise InvalidArgument(f'early_stopping must be True, False or "never", got {early_stopping!r}')
    try:  # values the wire cannot carry (an int past int32/int64) are the caller's error too
        req = pb.GenerateRequest(prompt=prompt or "", max_new_tokens=int(max_new_tokens),
                                 temperature=float(temperature), top_k=int(top_k),
                                 stop=stops, ignore_eos=bool(ignore_eos), return_logprobs=want_logprobs,
                                 top_logprobs=top_logprobs, n=int(n or 0), best_of=int(best_of or 0),
                                 min_new_tokens=int(min_new_tokens),
                                 repetition_penalty=float(repetition_penalty),
                                 presence_penalty=float(presence_penalty),
                                 frequency_penalty=float(frequency_penalty), min_p=float(min_p),
                                 beam_width=int(beam_width or 0),
                                 early_stopping=str(early_stopping).lower() if beam_width or early_stopping is not False else "",
                                 include_stop_str_in_output=bool(include_stop_str_in_output))
        _optional_fields(req, length_penalty, top_p, prompt_token_ids, stop_token_ids, seed)
        _structured(req, json_schema, regex, choice, json_object)
        if grammar_after_token_id is not None:
            if isinstance(grammar_after_token_id, bool) or not isinstance(grammar_after_token_id, int):
                raise TypeError(f"grammar_after_token_id must be an int, got {grammar_after_token_id!r:.40}")
            req.grammar_after_token_id = grammar_after_token_id
        _set_prompt_logprobs(req, prompt_logprobs)
    except (ValueError, OverflowError) as e:
        raise InvalidArgument(str(e)) from None
    return req


def _check_prompt_and_ints(prompt, prompt_token_ids, ints) -> None:
    """One prompt form, a str prompt, and real ints (not bools) where the wire holds ints."""
    if prompt is not None and not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
    if prompt is not None and prompt_token_ids is not None:
        raise InvalidArgument("give prompt or prompt_token_ids, not both")
    for name, v in ints:
        if (v is not None or name in ("max_new_tokens", "top_k", "min_new_tokens")) and \
                (isinstance(v, bool) or not isinstance(v, (int, np.integer))):
            raise TypeError(f"{name} must be an int, got {v!r}")
        bits = 63 if name == "seed" else 31          # the wire's int64 / int32
        if v is not None and not -(1 << bits) <= v < (1 << bits):
            raise InvalidArgument(f"{name} = {v} is out of range (an int{bits + 1} on the wire)")


def _check_numbers(*fields) -> None:
    """Real numbers (not bools: True would sample at temperature 1) where the wire holds floats;
    a third element: the one value besides numbers that means "unset"."""
    for name, v, *unset in fields:
        if unset and v is unset[0]:
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{name} must be a number, got {v!r}")


def _check_text(*fields) -> None:
    """Strings the wire carries as UTF-8: a lone surrogate (valid in JSON, not text) is named."""
    for name, values in fields:
        for v in values:
            if not isinstance(v, str):
                continue                          # (a wrong type is named by the type checks)
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidArgument(f"{name} is not valid text: {e.reason} at {e.start} "
                                      f"({v[e.start:e.end]!r})") from None


def _check_wire_zeros(n, best_of, repetition_penalty) -> None:
    """Values the caller set that the wire would read as unset (proto3's 0): refused here, as the
    service refuses the same values when they are not 0."""
    if n is not None and n < 1:
        raise InvalidArgument(f"n must be in [1, {MAX_CHOICES}], got {n}")
    if best_of is not None and best_of < 1:
        raise InvalidArgument(f"best_of must be in [n, {MAX_CHOICES}], got {best_of}")
    if isinstance(repetition_penalty, numbers.Real) and not isinstance(repetition_penalty, bool) \
            and float(repetition_penalty) == 0:
        raise InvalidArgument("repetition_penalty must be > 0 (1 = off), got 0")


def _optional_fields(req: pb.GenerateRequest, length_penalty, top_p, prompt_token_ids, stop_token_ids,
                     seed) -> None:
    """Fields whose absence means something of its own (proto3 optional) or that are packed arrays."""
    if length_penalty is not None:
        req.length_penalty = float(length_penalty)
    if top_p is not None:  # proto3 optional: unset means 1 (off)
        req.top_p = float(top_p)
    if prompt_token_ids is not None:
        req.prompt_token_ids = _int_array("prompt_token_ids", prompt_token_ids)
    if stop_token_ids is not None:
        req.stop_token_ids = _int_array("stop_token_ids", stop_token_ids)
    if seed is not None:  # proto3 optional: unset means "the service picks one"
        req.seed = int(seed)


def _set_prompt_logprobs(req: pb.GenerateRequest, prompt_logprobs) -> None:
    if prompt_logprobs is None:  # proto3 optional: 0 (own logprob only) differs from unset
        return
    if isinstance(prompt_logprobs, bool) or not isinstance(prompt_logprobs, (int, np.integer)):
        raise TypeError(f"prompt_logprobs must be an int >= 0 or None, got {prompt_logprobs!r}")
    if prompt_logprobs < 0:
        raise InvalidArgument(f"prompt_logprobs must be >= 0 (alternatives per prompt token), "
                              f"got {prompt_logprobs}")
    req.prompt_logprobs = int(prompt_logprobs)


def _structured(req: pb.GenerateRequest, json_schema, regex, choice, json_object) -> None:
    """The structured-output fields; the service compiles them and names what is invalid."""
    if json_schema is not None:
        if isinstance(json_schema, (dict, bool)):
            json_schema = json.dumps(json_schema)
        if not isinstance(json_schema, str):
            raise TypeError(f"json_schema must be a dict or a JSON string, got {type(json_schema).__name__}")
        if not json_schema.strip():   # "" is unset on the wire
            raise InvalidArgument("json_schema must be a JSON schema, got an empty string")
        req.json_schema = json_schema
    if regex is not None:
        if not isinstance(regex, str):
            raise TypeError(f"regex must be a str, got {type(regex).__name__}")
        if not regex:   # "" is unset on the wire
            raise InvalidArgument("regex must be a non-empty pattern")
        req.regex = regex
    if choice is not None:
        if isinstance(choice, str) or not all(isinstance(c, str) for c in choice):
            raise TypeError(f"choice must be a list of str, got {choice!r:.80}")
        if not choice:  # an empty list is unset on the wire
            raise InvalidArgument("choice must be 1 to 1024 non-empty strings, got none")
        req.choice.extend(choice)
    req.json_object = bool(json_object)


@_before_rpc
def build_submit_request(requests: Sequence[dict]) -> pb.SubmitJobRequest:
    if not isinstance(requests, (list, tuple)):
        raise TypeError(f"submit takes a list of request dicts, got {type(requests).__name__}")
    items = []
    for i, item in enumerate(requests):
        if not isinstance(item, dict):
            raise TypeError(f"submit item {i} must be a dict, got {type(item).__name__}")
        unknown = set(item) - set(REQUEST_KEYS)
        if unknown:
            raise TypeError(f"submit item {i}: unknown keys {sorted(unknown)} (allowed: {REQUEST_KEYS})")
        try:
            items.append(build_generate_request(**item))
        except MiniPagedError as e:           # the SDK's own check: say which item
            err = type(e)(f"submit item {i}: {e.details}", e.code)
            err.before_rpc = e.before_rpc
            raise err from None
        except (TypeError, ValueError) as e:
            raise type(e)(f"submit item {i}: {e}") from None
    return pb.SubmitJobRequest(requests=items)


def job_request(job_id) -> pb.JobRequest:
    """GetJob / CancelJob / DeleteJob / WatchJob's request: a job id is the str submit() returned."""
    if not isinstance(job_id, str):
        raise TypeError(f"job_id must be a str (submit() returns one), got {type(job_id).__name__} {job_id!r:.40}")
    return pb.JobRequest(job_id=job_id)


def batch_items(prompt, params: dict) -> list[dict] | None:
    """generate([...]): a list of prompts (str, token-id lists or request dicts), or
    prompt_token_ids=[[...], ...], is a batch: one request dict per item (shared `params` under
    each item's own keys). None when this is a single request."""
    ids = params.get("prompt_token_ids")
    if prompt is None and isinstance(ids, (list, tuple)) and ids and isinstance(ids[0], (list, tuple, np.ndarray)):
        rest = {k: v for k, v in params.items() if k != "prompt_token_ids"}
        return [{**rest, "prompt_token_ids": list(x)} for x in ids]
    if not isinstance(prompt, (list, tuple)):
        return None
    items = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            items.append({**params, "prompt": p})
        elif isinstance(p, dict):
            items.append({**params, **p})
        elif isinstance(p, (list, tuple, np.ndarray)):
            items.append({**params, "prompt_token_ids": list(p)})
        else:
            raise TypeError(f"generate([...]) item {i} must be a str, a list of token ids or a dict, "
                            f"got {type(p).__name__} (one prompt of token ids: prompt_token_ids=[...])")
    for i, item in enumerate(items):
        unknown = set(item) - set(REQUEST_KEYS)
        if unknown:
            raise TypeError(f"generate([...]) item {i}: unknown keys {sorted(unknown)} (allowed: {REQUEST_KEYS})")
    return items


def final_only(request: pb.GenerateRequest) -> pb.GenerateRequest:
    """Ask for the result in one chunk per choice (callers that wait for the end: no per-token messages)."""
    request.final_only = True
    return request
