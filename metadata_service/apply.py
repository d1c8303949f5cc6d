"""Applying a step's reply to its sequences: each sampled token appended, the stop rules checked,
finished sequences removed and their owners told. `apply_reply` handles every rule (stop strings,
grammars, logprobs, beams, streams); `apply_plain` the steady decode step of plain sequences
(step_rows.py), with the stop rules as vector compares. Called by the chain's thread, under its lock."""
from __future__ import annotations

import time
from collections import deque
from operator import attrgetter

import numpy as np

from minipaged.v1 import worker_pb2
from minipaged.wire import FLOAT32, INT32, unpack

from .beam import on_beam_rows
from .grammar import advance, fill_bitmask
from .step_batch import ScheduledBatch
from .sequence import SeqStatus
from .step_rows import STEP_ROW, eos_mask


_outputs = attrgetter("output_token_ids")


def apply_reply(chain, b: ScheduledBatch, reply: worker_pb2.StepReply) -> None:
    """Append each sampled token and apply the stop rules, any rule (one pass, locals only)."""
    sampled, logprobs, top = _unpack_reply(reply)
    tokens = sampled.tolist()
    is_eos = eos_mask(sampled, chain.engine.eos_ids).tolist()
    rows = b.do_sample.nonzero()[0].tolist() if len(tokens) < len(b.seqs) else range(len(tokens))
    P, pr = chain.scheduler.progress, b.progress_rows
    same = P.same_run(pr, b.seq_ids, b.gens).tolist()   # step_done already took them out of flight
    seqs = b.seqs
    finished_status, engine = SeqStatus.FINISHED, chain.engine
    special = b.special or logprobs is not None or top is not None
    ended, beams, kept_rows, kept_tokens = [], [], [], []
    now = 0.0
    for j, i in enumerate(rows):
        seq = seqs[i]
        if not same[i] or seq.status is finished_status:  # preempted or ended while in flight
            continue
        if seq.group is not None and seq.group.beam:  # beam search: its group picks the tokens
            beams.append((seq, j))
            continue
        tok = tokens[j]
        kept_rows.append(i)
        kept_tokens.append(j)
        out = seq.output_token_ids
        if not out:
            seq.first_token_at = now = now or time.monotonic()
        out.append(tok)
        verdict = _extras(seq, tok, j, logprobs, top) if special else ""
        reason = _stop(seq, tok, verdict, is_eos[j])
        if reason:
            ended.append((seq, reason))
        elif seq.sink is not None and seq.tag is None and seq.params.per_token_events:  # streams hear every token
            engine.stream_tokens(seq, [tok], [logprobs[j]] if logprobs else [],
                                 seq.output_top[-1:] if seq.params.top_logprobs else [])
    kept = len(kept_rows)
    fill = []
    if kept:
        live = pr[kept_rows]
        P.num_tokens[live] += 1
        deferred = P.deferred[live]                   # the step after this one already reads the token
        P.deferred[live] = False
        fill = np.asarray(kept_tokens)[deferred]
    if beams:
        kept += on_beam_rows(chain, beams, top)
    if len(fill):
        chain.manager.fill_tokens(b.seq_ids[b.do_sample.astype(bool)][fill], sampled[fill])
    chain.generated_tokens += kept        # tokens requests kept (not one computed and dropped)
    _end(chain, ended)


def _unpack_reply(reply: worker_pb2.StepReply):
    """(sampled ids, logprobs list or None, (top ids, top logprobs) or None) of a general reply."""
    sampled = unpack(reply.sampled_token_ids, INT32)
    logprobs = unpack(reply.logprobs, FLOAT32).tolist() if reply.logprobs else None
    top = None
    if reply.top_logprob_ids:
        top_ids = unpack(reply.top_logprob_ids, INT32).reshape(sampled.size, -1)
        top = (top_ids, unpack(reply.top_logprobs, FLOAT32).reshape(top_ids.shape))
    return sampled, logprobs, top


def _extras(seq, tok: int, j: int, logprobs, top) -> str:
    """Logprobs and alternatives kept; the grammar advanced ("stop", "rejected" or "")."""
    p = seq.params
    if logprobs is not None:
        seq.output_logprobs.append(logprobs[j])
    if top is not None and p.top_logprobs:
        seq.output_top.append((top[0][j, :p.top_logprobs], top[1][j, :p.top_logprobs]))
    return advance(seq.matcher, tok) if seq.matcher is not None else ""   # structured outputs


def _stop(seq, tok: int, verdict: str, is_eos: bool) -> str:
    """Why the sequence ends with this token ("stop", "length", "rejected"), or ""."""
    p = seq.params
    if verdict == "rejected":
        return verdict
    if verdict == "stop" or (is_eos and not p.ignore_eos) or tok in p.stop_token_ids:
        seq.stopped_on_token = True
        return "stop"
    if seq.stop_checker is not None and seq.stop_checker.push(tok, len(seq.output_token_ids) > p.min_new_tokens):
        return "stop"
    return "length" if len(seq.output_token_ids) >= p.max_new_tokens else ""


def _end(chain, ended: list) -> None:
    """Ended sequences leave the scheduler first (their blocks free), then their owners hear."""
    for seq, _ in ended:
        chain.scheduler.remove(seq)
    for seq, reason in ended:
        if reason == "rejected":
            chain.engine.finish(seq, "error", **_rejection(seq, chain.stages[-1].info.vocab_size))
        else:
            chain.engine.finish(seq, reason)


def _rejection(seq, vocab_size: int) -> dict:
    """A token the grammar refused. Either the grammar allowed no token at all (a dead end: its text
    cannot be spelled in this vocabulary, e.g. a character whose byte is the EOS id), the request's
    fault, or a worker ignored the bitmask."""
    bits = np.unpackbits(fill_bitmask([seq.matcher], vocab_size).view(np.uint8), bitorder="little")
    if not bits[:vocab_size].any():
        return dict(code="INVALID_ARGUMENT",
                    error=f"the structured output cannot go on after {len(seq.output_token_ids) - 1} tokens: its "
                          f"grammar allows no token of this model's vocabulary there (text the tokenizer cannot "
                          f"spell, or that needs a special token)")
    return dict(code="INTERNAL", error=f"the data plane returned token {seq.output_token_ids[-1]}, which the "
                                       f"request's grammar does not allow (a worker ignored the bitmask)")


def apply_plain(chain, b: ScheduledBatch, tokens: np.ndarray) -> None:
    """A decode step of plain sequences: vector updates of their Progress rows, one pass that
    appends the tokens, vector compares that find the ends."""
    finished, fill, kept = _plain_rows(chain.scheduler.progress, b, tokens, chain.engine.eos_ids)
    if fill.size:
        chain.manager.fill_rows(b.manager_rows[fill], tokens[fill])   # rows of live sequences (not gone)
    chain.generated_tokens += kept
    for seq, _ in finished:
        chain.scheduler.remove(seq)
    for seq, reason in finished:
        chain.engine.finish(seq, reason)


def _plain_rows(P, b, tokens: np.ndarray, eos_ids) -> tuple[list, np.ndarray, int]:
    """The reply of a plain decode step `b` (a ScheduledBatch) over Progress `P`: each sequence still
    in it appends its token and is one step less in flight (the step_done of the general path).
    Returns (finished [(seq, reason)], indexes of tokens an in-flight step read as -1, tokens kept)."""
    pr = b.progress_rows
    same = P.step_back(pr, b.seq_ids, b.gens)          # what the general path's step_done does
    seqs, toks = b.seqs, tokens.tolist()
    finished_status = SeqStatus.FINISHED
    if same.all():
        # Every row still holds its run, so none ended meanwhile: an ended sequence leaves the
        # scheduler (its row unbound) before its owner hears. Each token goes to its list in a
        # C loop (map), not a Python one: this pass touches every sequence of the step.
        gone = []
        deque(map(list.append, map(_outputs, seqs), toks), maxlen=0)
    else:
        gone = np.flatnonzero(~same).tolist()
        for j in np.flatnonzero(same).tolist():
            s = seqs[j]
            if s.status is finished_status:
                gone.append(j)
            else:
                s.output_token_ids.append(toks[j])
    keep = np.ones(len(seqs), dtype=bool)
    keep[gone] = False
    kept_rows = pr[keep]
    P.num_tokens[kept_rows] += 1
    fill = np.flatnonzero(keep & P.deferred[pr])                # the step after this one already read it
    P.deferred[pr[fill]] = False
    first = np.flatnonzero((b.sample_offsets == 0) & keep)
    if first.size:
        now = time.monotonic()
        for j in first.tolist():
            seqs[j].first_token_at = now
    rows = np.frombuffer(b.step_rows, dtype=STEP_ROW)
    new_len = b.sample_offsets + 1                     # output length once this token is appended
    stop = eos_mask(tokens, eos_ids) & (rows["ignore_eos"] == 0)
    done = (stop | (new_len >= rows["max_new"])) & keep
    finished = [(seqs[j], "stop" if stop[j] else "length") for j in np.flatnonzero(done).tolist()]
    return finished, fill, len(seqs) - len(gone)
