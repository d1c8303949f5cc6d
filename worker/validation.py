"""Step request validation: decode every packed array and check it before the cache is touched.

A worker cannot trust the metadata plane blindly: one bad slot would silently overwrite another
sequence's K/V. Every check here is vectorized numpy over the whole batch (no per-token Python
loops), and every failure raises StepValidationError naming the field and the limit; the server
turns it into INVALID_ARGUMENT with the cache untouched. What the step assumes the stage remembers
(delta block tables, placeholder input ids; worker/step_state.py) is checked against the stage's
SequenceStore without changing it: a mismatch raises StepPrecondition (FAILED_PRECONDITION)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minipaged import wire
from minipaged.constants import DTYPE_BYTES, STEP_MAX_TOP_LOGPROBS
from minipaged.id_index import has_duplicates
from minipaged.wire import WireError
from worker.prompt_logprobs import PromptRows, parse as parse_prompt_rows
from worker.step_state import SequenceStore, StepPrecondition  # noqa: F401 (re-exported)



class StepValidationError(ValueError):
    """A Step request that must be rejected with INVALID_ARGUMENT."""


@dataclass(frozen=True)
class StepLimits:
    """What this worker can accept: the model's shapes and the allocated cache."""
    vocab_size: int
    hidden_size: int
    max_position: int
    num_blocks: int
    block_size: int
    is_first: bool


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
    extras: "SamplingExtras | None" = None
    prompt_rows: "PromptRows | None" = None  # prompt logprobs asked for (worker/prompt_logprobs.py)


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


def _fail(msg: str):
    raise StepValidationError(msg)


def _range(name: str, arr: np.ndarray, lo, hi_excl) -> None:
    """All values in [lo, hi_excl); the message names the first offender (1-D or 2-D index)."""
    bad = (arr < lo) | (arr >= hi_excl)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        _fail(f"{name}[{', '.join(map(str, idx))}] = {arr[idx]} is out of range [{lo}, {hi_excl})")


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
    input_ids, hidden, placeholders = _token_inputs(req, lim, qsl, T, seq_ids, store, placeholder_timeout_s,
                                                    hidden_bytes)
    seq_lens, seq_of_token = _context(req, lim, qsl, qlen, positions)
    tables, table_delta = _block_tables(req, lim, B, seq_ids, seq_lens, store)
    slots = _slots(req, lim, T, positions, tables, seq_of_token)
    do_sample, temperature, top_p, top_k, seeds, offsets = _sampling(req, B)
    copy_src, copy_dst = _copies(req, lim)
    release = wire.unpack(req.release_sequence_ids, wire.INT64, name="release_sequence_ids").tolist()
    try:
        prompt_rows = parse_prompt_rows(req, qsl, lim.vocab_size)
    except ValueError as e:
        _fail(str(e))
    return StepArrays(B, T, input_ids, hidden, req.hidden_dtype, positions, slots, qsl, seq_lens,
                      tables, do_sample.astype(bool), temperature, top_p, top_k, seeds, offsets,
                      seq_ids=seq_ids, table_delta=table_delta, placeholders=placeholders,
                      release_ids=release, copy_src=copy_src, copy_dst=copy_dst,
                      extras=_extras(req, B, lim.vocab_size, do_sample), prompt_rows=prompt_rows)


def _batch_shape(req):
    """query_start_loc and positions: B >= 1 sequences, each with >= 1 query token."""
    qsl = wire.unpack(req.query_start_loc, wire.INT32, name="query_start_loc")
    if qsl.size < 2:
        _fail(f"query_start_loc: needs B+1 >= 2 entries (at least one sequence), got {qsl.size}")
    positions = wire.unpack(req.positions, wire.INT32, name="positions")
    T = positions.size
    if qsl[0] != 0 or qsl[-1] != T:
        _fail(f"query_start_loc must start at 0 and end at T={T} (len(positions)), "
              f"got [{qsl[0]} ... {qsl[-1]}]")
    qlen = np.diff(qsl.astype(np.int64))  # int64: hostile offsets must not wrap into valid-looking lengths
    if (qlen < 1).any():
        b = int(np.argmax(qlen < 1))
        _fail(f"query_start_loc: sequence {b} has query length {qlen[b]} (must be >= 1, non-decreasing offsets)")
    return qsl, qlen, positions


def _sequence_ids(req, B: int, store) -> np.ndarray:
    seq_ids = np.zeros(0, dtype=np.int64)
    if req.sequence_ids:
        seq_ids = wire.unpack(req.sequence_ids, wire.INT64, name="sequence_ids", count=B)
    stateful = req.delta_tables or req.release_sequence_ids
    if stateful and store is None:
        _fail("delta_tables / release_sequence_ids need a stage that keeps a SequenceStore")
    if req.delta_tables and has_duplicates(seq_ids):
        _fail(f"sequence_ids: delta tables need {B} distinct sequence ids, got {np.unique(seq_ids).size}")
    return seq_ids


def _token_inputs(req, lim: StepLimits, qsl, T: int, seq_ids, store, placeholder_timeout_s, hidden_bytes):
    """Token inputs: ids on stage 0 (-1 placeholders resolved), the previous stage's hidden states after."""
    input_ids = hidden = placeholders = None
    if lim.is_first:
        input_ids = wire.unpack(req.input_ids, wire.INT32, name="input_ids", count=T)
        if (input_ids == -1).any():
            input_ids, placeholders = _resolve_placeholders(input_ids, qsl, seq_ids, store, placeholder_timeout_s)
        _range("input_ids", input_ids, 0, lim.vocab_size)
        return input_ids, hidden, placeholders
    itemsize = DTYPE_BYTES.get(req.hidden_dtype)
    if itemsize is None:
        _fail(f"hidden_dtype {req.hidden_dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    want = T * lim.hidden_size * itemsize
    # once: each access of a bytes field copies it (or given apart: the TCP data link)
    hidden = req.hidden_states if hidden_bytes is None else hidden_bytes
    if len(hidden) != want:
        _fail(f"hidden_states: expected T*hidden = {T}*{lim.hidden_size} {req.hidden_dtype} values "
              f"({want} bytes), got {len(hidden)} bytes")
    return input_ids, hidden, placeholders


def _context(req, lim: StepLimits, qsl, qlen, positions):
    """seq_lens, and positions that are each sequence's last qlen positions, in order."""
    B, T = qlen.size, positions.size
    _range("positions", positions, 0, lim.max_position)
    seq_lens = wire.unpack(req.seq_lens, wire.INT32, name="seq_lens", count=B)
    if (seq_lens < qlen).any():
        b = int(np.argmax(seq_lens < qlen))
        _fail(f"seq_lens[{b}] = {seq_lens[b]} is shorter than its query length {qlen[b]}")
    seq_of_token = np.repeat(np.arange(B), qlen)
    expected = (seq_lens - qlen)[seq_of_token] + (np.arange(T) - qsl[:-1][seq_of_token])
    if (positions != expected).any():
        t = int(np.argmax(positions != expected))
        b = int(seq_of_token[t])
        _fail(f"positions[{t}] = {positions[t]} but sequence {b} (seq_len {seq_lens[b]}, query length "
              f"{qlen[b]}) needs {expected[t]}: queries must be the last qlen positions of the context")
    return seq_lens, seq_of_token


def _block_tables(req, lim: StepLimits, B: int, seq_ids, seq_lens, store):
    """Block tables (full, or a delta over what the store holds): ids in range, and every block
    the context uses is present. Returns (tables [B, M], (base, counts) or None)."""
    table_delta = None
    if req.delta_tables:
        base = wire.unpack(req.table_base, wire.INT32, name="table_base", count=B)
        counts = wire.unpack(req.new_block_counts, wire.INT32, name="new_block_counts", count=B)
        if (base < 0).any() or (counts < 0).any():
            _fail("table_base and new_block_counts must be >= 0")
        new_blocks = wire.unpack(req.new_blocks, wire.INT32, name="new_blocks", count=int(counts.sum()))
        _range("new_blocks", new_blocks, 0, lim.num_blocks)
        tables = store.preview_tables(seq_ids, base, counts, new_blocks)
        table_delta = (base, counts)
        # a row's first base + count blocks are ids checked when they came (here or by an earlier
        # step), and -1 after: the per-row count is the whole hole check, no pass over the table
        valid_blocks = base.astype(np.int64) + counts
    else:
        M = req.max_blocks_per_seq
        if M < 1:
            _fail(f"max_blocks_per_seq = {M} must be >= 1")
        tables = wire.unpack_2d(req.block_tables, B, M, wire.INT32, name="block_tables")
        _range("block_tables", tables, -1, lim.num_blocks)
    M = tables.shape[1]
    used = (seq_lens.astype(np.int64) + lim.block_size - 1) // lim.block_size
    if (used > M).any():
        b = int(np.argmax(used > M))
        _fail(f"seq_lens[{b}] = {seq_lens[b]} needs {used[b]} blocks of {lim.block_size}, "
              f"more than max_blocks_per_seq = {M}")
    if table_delta is not None:
        short = used > valid_blocks
        hole = (int(np.argmax(short)), int(valid_blocks[np.argmax(short)])) if short.any() else None
    else:
        holes = (np.arange(M)[None, :] < used[:, None]) & (tables < 0)
        hole = tuple(int(x) for x in np.argwhere(holes)[0]) if holes.any() else None
    if hole is not None:
        b, j = hole
        _fail(f"block_tables[{b}, {j}] = -1 inside the used part ({used[b]} blocks for seq_len {seq_lens[b]})")
    return tables, table_delta


def _slots(req, lim: StepLimits, T: int, positions, tables, seq_of_token) -> np.ndarray:
    """Slots in range, and each written slot where the tables say its position lives."""
    slots = wire.unpack(req.slot_mapping, wire.INT32, name="slot_mapping", count=T)
    _range("slot_mapping", slots, -1, lim.num_blocks * lim.block_size)
    pos64 = positions.astype(np.int64)
    want = tables[seq_of_token, pos64 // lim.block_size].astype(np.int64) * lim.block_size + pos64 % lim.block_size
    wrong = (slots != -1) & (slots != want)
    if wrong.any():
        t = int(np.argmax(wrong))
        _fail(f"slot_mapping[{t}] = {slots[t]} but position {positions[t]} of sequence "
              f"{int(seq_of_token[t])} maps to slot {want[t]} through its block table")
    return slots

def _sampling(req, B: int):
    """Per-sequence sampling parameters, each in its range."""
    do_sample = wire.unpack(req.do_sample, wire.UINT8, name="do_sample", count=B)
    if (do_sample > 1).any():
        _fail("do_sample: values must be 0 or 1")
    temperature = wire.unpack(req.temperature, wire.FLOAT32, name="temperature", count=B)
    if not (np.isfinite(temperature) & (temperature >= 0)).all():
        _fail("temperature: every value must be finite and >= 0 (0 = greedy)")
    top_p = wire.unpack(req.top_p, wire.FLOAT32, name="top_p", count=B)
    if not ((top_p >= 0) & (top_p <= 1)).all():  # NaN fails both comparisons
        _fail("top_p: every value must be in [0, 1]")
    top_k = wire.unpack(req.top_k, wire.INT32, name="top_k", count=B)
    if (top_k < 0).any():
        _fail("top_k: every value must be >= 0 (0 = off)")
    seeds = wire.unpack(req.seeds, wire.INT64, name="seeds", count=B)
    offsets = wire.unpack(req.sample_offsets, wire.INT32, name="sample_offsets", count=B)
    if (offsets < 0).any():
        _fail("sample_offsets: every value must be >= 0")
    return do_sample, temperature, top_p, top_k, seeds, offsets


def _copies(req, lim: StepLimits):
    """Copy-on-write block pairs to run before the step (forks)."""
    copy_src = copy_dst = None
    if req.copy_src or req.copy_dst:
        copy_src = wire.unpack(req.copy_src, wire.INT32, name="copy_src")
        copy_dst = wire.unpack(req.copy_dst, wire.INT32, name="copy_dst", count=copy_src.size)
        _range("copy_src", copy_src, 0, lim.num_blocks)
        _range("copy_dst", copy_dst, 0, lim.num_blocks)
        if np.unique(copy_dst).size != copy_dst.size:
            _fail("copy_dst: duplicate destination blocks")
    return copy_src, copy_dst


def _resolve_placeholders(input_ids, qsl, seq_ids, store, timeout_s):
    """-1 inputs (async scheduling) -> the token this stage saw sampled for that sequence last."""
    holes = np.flatnonzero(input_ids == -1)
    if store is None or not seq_ids.size:
        _fail("input_ids: -1 (the previously sampled token) needs sequence_ids and a stage that keeps them")
    last = qsl[1:] - 1                                          # each sequence's last query token
    b = np.searchsorted(qsl, holes, side="right") - 1
    if (last[b] != holes).any():
        t = int(holes[np.argmax(last[b] != holes)])
        _fail(f"input_ids[{t}] = -1 is not the last query token of its sequence (only that one may be pending)")
    ids = input_ids.copy()
    ids[holes] = store.resolve_placeholders(seq_ids[b], timeout_s)
    return ids, holes


def _extras(req, B: int, vocab: int, do_sample=None) -> SamplingExtras | None:
    """The optional per-sequence sampling rules; None when the batch uses none of them."""
    if not (req.min_tokens_suppress or req.repetition_penalty or req.presence_penalty
            or req.frequency_penalty or req.top_logprobs or req.grammar_rows):
        return None
    x = SamplingExtras()
    if req.grammar_rows:
        from worker import grammar_mask
        x.grammar_rows = wire.unpack(req.grammar_rows, wire.INT32, name="grammar_rows")
        words = wire.unpack(req.grammar_bitmask, wire.INT32, name="grammar_bitmask")
        try:
            x.grammar_bitmask = grammar_mask.check(x.grammar_rows, words, B, np.asarray(do_sample, dtype=bool), vocab)
        except ValueError as e:
            _fail(str(e))
    if not 0 <= req.top_logprobs <= STEP_MAX_TOP_LOGPROBS:
        _fail(f"top_logprobs = {req.top_logprobs} must be in [0, {STEP_MAX_TOP_LOGPROBS}]")
    x.top_logprobs = min(req.top_logprobs, vocab)
    if req.min_tokens_suppress:
        x.suppress = wire.unpack(req.min_tokens_suppress, wire.UINT8, name="min_tokens_suppress", count=B) > 0
        x.suppress_counts = wire.unpack(req.suppress_counts, wire.INT32, name="suppress_counts", count=B)
        if (x.suppress_counts < 0).any():
            _fail("suppress_counts must be >= 0")
        x.suppress_ids = wire.unpack(req.suppress_ids, wire.INT32, name="suppress_ids",
                                     count=int(x.suppress_counts.sum()))
        _range("suppress_ids", x.suppress_ids, 0, vocab)
    if req.repetition_penalty or req.presence_penalty or req.frequency_penalty:
        x.repetition = _floats(req.repetition_penalty, B, "repetition_penalty", 1.0)
        x.presence = _floats(req.presence_penalty, B, "presence_penalty", 0.0)
        x.frequency = _floats(req.frequency_penalty, B, "frequency_penalty", 0.0)
        if (x.repetition <= 0).any():
            _fail("repetition_penalty: every value must be > 0 (1 = off)")
        x.penalty_counts = wire.unpack(req.penalty_counts, wire.INT32, name="penalty_counts", count=B)
        x.penalty_prompt_lens = wire.unpack(req.penalty_prompt_lens, wire.INT32, name="penalty_prompt_lens",
                                            count=B)
        if (x.penalty_counts < 0).any() or (x.penalty_prompt_lens < 0).any() \
                or (x.penalty_prompt_lens > x.penalty_counts).any():
            _fail("penalty_counts / penalty_prompt_lens must be >= 0 and prompt lens <= counts")
        x.penalty_tokens = wire.unpack(req.penalty_tokens, wire.INT32, name="penalty_tokens",
                                       count=int(x.penalty_counts.sum()))
        _range("penalty_tokens", x.penalty_tokens, 0, vocab)
    return x


def _floats(data: bytes, B: int, name: str, default: float) -> np.ndarray:
    if not data:
        return np.full(B, default, dtype=np.float64)
    arr = wire.unpack(data, wire.FLOAT64, name=name, count=B)
    if not np.isfinite(arr).all():
        _fail(f"{name}: every value must be finite")
    return arr
