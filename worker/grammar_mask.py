"""Structured outputs on the last stage: keep only the tokens a row's grammar bitmask allows.

The metadata plane (metadata_service/grammar.py, xgrammar) sends one packed int32 row per
constrained sequence: bit j of word w allows token 32 * w + j (xgrammar's layout). Disallowed
logits become -inf before anything else looks at them, so greedy, top-k / top-p and the draw all
pick among allowed tokens, as vLLM applies the grammar bitmask before sampling. Vectorised: one
shift-and-mask over [G, words, 32], no per-row loop, on the logits' device. The worker needs no
grammar engine of its own."""
from __future__ import annotations

import numpy as np
import torch


def words_for(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def check(rows: np.ndarray, bitmask: np.ndarray, B: int, do_sample: np.ndarray, vocab_size: int) -> np.ndarray:
    """Validate the wire arrays (ValueError says what is wrong); returns the bitmask int32 [G, words]."""
    G, W = rows.size, words_for(vocab_size)
    if bitmask.size != G * W:
        raise ValueError(f"grammar_bitmask: {bitmask.size} int32 words for {G} rows; expected "
                                  f"{G} x {W} (ceil(vocab_size {vocab_size} / 32))")
    if G and (rows.min() < 0 or rows.max() >= B):
        raise ValueError(f"grammar_rows must be in [0, {B})")
    if np.unique(rows).size != G:
        raise ValueError("grammar_rows: a row appears twice")
    if G and not do_sample[rows].all():
        raise ValueError("grammar_rows: every constrained row must have do_sample set")
    return bitmask.reshape(G, W)


def allowed(bitmask: np.ndarray, vocab_size: int, device) -> torch.Tensor:
    """int32 [G, words] -> bool [G, vocab_size]."""
    bits = torch.as_tensor(np.ascontiguousarray(bitmask), device=device)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    return ((bits[:, :, None] >> shifts) & 1).bool().reshape(bits.shape[0], -1)[:, :vocab_size]


def apply(logits: torch.Tensor, rows: np.ndarray, bitmask: np.ndarray) -> torch.Tensor:
    """logits [S, V] (sampled rows), rows int64 [G] into them -> logits with -inf where disallowed."""
    if not rows.size:
        return logits
    idx = torch.as_tensor(rows, dtype=torch.long, device=logits.device)
    ok = allowed(bitmask, logits.shape[1], logits.device)
    logits[idx] = logits[idx].masked_fill(~ok, float("-inf"))
    return logits
