"""What travels between the SDK and the service, on the client's side: result types, request
building from keyword arguments, and decoding of replies and job progress. Shared by `Client`,
`AsyncClient` and the CLI. Only grpc, the generated code and minipaged helpers (wire, constants) are imported here."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Sequence

import numpy as np

from minipaged import wire
from minipaged.constants import MAX_MESSAGE_BYTES, grpc_options  # noqa: F401 (MAX_MESSAGE_BYTES: client's API)
from minipaged.v1 import metadata_pb2 as pb

from .errors import InvalidArgument

CHANNEL_OPTIONS = grpc_options()
TERMINAL_STATES = ("done", "cancelled", "failed")
# Keys a generate() call / a submit() item may carry (timeout is per call, not per request).
REQUEST_KEYS = ("prompt", "prompt_token_ids", "max_new_tokens", "temperature", "top_p", "top_k",
                "seed", "stop", "stop_token_ids", "ignore_eos", "return_logprobs", "logprobs", "n", "best_of",
                "min_new_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty",
                "json_schema", "regex", "choice", "json_object", "beam_width", "length_penalty", "early_stopping",
                "prompt_logprobs")
DEFAULT_PORT = 50051


def normalize_address(address: str) -> str:
    """"HOST" means HOST:50051 (the metadata service's default port); "HOST:PORT", "[v6]:PORT",
    "unix:..." and "dns:///..." targets pass through unchanged."""
    a = address.strip()
    if not a or a.startswith(("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")) or "://" in a:
        return a
    if a.startswith("["):                       # [::1] or [::1]:50051
        return a if "]:" in a else f"{a}:{DEFAULT_PORT}"
    if a.count(":") == 0:
        return f"{a}:{DEFAULT_PORT}"
    if a.count(":") > 1:                        # a bare IPv6 address
        return f"[{a}]:{DEFAULT_PORT}"
    return a


# ---------------------------------------------------------------- result types

@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0

    @classmethod
    def from_proto(cls, u: pb.Usage) -> "Usage":
        return cls(u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.preemptions)


@dataclass
class GenerateResult:
    """One request's result. With n > 1, `choices` holds every choice (choice 0 first) and the
    top-level fields are choice 0's."""
    token_ids: list[int]
    text: str
    finish_reason: str
    usage: Usage
    logprobs: list[float] | None = None
    index: int = 0
    error: str | None = None  # set when this one request of a job failed on its own
    # logprobs=k: per generated token, its k best alternatives {token_id: logprob}, best first
    top_logprobs: list[dict[int, float]] | None = None
    choice: int = 0
    cumulative_logprob: float | None = None
    choices: list["GenerateResult"] | None = None
    beam_score: float | None = None   # beam search: cumulative_logprob / length ** length_penalty
    # prompt_logprobs=k: per prompt token its logprob given the tokens before it (None for the
    # first token), and with k > 0 its k best alternatives {token_id: logprob} (None first)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class StreamChunk:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # None while running; set on the last chunk (of its choice)
    usage: Usage | None = None        # set on the last chunk (of its choice)
    logprobs: list[float] | None = None
    index: int = 0                    # which choice (n > 1): chunks of different choices interleave
    top_logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None  # beam search: on each choice's (single) chunk
    beam_score: float | None = None
    prompt_logprobs: list[float | None] | None = None          # on the first chunk (prompt_logprobs=k)
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    decode_seconds: float = 0.0       # final_only chunks: the choice's first token to its last


@dataclass
class JobStatus:
    job_id: str
    state: str  # "queued" | "running" | "done" | "cancelled"
    total: int
    completed: int
    results: list[GenerateResult] = field(default_factory=list)
    created: float = 0.0  # unix time of SubmitJob

    @property
    def done(self) -> bool:
        return self.state in TERMINAL_STATES


@dataclass
class Stats:
    """Every StatsReply field, by the proto's names (tests check none is missing)."""
    num_blocks: int = 0
    block_size: int = 0
    used_blocks: int = 0
    free_blocks: int = 0
    cached_blocks: int = 0
    internal_fragmentation_tokens: int = 0
    kv_utilization: float = 0.0
    running: int = 0
    waiting: int = 0
    preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_hit_rate: float = 0.0
    invariants_ok: bool = False
    steps: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    tokens_per_second: float = 0.0
    metadata_ms_per_step: float = 0.0
    num_workers: int = 0
    ready: bool = False
    cache_epoch: int = 0
    live_sequences: int = 0
    shared_blocks: int = 0
    not_ready_reason: str = ""
    chains: list = field(default_factory=list)   # one dict per replica chain (ChainStats fields)
    num_chains: int = 0
    standby_workers: int = 0
    metadata_cpu_seconds: float = 0.0
    model: str = ""
    max_model_len: int = 0
    model_fingerprint: str = ""
    model_shape: str = ""

    @classmethod
    def from_proto(cls, r: pb.StatsReply) -> "Stats":
        from google.protobuf.json_format import MessageToDict
        kw = {f.name: getattr(r, f.name) for f in fields(cls) if f.name != "chains"}
        kw["chains"] = [MessageToDict(c, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
                        for c in r.chains]
        return cls(**kw)

    def as_dict(self) -> dict:
        return asdict(self)

    def __getitem__(self, key: str):  # dict-like access: stats["free_blocks"]
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)

    def keys(self):
        return self.as_dict().keys()

    def table(self) -> str:
        """A human table grouped the way an operator reads it (pool, fragmentation, queue, ...)."""
        s = self
        rows = [
            ("blocks used / free / cached", f"{s.used_blocks} / {s.free_blocks} / {s.cached_blocks}"
                                            f"  (of {s.num_blocks}, block_size {s.block_size})"),
            ("internal fragmentation", f"{s.internal_fragmentation_tokens} tokens"),
            ("KV utilization", f"{s.kv_utilization:.1%}"),
            ("running / waiting / live seqs", f"{s.running} / {s.waiting} / {s.live_sequences}"),
            ("preemptions", str(s.preemptions)),
            ("prefix cache hits", f"{s.prefix_cache_hits} / {s.prefix_cache_queries} blocks"
                                  f"  ({s.prefix_cache_hit_rate:.1%})"),
            ("steps", str(s.steps)),
            ("prompt / generated tokens", f"{s.prompt_tokens} / {s.generated_tokens}"),
            ("tokens/s", f"{s.tokens_per_second:.1f}"),
            ("metadata ms/step", f"{s.metadata_ms_per_step:.3f}"),
            ("workers / ready / cache epoch", f"{s.num_workers} / {s.ready} / {s.cache_epoch}"),
            ("invariants_ok", str(s.invariants_ok)),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# ---------------------------------------------------------------- request building / decoding

def _int_array(name: str, values) -> bytes:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise TypeError(f"{name} must be a flat sequence of ints, got {values!r:.80}")
    if arr.size and (int(arr.min()) < -2**31 or int(arr.max()) >= 2**31):  # would wrap silently
        raise InvalidArgument(f"{name}: values must fit int32, got min {arr.min()} max {arr.max()}")
    return wire.pack(arr, wire.INT32)


def _logprob_fields(logprobs, return_logprobs) -> tuple[bool, int]:
    """`logprobs=True` (or the older `return_logprobs=True`): the sampled tokens' logprobs;
    `logprobs=k` (an int >= 0): also the k best alternatives per token (OpenAI's `logprobs=k`)."""
    if logprobs is None or logprobs is False:
        return bool(return_logprobs), 0
    if logprobs is True:
        return True, 0
    if isinstance(logprobs, (int, np.integer)):
        if logprobs < 0:
            raise InvalidArgument(f"logprobs must be True or an int >= 0 (alternatives per token), got {logprobs}")
        return True, int(logprobs)
    raise TypeError(f"logprobs must be a bool or an int, got {logprobs!r}")


def refuse_unstreamable(request: pb.GenerateRequest) -> None:
    """stream() with best_of > n: the winners are known only when every candidate has ended, so
    there is nothing to stream (generate() and the gateway's non-streaming path wait for them)."""
    n = max(1, request.n)
    if request.best_of > n:
        raise InvalidArgument(f"best_of ({request.best_of}) > n ({n}) cannot be streamed: which choices win "
                              f"is known only at the end; use generate() (it waits for them) or submit() a job")


def build_generate_request(prompt: str | None = None, prompt_token_ids: Sequence[int] | None = None,
                           max_new_tokens: int = 32, temperature: float = 0.0, top_p: float | None = None,
                           top_k: int = 0, seed: int | None = None, stop: str | Sequence[str] | None = None,
                           stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
                           return_logprobs: bool = False, logprobs: bool | int | None = None,
                           n: int | None = None, best_of: int | None = None, min_new_tokens: int = 0,
                           repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                           frequency_penalty: float = 0.0, json_schema: dict | str | None = None,
                           regex: str | None = None, choice: Sequence[str] | None = None,
                           json_object: bool = False, beam_width: int = 0,
                           length_penalty: float | None = None,
                           early_stopping: bool | str = False,
                           prompt_logprobs: int | None = None) -> pb.GenerateRequest:
    """Type checks and the few value checks the wire cannot express (top_p=0, both prompt forms);
    the server validates every value and answers INVALID_ARGUMENT.

    Structured outputs (at most one): `json_schema` (a dict or its JSON text), `regex`, `choice` (a
    list of strings), `json_object=True` (any JSON object). beam_width=K: beam search
    (transformers' num_beams=K, num_return_sequences=K): K choices, best first, each with its
    cumulative_logprob and beam_score; n must then be unset or K."""
    if prompt is not None and not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
    if prompt is not None and prompt_token_ids is not None:
        raise InvalidArgument("give prompt or prompt_token_ids, not both")
    for name, v in (("max_new_tokens", max_new_tokens), ("top_k", top_k), ("seed", seed), ("n", n),
                    ("best_of", best_of), ("min_new_tokens", min_new_tokens), ("beam_width", beam_width)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer))):
            raise TypeError(f"{name} must be an int, got {v!r}")
    if top_p is not None and not 0 < float(top_p) <= 1:  # also catches NaN
        raise InvalidArgument(f"top_p must be in (0, 1], got {top_p}")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) for s in stops):
        raise TypeError(f"stop must be a str or a list of str, got {stop!r}")
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
                                 frequency_penalty=float(frequency_penalty), beam_width=int(beam_width or 0),
                                 early_stopping=str(early_stopping).lower() if beam_width else "")
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
        _structured(req, json_schema, regex, choice, json_object)
        if prompt_logprobs is not None:  # proto3 optional: 0 (own logprob only) differs from unset
            if isinstance(prompt_logprobs, bool) or not isinstance(prompt_logprobs, (int, np.integer)):
                raise TypeError(f"prompt_logprobs must be an int >= 0 or None, got {prompt_logprobs!r}")
            if prompt_logprobs < 0:
                raise InvalidArgument(f"prompt_logprobs must be >= 0 (alternatives per prompt token), "
                                      f"got {prompt_logprobs}")
            req.prompt_logprobs = int(prompt_logprobs)
    except (ValueError, OverflowError) as e:
        raise InvalidArgument(f"{e} (max_new_tokens, top_k, n, best_of, min_new_tokens are int32, seed int64, "
                              f"token ids int32)") from None
    return req


def _structured(req: pb.GenerateRequest, json_schema, regex, choice, json_object) -> None:
    """The structured-output fields; the service compiles them and names what is invalid."""
    if json_schema is not None:
        if isinstance(json_schema, (dict, bool)):
            json_schema = json.dumps(json_schema)
        if not isinstance(json_schema, str):
            raise TypeError(f"json_schema must be a dict or a JSON string, got {type(json_schema).__name__}")
        req.json_schema = json_schema
    if regex is not None:
        if not isinstance(regex, str):
            raise TypeError(f"regex must be a str, got {type(regex).__name__}")
        req.regex = regex
    if choice is not None:
        if isinstance(choice, str) or not all(isinstance(c, str) for c in choice):
            raise TypeError(f"choice must be a list of str, got {choice!r:.80}")
        req.choice.extend(choice)
    req.json_object = bool(json_object)


def build_submit_request(requests: Sequence[dict]) -> pb.SubmitJobRequest:
    items = []
    for i, item in enumerate(requests):
        if not isinstance(item, dict):
            raise TypeError(f"submit item {i} must be a dict, got {type(item).__name__}")
        unknown = set(item) - set(REQUEST_KEYS)
        if unknown:
            raise TypeError(f"submit item {i}: unknown keys {sorted(unknown)} (allowed: {REQUEST_KEYS})")
        items.append(build_generate_request(**item))
    return pb.SubmitJobRequest(requests=items)


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


def _floats(data: bytes) -> list[float] | None:
    return wire.unpack(data, wire.FLOAT32, name="logprobs").tolist() if data else None


def _top(ids: bytes, lps: bytes, n_tokens: int) -> list[dict[int, float]] | None:
    """int32 [k, K] ids + float32 [k, K] logprobs -> per token {id: logprob}, best first."""
    if not ids or n_tokens == 0:
        return None
    a = wire.unpack(ids, wire.INT32, name="top_logprob_ids")
    b = wire.unpack(lps, wire.FLOAT32, name="top_logprobs", count=a.size)
    if a.size % n_tokens:
        raise wire.WireError(f"top_logprob_ids: {a.size} values is not a multiple of {n_tokens} tokens")
    a, b = a.reshape(n_tokens, -1).tolist(), b.reshape(n_tokens, -1).tolist()
    return [dict(zip(r, s)) for r, s in zip(a, b)]


def _prompt_logprobs(msg) -> tuple[list | None, list | None]:
    """float64 [P] (+ int32 / float64 [P, k]) -> per prompt token, None for the first (the wire's
    NaN row: nothing comes before it)."""
    if not msg.prompt_logprobs:
        return None, None
    lps = wire.unpack(msg.prompt_logprobs, wire.FLOAT64, name="prompt_logprobs")
    own = [None] + lps[1:].tolist()
    if not msg.prompt_top_logprob_ids:
        return own, None
    ids = wire.unpack(msg.prompt_top_logprob_ids, wire.INT32, name="prompt_top_logprob_ids")
    vals = wire.unpack(msg.prompt_top_logprobs, wire.FLOAT64, name="prompt_top_logprobs", count=ids.size)
    if ids.size % lps.size:
        raise wire.WireError(f"prompt_top_logprob_ids: {ids.size} values for {lps.size} prompt tokens")
    rows = zip(ids.reshape(lps.size, -1)[1:].tolist(), vals.reshape(lps.size, -1)[1:].tolist())
    return own, [None] + [dict(zip(a, b)) for a, b in rows]


def result_from_proto(r: pb.GenerationResult) -> GenerateResult:
    ids = wire.unpack(r.token_ids, name="token_ids").tolist()
    out = GenerateResult(token_ids=ids, text=r.text, finish_reason=r.finish_reason,
                         usage=Usage.from_proto(r.usage), logprobs=_floats(r.logprobs), index=r.index,
                         error=r.error or None, top_logprobs=_top(r.top_logprob_ids, r.top_logprobs, len(ids)),
                         choice=r.choice, cumulative_logprob=r.cumulative_logprob if (r.logprobs or r.cumulative_logprob) else None,
                         beam_score=r.beam_score if r.beam_score else None)
    out.prompt_logprobs, out.prompt_top_logprobs = _prompt_logprobs(r)
    if r.choices:
        out.choices = [result_from_proto(c) for c in r.choices]
        for c in out.choices:
            c.index = out.index
    return out


def chunk_from_proto(c: pb.GenerateChunk) -> StreamChunk:
    ids = wire.unpack(c.token_ids, name="token_ids").tolist()
    own, top = _prompt_logprobs(c)
    return StreamChunk(token_ids=ids, text=c.text, finish_reason=c.finish_reason or None,
                       usage=Usage.from_proto(c.usage) if c.HasField("usage") else None,
                       logprobs=_floats(c.logprobs), index=c.index,
                       top_logprobs=_top(c.top_logprob_ids, c.top_logprobs, len(ids)),
                       cumulative_logprob=c.cumulative_logprob if c.beam_score else None,
                       beam_score=c.beam_score if c.beam_score else None,
                       prompt_logprobs=own, prompt_top_logprobs=top, decode_seconds=c.decode_seconds)


def final_only(request: pb.GenerateRequest) -> pb.GenerateRequest:
    """Ask for the result in one chunk per choice (callers that wait for the end: no per-token messages)."""
    request.final_only = True
    return request


def job_from_proto(j) -> JobStatus:
    """pb.Job or pb.JobProgress (the latter's results are only the new ones)."""
    results = j.results if isinstance(j, pb.Job) else j.new_results
    return JobStatus(j.job_id, j.state, j.total, j.completed, [result_from_proto(r) for r in results],
                     created=getattr(j, "created", 0.0))


class Deadline:
    """One overall deadline for calls made of several RPCs (wait = WatchJob... + GetJob)."""

    def __init__(self, timeout: float | None):
        self.at = None if timeout is None else time.monotonic() + timeout

    def left(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - time.monotonic())


class _ChoiceAssembler:
    def __init__(self, index: int):
        self.index = index
        self.token_ids, self.text, self.logprobs, self.top = [], [], [], []
        self.finish_reason, self.usage = "", Usage()
        self.cumulative, self.beam_score = None, None

    def add(self, c: StreamChunk) -> None:
        if c.beam_score is not None:
            self.cumulative, self.beam_score = c.cumulative_logprob, c.beam_score
        self.token_ids += c.token_ids
        self.text.append(c.text)
        self.logprobs += c.logprobs or []
        self.top += c.top_logprobs or []
        self.finish_reason = c.finish_reason or self.finish_reason
        self.usage = c.usage or self.usage

    def result(self) -> GenerateResult:
        return GenerateResult(self.token_ids, "".join(self.text), self.finish_reason, self.usage,
                              self.logprobs or None, top_logprobs=self.top or None, choice=self.index,
                              cumulative_logprob=self.cumulative if self.beam_score is not None
                              else float(sum(self.logprobs)) if self.logprobs else None,
                              beam_score=self.beam_score)


class ResultAssembler:
    """Folds stream chunks into one GenerateResult (generate() is stream() collected). Chunks of
    several choices (n > 1) interleave; each is folded by its `index`."""

    def __init__(self):
        self._choices: dict[int, _ChoiceAssembler] = {}
        self._prompt = (None, None)     # prompt logprobs: the request's, on its first chunk

    def add(self, c: StreamChunk) -> None:
        if c.prompt_logprobs is not None:
            self._prompt = (c.prompt_logprobs, c.prompt_top_logprobs)
        if c.index not in self._choices:
            self._choices[c.index] = _ChoiceAssembler(c.index)
        self._choices[c.index].add(c)

    def result(self) -> GenerateResult:
        out = self._result()
        out.prompt_logprobs, out.prompt_top_logprobs = self._prompt
        return out

    def _result(self) -> GenerateResult:
        if not self._choices:
            return _ChoiceAssembler(0).result()
        choices = [self._choices[i].result() for i in sorted(self._choices)]
        if len(choices) == 1:
            return choices[0]
        top = GenerateResult(**{f.name: getattr(choices[0], f.name) for f in fields(GenerateResult)})
        top.choices = choices
        return top


class JobCollector:
    """Gathers a job's results from WatchJob messages and a final GetJob, keyed by index."""

    def __init__(self, progress: bool, job_id: str):
        self.results: dict[int, GenerateResult] = {}
        self.state, self.total = "queued", 0
        self._progress, self._job_id, self._bar = progress, job_id, None

    def update(self, status: JobStatus) -> None:
        self.state, self.total = status.state, status.total
        for r in status.results:
            self.results[r.index] = r
        if self._progress:
            if self._bar is None:
                from tqdm import tqdm
                self._bar = tqdm(total=status.total, desc=f"job {self._job_id[:8]}", unit="req")
            done = max(status.completed, len(self.results))
            self._bar.set_postfix_str(status.state, refresh=False)
            self._bar.update(max(0, done - self._bar.n))  # update(), not n=: keeps the rate right

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def ordered(self) -> list[GenerateResult]:
        """In submission order; a cancelled job's unfinished requests read as empty 'cancelled'."""
        out = []
        for i in range(self.total):
            r = self.results.get(i)
            if r is None:
                r = GenerateResult([], "", "cancelled" if self.state == "cancelled" else "", Usage(), index=i)
            out.append(r)
        return out


# ---------------------------------------------------------------- pool snapshot (dashboard)

@dataclass
class SequenceSnapshot:
    sequence_id: int
    state: str                 # "running" | "waiting"
    length: int
    num_blocks: int
    block_table: list[int]     # the first <= 64 blocks of its table
    num_cached_tokens: int
    label: str


@dataclass
class ChainSnapshot:
    """One chain's pool: block_state[i] (0 free, 1 owned, 2 shared, 3 cached) describes physical
    block i * stride; the counts are exact over the whole pool."""
    chain_id: int
    num_blocks: int
    block_size: int
    stride: int
    block_state: list[int]
    ref_counts: list[int]
    free_blocks: int
    owned_blocks: int
    shared_blocks: int
    cached_blocks: int
    sequences: list[SequenceSnapshot]
    running: int
    waiting: int


@dataclass
class PoolSnapshot:
    chains: list[ChainSnapshot]
    time: float

    def as_dict(self) -> dict:
        return asdict(self)


def pool_snapshot_from_proto(r: pb.PoolSnapshotReply) -> PoolSnapshot:
    chains = []
    for c in r.chains:
        seqs = [SequenceSnapshot(s.sequence_id, s.state, s.length, s.num_blocks,
                                 wire.unpack(s.block_table, wire.INT32, name="block_table").tolist(),
                                 s.num_cached_tokens, s.label) for s in c.sequences]
        chains.append(ChainSnapshot(c.chain_id, c.num_blocks, c.block_size, max(1, c.stride),
                                    wire.unpack(c.block_state, wire.UINT8, name="block_state").tolist(),
                                    wire.unpack(c.ref_counts, wire.UINT8, name="ref_counts").tolist(),
                                    c.free_blocks, c.owned_blocks, c.shared_blocks, c.cached_blocks, seqs,
                                    c.running, c.waiting))
    return PoolSnapshot(chains, r.time)
