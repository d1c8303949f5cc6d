"""Step request validation: decode every packed array and check it before the cache is touched.

A worker cannot trust the metadata plane blindly: one bad slot would silently overwrite another
sequence's K/V. Every check is vectorized numpy over the whole batch (no per-token Python loops),
and every failure raises StepValidationError naming the field and the limit; the server turns it
into INVALID_ARGUMENT with the cache untouched. What the step assumes the stage remembers (delta
block tables, -1 inputs for tokens still being sampled; worker/step_state.py) is checked against
the stage's SequenceStore without changing it: a mismatch raises StepPrecondition
(FAILED_PRECONDITION).

This module checks the batch's shape, its token inputs and positions, and assembles StepArrays;
worker/validate_cache.py checks where the step reads and writes K/V (tables, slots, copies),
worker/validate_sampling.py the sampling part."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minipaged import wire
from minipaged.constants import DTYPE_BYTES
from minipaged.id_index import has_duplicates
from minipaged.wire import WireError
from worker.prompt_logprobs import PromptRows, parse as parse_prompt_rows
from worker.step_state import SequenceStore, StepPrecondition  # noqa: F401 (re-exported)
from worker.validate_cache import block_tables, copies, slot_mapping, tier_moves
from worker.validate_common import StepLimits, StepValidationError, check_range, fail
from worker.validate_sampling import SamplingExtras, complete_histories, sampling_extras, sampling_params


@dataclass
class StepArrays:
    """The decoded, validated batch (read-only views of the request's bytes)."""
    num_seqs: int
    num_tokens: int
    input_ids: np.ndarray | None   # int32 [T] on stage 0, else None
    hidden_states: bytes | None    # raw [T, hidden] bytes in hidden_dtype on later stages
    hidden_dtype: str
    positions: np.ndarray          # int32 [T]
    slot_mapping: np.ndarray       # int32 [T]
    query_start_loc: np.ndarray    # int32 [B+1]
    seq_lens: np.ndarray           # int32 [B]
    block_tables: np.ndarray       # int32 [B, max_blocks]
    do_sample: np.ndarray          # bool [B]
    temperature: np.ndarray        # float32 [B]
    top_p: np.ndarray              # float32 [B]
    top_k: np.ndarray              # int32 [B]
    seeds: np.ndarray              # int64 [B]
    sample_offsets: np.ndarray     # int32 [B]
    seq_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # int64 [B] (or [0]: none sent)
    table_delta: tuple | None = None     # (base, counts) to commit into the SequenceStore
    placeholders: np.ndarray | None = None  # token indexes whose input id was -1 (resolved)
    release_ids: list[int] = field(default_factory=list)
    copy_src: np.ndarray | None = None   # int32 [K] copy-on-write before the step
    copy_dst: np.ndarray | None = None
    tier: tuple | None = None            # (save blocks, save slots, load slots, load blocks), before the copies
    extras: "SamplingExtras | None" = None
    prompt_rows: "PromptRows | None" = None  # prompt logprobs asked for (worker/prompt_logprobs.py)


def validate_step(req, lim: StepLimits, store: SequenceStore | None = None,
                  placeholder_timeout_s: float = 30.0, hidden: bytes | None = None) -> StepArrays:
    """Decode and check a StepRequest against this worker's limits (and, for delta tables and
    placeholder inputs, its SequenceStore, read only). Raises StepValidationError or
    StepPrecondition; changes nothing."""
    try:
        return _validate(req, lim, store, placeholder_timeout_s, hidden)
    except WireError as e:
        raise StepValidationError(str(e)) from None


def _validate(req, lim: StepLimits, store, placeholder_timeout_s, hidden_bytes=None) -> StepArrays:
    qsl, qlen, positions = _batch_shape(req)
    B, T = qsl.size - 1, positions.size
    seq_ids = _sequence_ids(req, B, store)
    input_ids, hidden, pending = _token_inputs(req, lim, qsl, T, seq_ids, store, hidden_bytes)
    seq_lens, seq_of_token = _context(req, lim, qsl, qlen, positions)
    tables, table_delta = block_tables(req, lim, B, seq_ids, seq_lens, store)
    slots = slot_mapping(req, lim, T, positions, tables, seq_of_token)
    do_sample, temperature, top_p, top_k, seeds, offsets = sampling_params(req, B)
    copy_src, copy_dst = copies(req, lim)
    tier = tier_moves(req, lim)
    release = wire.unpack(req.release_sequence_ids, wire.INT64, name="release_sequence_ids").tolist()
    try:
        prompt_rows = parse_prompt_rows(req, qsl, lim.vocab_size)
    except ValueError as e:
        fail(str(e))
    extras = sampling_extras(req, B, lim.vocab_size, do_sample)
    if extras is not None and extras.repetition is not None and lim.is_last:
        complete_histories(extras, do_sample, offsets, seq_ids, store)
    if lim.is_first:   # last: stage 0 may wait here for the last stage's tokens, every other check done
        input_ids = _resolved_inputs(input_ids, pending, store, placeholder_timeout_s, lim)
    return StepArrays(B, T, input_ids, hidden, req.hidden_dtype, positions, slots, qsl, seq_lens,
                      tables, do_sample.astype(bool), temperature, top_p, top_k, seeds, offsets,
                      seq_ids=seq_ids, table_delta=table_delta,
                      placeholders=pending[0] if pending is not None else None,
                      release_ids=release, copy_src=copy_src, copy_dst=copy_dst, tier=tier,
                      extras=extras, prompt_rows=prompt_rows)


def _batch_shape(req):
    """query_start_loc and positions: B >= 1 sequences, each with >= 1 query token."""
    qsl = wire.unpack(req.query_start_loc, wire.INT32, name="query_start_loc")
    if qsl.size < 2:
        fail(f"query_start_loc: needs B+1 >= 2 entries (at least one sequence), got {qsl.size}")
    positions = wire.unpack(req.positions, wire.INT32, name="positions")
    T = positions.size
    if qsl[0] != 0 or qsl[-1] != T:
        fail(f"query_start_loc must start at 0 and end at T={T} (len(positions)), "
             f"got [{qsl[0]} ... {qsl[-1]}]")
    qlen = np.diff(qsl.astype(np.int64))  # int64: hostile offsets must not wrap into valid-looking lengths
    if (qlen < 1).any():
        b = int(np.argmax(qlen < 1))
        fail(f"query_start_loc: sequence {b} has query length {qlen[b]} (must be >= 1, non-decreasing offsets)")
    return qsl, qlen, positions


def _sequence_ids(req, B: int, store) -> np.ndarray:
    seq_ids = np.zeros(0, dtype=np.int64)
    if req.sequence_ids:
        seq_ids = wire.unpack(req.sequence_ids, wire.INT64, name="sequence_ids", count=B)
    stateful = req.delta_tables or req.release_sequence_ids
    if stateful and store is None:
        fail("delta_tables / release_sequence_ids need a stage that keeps a SequenceStore")
    if req.delta_tables and has_duplicates(seq_ids):
        fail(f"sequence_ids: delta tables need {B} distinct sequence ids, got {np.unique(seq_ids).size}")
    return seq_ids


def _token_inputs(req, lim: StepLimits, qsl, T: int, seq_ids, store, hidden_bytes):
    """Token inputs: ids on stage 0 with their -1 inputs still pending ((token indexes, sequence
    ids) or None; resolved last, by _resolved_inputs), the previous stage's hidden states after."""
    input_ids = hidden = pending = None
    if lim.is_first:
        input_ids = wire.unpack(req.input_ids, wire.INT32, name="input_ids", count=T)
        if (input_ids == -1).any():
            pending = _pending_inputs(input_ids, qsl, seq_ids, store)
        return input_ids, hidden, pending
    itemsize = DTYPE_BYTES.get(req.hidden_dtype)
    if itemsize is None:
        fail(f"hidden_dtype {req.hidden_dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    want = T * lim.hidden_size * itemsize
    # once: each access of a bytes field copies it (or given apart: the TCP data link)
    hidden = req.hidden_states if hidden_bytes is None else hidden_bytes
    if len(hidden) != want:
        fail(f"hidden_states: expected T*hidden = {T}*{lim.hidden_size} {req.hidden_dtype} values "
             f"({want} bytes), got {len(hidden)} bytes")
    return input_ids, hidden, pending


def _context(req, lim: StepLimits, qsl, qlen, positions):
    """seq_lens, and positions that are each sequence's last qlen positions, in order."""
    B, T = qlen.size, positions.size
    check_range("positions", positions, 0, lim.max_position)
    seq_lens = wire.unpack(req.seq_lens, wire.INT32, name="seq_lens", count=B)
    if (seq_lens < qlen).any():
        b = int(np.argmax(seq_lens < qlen))
        fail(f"seq_lens[{b}] = {seq_lens[b]} is shorter than its query length {qlen[b]}")
    seq_of_token = np.repeat(np.arange(B), qlen)
    expected = (seq_lens - qlen)[seq_of_token] + (np.arange(T) - qsl[:-1][seq_of_token])
    if (positions != expected).any():
        t = int(np.argmax(positions != expected))
        b = int(seq_of_token[t])
        fail(f"positions[{t}] = {positions[t]} but sequence {b} (seq_len {seq_lens[b]}, query length "
             f"{qlen[b]}) needs {expected[t]}: queries must be the last qlen positions of the context")
    return seq_lens, seq_of_token


def _pending_inputs(input_ids, qsl, seq_ids, store):
    """The -1 inputs (async scheduling), each its sequence's last query token: (token indexes,
    their sequence ids)."""
    holes = np.flatnonzero(input_ids == -1)
    if store is None or not seq_ids.size:
        fail("input_ids: -1 (the previously sampled token) needs sequence_ids and a stage that keeps them")
    last = qsl[1:] - 1                                          # each sequence's last query token
    b = np.searchsorted(qsl, holes, side="right") - 1
    if (last[b] != holes).any():
        t = int(holes[np.argmax(last[b] != holes)])
        fail(f"input_ids[{t}] = -1 is not the last query token of its sequence (only that one may be pending)")
    return holes, seq_ids[b]


def _resolved_inputs(input_ids, pending, store, timeout_s, lim: StepLimits):
    """-1 inputs -> the token this stage saw sampled for that sequence last (waiting, bounded, for
    a step still downstream); then every id in the vocabulary."""
    if pending is not None:
        holes, hole_seqs = pending
        input_ids = input_ids.copy()
        input_ids[holes] = store.resolve_placeholders(hole_seqs, timeout_s)
    check_range("input_ids", input_ids, 0, lim.vocab_size)
    return input_ids


