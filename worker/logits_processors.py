"""Per-request rules on the logits beyond temperature / top-k / top-p, applied to the sampled rows
before the sampler draws (vectorized over the batch: one scatter per rule, no per-token loops).

- min_new_tokens: the EOS ids and stop_token_ids are masked (-inf) while the output is shorter
  (transformers' MinNewTokensLengthLogitsProcessor).
- repetition_penalty over prompt + output tokens, transformers' RepetitionPenaltyLogitsProcessor:
  a seen token's logit is divided by the penalty when positive, multiplied when negative.
- presence / frequency penalties over output tokens, OpenAI's definitions (as vLLM applies them):
  logit -= frequency * count + presence * (count > 0).
- structured outputs: a constrained row keeps only the tokens its grammar bitmask allows (-inf
  elsewhere; worker/grammar_mask.py), before the rules above.
- top-k alternative logprobs: log_softmax of the raw logits (temperature 1, before these rules), as
  the sampled token's own logprob is.

The per-sequence arrays arrive per sequence of the step ([B], CSR for token lists); `rows` narrows
them to the sampled rows first."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from worker import grammar_mask
from worker.validate_sampling import SamplingExtras


def _csr_rows(counts: np.ndarray, values: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    keep = np.repeat(mask, counts)
    return counts[mask], values[keep]


def rows(x: SamplingExtras, mask: np.ndarray) -> SamplingExtras:
    """The rules of the rows with do_sample set, in batch order."""
    out = replace(x)
    if x.grammar_rows is not None:  # batch rows -> sampled rows (every constrained row samples)
        out.grammar_rows = (np.cumsum(mask) - 1)[x.grammar_rows]
    if x.suppress is not None:
        out.suppress = x.suppress[mask]
        out.suppress_counts, out.suppress_ids = _csr_rows(x.suppress_counts, x.suppress_ids, mask)
    if x.repetition is not None:
        out.repetition, out.presence, out.frequency = x.repetition[mask], x.presence[mask], x.frequency[mask]
        out.penalty_prompt_lens = x.penalty_prompt_lens[mask]
        out.penalty_counts, out.penalty_tokens = _csr_rows(x.penalty_counts, x.penalty_tokens, mask)
    return out


def apply(logits: torch.Tensor, x: SamplingExtras) -> torch.Tensor:
    """logits [S, V] (already narrowed to the sampled rows) -> a processed copy."""
    S, V = logits.shape
    dev = logits.device
    out = logits.clone()
    if x.grammar_rows is not None:
        grammar_mask.apply(out, x.grammar_rows, x.grammar_bitmask)
    if x.repetition is not None and x.penalty_tokens.size:
        row = torch.as_tensor(np.repeat(np.arange(S), x.penalty_counts), device=dev)
        tok = torch.as_tensor(x.penalty_tokens.astype(np.int64), device=dev)
        # position of each history token inside its row: the first prompt_len are the prompt's
        first = np.repeat(np.cumsum(x.penalty_counts) - x.penalty_counts, x.penalty_counts)
        is_output = torch.as_tensor((np.arange(x.penalty_tokens.size) - first)
                                    >= np.repeat(x.penalty_prompt_lens, x.penalty_counts), device=dev)
        seen = torch.zeros(S, V, dtype=torch.bool, device=dev)
        seen[row, tok] = True
        counts = torch.zeros(S, V, dtype=out.dtype, device=dev)
        counts.index_put_((row[is_output], tok[is_output]), torch.ones(int(is_output.sum()), dtype=out.dtype,
                                                                       device=dev), accumulate=True)
        rep = torch.as_tensor(x.repetition, dtype=out.dtype, device=dev)[:, None]
        out = torch.where(seen, torch.where(out < 0, out * rep, out / rep), out)
        freq = torch.as_tensor(x.frequency, dtype=out.dtype, device=dev)[:, None]
        pres = torch.as_tensor(x.presence, dtype=out.dtype, device=dev)[:, None]
        out = out - freq * counts - pres * (counts > 0).to(out.dtype)
    if x.suppress is not None and x.suppress.any():
        keep = np.repeat(x.suppress, x.suppress_counts)
        row = np.repeat(np.arange(S), x.suppress_counts)[keep]
        out[torch.as_tensor(row, device=dev), torch.as_tensor(x.suppress_ids[keep].astype(np.int64), device=dev)] = \
            float("-inf")
    return out


def top_logprobs(raw_logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [S, k], logprobs float32 [S, k]), best first, from the raw distribution."""
    lp = torch.log_softmax(raw_logits.to(torch.float64 if raw_logits.dtype == torch.float64 else torch.float32), -1)
    vals, ids = torch.topk(lp, k, dim=-1)
    return ids.to(torch.int32).cpu().numpy(), vals.to(torch.float32).cpu().numpy()
