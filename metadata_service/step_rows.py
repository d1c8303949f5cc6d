"""Each sequence's fixed facts, packed once (STEP_ROW): what the steady decode step reads as columns.

Most steps of a busy chain only append one token to every sequence of a micro-batch. What a step
needs of a sequence that never changes (its id, sampling parameters, prompt length, max_new_tokens,
ignore_eos, and whether any rule beyond those applies) is packed into one STEP_ROW when it is
admitted; a step joins the rows of its sequences (one pass) and reads the columns as arrays. A
step whose sequences are all "plain" (no stop strings or stop ids, streams, grammars, logprobs,
penalties, beams or choices) is applied by apply.py's `apply_plain`: the stop rules are vector
compares, and the pass over the sequences only appends each token."""
from __future__ import annotations

import struct

import numpy as np

from .sequence import Sequence

STEP_ROW = np.dtype([("temperature", "<f4"), ("top_p", "<f4"), ("top_k", "<i4"), ("seed", "<i8"),
                     ("seq_id", "<i8"), ("prompt_len", "<i4"), ("max_new", "<i4"), ("ignore_eos", "u1"),
                     ("plain", "u1")])
_ROW = struct.Struct("<ffiqqiiBB")
assert _ROW.size == STEP_ROW.itemsize


def pack_step_row(s: Sequence) -> bytes:
    """Once per sequence, when it is admitted (everything it reads is fixed by then)."""
    p = s.params
    plain = (s.group is None and s.matcher is None and s.stop_checker is None and not p.stop_token_ids
             and not p.return_logprobs and not p.extras and s.prompt_lp is None
             and not (s.sink is not None and s.tag is None and p.per_token_events))
    return _ROW.pack(p.temperature, p.top_p, p.top_k, p.seed, s.seq_id, len(s.prompt_token_ids),
                     p.max_new_tokens, p.ignore_eos, plain)


def eos_mask(tokens: np.ndarray, eos_ids) -> np.ndarray:
    """Which sampled tokens are an EOS id: one vector compare per EOS id (a model has one to three)."""
    hit = np.zeros(tokens.size, dtype=bool)
    for e in eos_ids:
        hit |= tokens == e
    return hit
