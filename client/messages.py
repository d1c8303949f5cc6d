"""What travels between the SDK and the service, on the client's side: result types, request
building from keyword arguments, and decoding of replies and job progress. Shared by `Client`,
`AsyncClient` and the CLI. Only grpc, the generated code and minipaged.wire are imported here."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields
from typing import Sequence

import numpy as np

from minipaged import wire
from minipaged.v1 import metadata_pb2 as pb

from .errors import InvalidArgument

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
TERMINAL_STATES = ("done", "cancelled", "failed")
# Keys a generate() call / a submit() item may carry (timeout is per call, not per request).
REQUEST_KEYS = ("prompt", "prompt_token_ids", "max_new_tokens", "temperature", "top_p", "top_k",
                "seed", "stop", "stop_token_ids", "ignore_eos", "return_logprobs")


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
    token_ids: list[int]
    text: str
    finish_reason: str
    usage: Usage
    logprobs: list[float] | None = None
    index: int = 0
    error: str | None = None  # set when this one request of a job failed on its own

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class StreamChunk:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # None while running; set on the last chunk
    usage: Usage | None = None        # set on the last chunk
    logprobs: list[float] | None = None


@dataclass
class JobStatus:
    job_id: str
    state: str  # "queued" | "running" | "done" | "cancelled"
    total: int
    completed: int
    results: list[GenerateResult] = field(default_factory=list)

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


def build_generate_request(prompt: str | None = None, prompt_token_ids: Sequence[int] | None = None,
                           max_new_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
                           top_k: int = 0, seed: int | None = None, stop: str | Sequence[str] | None = None,
                           stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
                           return_logprobs: bool = False) -> pb.GenerateRequest:
    """Light type checks only: the server validates values and answers INVALID_ARGUMENT."""
    if prompt is not None and not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
    for name, v in (("max_new_tokens", max_new_tokens), ("top_k", top_k), ("seed", seed)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer))):
            raise TypeError(f"{name} must be an int, got {v!r}")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) for s in stops):
        raise TypeError(f"stop must be a str or a list of str, got {stop!r}")
    try:  # values the wire cannot carry (an int past int32/int64) are the caller's error too
        req = pb.GenerateRequest(prompt=prompt or "", max_new_tokens=int(max_new_tokens),
                                 temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
                                 stop=stops, ignore_eos=bool(ignore_eos),
                                 return_logprobs=bool(return_logprobs))
        if prompt_token_ids is not None:
            req.prompt_token_ids = _int_array("prompt_token_ids", prompt_token_ids)
        if stop_token_ids is not None:
            req.stop_token_ids = _int_array("stop_token_ids", stop_token_ids)
        if seed is not None:  # proto3 optional: unset means "the service picks one"
            req.seed = int(seed)
    except (ValueError, OverflowError) as e:
        raise InvalidArgument(f"{e} (max_new_tokens and top_k are int32, seed int64, token ids int32)") from None
    return req


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


def _floats(data: bytes) -> list[float] | None:
    return wire.unpack(data, wire.FLOAT32, name="logprobs").tolist() if data else None


def result_from_proto(r: pb.GenerationResult) -> GenerateResult:
    return GenerateResult(token_ids=wire.unpack(r.token_ids, name="token_ids").tolist(), text=r.text,
                          finish_reason=r.finish_reason, usage=Usage.from_proto(r.usage),
                          logprobs=_floats(r.logprobs), index=r.index, error=r.error or None)


def chunk_from_proto(c: pb.GenerateChunk) -> StreamChunk:
    return StreamChunk(token_ids=wire.unpack(c.token_ids, name="token_ids").tolist(), text=c.text,
                       finish_reason=c.finish_reason or None,
                       usage=Usage.from_proto(c.usage) if c.HasField("usage") else None,
                       logprobs=_floats(c.logprobs))


def job_from_proto(j) -> JobStatus:
    """pb.Job or pb.JobProgress (the latter's results are only the new ones)."""
    results = j.results if isinstance(j, pb.Job) else j.new_results
    return JobStatus(j.job_id, j.state, j.total, j.completed, [result_from_proto(r) for r in results])


class Deadline:
    """One overall deadline for calls made of several RPCs (wait = WatchJob... + GetJob)."""

    def __init__(self, timeout: float | None):
        self.at = None if timeout is None else time.monotonic() + timeout

    def left(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - time.monotonic())


class ResultAssembler:
    """Folds stream chunks into one GenerateResult (generate() is stream() collected)."""

    def __init__(self):
        self.token_ids, self.text, self.logprobs = [], [], []
        self.finish_reason, self.usage = "", Usage()

    def add(self, c: StreamChunk) -> None:
        self.token_ids += c.token_ids
        self.text.append(c.text)
        self.logprobs += c.logprobs or []
        self.finish_reason = c.finish_reason or self.finish_reason
        self.usage = c.usage or self.usage

    def result(self) -> GenerateResult:
        return GenerateResult(self.token_ids, "".join(self.text), self.finish_reason, self.usage,
                              self.logprobs or None)


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
