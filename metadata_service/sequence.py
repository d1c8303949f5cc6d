"""One generation request as the scheduler sees it: tokens, progress, sampling and stop rules.

The engine thread alone mutates a Sequence; RPC threads only read the events it publishes."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Callable, Optional


# Scheduler sequence ids live above the block API's range (0 .. 2**62-1), so both can share one
# KVBlockManager without colliding.
_SEQ_IDS = itertools.count(2**62)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False  # vLLM's: keep the stop string / stop token's text
    ignore_eos: bool = False
    return_logprobs: bool = False
    n: int = 1                               # choices returned
    best_of: int = 1                         # choices generated (forked from one prefill)
    min_new_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int = 0
    min_p: float = 0.0                       # keep tokens with p >= min_p x max p (worker/logits_processors.py)
    show_logprobs: bool = False              # the caller asked for them (best_of computes them anyway)
    grammar: object = None                   # xgrammar CompiledGrammar (structured outputs; grammar.py)
    grammar_after_token: int = -1            # the grammar starts after this token (a reasoning end), -1: at once
    beam_width: int = 0                      # beam search (metadata_service/beam.py): K beams, 0 = off
    length_penalty: float = 1.0
    early_stopping: object = False           # transformers': False, True or "never"
    prompt_logprobs: int = -1                # alternatives per prompt token (0 = own only, -1 = off)
    per_token_events: bool = True            # a stream's sink hears each token; False: only the end, with all
    # derived once (read for every sequence of every step):
    penalized: bool = field(init=False)      # its next sample depends on every token so far
    waits_for_token: bool = field(init=False)  # never decodes ahead of its sampled token (async scheduling)
    extras: bool = field(init=False)         # needs worker/logits_processors.py

    def __post_init__(self):
        self.penalized = (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                          or self.frequency_penalty != 0.0)
        # min_new_tokens masks EOS (unless ignored) and stop_token_ids; with neither it masks nothing
        # (vLLM's rule too), and its sequences stay on the plain paths
        masks = self.min_new_tokens > 0 and (bool(self.stop_token_ids) or not self.ignore_eos)
        self.extras = self.penalized or masks or self.top_logprobs > 0 or (self.min_p > 0 and self.temperature > 0)
        # a grammar's bitmask needs the last token; a penalized row's history does not: the last
        # stage appends the token it sampled itself (worker/validate_sampling.py complete_histories)
        self.waits_for_token = self.grammar is not None


@dataclass
class SeqEvent:
    """What a request's owner (a Generate stream or a job) hears after each step."""
    new_token_ids: list[int]
    new_logprobs: list[float]
    finished: bool = False
    finish_reason: str = ""
    error: str = ""
    error_code: str = ""                     # a grpc.StatusCode name when error is set
    new_top: list = field(default_factory=list)  # per new token: (ids [k], logprobs [k]) alternatives
    beam_score: float | None = None          # beam search: a returned hypothesis' score ...
    cumulative_logprob: float | None = None  # ... and its cumulative logprob


def _counter(name: str) -> property:
    """A field that lives in the owning scheduler's Progress row while the sequence is bound."""
    own = "_" + name

    def get(self):
        p = self._progress
        return getattr(self, own) if p is None else getattr(p, name).item(self._row)   # a Python int / bool

    def put(self, value):
        p = self._progress
        if p is None:
            setattr(self, own, value)
        else:
            getattr(p, name)[self._row] = value
    return property(get, put)


@dataclass(eq=False)  # identity semantics: sequences live in lists and sets
class Sequence:
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: Optional[Callable[["Sequence", SeqEvent], None]] = None
    tag: object = None                       # owner's handle (job id + index), opaque here
    seq_id: int = field(default_factory=lambda: next(_SEQ_IDS))
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0               # prompt tokens the prefix cache served (first admission)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str = ""
    preemptions: int = 0
    stop_checker: object = None              # StopChecker when the request has stop strings
    stopped_on_token: bool = False           # ended by EOS / a stop token id: its text is not output


    # Where it runs and what is in flight (the owning chain's thread alone writes these).
    chain: object = None                     # the ChainRunner it was routed to
    slot: int = 0                            # micro-batch it belongs to on that chain
    abort_requested: bool = False            # set by any thread; the owning chain finishes it
    route: object = None                     # router.Route: what the router charged its chain (given back at the end)
    admitted_at: float = 0.0                 # time.monotonic() of admission (TTFT)
    first_token_at: float = 0.0
    group: object = None                     # SequenceGroup when the request asked for n / best_of > 1
    choice: int = 0                          # this sequence's index in its group
    output_top: list = field(default_factory=list)   # per output token: (ids int32 [k], logprobs float32 [k])
    suppress_ids: tuple = ()                 # EOS + stop ids, masked while output < min_new_tokens
    matcher: object = None                   # xgrammar GrammarMatcher when params.grammar is set
    handed_off: bool = False                 # left its prefill chain for a decode chain (or chose to stay)

    step_row: bytes = b""                    # its fixed facts packed once, at admission (step_rows.py)
    prompt_lp: object = None                 # PromptState when the request asked for prompt logprobs

    # Step-path counters (progress.py): in a Progress row while the sequence runs, else here.
    #   num_tokens           prompt + output, kept as a counter: read every step
    #   num_computed_tokens  tokens whose K/V are in the cache
    #   inflight             steps in flight that contain it
    #   gen                  bumped when it loses its blocks: in-flight results are void
    #   blocks_sent          leading blocks of its table the chain's workers hold
    #   deferred             its last appended position's token is still being sampled
    #   pending_sample       the newest in-flight step containing it samples for it
    num_tokens = _counter("num_tokens")
    num_computed_tokens = _counter("num_computed_tokens")
    inflight = _counter("inflight")
    gen = _counter("gen")
    blocks_sent = _counter("blocks_sent")
    deferred = _counter("deferred")
    pending_sample = _counter("pending_sample")

    def __post_init__(self):
        self._progress, self._row = None, -1
        self._num_computed_tokens = self._gen = self._inflight = self._blocks_sent = 0
        self._deferred = self._pending_sample = False
        self.num_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output without building the whole list."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p:stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - p]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
