"""What a finished sequence returns: its final text (vLLM's stop rules), stop_reason, usage, and a
job's GenerationResult (n / best_of choices, beam hypotheses). Reads a Sequence; changes nothing."""
from __future__ import annotations

import numpy as np

from minipaged.v1 import metadata_pb2
from minipaged.wire import FLOAT32, INT32, pack

from . import prompt_logprobs
from .sequence import Sequence


def final_text(seq: Sequence, engine) -> str:
    """The output's text as vLLM returns it: without the stop token that ended it (EOS, a stop
    token id) and cut before a matched stop string, unless include_stop_str_in_output. The U+FFFD
    that decode() ends with (a character left unfinished, or invalid bytes) is dropped: vLLM's
    detokenizer never emits it, nor does a stream's (minipaged/tokenizer.py)."""
    keep = seq.params.include_stop_str_in_output
    ids = seq.output_token_ids[:-1] if seq.stopped_on_token and not keep else seq.output_token_ids
    text = engine.decode(ids).rstrip("\ufffd")
    checker = seq.stop_checker
    if checker is None or checker.cut is None:
        return text
    return text[:checker.end if keep else checker.cut]


def set_stop_reason(msg, seq: Sequence, engine, finish_reason: str) -> None:
    """vLLM's stop_reason on a GenerateChunk / GenerationResult that ended "stop": the stop string
    that matched, or the token id when a stop token ended it. vLLM's rule: the tokenizer's own EOS
    gives none; generation_config.json's other EOS ids count as stop tokens, so they give their id."""
    if finish_reason != "stop":
        return
    checker = seq.stop_checker
    if checker is not None and checker.matched is not None:
        msg.stop_str = checker.matched
        return
    if not seq.output_token_ids:
        return
    last, p = seq.output_token_ids[-1], seq.params
    own_eos = last in getattr(engine.tokenizer, "eos_token_ids", ()) and not p.ignore_eos
    if not own_eos and (last in p.stop_token_ids or (last in engine.eos_ids and not p.ignore_eos)):
        msg.stop_token_id = last


def usage(seq: Sequence) -> metadata_pb2.Usage:
    return metadata_pb2.Usage(prompt_tokens=seq.num_prompt_tokens, completion_tokens=len(seq.output_token_ids),
                              cached_tokens=seq.num_cached_tokens, preemptions=seq.preemptions)


def result(seq: Sequence, event, index: int, engine) -> metadata_pb2.GenerationResult:
    """A job's result for one request: its sequence, or with n / best_of every chosen choice (the
    top-level fields are the first one's; usage counts the returned choices' tokens, as vLLM's does
    and as generate() and the gateway do; preemptions count every candidate's)."""
    if seq.group is not None and seq.group.beam:
        return beam_result(seq, event, index, engine)
    members = seq.group.chosen() if seq.group is not None else [seq]
    choices = [_choice(m, engine, seq.group.ended[m.choice].finish_reason if seq.group else event.finish_reason)
               for m in members]
    out = metadata_pb2.GenerationResult()
    out.CopyFrom(choices[0] if choices else _choice(seq, engine, event.finish_reason))
    out.index, out.error = index, event.error
    prompt_logprobs.attach(out, seq.prompt_lp)
    if seq.group is not None:
        out.choices.extend(choices)
        for i, c in enumerate(out.choices):
            c.choice = i
        out.usage.completion_tokens = sum(len(m.output_token_ids) for m in members)
        out.usage.preemptions = sum(m.preemptions for m in seq.group.members)
    return out


def _choice(seq: Sequence, engine, finish_reason: str) -> metadata_pb2.GenerationResult:
    r = metadata_pb2.GenerationResult(
        token_ids=pack(seq.output_token_ids, INT32), text=final_text(seq, engine), finish_reason=finish_reason,
        usage=usage(seq),
        # only where the request's logprobs are computed (asked for, or best_of's ranking): a step's
        # batch may compute them for every row, and the result must not depend on its neighbours
        cumulative_logprob=float(sum(seq.output_logprobs)) if seq.params.return_logprobs else 0.0,
        logprobs=pack(seq.output_logprobs, FLOAT32) if seq.params.show_logprobs else b"")
    set_stop_reason(r, seq, engine, finish_reason)
    if seq.output_top:
        r.top_logprob_ids = pack(np.concatenate([t[0] for t in seq.output_top]))
        r.top_logprobs = pack(np.concatenate([t[1] for t in seq.output_top]), FLOAT32)
    return r


def beam_result(seq: Sequence, event, index: int, engine) -> metadata_pb2.GenerationResult:
    """A beam search job's result: the K hypotheses, best first, with their scores."""
    g = seq.group
    choices = []
    for s_, h in zip(g.choice_sequences(), g.hypotheses):
        c = _choice(s_, engine, h.finish_reason)
        c.cumulative_logprob, c.beam_score = float(h.cumulative_logprob), float(h.score)
        choices.append(c)
    out = metadata_pb2.GenerationResult()
    out.CopyFrom(choices[0] if choices else _choice(seq, engine, event.finish_reason))
    out.index, out.error = index, event.error
    out.choices.extend(choices)
    for i, c in enumerate(out.choices):
        c.choice = i
    out.usage.completion_tokens = sum(len(c_.output_token_ids) for c_ in g.choice_sequences())
    out.usage.preemptions = sum(m.preemptions for m in g.members)
    return out
