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
- min_p (vLLM's, after the rules above and before top-k / top-p): a row keeps the tokens whose
  probability at its temperature is at least min_p times its most likely token's, i.e. whose logit
  is >= max + temperature * ln(min_p) (in the logits' dtype); the rest get -inf. Greedy rows ignore it.
- top-k alternative logprobs: log_softmax of the raw logits (temperature 1, before these rules), as
  the sampled token's own logprob is; a grammar's mask alone comes first (vLLM's order: it masks
  the logits before its sampler computes logprobs).

The per-sequence arrays arrive per sequence of the step ([B], CSR for token lists); `rows` narrows
them to the sampled rows first."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from worker import cpu_kernels, grammar_mask, sampler
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
    if x.min_p is not None:
        out.min_p = x.min_p[mask]
    if x.repetition is not None:
        out.repetition, out.presence, out.frequency = x.repetition[mask], x.presence[mask], x.frequency[mask]
        out.penalty_prompt_lens = x.penalty_prompt_lens[mask]
        out.penalty_counts, out.penalty_tokens = _csr_rows(x.penalty_counts, x.penalty_tokens, mask)
    return out


def apply(logits: torch.Tensor, x: SamplingExtras, in_place: bool = False) -> torch.Tensor:
    """logits [S, V] (already narrowed to the sampled rows) -> the processed logits: a copy, or
    `logits` itself changed when in_place (the caller needs no raw logit after this: copying
    [64, 151,936] float32 costs ~10 ms on 2 cores, 8% of a Qwen3-0.6B decode step).

    Every rule touches only the entries it names (the penalties the (row, token) pairs a row has
    seen, once each), with the same float operations the dense form would run on them: an entry
    none names keeps its value exactly, as `x - 0 * 0` would."""
    S, V = logits.shape
    dev = logits.device
    out = logits if in_place else logits.clone()
    if x.grammar_rows is not None:
        grammar_mask.apply(out, x.grammar_rows, x.grammar_bitmask)
    if x.repetition is not None and x.penalty_tokens.size:
        _penalize(out, x)
    if x.suppress is not None and x.suppress.any():
        keep = np.repeat(x.suppress, x.suppress_counts)
        row = np.repeat(np.arange(S), x.suppress_counts)[keep]
        out[torch.as_tensor(row, device=dev), torch.as_tensor(x.suppress_ids[keep].astype(np.int64), device=dev)] = \
            float("-inf")
    return out


def _penalize(out: torch.Tensor, x: SamplingExtras) -> None:
    """Repetition, presence and frequency penalties, in place, on each seen (row, token) once."""
    S, V = out.shape
    row = np.repeat(np.arange(S, dtype=np.int64), x.penalty_counts)
    # position of each history token inside its row: the first prompt_len are the prompt's
    first = np.repeat(np.cumsum(x.penalty_counts) - x.penalty_counts, x.penalty_counts)
    is_output = (np.arange(x.penalty_tokens.size) - first) >= np.repeat(x.penalty_prompt_lens, x.penalty_counts)
    seen, where = np.unique(row * V + x.penalty_tokens.astype(np.int64), return_inverse=True)
    counts = np.bincount(where.reshape(-1), weights=is_output, minlength=seen.size)   # output occurrences
    r, t = torch.as_tensor(seen // V, device=out.device), torch.as_tensor(seen % V, device=out.device)
    v = out[r, t]
    cnt = torch.as_tensor(counts, dtype=out.dtype, device=out.device)
    rep = torch.as_tensor(x.repetition, dtype=out.dtype, device=out.device)[r]
    v = torch.where(v < 0, v * rep, v / rep)
    freq = torch.as_tensor(x.frequency, dtype=out.dtype, device=out.device)[r]
    pres = torch.as_tensor(x.presence, dtype=out.dtype, device=out.device)[r]
    out[r, t] = v - freq * cnt - pres * (cnt > 0).to(out.dtype)


def apply_min_p(out: torch.Tensor, min_p: np.ndarray, temperature) -> None:
    """In place: each row with min_p > 0 and temperature > 0 keeps the logits >= its max +
    temperature * ln(min_p) (the tokens with probability >= min_p x the most likely's), -inf elsewhere."""
    temperature = np.asarray(temperature, dtype=np.float64)
    rows = np.flatnonzero((min_p > 0) & (temperature > 0))
    if not rows.size:
        return
    whole = rows.size == out.shape[0]
    sub = out if whole else out[torch.as_tensor(rows, device=out.device)]
    drop = torch.as_tensor(temperature[rows] * np.log(min_p[rows].astype(np.float64)), dtype=out.dtype,
                           device=out.device)
    if cpu_kernels.fused_ok(sub) and sub.is_contiguous():   # float32 on the CPU: one compiled pass
        cpu_kernels.min_p_mask(sub, drop)
    else:
        sub.masked_fill_(sub < sub.amax(dim=1, keepdim=True) + drop[:, None], float("-inf"))
    if not whole:
        out[torch.as_tensor(rows, device=out.device)] = sub


def sample_with_rules(logits: torch.Tensor, x: SamplingExtras, temperature, top_p, top_k, seeds, offsets,
                      return_logprobs: bool, keep_raw: bool = False):
    """The sampled rows' logits [S, V] with their rules -> (ids int32 [S], logprobs float32 [S] or
    None, top alternatives or None). Logprobs and alternatives are those of the raw distribution
    (one log_softmax before the rules serves both), except that a grammar's mask comes first, as
    vLLM masks the logits before its sampler: a constrained row's logprobs are over the tokens its
    grammar allows. Then the rules run in place unless keep_raw."""
    if x.grammar_rows is not None:
        logits = logits.clone() if keep_raw else logits
        grammar_mask.apply(logits, x.grammar_rows, x.grammar_bitmask)
        x = replace(x, grammar_rows=None, grammar_bitmask=None)
    raw_lp = None
    if return_logprobs or x.top_logprobs:
        raw_lp = sampler.log_softmax_rows(logits)
    ruled = apply(logits, x, in_place=not keep_raw)
    if x.min_p is not None:
        apply_min_p(ruled, x.min_p, temperature)
    ids, _ = sampler.sample(ruled, temperature, top_p, top_k, seeds, offsets)
    logprobs = None
    if return_logprobs:
        at = torch.as_tensor(ids, device=logits.device).long()[:, None]
        logprobs = raw_lp.gather(1, at).squeeze(1).to(torch.float32).cpu().numpy()
    top = top_logprobs(logits, x.top_logprobs, raw_lp) if x.top_logprobs else None
    return ids, logprobs, top


def top_logprobs(raw_logits: torch.Tensor, k: int, raw_lp: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [S, k], logprobs float32 [S, k]), best first, from the raw distribution (its
    log_softmax given as raw_lp when the caller has it; then raw_logits is not read)."""
    lp = raw_lp if raw_lp is not None else torch.log_softmax(
        raw_logits.to(torch.float64 if raw_logits.dtype == torch.float64 else torch.float32), -1)
    if cpu_kernels.fused_ok(lp) and lp.is_contiguous():   # one compiled scan (ties: the lower id first)
        vals, ids = cpu_kernels.head_stable(lp, k)
        return ids.to(torch.int32).numpy(), vals.numpy()
    vals, ids = torch.topk(lp, k, dim=-1)
    return ids.to(torch.int32).cpu().numpy(), vals.to(torch.float32).cpu().numpy()
