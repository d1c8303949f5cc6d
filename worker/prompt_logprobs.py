"""Prompt logprobs on the last stage: each asked-for query row's log_softmax at the next prompt
token (and its k best alternatives), for evaluation harnesses and perplexity scoring.

Only the rows a request asked for are computed, and in row chunks: a long prompt never holds
[prompt_len, vocab] logits at once (2k tokens x 151,936 x 4 bytes would be 1.2 GB). Each chunk is
reduced on the device to one logprob and k alternatives per row; only those travel back.

Which rows: sequence b's first `rows[b]` query rows, each scoring `targets` (the metadata service
sends the target ids: the last stage has no input ids, and a chunk's last row scores the first
token of the next chunk). Steps without prompt logprobs carry none of these fields and pay nothing."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minipaged import wire
from minipaged.constants import OPENAI_MAX_TOP_LOGPROBS

CHUNK_BYTES = 64 * 1024 * 1024        # logits held at once per chunk (about 110 rows at vocab 151,936)


@dataclass
class PromptRows:
    rows: np.ndarray        # int64 [R] indexes into the step's T query rows, batch order
    targets: np.ndarray     # int64 [R] the token each row scores
    top_k: int


def parse(req, qsl: np.ndarray, vocab: int) -> PromptRows | None:
    """The step's prompt-logprob fields, checked (raises ValueError / wire.WireError); None when
    the step asks for none."""
    if not req.prompt_logprob_rows:
        if req.prompt_logprob_targets or req.prompt_top_logprobs:
            raise ValueError("prompt_logprob_targets / prompt_top_logprobs need prompt_logprob_rows")
        return None
    B = qsl.size - 1
    counts = wire.unpack(req.prompt_logprob_rows, wire.INT32, name="prompt_logprob_rows", count=B).astype(np.int64)
    qlen = np.diff(qsl.astype(np.int64))
    if (counts < 0).any() or (counts > qlen).any():
        b = int(np.argmax((counts < 0) | (counts > qlen)))
        raise ValueError(f"prompt_logprob_rows[{b}] = {counts[b]} must be in [0, query length {qlen[b]}]")
    targets = wire.unpack(req.prompt_logprob_targets, wire.INT32, name="prompt_logprob_targets",
                          count=int(counts.sum())).astype(np.int64)
    if targets.size and (targets.min() < 0 or targets.max() >= vocab):
        raise ValueError(f"prompt_logprob_targets must be in [0, {vocab})")
    if not 0 <= req.prompt_top_logprobs <= OPENAI_MAX_TOP_LOGPROBS:
        raise ValueError(f"prompt_top_logprobs = {req.prompt_top_logprobs} must be in "
                         f"[0, {OPENAI_MAX_TOP_LOGPROBS}]")
    # row r of sequence b is qsl[b] + r: the leading rows of each sequence's query
    first = np.repeat(qsl[:-1].astype(np.int64), counts)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return PromptRows(first + within, targets, min(int(req.prompt_top_logprobs), vocab))


def chunk_rows(vocab: int, itemsize: int = 4) -> int:
    """Rows per chunk so one chunk's logits (and their log_softmax) stay near CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // (2 * vocab * itemsize))


def compute(compute_logits, hidden, p: PromptRows, vocab: int):
    """(logprobs float64 [R], top ids int32 [R, k], top logprobs float64 [R, k]) for the rows of
    `hidden` [T, hidden] that `p` names. `compute_logits`: [n, hidden] -> [n, vocab] (float32, or
    float64 for a float64 model)."""
    import torch

    R, k = int(p.rows.size), p.top_k
    lp_out = torch.empty(R, dtype=torch.float64, device=hidden.device)
    ids_out = torch.empty(R, k, dtype=torch.int64, device=hidden.device)
    top_out = torch.empty(R, k, dtype=torch.float64, device=hidden.device)
    rows = torch.as_tensor(p.rows, device=hidden.device)
    targets = torch.as_tensor(p.targets, device=hidden.device)
    step = chunk_rows(vocab, 8 if hidden.dtype == torch.float64 else 4)
    with torch.inference_mode():
        for a in range(0, R, step):
            b = min(R, a + step)
            logp = torch.log_softmax(compute_logits(hidden[rows[a:b]]), dim=-1)
            lp_out[a:b] = logp.gather(1, targets[a:b, None]).squeeze(1).to(torch.float64)
            if k:
                vals, idx = torch.topk(logp, k, dim=-1)
                top_out[a:b], ids_out[a:b] = vals.to(torch.float64), idx
            del logp
    return (lp_out.cpu().numpy(), ids_out.to(torch.int32).cpu().numpy(), top_out.cpu().numpy())


def fill_reply(reply, runner, hidden, p: PromptRows) -> None:
    """Compute the step's prompt logprobs on this (last) stage and pack them into `reply`."""
    if not p.rows.size:
        return
    lp, ids, top = runner.prompt_logprobs(hidden, p)
    reply.prompt_logprobs = wire.pack(np.asarray(lp, dtype=np.float64), wire.FLOAT64)
    if p.top_k:
        reply.prompt_top_logprob_ids = wire.pack(np.asarray(ids, dtype=np.int32))
        reply.prompt_top_logprobs = wire.pack(np.asarray(top, dtype=np.float64), wire.FLOAT64)
