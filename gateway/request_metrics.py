"""How one prompt's chunks are observed for the gateway's metrics (vLLM's series): time to first
token, inter-token latency, end-to-end latency, prompt and generation tokens, finish reasons. One
Observed per prompt; `gw` is the Gateway whose metrics and TTFT totals (the dashboard's) it feeds."""
from __future__ import annotations

import time

import grpc

from client.messages import StreamChunk

S = grpc.StatusCode
REFUSALS = {S.INVALID_ARGUMENT, S.RESOURCE_EXHAUSTED, S.UNAVAILABLE, S.UNAUTHENTICATED, S.PERMISSION_DENIED,
            S.FAILED_PRECONDITION, S.OUT_OF_RANGE, S.ALREADY_EXISTS, S.NOT_FOUND}


class Observed:
    """Per prompt: TTFT, inter-token latency, e2e latency, tokens and finish reasons."""

    def __init__(self, gw, t0: float, choices: int = 1, prompt_len=lambda: None):
        self.gw, self.m, self.model, self.t0 = gw, gw.metrics, gw.model_name, t0
        self.prompt_len = prompt_len   # for a stream left early, before the service's final usage
        self.first: float | None = None
        self.last: dict[int, float] = {}
        self.prompt_tokens = 0
        self.generated = 0
        self.finished: list[str] = []
        self.choices, self.done = choices, False

    def chunk(self, c: StreamChunk) -> None:
        now = time.monotonic()
        if c.decode_seconds and len(c.token_ids) > 1:   # a whole choice: the service timed its tokens
            self._whole(c, now)
        elif c.token_ids:
            if self.first is None:
                self.first = now
                self.m.ttft.labels(self.model).observe(now - self.t0)
                self.gw.ttft_sum += now - self.t0
                self.gw.ttft_count += 1
            elif c.index in self.last:
                self.m.itl.labels(self.model).observe((now - self.last[c.index]) / len(c.token_ids))
            self.last[c.index] = now
            self.generated += len(c.token_ids)
        if c.usage is not None:
            self.prompt_tokens = c.usage.prompt_tokens
        if c.finish_reason:
            self.finished.append(c.finish_reason)
            if len(self.finished) == self.choices:   # recorded now: a client that hangs up on the
                self.finish()                        # last chunk was still served in full

    def _whole(self, c: StreamChunk, now: float) -> None:
        first = now - c.decode_seconds
        if self.first is None:
            self.first = first
            self.m.ttft.labels(self.model).observe(first - self.t0)
            self.gw.ttft_sum += first - self.t0
            self.gw.ttft_count += 1
        itl = self.m.itl.labels(self.model)
        for _ in range(len(c.token_ids) - 1):        # the mean gap, once per token (as a stream counts)
            itl.observe(c.decode_seconds / (len(c.token_ids) - 1))
        self.last[c.index] = now
        self.generated += len(c.token_ids)

    def fail(self, e: BaseException) -> None:
        """A stream that ended in an error: refused before any token (the service never admitted
        it: a bad value, a full queue, no worker) it counts nowhere, as vLLM counts a request it
        rejects; after admission it is an abort."""
        if self.first is None and not self.finished and getattr(e, "code", None) in REFUSALS:
            self.done = True
            return
        self.abort()

    def abort(self) -> None:
        """A prompt whose stream ended early (the client left, or an error): its tokens so far count,
        and its unfinished choices as "abort", vLLM's reason for them. Its prompt counts once its
        first token came (as vLLM counts it): the final usage that would have said so never will."""
        if not self.prompt_tokens and self.first is not None:
            self.prompt_tokens = self.prompt_len() or 0
        self.finished += ["abort"] * (self.choices - len(self.finished))
        self.finish()

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        self.m.e2e.labels(self.model).observe(time.monotonic() - self.t0)
        self.m.prompt_tokens.labels(self.model).inc(self.prompt_tokens)
        self.m.generation_tokens.labels(self.model).inc(self.generated)
        for reason in self.finished:
            self.m.request_success.labels(self.model, reason).inc()
