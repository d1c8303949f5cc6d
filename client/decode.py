"""Replies -> result types: a GenerationResult, a GenerateChunk, a job's progress. Packed arrays
are unpacked with minipaged.wire (a wrong length is a WireError, not a silent misread)."""
from __future__ import annotations

from minipaged import wire
from minipaged.v1 import metadata_pb2 as pb

from .results import GenerateResult, JobStatus, StreamChunk, Usage


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


def _stop_reason(msg) -> str | int | None:
    if msg.stop_str:
        return msg.stop_str
    return msg.stop_token_id if msg.HasField("stop_token_id") else None


def result_from_proto(r: pb.GenerationResult) -> GenerateResult:
    ids = wire.unpack(r.token_ids, name="token_ids").tolist()
    out = GenerateResult(token_ids=ids, text=r.text, finish_reason=r.finish_reason,
                         usage=Usage.from_proto(r.usage), logprobs=_floats(r.logprobs), index=r.index,
                         error=r.error or None, top_logprobs=_top(r.top_logprob_ids, r.top_logprobs, len(ids)),
                         choice=r.choice, beam_score=r.beam_score if r.HasField("beam_score") else None,
                         cumulative_logprob=r.cumulative_logprob
                         if (r.logprobs or r.cumulative_logprob or r.HasField("beam_score")) else None,
                         stop_reason=_stop_reason(r))
    out.prompt_logprobs, out.prompt_top_logprobs = _prompt_logprobs(r)
    if r.choices:
        out.choices = [result_from_proto(c) for c in r.choices]
        for c in out.choices:   # the prompt's logprobs are the request's: every choice has them
            c.index = out.index
            c.prompt_logprobs, c.prompt_top_logprobs = out.prompt_logprobs, out.prompt_top_logprobs
    return out


def chunk_from_proto(c: pb.GenerateChunk) -> StreamChunk:
    ids = wire.unpack(c.token_ids, name="token_ids").tolist()
    own, top = _prompt_logprobs(c)
    return StreamChunk(token_ids=ids, text=c.text, finish_reason=c.finish_reason or None,
                       usage=Usage.from_proto(c.usage) if c.HasField("usage") else None,
                       logprobs=_floats(c.logprobs), index=c.index,
                       top_logprobs=_top(c.top_logprob_ids, c.top_logprobs, len(ids)),
                       cumulative_logprob=c.cumulative_logprob if c.HasField("cumulative_logprob") else None,
                       beam_score=c.beam_score if c.HasField("beam_score") else None,  # (0.0 is a score)
                       prompt_logprobs=own, prompt_top_logprobs=top, decode_seconds=c.decode_seconds,
                       stop_reason=_stop_reason(c))


def job_from_proto(j) -> JobStatus:
    """pb.Job or pb.JobProgress (the latter's results are only the new ones)."""
    results = j.results if isinstance(j, pb.Job) else j.new_results
    return JobStatus(j.job_id, j.state, j.total, j.completed, [result_from_proto(r) for r in results],
                     created=getattr(j, "created", 0.0))
