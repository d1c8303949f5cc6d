"""Step checks of the sampling part: per-sequence temperature / top-p / top-k / seeds, and the
optional rules beyond them (min-tokens suppression, penalties, top logprobs, grammar bitmasks),
decoded into SamplingExtras for the sampler (worker/logits_processors.py)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minipaged import wire
from minipaged.constants import STEP_MAX_TOP_LOGPROBS
from worker.validate_common import check_range, fail


@dataclass
class SamplingExtras:
    """Per-sequence sampling rules beyond temperature/top-p/top-k ([B] arrays; None = off)."""
    suppress: np.ndarray | None = None          # bool [B]: mask suppress ids (EOS etc.) this step
    suppress_counts: np.ndarray | None = None   # int32 [B] CSR
    suppress_ids: np.ndarray | None = None      # int32 [sum]
    repetition: np.ndarray | None = None        # float64 [B]
    presence: np.ndarray | None = None
    frequency: np.ndarray | None = None
    penalty_counts: np.ndarray | None = None    # int32 [B] CSR over penalty_tokens
    penalty_prompt_lens: np.ndarray | None = None
    penalty_tokens: np.ndarray | None = None
    top_logprobs: int = 0
    grammar_rows: np.ndarray | None = None      # int32 [G] constrained rows (structured outputs)
    grammar_bitmask: np.ndarray | None = None   # int32 [G, ceil(vocab / 32)] (worker/grammar_mask.py)
    min_p: np.ndarray | None = None             # float32 [B], 0 = off


def sampling_params(req, B: int):
    """Per-sequence sampling parameters, each in its range."""
    do_sample = wire.unpack(req.do_sample, wire.UINT8, name="do_sample", count=B)
    if (do_sample > 1).any():
        fail("do_sample: values must be 0 or 1")
    temperature = wire.unpack(req.temperature, wire.FLOAT32, name="temperature", count=B)
    if not (np.isfinite(temperature) & (temperature >= 0)).all():
        fail("temperature: every value must be finite and >= 0 (0 = greedy)")
    top_p = wire.unpack(req.top_p, wire.FLOAT32, name="top_p", count=B)
    if not ((top_p >= 0) & (top_p <= 1)).all():  # NaN fails both comparisons
        fail("top_p: every value must be in [0, 1]")
    top_k = wire.unpack(req.top_k, wire.INT32, name="top_k", count=B)
    if (top_k < 0).any():
        fail("top_k: every value must be >= 0 (0 = off)")
    seeds = wire.unpack(req.seeds, wire.INT64, name="seeds", count=B)
    offsets = wire.unpack(req.sample_offsets, wire.INT32, name="sample_offsets", count=B)
    if (offsets < 0).any():
        fail("sample_offsets: every value must be >= 0")
    return do_sample, temperature, top_p, top_k, seeds, offsets


def sampling_extras(req, B: int, vocab: int, do_sample=None) -> SamplingExtras | None:
    """The optional per-sequence sampling rules; None when the batch uses none of them."""
    if not (req.min_tokens_suppress or req.repetition_penalty or req.presence_penalty
            or req.frequency_penalty or req.top_logprobs or req.grammar_rows or req.min_p):
        return None
    x = SamplingExtras()
    if req.grammar_rows:
        from worker import grammar_mask
        x.grammar_rows = wire.unpack(req.grammar_rows, wire.INT32, name="grammar_rows")
        words = wire.unpack(req.grammar_bitmask, wire.INT32, name="grammar_bitmask")
        try:
            x.grammar_bitmask = grammar_mask.check(x.grammar_rows, words, B, np.asarray(do_sample, dtype=bool), vocab)
        except ValueError as e:
            fail(str(e))
    if not 0 <= req.top_logprobs <= STEP_MAX_TOP_LOGPROBS:
        fail(f"top_logprobs = {req.top_logprobs} must be in [0, {STEP_MAX_TOP_LOGPROBS}]")
    x.top_logprobs = min(req.top_logprobs, vocab)
    if req.min_p:
        x.min_p = wire.unpack(req.min_p, wire.FLOAT32, name="min_p", count=B)
        if not ((x.min_p >= 0) & (x.min_p <= 1)).all():  # NaN fails both comparisons
            fail("min_p: every value must be in [0, 1] (0 = off)")
    if req.min_tokens_suppress:
        x.suppress = wire.unpack(req.min_tokens_suppress, wire.UINT8, name="min_tokens_suppress", count=B) > 0
        x.suppress_counts = wire.unpack(req.suppress_counts, wire.INT32, name="suppress_counts", count=B)
        if (x.suppress_counts < 0).any():
            fail("suppress_counts must be >= 0")
        x.suppress_ids = wire.unpack(req.suppress_ids, wire.INT32, name="suppress_ids",
                                     count=int(x.suppress_counts.sum()))
        check_range("suppress_ids", x.suppress_ids, 0, vocab)
    if req.repetition_penalty or req.presence_penalty or req.frequency_penalty:
        x.repetition = _floats(req.repetition_penalty, B, "repetition_penalty", 1.0)
        x.presence = _floats(req.presence_penalty, B, "presence_penalty", 0.0)
        x.frequency = _floats(req.frequency_penalty, B, "frequency_penalty", 0.0)
        if (x.repetition <= 0).any():
            fail("repetition_penalty: every value must be > 0 (1 = off)")
        x.penalty_counts = wire.unpack(req.penalty_counts, wire.INT32, name="penalty_counts", count=B)
        x.penalty_prompt_lens = wire.unpack(req.penalty_prompt_lens, wire.INT32, name="penalty_prompt_lens",
                                            count=B)
        if (x.penalty_counts < 0).any() or (x.penalty_prompt_lens < 0).any() \
                or (x.penalty_prompt_lens > x.penalty_counts).any():
            fail("penalty_counts / penalty_prompt_lens must be >= 0 and prompt lens <= counts")
        x.penalty_tokens = wire.unpack(req.penalty_tokens, wire.INT32, name="penalty_tokens",
                                       count=int(x.penalty_counts.sum()))
        check_range("penalty_tokens", x.penalty_tokens, 0, vocab)
    return x


def _floats(data: bytes, B: int, name: str, default: float) -> np.ndarray:
    if not data:
        return np.full(B, default, dtype=np.float64)
    arr = wire.unpack(data, wire.FLOAT64, name=name, count=B)
    if not np.isfinite(arr).all():
        fail(f"{name}: every value must be finite")
    return arr


def complete_histories(x: SamplingExtras, do_sample, offsets, seq_ids, store) -> None:
    """A penalized sequence scheduled before its last token came back (async scheduling) sends its
    history without that token: it has sample_offsets[b] - 1 outputs where the rule needs
    sample_offsets[b]. The last stage sampled that token itself in the sequence's previous step
    (SequenceStore.record_sampled) and appends it here; more than one missing is an error."""
    penalized = (x.repetition != 1.0) | (x.presence != 0.0) | (x.frequency != 0.0)
    outputs = x.penalty_counts.astype(np.int64) - x.penalty_prompt_lens
    missing = np.where(penalized & np.asarray(do_sample, dtype=bool), offsets.astype(np.int64) - outputs, 0)
    if ((missing != 0) & (missing != 1)).any():
        b = int(np.argmax((missing != 0) & (missing != 1)))
        fail(f"penalty_counts: sequence {b} sends {int(outputs[b])} output tokens for sample offset "
             f"{int(offsets[b])} (at most its last token may be left out)")
    late = np.flatnonzero(missing)
    if not late.size:
        return
    if store is None or not np.asarray(seq_ids).size:
        fail("penalty history without its last token needs sequence_ids and a stage that keeps them")
    toks = store.sampled_tokens(np.asarray(seq_ids)[late])
    ends = np.cumsum(x.penalty_counts.astype(np.int64))[late]   # each late row's segment ends there
    x.penalty_tokens = np.insert(x.penalty_tokens, ends, toks.astype(x.penalty_tokens.dtype))
    x.penalty_counts = x.penalty_counts + missing.astype(x.penalty_counts.dtype)

