"""Continuous batching under a token budget (vLLM v1 style).

Each step: running sequences first (decodes as one vectorized block-manager call, then the next
chunk of any prefill still in flight), then waiting sequences, their prefills chunked to fit the
budget, so prefill chunks and decodes share a step. When a decode cannot get a block, the most
recently admitted running sequence is preempted: its blocks are freed and it goes back to the
front of the queue to be recomputed (its full blocks usually come back from the prefix cache).

The scheduler owns sequence progress; the KVBlockManager owns blocks. Only the engine thread calls
it, holding the block-manager lock."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from .block_manager import KVBlockManager, OutOfBlocksError
from .sequence import SeqStatus, Sequence


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    input_ids: np.ndarray        # int32 [T]
    positions: np.ndarray        # int32 [T]
    slot_mapping: np.ndarray     # int32 [T]
    query_start_loc: np.ndarray  # int32 [B+1]
    seq_lens: np.ndarray         # int32 [B]
    block_tables: np.ndarray     # int32 [B, max_blocks]
    do_sample: np.ndarray        # uint8 [B]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.size)


class Scheduler:
    def __init__(self, manager: KVBlockManager, max_num_batched_tokens: int, max_num_seqs: int):
        self.manager = manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # admission order: the last is preempted first
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is (finished or aborted) and free its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.seq_id in self.manager.sequences:
            self.manager.release_sequence(seq.seq_id)
        seq.status = SeqStatus.FINISHED

    def requeue_all(self) -> None:
        """The data plane lost its cache: every running sequence recomputes from its tokens."""
        for seq in reversed(self.running):
            self._preempt(seq, count=False)
        self.running = []

    def _preempt(self, seq: Sequence, count: bool = True) -> None:
        if seq.seq_id in self.manager.sequences:
            self.manager.release_sequence(seq.seq_id)
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

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> ScheduledBatch | None:
        budget = self.max_num_batched_tokens
        chosen: list[tuple[Sequence, int]] = []
        slots: list[np.ndarray] = []

        # 1. Decodes: one token each, one all-or-nothing block-manager call; preempt on shortage.
        decodes, prefilling = [], []
        for s in self.running:
            (decodes if s.num_tokens - s.num_computed_tokens == 1 else prefilling).append(s)
        del decodes[budget:]
        while decodes:
            try:
                slots.append(self.manager.slot_mapping_for_append([s.seq_id for s in decodes],
                                                                  [s.last_token for s in decodes]))
                break
            except OutOfBlocksError:
                victim = self.running.pop()
                self._preempt(victim)
                for group in (decodes, prefilling):
                    if victim in group:
                        group.remove(victim)
        chosen.extend((s, 1) for s in decodes)
        num_decodes = len(decodes)
        budget -= num_decodes

        # 2. Running prefills still in flight (chunked prefill), then 3. admissions.
        for s in prefilling:
            if budget <= 0:
                break
            n = min(s.num_tokens - s.num_computed_tokens, budget, self._room(s))
            if n > 0:
                slots.append(self._append(s, n))
                chosen.append((s, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            s = self.waiting[0]
            created = s.seq_id not in self.manager.sequences
            if created:
                cached = self.manager.create_sequence(s.seq_id, s.all_token_ids)
                s.num_computed_tokens = cached
                if s.preemptions == 0:
                    s.num_cached_tokens = cached
            n = min(s.num_tokens - s.num_computed_tokens, budget, self._room(s))
            if n <= 0:
                if created:
                    self.manager.release_sequence(s.seq_id)
                    s.num_computed_tokens = 0
                break
            self.waiting.popleft()
            s.status = SeqStatus.RUNNING
            self.running.append(s)
            slots.append(self._append(s, n))
            chosen.append((s, n))
            budget -= n

        if not chosen:
            if self.running:  # everything stuck on blocks (only prefills): free the newest
                self._preempt(self.running.pop())
            return None
        return self._build(chosen, slots, num_decodes)

    def _append(self, s: Sequence, n: int) -> np.ndarray:
        start = s.num_computed_tokens
        return self.manager.append_tokens(s.seq_id, n, s.token_slice(start, start + n))

    def _build(self, chosen: list[tuple[Sequence, int]], slots: list[np.ndarray],
               num_decodes: int) -> ScheduledBatch:
        """Pack the step's arrays. `chosen` lists the decodes first; they need no per-token work."""
        seqs = [s for s, _ in chosen]
        ids = [s.seq_id for s in seqs]
        seq_lens = np.asarray(self.manager.get_seq_lens_tensor(ids), dtype=np.int32)  # after the appends
        B = len(seqs)
        do_sample = np.ones(B, dtype=np.uint8)
        if num_decodes == B:  # the steady state: one token per sequence, no per-token work
            num_new = np.ones(B, dtype=np.int32)
            input_ids = np.fromiter((s.last_token for s in seqs), dtype=np.int32, count=B)
            positions = seq_lens - 1
            for s in seqs:
                s.num_computed_tokens += 1
        else:
            num_new = np.fromiter((n for _, n in chosen), dtype=np.int32, count=B)
            starts = seq_lens - num_new
            input_ids = np.concatenate([np.asarray(s.token_slice(int(a), int(a) + int(n)), dtype=np.int32)
                                        for s, a, n in zip(seqs, starts, num_new)])
            # positions: each chunk's start repeated, plus the offset inside the chunk
            ends = np.cumsum(num_new)
            offsets = np.arange(int(ends[-1]), dtype=np.int32) - np.repeat(ends - num_new, num_new)
            positions = np.repeat(starts, num_new) + offsets
            for s, n in chosen:
                s.num_computed_tokens += n
            # a prefill chunk samples only once it reaches the last known token
            do_sample[num_decodes:] = [s.num_computed_tokens == s.num_tokens for s in seqs[num_decodes:]]
        qsl = np.zeros(B + 1, dtype=np.int32)
        np.cumsum(num_new, out=qsl[1:])
        return ScheduledBatch(
            seqs=seqs,
            input_ids=input_ids,
            positions=positions.astype(np.int32, copy=False),
            slot_mapping=(slots[0] if len(slots) == 1 else np.concatenate(slots)).astype(np.int32, copy=False),
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=np.asarray(self.manager.get_block_table_tensor(ids), dtype=np.int32),
            do_sample=do_sample,
        )
