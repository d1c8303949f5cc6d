"""Which running sequences of a micro-batch decode this step (`DecodePicking`, a Scheduler mixin).

A micro-batch of plain sequences (no choices, beams or grammars) is classified by vector
compares over its Progress rows (`_vector_decodes`, the steady state); any other one sequence by
sequence (`_decodes`), which also preempts when the decodes' blocks run short."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .block_manager import OutOfBlocksError
from .sequence import SeqStatus, Sequence
from .step_rows import STEP_ROW


@dataclass
class SlotRows:
    """A micro-batch's running sequences as arrays, rebuilt when it gains or loses one."""
    prog: np.ndarray             # Progress rows
    ids: np.ndarray              # int64 sequence ids
    mrows: np.ndarray            # KVBlockManager rows
    step_rows: bytes             # their STEP_ROWs, joined
    simple: bool                 # no choices, beams or sequences that wait for their token


class DecodePicking:
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
        """The same for any micro-batch, one sequence at a time (choices, beams, grammars)."""
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
                victim = self._preempt_newest()
                if victim is None:
                    return None
                # the victim, or a whole beam group (preempt_beams), leaves both lists
                decodes[:] = [s for s in decodes if s.status is SeqStatus.RUNNING]
                chunks[:] = [s for s in chunks if s.status is SeqStatus.RUNNING]
                toks = [s.last_token if s.num_tokens > s.num_computed_tokens else -1 for s in decodes]
        return decodes, chunks, None, []

    def _stagger(self, decodes: list[Sequence], slot: int) -> list[Sequence]:
        """Async scheduling with sequences that wait for their sampled token (grammars):
        when none of this micro-batch's are in flight, half of them go now and half in the step sent
        right after, so from then on one half computes while the host applies and prepares the
        other. Without this they all wait for the same reply and the overlap is lost for good."""
        waiting = [s for s in decodes if s.params.waits_for_token]
        if len(waiting) < 2 or any(s.inflight and s.params.waits_for_token for s in self.by_slot[slot]):
            return decodes
        later = set(waiting[(len(waiting) + 1) // 2:])
        return [s for s in decodes if s not in later]
