"""The SDK's result types: a request's result (GenerateResult), a stream's chunk (StreamChunk),
its token counts (Usage) and a job's state (JobStatus)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from minipaged.v1 import metadata_pb2 as pb

TERMINAL_STATES = ("done", "cancelled", "failed")


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
    # vLLM's stop_reason, when it ended "stop": the stop string that matched or the stop token id
    # (None for the tokenizer's EOS)
    stop_reason: str | int | None = None

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
    cumulative_logprob: float | None = None  # beam search and best_of's winners: on each choice's (single) chunk
    beam_score: float | None = None
    prompt_logprobs: list[float | None] | None = None          # on the first chunk (prompt_logprobs=k)
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    decode_seconds: float = 0.0       # final_only chunks: the choice's first token to its last
    stop_reason: str | int | None = None   # on the last chunk of a choice, as GenerateResult's


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
