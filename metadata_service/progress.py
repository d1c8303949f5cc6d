"""Progress: the step path's per-sequence counters as columns, one row per running sequence.

A decode step changes the same few counters of every sequence in it (tokens computed, steps in
flight, whether its input is still being sampled, ...). Kept as fields of 256 Python objects they
cost a Python pass per step; kept here, one numpy operation over the batch's rows does it.

A Scheduler owns one Progress. A sequence is bound to a row while it runs on that scheduler's
chain (`bind` at admission, `unbind` when it stops running: finished, preempted, handed to another
chain); `Sequence`'s fields of the same names read and write its row while it is bound and its own
attributes otherwise, so code off the step path sees plain ints and bools either way. `owner`
holds the bound sequence's id: a reply for a row that was unbound (and maybe bound again to another
sequence) since its step was sent is recognised by id, the way `gen` recognises a preemption."""
from __future__ import annotations

import numpy as np

# (name, dtype) of every column; Sequence exposes each under the same name (sequence.py)
COLUMNS = (("num_tokens", np.int64), ("num_computed_tokens", np.int64), ("inflight", np.int32),
           ("gen", np.int64), ("blocks_sent", np.int32), ("deferred", np.bool_), ("pending_sample", np.bool_))
NAMES = tuple(name for name, _ in COLUMNS)


class Progress:
    def __init__(self, capacity: int = 256):
        self.capacity = 0
        self.owner = np.zeros(0, dtype=np.int64)
        for name, dtype in COLUMNS:
            setattr(self, name, np.zeros(0, dtype=dtype))
        self._free: list[int] = []
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        for name in ("owner",) + NAMES:
            col = getattr(self, name)
            new = np.zeros(capacity, dtype=col.dtype)
            new[:old] = col
            setattr(self, name, new)
        self.owner[old:] = -1
        self._free.extend(range(capacity - 1, old - 1, -1))   # lowest row handed out first
        self.capacity = capacity

    def bind(self, seq) -> int:
        """Give `seq` a row holding its current counters; from now on they live here."""
        if seq._progress is self:
            return seq._row
        if seq._progress is not None:
            seq._progress.unbind(seq)
        values = [getattr(seq, name) for name in NAMES]
        if not self._free:
            self._grow(2 * self.capacity)
        row = self._free.pop()
        for name, v in zip(NAMES, values):
            getattr(self, name)[row] = v
        self.owner[row] = seq.seq_id
        seq._progress, seq._row = self, row
        return row

    def unbind(self, seq) -> None:
        """The counters go back into the sequence's own attributes; the row is free again."""
        if seq._progress is not self:
            return
        row = seq._row
        values = [getattr(seq, name) for name in NAMES]
        seq._progress, seq._row = None, -1
        for name, v in zip(NAMES, values):
            setattr(seq, name, v)
        self.owner[row] = -1
        self._free.append(row)

    def same_run(self, rows: np.ndarray, ids: np.ndarray, gens: np.ndarray) -> np.ndarray:
        """Which of a step's rows still hold the run it was sent for: the same sequence (owner) and
        no preemption since (gen). The others' results are void."""
        return (self.owner[rows] == ids) & (self.gen[rows] == gens)

    def step_back(self, rows: np.ndarray, ids: np.ndarray, gens: np.ndarray) -> np.ndarray:
        """A step came back: its live rows are one step less in flight. Returns same_run's mask."""
        same = self.same_run(rows, ids, gens)
        live = rows[same]
        self.inflight[live] -= self.inflight[live] > 0
        return same

    def rows_of(self, seqs) -> np.ndarray:
        """Rows of bound sequences, in order."""
        return np.fromiter((s._row for s in seqs), dtype=np.int64, count=len(seqs))
