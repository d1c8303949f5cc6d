"""Step request validation: decode every packed array and check it before the cache is touched.

A worker keeps no per-sequence state, so it cannot trust the metadata plane blindly: one bad slot
would silently overwrite another sequence's K/V. Every check here is vectorized numpy over the whole
batch (no per-token Python loops), and every failure raises StepValidationError naming the field and
the limit; the server turns it into INVALID_ARGUMENT with the cache untouched."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minipaged import wire
from minipaged.wire import WireError

# Element sizes of the hidden-state dtypes a previous stage may send (bfloat16 has no numpy dtype).
HIDDEN_DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


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


def _fail(msg: str):
    raise StepValidationError(msg)


def _range(name: str, arr: np.ndarray, lo, hi_excl) -> None:
    """All values in [lo, hi_excl); the message names the first offender (1-D or 2-D index)."""
    bad = (arr < lo) | (arr >= hi_excl)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        _fail(f"{name}[{', '.join(map(str, idx))}] = {arr[idx]} is out of range [{lo}, {hi_excl})")


def validate_step(req, lim: StepLimits) -> StepArrays:
    """Decode and check a StepRequest against this worker's limits. Raises StepValidationError."""
    try:
        return _validate(req, lim)
    except WireError as e:
        raise StepValidationError(str(e)) from None


def _validate(req, lim: StepLimits) -> StepArrays:
    qsl = wire.unpack(req.query_start_loc, wire.INT32, name="query_start_loc")
    if qsl.size < 2:
        _fail(f"query_start_loc: needs B+1 >= 2 entries (at least one sequence), got {qsl.size}")
    B = qsl.size - 1
    positions = wire.unpack(req.positions, wire.INT32, name="positions")
    T = positions.size
    if qsl[0] != 0 or qsl[-1] != T:
        _fail(f"query_start_loc must start at 0 and end at T={T} (len(positions)), "
              f"got [{qsl[0]} ... {qsl[-1]}]")
    qlen = np.diff(qsl.astype(np.int64))  # int64: hostile offsets must not wrap into valid-looking lengths
    if (qlen < 1).any():
        b = int(np.argmax(qlen < 1))
        _fail(f"query_start_loc: sequence {b} has query length {qlen[b]} (must be >= 1, non-decreasing offsets)")

    # Token inputs: ids on stage 0, the previous stage's hidden states after that.
    input_ids = hidden = None
    if lim.is_first:
        input_ids = wire.unpack(req.input_ids, wire.INT32, name="input_ids", count=T)
        _range("input_ids", input_ids, 0, lim.vocab_size)
    else:
        itemsize = HIDDEN_DTYPE_BYTES.get(req.hidden_dtype)
        if itemsize is None:
            _fail(f"hidden_dtype {req.hidden_dtype!r} is not one of {sorted(HIDDEN_DTYPE_BYTES)}")
        want = T * lim.hidden_size * itemsize
        if len(req.hidden_states) != want:
            _fail(f"hidden_states: expected T*hidden = {T}*{lim.hidden_size} {req.hidden_dtype} values "
                  f"({want} bytes), got {len(req.hidden_states)} bytes")
        hidden = req.hidden_states

    _range("positions", positions, 0, lim.max_position)
    seq_lens = wire.unpack(req.seq_lens, wire.INT32, name="seq_lens", count=B)
    if (seq_lens < qlen).any():
        b = int(np.argmax(seq_lens < qlen))
        _fail(f"seq_lens[{b}] = {seq_lens[b]} is shorter than its query length {qlen[b]}")
    if req.sequence_ids:
        wire.unpack(req.sequence_ids, wire.INT64, name="sequence_ids", count=B)

    # Positions of sequence b's queries must be seq_lens[b]-qlen_b ... seq_lens[b]-1, in order.
    seq_of_token = np.repeat(np.arange(B), qlen)
    expected = (seq_lens - qlen)[seq_of_token] + (np.arange(T) - qsl[:-1][seq_of_token])
    if (positions != expected).any():
        t = int(np.argmax(positions != expected))
        b = int(seq_of_token[t])
        _fail(f"positions[{t}] = {positions[t]} but sequence {b} (seq_len {seq_lens[b]}, query length "
              f"{qlen[b]}) needs {expected[t]}: queries must be the last qlen positions of the context")

    # Block tables: ids in range, and every block the context uses is present.
    M = req.max_blocks_per_seq
    if M < 1:
        _fail(f"max_blocks_per_seq = {M} must be >= 1")
    tables = wire.unpack_2d(req.block_tables, B, M, wire.INT32, name="block_tables")
    _range("block_tables", tables, -1, lim.num_blocks)
    used = (seq_lens.astype(np.int64) + lim.block_size - 1) // lim.block_size
    if (used > M).any():
        b = int(np.argmax(used > M))
        _fail(f"seq_lens[{b}] = {seq_lens[b]} needs {used[b]} blocks of {lim.block_size}, "
              f"more than max_blocks_per_seq = {M}")
    holes = (np.arange(M)[None, :] < used[:, None]) & (tables < 0)
    if holes.any():
        b, j = (int(x) for x in np.argwhere(holes)[0])
        _fail(f"block_tables[{b}, {j}] = -1 inside the used part ({used[b]} blocks for seq_len {seq_lens[b]})")

    # Slots: in range, and each written slot is where the tables say this position lives.
    slots = wire.unpack(req.slot_mapping, wire.INT32, name="slot_mapping", count=T)
    _range("slot_mapping", slots, -1, lim.num_blocks * lim.block_size)
    pos64 = positions.astype(np.int64)
    want = tables[seq_of_token, pos64 // lim.block_size].astype(np.int64) * lim.block_size + pos64 % lim.block_size
    wrong = (slots != -1) & (slots != want)
    if wrong.any():
        t = int(np.argmax(wrong))
        _fail(f"slot_mapping[{t}] = {slots[t]} but position {positions[t]} of sequence "
              f"{int(seq_of_token[t])} maps to slot {want[t]} through its block table")

    # Per-sequence sampling parameters.
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

    return StepArrays(B, T, input_ids, hidden, req.hidden_dtype, positions, slots, qsl, seq_lens,
                      tables, do_sample.astype(bool), temperature, top_p, top_k, seeds, offsets)
