"""Continuous batching under a token budget (vLLM v1 style), for one chain, in micro-batches.

Each step serves one micro-batch (a `slot`): its running sequences first (decodes as one vectorized
block-manager call, then the next chunk of any prefill still in flight), then waiting sequences,
admitted into this slot, their prefills chunked to fit the budget, so prefill chunks and decodes
share a step. A sequence belongs to one slot; `max_num_seqs` and the token budget are per micro-
batch, so an N-stage chain holds several micro-batches, each up to the size one worker would run.

Steps may be scheduled while earlier ones are in flight:
- known tokens never wait: the next prefill chunk goes out while the previous one is computing;
- with `overlap` (async scheduling), a sequence whose sampled token is still in flight decodes
  anyway, with input id -1 ("the token you just sampled", filled in by stage 0). At most one such
  token per sequence; if it turns out to end the sequence, the extra token is computed and dropped.
  Sequences whose next step needs that token on the host (penalties, grammar bitmasks) wait for it;
  they are staggered over the two steps in flight so one half computes while the other is prepared.
When a decode cannot get a block, the newest running sequence of the slot is preempted: its blocks
are freed and it goes back to the front of the queue for recompute (`gen` goes up, so whatever of it
is still in flight is ignored). Freeing blocks that an in-flight step still writes is safe because
every stage runs steps in the order they were sent.

The scheduler owns sequence progress; the KVBlockManager owns blocks. Only the chain's thread calls
it, holding the chain's lock."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .block_manager import KVBlockManager, OutOfBlocksError
from .step_rows import STEP_ROW, pack_step_row
from .progress import Progress
from .prompt_logprobs import plan as plan_prompt_rows
from .sequence import SeqStatus, Sequence


@dataclass
class SlotRows:
    """A micro-batch's running sequences as arrays, rebuilt when it gains or loses one."""
    prog: np.ndarray             # Progress rows
    ids: np.ndarray              # int64 sequence ids
    mrows: np.ndarray            # KVBlockManager rows
    step_rows: bytes             # their STEP_ROWs, joined
    simple: bool                 # no choices, beams or sequences that wait for their token


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

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.size)

    @property
    def deferred(self) -> list[Sequence]:
        """The sequences whose input is the token still being sampled (-1)."""
        last = self.input_ids[self.query_start_loc[1:] - 1]
        return [self.seqs[i] for i in np.flatnonzero(last == -1).tolist()]


class Scheduler:
    def __init__(self, manager: KVBlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 micro_batches: int = 1, overlap: bool = False, full_tables: bool = False):
        self.manager = manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs          # per micro-batch
        self.micro_batches = micro_batches
        self.overlap = overlap
        self.full_tables = full_tables            # send whole block tables every step (for comparison)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []         # admission order: the newest is preempted first
        self.by_slot: list[list[Sequence]] = [[] for _ in range(micro_batches)]  # the same, per micro-batch
        self.unforked: list[Sequence] = []        # running requests with several choices, before their fork
        self.released: list[int] = []             # ids whose worker-side state can be dropped
        self.copies: list[tuple[int, int]] = []   # forks' copy-on-write, for the next step to carry
        self.num_preemptions = 0
        self.num_special = 0                      # running sequences with logprobs / extras / a grammar
        self.progress = Progress(max(256, max_num_seqs * micro_batches))   # running sequences' counters
        self._slots: list[SlotRows | None] = [None] * micro_batches        # by_slot as arrays (cached)

    # ------------------------------------------------------------------ queue
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _forget(self, seq: Sequence) -> None:
        """Its blocks go back to the pool and the workers may drop what they remember of it."""
        if seq.seq_id in self.manager.sequences:
            self.manager.release_sequence(seq.seq_id)
        if seq.blocks_sent or seq.inflight or seq.deferred:
            self.released.append(seq.seq_id)
        seq.gen += 1
        seq.inflight, seq.deferred, seq.blocks_sent = 0, False, 0

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is (finished or aborted) and free its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self._drop_running(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._forget(seq)
        seq.status = SeqStatus.FINISHED

    def requeue_all(self) -> None:
        """The data plane lost its cache: every running sequence recomputes from its tokens."""
        for seq in reversed(self.running):
            self.progress.unbind(seq)
            self._preempt(seq, count=False)
        self.running = []
        self.by_slot = [[] for _ in range(self.micro_batches)]
        self._slots = [None] * self.micro_batches
        self.unforked = []
        self.num_special = 0

    def drain(self) -> list[Sequence]:
        """Every unfinished sequence, running ones reset for recompute (a lost chain hands them on)."""
        self.requeue_all()
        out = list(self.waiting)
        self.waiting.clear()
        for s in out:
            self._forget(s)
        self.released.clear()
        return out

    @staticmethod
    def _special(s: Sequence) -> bool:
        return s.params.return_logprobs or s.params.extras or s.matcher is not None

    def _drop_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.by_slot[seq.slot].remove(seq)
        self._slots[seq.slot] = None
        self.progress.unbind(seq)
        self.num_special -= self._special(seq)
        if seq in self.unforked:
            self.unforked.remove(seq)

    def _admit_running(self, seq: Sequence, slot: int) -> None:
        seq.status, seq.slot = SeqStatus.RUNNING, slot
        if not seq.step_row:
            seq.step_row = pack_step_row(seq)
        self.progress.bind(seq)
        self.running.append(seq)
        self.by_slot[slot].append(seq)
        self._slots[slot] = None
        self.num_special += self._special(seq)
        if seq.group is not None and not seq.group.forked and seq.group.parent is seq:
            self.unforked.append(seq)

    def _preempt(self, seq: Sequence, count: bool = True) -> None:
        self._forget(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        if count:
            seq.preemptions += 1
            self.num_preemptions += 1

    def _room(self, seq: Sequence) -> int:
        """Tokens this sequence can still append: its last block's slack plus every free block."""
        st = self.manager.sequences[seq.seq_id]
        slack = len(st.block_table) * self.manager.block_size - st.sequence_length
        return slack + self.manager.num_free_blocks * self.manager.block_size

    def _preempt_newest(self, slot: int) -> Sequence | None:
        mine = self.by_slot[slot]
        if not mine:
            return None
        s = mine[-1]
        if s.group is not None and s.group.beam:
            self.preempt_beams([b for b in s.group.live if b.chain is s.chain])
            return s
        self._drop_running(s)
        self._preempt(s)
        return s

    # ------------------------------------------------------------------ beam groups (beam.py)
    # A beam group waits for every live beam's tokens, so part of one holding blocks while the
    # rest waits for blocks could stall every group: its beams leave and come back together.
    def preempt_beams(self, beams: list[Sequence]) -> None:
        for b in reversed(beams):
            if b.status is SeqStatus.RUNNING:
                self._drop_running(b)
                self._preempt(b)

    @staticmethod
    def _beam_sibling(s: Sequence, mine: list[Sequence]) -> bool:
        return bool(mine) and s.group is not None and s.group.beam and mine[-1].group is s.group

    def _beams_fit(self, s: Sequence) -> bool:
        """The first beam of a waiting group comes in only when all of them fit (the prompt's
        full blocks counted once: they are shared), or when nothing else runs."""
        live = s.group.live
        waiting = [b for b in live if b.status is SeqStatus.WAITING]
        if len(waiting) < len(live) or not self.running:
            return True
        bs = self.manager.block_size
        full = s.num_prompt_tokens // bs
        need = full + sum(-(-(b.num_tokens - full * bs) // bs) for b in waiting)
        return need <= self.manager.num_free_blocks

    # ------------------------------------------------------------------ forks (n / best_of)
    @staticmethod
    def _todo(s: Sequence) -> int:
        """Known tokens it may compute now: a request with several choices stops its prefill one
        token short, where it forks (each choice then computes that last token itself)."""
        g = s.group
        if g is not None and not g.forked and g.parent is s:
            return g.prefill_target() - s.num_computed_tokens
        return s.num_tokens - s.num_computed_tokens

    def _fork_ready(self, slot: int) -> bool:
        forked = False
        for s in list(self.unforked):
            g = s.group
            if s.slot != slot or self._todo(s) != 0:
                continue
            partial = s.num_computed_tokens % self.manager.block_size != 0
            if partial and self.manager.num_free_blocks < g.size - 1:
                continue                              # no room for the copies yet: try again later
            self.unforked.remove(s)
            for c in g.fork():
                self.copies += self.manager.fork(s.seq_id, c.seq_id)
                self._admit_running(c, slot)
            forked = True
        return forked

    # ------------------------------------------------------------------ schedule
    def schedule(self, slot: int = 0) -> ScheduledBatch | None:
        budget = self.max_num_batched_tokens
        forked = self._fork_ready(slot)
        picked = self._vector_decodes(slot, budget) or self._decodes(slot, budget)
        if picked is None:
            return None
        decodes, chunks, dec, slots = picked
        budget -= len(decodes)

        # 2. Running prefills still in flight (chunked prefill), then 3. admissions into this slot.
        extra: list[tuple[Sequence, int]] = []       # (sequence, tokens) beyond the one-token decodes
        for s in chunks:
            if budget <= 0:
                break
            n = min(self._todo(s), budget, self._room(s))
            if n > 0:
                slots.append(self._append(s, n))
                extra.append((s, n))
                budget -= n
        # a fair share per micro-batch, so a few requests still spread over every pipeline slot
        share = min(self.max_num_seqs, -(-(len(self.running) + len(self.waiting)) // self.micro_batches))
        mine = self.by_slot[slot]
        while self.waiting and budget > 0 and (len(mine) < share or self._beam_sibling(self.waiting[0], mine)):
            s = self.waiting[0]
            if s.group is not None and s.group.beam and not self._beams_fit(s):
                break
            created = s.seq_id not in self.manager.sequences
            if created:
                # prompt logprobs need every prompt position's logits: no cached blocks for them
                cached = self.manager.create_sequence(s.seq_id, s.all_token_ids, reuse_cached=s.prompt_lp is None)
                s.num_computed_tokens = cached
                if s.preemptions == 0:
                    s.num_cached_tokens = cached
            todo = self._todo(s)
            n = min(todo, budget, self._room(s))
            if n <= 0 and todo > 0:
                if created:
                    self.manager.release_sequence(s.seq_id)
                    s.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self._admit_running(s, slot)
            if n > 0:
                slots.append(self._append(s, n))
                extra.append((s, n))
                budget -= n
        forked = self._fork_ready(slot) or forked

        if not decodes and not extra:
            if forked:
                return self.schedule(slot)            # the new choices decode right away
            if not any(s.inflight for s in self.by_slot[slot]):
                self._preempt_newest(slot)  # everything stuck on blocks (only prefills): free the newest
            return None
        return self._build(decodes, extra, slots, slot, dec)

    # 1. Decodes: one token each, one all-or-nothing block-manager call; preempt on shortage.
    def _slot_rows(self, slot: int) -> SlotRows:
        c = self._slots[slot]
        if c is None:
            mine = self.by_slot[slot]
            step_rows = b"".join([s.step_row for s in mine])
            ids = np.frombuffer(step_rows, dtype=STEP_ROW)["seq_id"].copy()
            c = self._slots[slot] = SlotRows(
                self.progress.rows_of(mine), ids, self.manager.rows_of(ids), step_rows,
                all(s.group is None and not s.params.waits_for_token for s in mine))
        return c

    def _vector_decodes(self, slot: int, budget: int):
        """The decodes of a micro-batch of sequences without choices, beams or a wait for their
        token, found by vector compares over its Progress rows (the steady state: no Python pass).
        None when that does not apply or blocks run short (then `_decodes` preempts)."""
        if not self.by_slot[slot]:
            return None
        c = self._slot_rows(slot)
        if not c.simple:
            return None
        P, pr = self.progress, c.prog
        known = P.num_tokens[pr] - P.num_computed_tokens[pr]
        ready = known == 1
        pick = ready | ((known == 0) & (P.inflight[pr] == 1) & ~P.deferred[pr] & P.pending_sample[pr]) \
            if self.overlap else ready
        pick = np.flatnonzero(pick)[:budget]
        mine = self.by_slot[slot]
        whole = pick.size == len(mine)
        decodes = list(mine) if whole else [mine[i] for i in pick.tolist()]
        toks = np.full(pick.size, -1, dtype=np.int32)
        known_input = np.flatnonzero(ready[pick])
        if known_input.size:
            toks[known_input] = [decodes[i].last_token for i in known_input.tolist()]
        rows = c.mrows[pick]
        if pick.size:
            try:
                slots = [self.manager.append_decode_rows(rows, toks)]
            except OutOfBlocksError:
                return None
        else:
            slots = []
        step_rows = c.step_rows if whole else np.frombuffer(c.step_rows, dtype=STEP_ROW)[pick].tobytes()
        chunks = [mine[i] for i in np.flatnonzero(known > 1).tolist()]
        dec = (step_rows, c.ids[pick], rows, toks, pr[pick]) if pick.size else None
        return decodes, chunks, dec, slots

    def _decodes(self, slot: int, budget: int):
        """The same for any micro-batch, one sequence at a time (choices, beams, penalties, grammars)."""
        decodes, chunks, toks = [], [], []   # toks: each decode's input id (-1: still being sampled)
        overlap = self.overlap
        for s in self.by_slot[slot]:
            g = s.group
            known = s.num_tokens - s.num_computed_tokens if g is None else self._todo(s)
            grouped = g is not None and not g.forked
            if not grouped and known == 1:
                decodes.append(s)
                toks.append(s.last_token)
            elif not grouped and (known == 0 and overlap and s.inflight == 1 and not s.deferred
                                  and s.pending_sample and not s.params.waits_for_token and not s.params.beam_width):
                decodes.append(s)
                toks.append(-1)
            elif known > 1 or (grouped and known > 0):
                chunks.append(s)
        del decodes[budget:], toks[budget:]
        if overlap:
            staggered = self._stagger(decodes, slot)
            if len(staggered) != len(decodes):
                decodes, toks = staggered, [s.last_token if s.num_tokens > s.num_computed_tokens else -1
                                            for s in staggered]
        while decodes:
            step_rows = b"".join([s.step_row for s in decodes])
            ids = np.frombuffer(step_rows, dtype=STEP_ROW)["seq_id"].copy()
            rows = self.manager.rows_of(ids)
            try:
                arr = np.asarray(toks, dtype=np.int32)
                slots = [self.manager.append_decode_rows(rows, arr)]
                return decodes, chunks, (step_rows, ids, rows, arr, self.progress.rows_of(decodes)), slots
            except OutOfBlocksError:
                victim = self._preempt_newest(slot)
                if victim is None:
                    return None
                # the victim, or a whole beam group (preempt_beams), leaves both lists
                decodes[:] = [s for s in decodes if s.status is SeqStatus.RUNNING]
                chunks[:] = [s for s in chunks if s.status is SeqStatus.RUNNING]
                toks = [s.last_token if s.num_tokens > s.num_computed_tokens else -1 for s in decodes]
        return decodes, chunks, None, []

    def _stagger(self, decodes: list[Sequence], slot: int) -> list[Sequence]:
        """Async scheduling with sequences that wait for their sampled token (penalties, grammars):
        when none of this micro-batch's are in flight, half of them go now and half in the step sent
        right after, so from then on one half computes while the host applies and prepares the
        other. Without this they all wait for the same reply and the overlap is lost for good."""
        waiting = [s for s in decodes if s.params.waits_for_token]
        if len(waiting) < 2 or any(s.inflight and s.params.waits_for_token for s in self.by_slot[slot]):
            return decodes
        later = set(waiting[(len(waiting) + 1) // 2:])
        return [s for s in decodes if s not in later]

    def _append(self, s: Sequence, n: int) -> np.ndarray:
        start = s.num_computed_tokens
        return self.manager.append_tokens(s.seq_id, n, s.token_slice(start, start + n))

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
        return ScheduledBatch(
            seqs=seqs, gens=a["gens"], input_ids=a["input_ids"], positions=a["positions"].astype(np.int32, copy=False),
            slot_mapping=(slots[0] if len(slots) == 1 else np.concatenate(slots)).astype(np.int32, copy=False),
            query_start_loc=qsl, seq_lens=a["seq_lens"], do_sample=a["do_sample"],
            table_base=a["base"], new_block_counts=counts, new_blocks=new_blocks.astype(np.int32, copy=False),
            seq_ids=a["ids"], sample_offsets=a["offsets"], step_rows=a["step_rows"], manager_rows=a["rows"],
            progress_rows=a["prog"], special=self.num_special > 0, plain=a["plain"], slot=slot, block_tables=tables,
            copies=self._take_copies(), prompt_rows=a["prompt_rows"])

    def _decode_arrays(self, dec) -> dict:
        """The steady state, one token per sequence: columns of their STEP_ROWs, the block
        manager's arrays and their Progress rows, no pass over the sequences."""
        step_rows, ids, rows, input_ids, prog = dec
        P = self.progress
        seq_lens = self.manager.lens_of_rows(rows).astype(np.int32)        # after the appends
        P.num_computed_tokens[prog] += 1
        P.inflight[prog] += 1
        P.pending_sample[prog] = True
        P.deferred[prog[input_ids == -1]] = True       # their input is the token still being sampled
        B = ids.size
        fixed = np.frombuffer(step_rows, dtype=STEP_ROW)
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
        # several choices never samples before its fork)
        do_sample = np.ones(B, dtype=np.uint8)
        pc = prog[num_decodes:]
        unforked = np.fromiter((s.group is not None and not s.group.forked for s in chunks), dtype=bool,
                               count=len(chunks))
        do_sample[num_decodes:] = (P.num_computed_tokens[pc] == P.num_tokens[pc]) & ~unforked
        P.inflight[prog] += 1
        P.pending_sample[prog] = do_sample.astype(bool)
        P.deferred[prog[defer]] = True
        return dict(ids=ids, rows=rows, prog=prog, input_ids=input_ids, seq_lens=seq_lens,
                    positions=np.repeat(starts, num_new) + inner, num_new=num_new, do_sample=do_sample,
                    gens=P.gen[prog], base=P.blocks_sent[prog], offsets=offsets,
                    step_rows=step_rows, plain=False, prompt_rows=prompt_rows)

    def _take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def step_done(self, batch: ScheduledBatch) -> None:
        """The step came back (applied or failed): its sequences are one step less in flight."""
        P, pr = self.progress, batch.progress_rows
        live = pr[(P.owner[pr] == batch.seq_ids) & (P.gen[pr] == batch.gens)]   # not ended nor preempted since
        P.inflight[live] -= P.inflight[live] > 0
