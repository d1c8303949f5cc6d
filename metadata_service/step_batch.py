"""A step's batch: `ScheduledBatch` (what the chain sends and applies) and `BatchPacking`, the
Scheduler's part that packs the chosen sequences into its arrays (positions, slot_mapping, table
deltas, sampling rows). The steady decode step is columns of the sequences' STEP_ROWs, the block
manager's arrays and their Progress rows: no Python pass over the batch."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .prompt_logprobs import plan as plan_prompt_rows
from .sequence import Sequence
from .step_rows import STEP_ROW


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    gens: np.ndarray             # int64 [B] each sequence's gen when scheduled (a later change voids its result)
    input_ids: np.ndarray        # int32 [T], -1 = the token sampled for it by the step before
    positions: np.ndarray        # int32 [T]
    slot_mapping: np.ndarray     # int32 [T]
    query_start_loc: np.ndarray  # int32 [B+1]
    seq_lens: np.ndarray         # int32 [B]
    do_sample: np.ndarray        # uint8 [B]
    table_base: np.ndarray       # int32 [B] blocks the workers already hold (delta tables)
    new_block_counts: np.ndarray  # int32 [B]
    new_blocks: np.ndarray       # int32 [sum]
    seq_ids: np.ndarray          # int64 [B]
    sample_offsets: np.ndarray   # int32 [B] index of the token each row samples (+1 when its input is -1)
    step_rows: bytes             # the sequences' STEP_ROWs (step_rows.py), joined
    manager_rows: np.ndarray     # their KVBlockManager rows (stable while they live)
    progress_rows: np.ndarray    # their Progress rows when scheduled (progress.py; owner = seq_ids)
    special: bool                # some sequence needs logprobs, extras or a grammar (else all skip them)
    plain: bool = False          # decodes only, of plain sequences: apply.apply_plain applies it
    slot: int = 0
    block_tables: np.ndarray | None = None   # int32 [B, max_blocks], only when sending full tables
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) before the step
    prompt_rows: object = None   # prompt_logprobs.StepRows when a request of the step asked for them
    tier_saves: list = field(default_factory=list)   # (pool block, tier slot), run first
    tier_loads: list = field(default_factory=list)   # (tier slot, pool block), run second

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.size)

    @property
    def deferred(self) -> list[Sequence]:
        """The sequences whose input is the token still being sampled (-1)."""
        last = self.input_ids[self.query_start_loc[1:] - 1]
        return [self.seqs[i] for i in np.flatnonzero(last == -1).tolist()]


class BatchPacking:
    """Scheduler mixin (uses its manager, progress, full_tables, copies and num_special)."""

    def _build(self, decodes: list[Sequence], extra: list[tuple[Sequence, int]], slots: list[np.ndarray],
               slot: int, dec) -> ScheduledBatch:
        """Pack the step's arrays: the decodes first, then `extra` (prefill chunks); `dec` = the
        decodes' (STEP_ROWs, ids, block-manager rows, input ids, Progress rows) when there are any."""
        a = self._mixed_arrays(decodes, extra, dec) if extra else self._decode_arrays(dec)
        seqs = decodes + [s for s, _ in extra] if extra else decodes
        B = len(seqs)
        qsl = np.zeros(B + 1, dtype=np.int32)
        np.cumsum(a["num_new"], out=qsl[1:])
        tables = None
        if self.full_tables:
            tables = np.asarray(self.manager.get_block_table_tensor(a["ids"]), dtype=np.int32)
            counts, new_blocks = np.zeros(B, dtype=np.int32), np.zeros(0, dtype=np.int32)
        else:
            counts, new_blocks = self.manager.table_delta_rows(a["rows"], a["base"])
            self.progress.blocks_sent[a["prog"]] += counts
        saves, loads = self.manager.take_tier_moves()
        return ScheduledBatch(
            seqs=seqs, gens=a["gens"], input_ids=a["input_ids"], positions=a["positions"].astype(np.int32, copy=False),
            slot_mapping=(slots[0] if len(slots) == 1 else np.concatenate(slots)).astype(np.int32, copy=False),
            query_start_loc=qsl, seq_lens=a["seq_lens"], do_sample=a["do_sample"],
            table_base=a["base"], new_block_counts=counts, new_blocks=new_blocks.astype(np.int32, copy=False),
            seq_ids=a["ids"], sample_offsets=a["offsets"], step_rows=a["step_rows"], manager_rows=a["rows"],
            progress_rows=a["prog"], special=self.num_special > 0, plain=a["plain"], slot=slot, block_tables=tables,
            copies=self._take_copies(), prompt_rows=a["prompt_rows"], tier_saves=saves, tier_loads=loads)

    def _decode_arrays(self, dec) -> dict:
        """The steady state, one token per sequence: columns of their STEP_ROWs, the block
        manager's arrays and their Progress rows, no pass over the sequences."""
        step_rows, ids, rows, input_ids, prog = dec
        P = self.progress
        seq_lens = self.manager.lens_of_rows(rows).astype(np.int32)        # after the appends
        P.num_computed_tokens[prog] += 1
        P.inflight[prog] += 1
        B = ids.size
        fixed = np.frombuffer(step_rows, dtype=STEP_ROW)
        # no decode goes ahead past a request's last token: it is never fed back, and admission
        # counts no K/V slot for it (requests.kv_tokens): a request filling the pool would preempt itself
        P.pending_sample[prog] = seq_lens - fixed["prompt_len"] + 1 < fixed["max_new"]
        P.deferred[prog[input_ids == -1]] = True       # their input is the token still being sampled
        return dict(ids=ids, rows=rows, prog=prog, input_ids=input_ids, seq_lens=seq_lens, positions=seq_lens - 1,
                    num_new=np.ones(B, dtype=np.int32), do_sample=np.ones(B, dtype=np.uint8), gens=P.gen[prog],
                    base=P.blocks_sent[prog],
                    # the token a decode samples is output number seq_len - prompt (one past its
                    # input, which is the last known token or, when -1, the one still in flight)
                    offsets=(seq_lens - fixed["prompt_len"]).astype(np.int32),
                    step_rows=step_rows, plain=bool(fixed["plain"].all()), prompt_rows=None)

    def _mixed_arrays(self, decodes: list[Sequence], extra: list[tuple[Sequence, int]], dec) -> dict:
        """Decodes and prefill chunks: per-chunk token slices and positions."""
        num_decodes = len(decodes)
        chunks = [s for s, _ in extra]
        seqs = decodes + chunks
        B = len(seqs)
        step_rows = (dec[0] if dec else b"") + b"".join([s.step_row for s in chunks])
        fixed = np.frombuffer(step_rows, dtype=STEP_ROW)
        ids = fixed["seq_id"].copy()
        rows = self.manager.rows_of(ids)
        seq_lens = self.manager.lens_of_rows(rows).astype(np.int32)
        num_new = np.ones(B, dtype=np.int32)
        num_new[num_decodes:] = [n for _, n in extra]
        starts = seq_lens - num_new
        input_ids = np.concatenate(
            [dec[3] if dec else np.zeros(0, dtype=np.int32)]
            + [np.asarray(s.token_slice(int(a), int(a) + int(n)), dtype=np.int32)
               for s, a, n in zip(chunks, starts[num_decodes:], num_new[num_decodes:])])
        # positions: each chunk's start repeated, plus the offset inside the chunk
        ends = np.cumsum(num_new)
        inner = np.arange(int(ends[-1]), dtype=np.int32) - np.repeat(ends - num_new, num_new)
        prompt_rows = plan_prompt_rows(seqs, starts, num_new, num_decodes)
        P = self.progress
        prog = np.concatenate([dec[4] if dec else np.zeros(0, dtype=np.int64), P.rows_of(chunks)])
        defer = np.zeros(B, dtype=bool)                 # decodes whose input is the token being sampled
        if dec:
            defer[:num_decodes] = dec[3] == -1
        # the token each row samples is output number (output so far), one more when its input is -1
        offsets = (P.num_tokens[prog] - fixed["prompt_len"] + defer).astype(np.int32)
        P.num_computed_tokens[prog] += num_new
        # a prefill chunk samples only once it reaches the last known token (a request with
        # several choices never samples before its fork), and never for max_new_tokens 0 (prompt
        # logprobs only): nothing is pending then, so no decode goes ahead into a slot past the
        # prompt (a prompt that filled the pool exactly was preempted by its own decode, forever)
        do_sample = np.ones(B, dtype=np.uint8)
        pc = prog[num_decodes:]
        unforked = np.fromiter((s.group is not None and not s.group.forked for s in chunks), dtype=bool,
                               count=len(chunks))
        do_sample[num_decodes:] = (P.num_computed_tokens[pc] == P.num_tokens[pc]) & ~unforked \
            & (fixed["max_new"][num_decodes:] > 0)
        P.inflight[prog] += 1
        P.pending_sample[prog] = do_sample.astype(bool) & (offsets + 1 < fixed["max_new"])   # (as decodes')
        P.deferred[prog[defer]] = True
        return dict(ids=ids, rows=rows, prog=prog, input_ids=input_ids, seq_lens=seq_lens,
                    positions=np.repeat(starts, num_new) + inner, num_new=num_new, do_sample=do_sample,
                    gens=P.gen[prog], base=P.blocks_sent[prog], offsets=offsets,
                    step_rows=step_rows, plain=False, prompt_rows=prompt_rows)

    def _take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies
