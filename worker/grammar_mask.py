"""Structured outputs on the last stage: keep only the tokens a row's grammar bitmask allows.

The metadata plane (metadata_service/grammar.py, xgrammar) sends one packed int32 row per
constrained sequence: bit j of word w allows token 32 * w + j (xgrammar's layout). Disallowed
logits become -inf before anything else looks at them, so greedy, top-k / top-p and the draw all
pick among allowed tokens, as vLLM applies the grammar bitmask before sampling. float32 rows on the
CPU: one compiled pass of masked stores (worker/cpu_sampling.cpp grammar_mask); elsewhere
xgrammar's kernel when installed, or one shift-and-mask over [G, words, 32] on the logits' device.
The worker needs no grammar engine of its own."""
from __future__ import annotations

import numpy as np
import torch

from worker import cpu_kernels


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
    return ~disallowed(bitmask, vocab_size, device)


def disallowed(bitmask: np.ndarray, vocab_size: int, device) -> torch.Tensor:
    """int32 [G, words] -> bool [G, vocab_size], True where the grammar forbids the token. On the
    host numpy unpacks the bits (little-endian words, little bit order: token 32w + j is byte 4w +
    j // 8, bit j % 8); on a GPU the shifts run there, so only the packed words cross the bus."""
    words = np.ascontiguousarray(bitmask, dtype=np.int32)
    if torch.device(device).type == "cpu":
        bits = np.unpackbits((~words).view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
        return torch.from_numpy(bits.view(np.bool_))
    w = torch.as_tensor(words, device=device)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    return ((w[:, :, None] >> shifts) & 1).eq(0).reshape(w.shape[0], -1)[:, :vocab_size]


def _xgrammar_cpu_kernel():
    """xgrammar's C++ kernel reads the packed words directly (about 2x faster than unpacking them
    here, measured at 64 x 151,936 float32); used when xgrammar is installed beside the worker."""
    try:
        from xgrammar import apply_token_bitmask_inplace
    except ImportError:
        return None
    return apply_token_bitmask_inplace


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def apply(logits: torch.Tensor, rows: np.ndarray, bitmask: np.ndarray) -> torch.Tensor:
    """logits [S, V] (sampled rows), rows int64 [G] into them: -inf where disallowed, in place."""
    if not rows.size:
        return logits
    if cpu_kernels.fused_ok(logits) and logits.is_contiguous():   # float32 on the CPU: one masked store pass
        cpu_kernels.grammar_mask(logits, rows, bitmask)
        return logits
    kernel = _xgrammar_cpu_kernel() if logits.device.type == "cpu" and logits.dtype in _KERNEL_DTYPES else None
    if kernel is not None:
        full = np.full((logits.shape[0], bitmask.shape[1]), -1, dtype=np.int32)   # -1: every token allowed
        full[rows] = bitmask
        kernel(logits, torch.from_numpy(full))
        return logits
    bad = disallowed(bitmask, logits.shape[1], logits.device)
    if rows.size == logits.shape[0] and (rows == np.arange(rows.size)).all():
        return logits.masked_fill_(bad, float("-inf"))   # every row constrained: no gather / scatter
    idx = torch.as_tensor(rows, dtype=torch.long, device=logits.device)
    logits[idx] = logits[idx].masked_fill(bad, float("-inf"))
    return logits
