"""The wire form of a scheduled step: a ScheduledBatch -> worker_pb2.StepRequest (docs/architecture.md
section 5). The part every stage reads (ids, positions, slots, tables as deltas, releases, copies)
and the sampling part (rows that sample, their parameters and rules) that only the last stage uses."""
from __future__ import annotations

import numpy as np

from minipaged.v1 import worker_pb2
from minipaged.wire import FLOAT64, INT32, INT64, pack

from . import prompt_logprobs
from .step_rows import STEP_ROW
from .grammar import fill_bitmask
from .step_batch import ScheduledBatch
from .sequence import Sequence


def build_step_request(b: ScheduledBatch, release: list[int], step_id: int, epoch: int, first_gets_tokens: bool,
                       vocab_size: int) -> worker_pb2.StepRequest:
    """The Step of a ScheduledBatch (vocab_size: for grammar bitmasks)."""
    seqs = b.seqs
    rows = np.frombuffer(b.step_rows, dtype=STEP_ROW)
    req = worker_pb2.StepRequest(
        step_id=step_id, cache_epoch=epoch,
        sequence_ids=pack(b.seq_ids, INT64),
        input_ids=pack(b.input_ids), positions=pack(b.positions), slot_mapping=pack(b.slot_mapping),
        query_start_loc=pack(b.query_start_loc), seq_lens=pack(b.seq_lens),
        do_sample=b.do_sample.tobytes(),
        temperature=rows["temperature"].tobytes(), top_p=rows["top_p"].tobytes(),
        top_k=rows["top_k"].tobytes(), seeds=rows["seed"].tobytes(),
        sample_offsets=pack(b.sample_offsets, INT32),
        return_logprobs=b.special and any(s.params.return_logprobs for s in seqs),
        first_gets_tokens=first_gets_tokens)
    if b.block_tables is not None:
        req.block_tables, req.max_blocks_per_seq = pack(b.block_tables), b.block_tables.shape[1]
    else:
        req.delta_tables = True
        req.table_base, req.new_block_counts = pack(b.table_base), pack(b.new_block_counts)
        req.new_blocks = pack(b.new_blocks)
    if release:
        req.release_sequence_ids = pack(release, INT64)
    add_tier_moves(req, b.tier_saves, b.tier_loads)
    if b.copies:
        req.copy_src, req.copy_dst = pack([c[0] for c in b.copies]), pack([c[1] for c in b.copies])
    ends = _add_grammar(req, b, vocab_size) if b.special and any(s.matcher is not None for s in seqs) else set()
    if b.special and any(s.params.extras for s in seqs):
        _add_extras(req, seqs, b.sample_offsets, ends)
    if b.prompt_rows is not None:
        prompt_logprobs.add_to_request(req, b.prompt_rows)
    return req


def add_tier_moves(req: worker_pb2.StepRequest, saves, loads) -> None:
    """The KV tier's (pool block, slot) saves and (slot, pool block) loads a Step runs first."""
    if saves:
        req.tier_save_blocks, req.tier_save_slots = pack([m[0] for m in saves]), pack([m[1] for m in saves])
    if loads:
        req.tier_load_slots, req.tier_load_blocks = pack([m[0] for m in loads]), pack([m[1] for m in loads])


def _add_grammar(req: worker_pb2.StepRequest, b: ScheduledBatch, vocab_size: int) -> set[int]:
    """Structured outputs: the next-token bitmask of every constrained row that samples this step
    (metadata_service/grammar.py). Its matcher has seen every token so far: constrained sequences
    never run ahead of their sampled token. Returns the rows whose grammar allows only tokens that
    min_new_tokens masks (it is complete and wants EOS): there the grammar wins, the output ends
    valid, where otherwise every token would be masked."""
    rows = [i for i, (s, d) in enumerate(zip(b.seqs, b.do_sample.tolist())) if d and s.matcher is not None]
    if not rows:
        return set()
    mask = fill_bitmask([b.seqs[i].matcher for i in rows], vocab_size)
    req.grammar_rows = pack(rows, INT32)
    req.grammar_bitmask = mask.tobytes()
    ends = set()
    for j, i in enumerate(rows):
        s = b.seqs[i]
        if s.suppress_ids and int(b.sample_offsets[i]) < s.params.min_new_tokens:
            allowed = np.flatnonzero(np.unpackbits(mask[j].view(np.uint8), bitorder="little"))
            if np.isin(allowed, s.suppress_ids).all():
                ends.add(i)
    return ends


def _add_extras(req: worker_pb2.StepRequest, seqs: list[Sequence], offsets: np.ndarray,
                grammar_ends: set[int] = frozenset()) -> None:
    """The per-sequence sampling rules beyond temperature/top-p/top-k (worker/logits_processors.py).
    Penalized sequences send their whole history: their cost grows with their length (only theirs).
    A history is what this service knows: a token still being sampled (input -1) is left out, and
    the last stage, which sampled it, appends it."""
    suppress = [bool(s.suppress_ids) and int(o) < s.params.min_new_tokens and i not in grammar_ends
                for i, (s, o) in enumerate(zip(seqs, offsets))]
    if any(suppress):
        ids = [s.suppress_ids if on else () for s, on in zip(seqs, suppress)]
        req.min_tokens_suppress = np.asarray(suppress, dtype=np.uint8).tobytes()
        req.suppress_counts = pack([len(x) for x in ids])
        req.suppress_ids = pack([t for x in ids for t in x])
    if any(s.params.penalized for s in seqs):
        hist = [s.all_token_ids if s.params.penalized else [] for s in seqs]
        req.repetition_penalty = pack([s.params.repetition_penalty for s in seqs], FLOAT64)
        req.presence_penalty = pack([s.params.presence_penalty for s in seqs], FLOAT64)
        req.frequency_penalty = pack([s.params.frequency_penalty for s in seqs], FLOAT64)
        req.penalty_counts = pack([len(h) for h in hist])
        req.penalty_prompt_lens = pack([s.num_prompt_tokens if s.params.penalized else 0 for s in seqs])
        req.penalty_tokens = pack([t for h in hist for t in h])
    req.top_logprobs = max(s.params.top_logprobs for s in seqs)
    if any(s.params.min_p > 0 for s in seqs):
        req.min_p = np.asarray([s.params.min_p for s in seqs], dtype=np.float32).tobytes()
