"""Folding replies into what a call returns: stream chunks into one GenerateResult
(ResultAssembler; generate() is stream() collected), a job's progress into its ordered results
(JobCollector), under one deadline for calls made of several RPCs (Deadline)."""
from __future__ import annotations

import math
import time
from dataclasses import fields

from .channel import grpc_seconds
from .results import GenerateResult, JobStatus, StreamChunk, Usage


class Deadline:
    """One overall deadline for calls made of several RPCs (wait = WatchJob... + GetJob; a list
    of prompts given to generate). None or inf: none."""

    def __init__(self, timeout: float | None):
        self.at = None if grpc_seconds(timeout) is None else time.monotonic() + timeout

    def left(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def remaining(self) -> float:
        """As a per-call timeout: inf when there is no deadline (not None, which means "the
        client's default")."""
        left = self.left()
        return math.inf if left is None else left

    def poll(self, cap: float) -> float:
        """How long one wait of a polling loop may take: at most `cap`, at least 50 ms."""
        return max(0.05, min(cap, self.remaining()))

    def expired(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at


class _ChoiceAssembler:
    def __init__(self, index: int):
        self.index = index
        self.token_ids, self.text, self.logprobs, self.top = [], [], [], []
        self.finish_reason, self.usage = "", Usage()
        self.cumulative, self.beam_score, self.stop_reason = None, None, None

    def add(self, c: StreamChunk) -> None:
        if c.cumulative_logprob is not None:      # beam search and best_of's winners say it
            self.cumulative = c.cumulative_logprob
        if c.beam_score is not None:
            self.beam_score = c.beam_score
        self.token_ids += c.token_ids
        self.text.append(c.text)
        self.logprobs += c.logprobs or []
        self.top += c.top_logprobs or []
        self.finish_reason = c.finish_reason or self.finish_reason
        self.usage = c.usage or self.usage
        if c.stop_reason is not None:
            self.stop_reason = c.stop_reason

    def result(self) -> GenerateResult:
        return GenerateResult(self.token_ids, "".join(self.text), self.finish_reason, self.usage,
                              self.logprobs or None, top_logprobs=self.top or None, choice=self.index,
                              cumulative_logprob=self.cumulative if self.cumulative is not None
                              else float(sum(self.logprobs)) if self.logprobs else None,
                              beam_score=self.beam_score, stop_reason=self.stop_reason)


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
        for r in [out, *(out.choices or [])]:   # the request's, the same for every choice
            r.prompt_logprobs, r.prompt_top_logprobs = self._prompt
        return out

    def _result(self) -> GenerateResult:
        if not self._choices:
            return _ChoiceAssembler(0).result()
        choices = [self._choices[i].result() for i in sorted(self._choices)]
        if len(choices) == 1:
            return choices[0]
        top = GenerateResult(**{f.name: getattr(choices[0], f.name) for f in fields(GenerateResult)})
        top.choices = choices
        first = choices[0].usage      # the request's usage: every returned choice's tokens (as a job's)
        top.usage = Usage(first.prompt_tokens, sum(c.usage.completion_tokens for c in choices), first.cached_tokens,
                          sum(c.usage.preemptions for c in choices))
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
