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
  Sequences whose next step needs that token on the host (grammar bitmasks) wait for it; they are
  staggered over the two steps in flight so one half computes while the other is prepared.
  Penalized ones do not: their history goes without it, and the last stage, which sampled it,
  appends it (worker/validate_sampling.py).
When a decode cannot get a block, the newest running sequence (of any slot) is preempted: its blocks
are freed and it goes back to the front of the queue for recompute (`gen` goes up, so whatever of it
is still in flight is ignored). Freeing blocks that an in-flight step still writes is safe because
every stage runs steps in the order they were sent.

The scheduler owns sequence progress; the KVBlockManager owns blocks. Only the chain's thread calls
it, holding the chain's lock."""
from __future__ import annotations

from collections import deque

import numpy as np

from .block_manager import KVBlockManager
from .decode_pick import DecodePicking, SlotRows
from .progress import Progress
from .sequence import SeqStatus, Sequence
from .step_batch import BatchPacking, ScheduledBatch
from .step_rows import pack_step_row

__all__ = ["Scheduler", "ScheduledBatch"]


class Scheduler(DecodePicking, BatchPacking):
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
            if self.copies:      # a fork's pending copy into its own blocks is void: they may be reused
                self._drop_copies_into(self.manager.sequences[seq.seq_id].block_table)
            self.manager.release_sequence(seq.seq_id)
        if seq.blocks_sent or seq.inflight or seq.deferred:
            self.released.append(seq.seq_id)
        seq.gen += 1
        seq.inflight, seq.deferred, seq.blocks_sent = 0, False, 0

    def _drop_copies_into(self, table) -> None:
        """Forget pending copy-on-write copies whose destination is one of `table`'s blocks. A
        fork's destination is a fresh block of the child alone: once the child's blocks go back
        (a beam group preempted in the reply that forked it), the block may be a copy's
        destination again in the same step, and the stale copy would race the new one."""
        mine = set(table)
        self.copies = [c for c in self.copies if c[1] not in mine]

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is (finished or aborted) and free its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self._drop_running(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._forget(seq)
        seq.status = SeqStatus.FINISHED

    def release_waiting(self, count: int) -> list[Sequence]:
        """Up to `count` of the newest waiting sequences that hold nothing here (never started: no
        blocks, no tokens, not one of a group), for a chain that joined to take."""
        out: list[Sequence] = []
        for s in reversed(self.waiting):
            if len(out) >= count:
                break
            if s.group is None and not s.output_token_ids and s.seq_id not in self.manager.sequences \
                    and not (s.blocks_sent or s.inflight or s.deferred or s.handed_off):
                out.append(s)
        if out:
            gone = {id(s) for s in out}
            self.waiting = deque(s for s in self.waiting if id(s) not in gone)
        return out

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

    def _preempt_newest(self) -> Sequence | None:
        """Free the blocks of the newest running sequence, whichever micro-batch it is in: the
        oldest always keeps going (first come, first served, as vLLM does). A victim chosen within
        the short micro-batch would let two micro-batches preempt each other's oldest in turn."""
        if not self.running:
            return None
        s = self.running[-1]
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
            self.unforked.remove(s)
            children = g.fork()
            # Each child shares the full blocks; one ending mid-block needs its own copy of the last
            # one. Those without room for it wait and recompute the prompt (from the prefix cache),
            # as vLLM's child requests each prefill: one choice fitting is enough to run (n up to 128).
            now = len(children) if not partial else min(len(children), self.manager.num_free_blocks)
            for c in children[:now]:
                self.copies += self.manager.fork(s.seq_id, c.seq_id)
                self._admit_running(c, slot)
            for c in reversed(children[now:]):
                c.num_computed_tokens, c.status = 0, SeqStatus.WAITING
                self.waiting.appendleft(c)
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
                if s.preemptions == 0 and not s.handed_off:   # (a moved-in prompt keeps its own figure)
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
            mine = self.by_slot[slot]
            if mine and not any(s.inflight for s in mine):
                self._preempt_newest()  # everything stuck on blocks (only prefills): free the newest
            return None
        return self._build(decodes, extra, slots, slot, dec)

    def _append(self, s: Sequence, n: int) -> np.ndarray:
        start = s.num_computed_tokens
        return self.manager.append_tokens(s.seq_id, n, s.token_slice(start, start + n))

    def step_done(self, batch: ScheduledBatch) -> None:
        """The step came back (applied or failed): its sequences are one step less in flight."""
        self.progress.step_back(batch.progress_rows, batch.seq_ids, batch.gens)
