"""Prompt logprobs on the metadata side: which rows of a step score which prompt token, and
gathering the last stage's answers into each request's arrays.

A prompt of P tokens has P-1 prompt logprobs: token i (i >= 1) is scored by the row of position
i-1 (token 0 has none: NaN on the wire, so the arrays line up with the prompt, one entry per token). A prefill chunk over positions [start, start + n) therefore scores tokens start+1 ...
start+n that are still prompt tokens: its first min(n, P-1-start) rows. The arrays are indexed by
position, so a preempted request that recomputes its prompt just writes the same values again.

Such a request does not reuse prefix-cache blocks (no logits exist for cached positions; see the
scheduler's admission), so every prompt token is computed and scored: never silently fewer. With
max_new_tokens = 0 it ends as soon as its last prompt logprob is back, with no token sampled (the
last prompt token's row scores no prompt token, so it is not even needed)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minipaged.v1 import metadata_pb2
from minipaged.wire import FLOAT64, INT32, pack, unpack


@dataclass
class PromptState:
    """One request's prompt logprobs, filled as its prefill chunks come back."""
    k: int                       # alternatives per token (0 = own logprob only)
    logprobs: np.ndarray         # float64 [P]: token i's logprob at index i (NaN for token 0 and until computed)
    top_ids: np.ndarray          # int32 [P, k] (row 0: -1)
    top_logprobs: np.ndarray     # float64 [P, k] (row 0: NaN)
    sent: bool = False           # already on a stream chunk

    @classmethod
    def new(cls, prompt_len: int, k: int) -> "PromptState":
        return cls(k, np.full(prompt_len, np.nan), np.full((prompt_len, k), -1, np.int32),
                   np.full((prompt_len, k), np.nan))

    @property
    def num_scored(self) -> int:
        return max(0, self.logprobs.size - 1)


@dataclass
class StepRows:
    """The prompt rows of one scheduled step."""
    counts: np.ndarray           # int32 [B] leading query rows of each sequence that score a prompt token
    starts: np.ndarray           # int64 [B] each sequence's chunk start position
    targets: np.ndarray          # int32 [sum(counts)]
    top_k: int                   # the most alternatives any of its requests asked for
    ends: np.ndarray             # int64 [B] chunk end position


def plan(seqs: list, starts: np.ndarray, num_new: np.ndarray, first: int) -> StepRows | None:
    """Rows of a step's prefill chunks (seqs[first:], the decodes before them score nothing);
    None when none of its requests asked for prompt logprobs (the common case: one pass of
    attribute reads) or none of their chunks reaches a prompt token (a one-token prompt)."""
    chunks = range(first, len(seqs))
    if not any(seqs[b].prompt_lp is not None for b in chunks):
        return None
    B = len(seqs)
    counts = np.zeros(B, np.int32)
    targets, k = [], 0
    for b in chunks:
        st = seqs[b].prompt_lp
        if st is None:
            continue
        a, n = int(starts[b]), int(num_new[b])
        c = max(0, min(n, st.num_scored - a))
        counts[b] = c
        targets.extend(seqs[b].prompt_token_ids[a + 1:a + 1 + c])
        k = max(k, st.k)
    if not targets:
        return None
    starts = np.asarray(starts, np.int64)
    return StepRows(counts, starts, np.asarray(targets, np.int32), k, starts + np.asarray(num_new, np.int64))


def add_to_request(req, rows: StepRows) -> None:
    req.prompt_logprob_rows = pack(rows.counts)
    req.prompt_logprob_targets = pack(rows.targets)
    req.prompt_top_logprobs = rows.top_k


def apply(batch, reply) -> list:
    """Write a step's prompt logprobs into its requests; returns the requests that are done now
    (max_new_tokens = 0 and every prompt logprob in)."""
    rows: StepRows = batch.prompt_rows
    R = int(rows.counts.sum())
    lp = unpack(reply.prompt_logprobs, FLOAT64, name="prompt_logprobs", count=R)
    ids = tops = None
    if rows.top_k and R:
        ids = unpack(reply.prompt_top_logprob_ids, INT32, name="prompt_top_logprob_ids",
                     count=R * rows.top_k).reshape(R, rows.top_k)
        tops = unpack(reply.prompt_top_logprobs, FLOAT64, name="prompt_top_logprobs",
                      count=R * rows.top_k).reshape(R, rows.top_k)
    done, off = [], 0
    for b, (seq, gen) in enumerate(zip(batch.seqs, batch.gens)):
        c, st = int(rows.counts[b]), seq.prompt_lp
        if st is None:
            continue
        a = int(rows.starts[b])
        if seq.gen == gen and seq.status.value != "finished":   # else preempted or ended meanwhile
            st.logprobs[a + 1:a + 1 + c] = lp[off:off + c]       # position a scores token a + 1
            if st.k and c:
                st.top_ids[a + 1:a + 1 + c] = ids[off:off + c, :st.k]
                st.top_logprobs[a + 1:a + 1 + c] = tops[off:off + c, :st.k]
            if seq.params.max_new_tokens == 0 and rows.ends[b] >= st.num_scored:
                done.append(seq)
        off += c
    return done


def trivial(seq) -> bool:
    """A one-token prompt with max_new_tokens = 0 has nothing to compute: it is done at once."""
    return seq.prompt_lp is not None and seq.params.max_new_tokens == 0 and seq.prompt_lp.num_scored == 0


def attach(msg, st: PromptState | None) -> None:
    """Fill a GenerateChunk or GenerationResult's prompt-logprob fields."""
    if st is None:
        return
    msg.prompt_logprobs = pack(st.logprobs, FLOAT64)
    if st.k:
        msg.prompt_top_logprob_ids = pack(st.top_ids.reshape(-1))
        msg.prompt_top_logprobs = pack(st.top_logprobs.reshape(-1), FLOAT64)


def attach_once(chunk: metadata_pb2.GenerateChunk, st: PromptState | None) -> None:
    """On the first chunk of a stream only."""
    if st is not None and not st.sent:
        st.sent = True
        attach(chunk, st)
