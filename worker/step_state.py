"""What a stage remembers between Steps of one cache epoch, per sequence: its block table (so Steps
can send only the blocks that are new, docs/architecture.md section 7) and the token last sampled for it (so the
metadata service can schedule step k+1 before step k's tokens come back: an input id of -1 means
"that token").

Both are caches, never the truth: the metadata service owns every table. A Step states how many
leading blocks it assumes the stage holds (`table_base`); a stage that holds fewer (it restarted,
evicted the row, or never saw the sequence) raises StepPrecondition, which the server answers with
FAILED_PRECONDITION, and the metadata service recovers with full tables. Nothing is ever guessed.

Rows live in numpy arrays indexed through a dict (as in the block manager) and its IdIndex, so a
step's lookups and updates are a few vectorized ops, whatever the batch or context length."""
from __future__ import annotations

import threading

import numpy as np

from minipaged.id_index import IdIndex

DEFAULT_MAX_SEQUENCES = 1 << 16


class StepPrecondition(Exception):
    """The step assumes state this stage does not hold: FAILED_PRECONDITION, never a guess."""


class SequenceStore:
    def __init__(self, max_sequences: int = DEFAULT_MAX_SEQUENCES):
        self.max_sequences = max_sequences
        self.next_serial = 1      # never reset: a ticket of an earlier row or epoch never matches
        self.cond = threading.Condition()  # guards `pending` and `last_token` for placeholder waits
        self.clear()

    def clear(self) -> None:
        """A new cache epoch: nothing cached survives."""
        rows, cols = 64, 16
        self.tables = np.full((rows, cols), -1, dtype=np.int32)
        self.held = np.zeros(rows, dtype=np.int32)          # blocks of the row that are valid
        self.last_token = np.full(rows, -1, dtype=np.int64)  # -1: none sampled yet
        self.pending = np.zeros(rows, dtype=np.int32)       # sampling steps forwarded, reply not back
        self.last_use = np.zeros(rows, dtype=np.int64)
        self.serial = np.zeros(rows, dtype=np.int64)        # which life of the row (see Ticket)
        self.row_of: dict[int, int] = {}
        self.free_rows = list(range(rows - 1, -1, -1))
        self.clock = 0
        self.index = IdIndex(self.row_of)

    def __len__(self) -> int:
        return len(self.row_of)

    # ------------------------------------------------------------------ rows
    def _grow_rows(self) -> None:
        n = len(self.held)
        grow = lambda a, fill: np.concatenate([a, np.full((n,) + a.shape[1:], fill, a.dtype)])  # noqa: E731
        self.tables = grow(self.tables, -1)
        self.held, self.pending = grow(self.held, 0), grow(self.pending, 0)
        self.last_token, self.last_use = grow(self.last_token, -1), grow(self.last_use, 0)
        self.serial = grow(self.serial, 0)
        self.free_rows = list(range(2 * n - 1, n - 1, -1))

    def _evict_lru(self) -> None:
        """Over capacity (the metadata service forgot to release): drop the least recently used
        quarter. A later Step that still relies on them gets FAILED_PRECONDITION, not a guess."""
        live = np.fromiter(self.row_of.values(), dtype=np.int64, count=len(self.row_of))
        old = live[np.argsort(self.last_use[live], kind="stable")[:max(1, len(live) // 4)]]
        inverse = {r: s for s, r in self.row_of.items()}
        self.release([inverse[int(r)] for r in old])

    def rows(self, seq_ids, create: bool) -> np.ndarray:
        """Row of each sequence id; -1 for unknown ones unless `create`."""
        ids = np.asarray(seq_ids, dtype=np.int64).reshape(-1)
        out = self.index.lookup(ids)
        if create and (out < 0).any():
            self.index.changed()
            row_of, evicted = self.row_of, False
            for i in np.flatnonzero(out < 0).tolist():   # only the new sequences
                s = int(ids[i])
                r = row_of.get(s)                        # (a batch may name a new id twice)
                if r is None:
                    if len(row_of) >= self.max_sequences:
                        self._evict_lru()
                        evicted = True
                    if not self.free_rows:
                        self._grow_rows()
                    r = row_of[s] = self.free_rows.pop()
                    self.serial[r] = self.next_serial
                    self.next_serial += 1
                out[i] = r
            if evicted:    # rows looked up before the eviction may be gone: look the batch up again
                return self.rows(ids, create=True)
        return out

    def release(self, seq_ids) -> None:
        for s in seq_ids:
            r = self.row_of.pop(int(s), None)
            if r is not None:
                self.index.changed()
                self.tables[r] = -1
                self.held[r] = self.pending[r] = 0
                self.last_token[r] = -1
                self.free_rows.append(r)

    # ------------------------------------------------------------------ block tables
    def preview_tables(self, seq_ids: list[int], base: np.ndarray, counts: np.ndarray,
                       new_blocks: np.ndarray) -> np.ndarray:
        """The batch's [B, max_blocks] tables after the delta, without changing anything (the
        server validates them first). Raises StepPrecondition when a base exceeds what is held."""
        rows = self.rows(seq_ids, create=False)
        held = np.where(rows >= 0, self.held[np.maximum(rows, 0)], 0)
        short = base > held
        if short.any():
            b = int(np.argmax(short))
            raise StepPrecondition(
                f"sequence {seq_ids[b]}: the step assumes this stage holds {int(base[b])} blocks of its table, "
                f"it holds {int(held[b])} (cache restarted or evicted): resend the full table")
        total = base.astype(np.int64) + counts
        width = max(int(total.max()) if total.size else 0, 1)
        keep = min(width, self.tables.shape[1])
        if keep == width and (rows >= 0).all():          # the steady state: one gather
            out = self.tables[rows, :width]
        else:
            out = np.full((len(seq_ids), width), -1, dtype=np.int32)
            known = rows >= 0
            out[known, :keep] = self.tables[rows[known], :keep]
        cut = base < held                                # rows the step shortens (a re-formed table)
        if cut.any():
            out[cut[:, None] & (np.arange(width)[None, :] >= base[:, None])] = -1
        if new_blocks.size:
            seq = np.repeat(np.arange(len(seq_ids)), counts)
            first = np.repeat(np.cumsum(counts) - counts, counts)
            col = np.repeat(base.astype(np.int64), counts) + (np.arange(new_blocks.size) - first)
            out[seq, col] = new_blocks
        return out

    def commit_tables(self, seq_ids: list[int], tables: np.ndarray, base: np.ndarray,
                      counts: np.ndarray) -> None:
        """Store the previewed rows (only the changed part is written)."""
        rows = self.rows(seq_ids, create=True)
        total = (base + counts).astype(np.int32)
        if tables.shape[1] > self.tables.shape[1]:
            extra = max(tables.shape[1], 2 * self.tables.shape[1]) - self.tables.shape[1]
            self.tables = np.concatenate(
                [self.tables, np.full((self.tables.shape[0], extra), -1, dtype=np.int32)], axis=1)
        changed = (counts > 0) | (base < self.held[rows])
        if changed.any():
            r, t = rows[changed], tables[changed]
            self.tables[r, :t.shape[1]] = t
            self.tables[r, t.shape[1]:] = -1
        self.held[rows] = total
        self.touch(rows)

    def touch(self, rows: np.ndarray) -> None:
        self.clock += 1
        self.last_use[rows] = self.clock

    # ------------------------------------------------------------------ sampled tokens
    # A preempted sequence is released and may come back (same id, a new row) while a step of its
    # earlier run is still downstream: that step's token belongs to the old run. Stage 0 therefore
    # holds a Ticket (rows and their serials) for each forwarded step, and a token lands only on a
    # row still in the life it was forwarded in.
    def note_forwarded(self, sampled_seq_ids) -> "Ticket":
        """Stage 0 sent a step that will sample these sequences downstream."""
        rows = self.rows(sampled_seq_ids, create=True)
        with self.cond:
            np.add.at(self.pending, rows, 1)
        return Ticket(rows, self.serial[rows].copy())

    def record_forwarded(self, ticket: "Ticket", tokens: np.ndarray | None) -> None:
        """The tokens of a forwarded step (None: the step failed, so no token is coming), on the rows
        of its ticket that were not released since."""
        with self.cond:
            live = self.serial[ticket.rows] == ticket.serials
            rows = ticket.rows[live]
            self.last_token[rows] = -1 if tokens is None else tokens[live]
            np.subtract.at(self.pending, rows, 1)
            np.maximum(self.pending, 0, out=self.pending)
            self.cond.notify_all()

    def sampled_tokens(self, seq_ids) -> np.ndarray:
        """The last token this (last) stage sampled for each sequence, never waiting: its steps run
        in order, so the step that sampled it has finished. StepPrecondition where there is none."""
        rows = self.rows(seq_ids, create=False)
        with self.cond:
            toks = np.where(rows >= 0, self.last_token[np.maximum(rows, 0)], -1)
        if (toks < 0).any():
            b = int(np.argmax(toks < 0))
            raise StepPrecondition(f"sequence {int(np.asarray(seq_ids)[b])}: its penalty history leaves out a "
                                   f"token this stage has not sampled (new cache epoch or evicted): send it")
        return toks

    def record_sampled(self, sampled_seq_ids, tokens: np.ndarray) -> None:
        """Tokens this stage sampled itself (the last stage: its steps run in order, nothing stale)."""
        rows = self.rows(sampled_seq_ids, create=True)
        with self.cond:
            self.last_token[rows] = tokens
            self.cond.notify_all()

    def resolve_placeholders(self, seq_ids: list[int], timeout_s: float) -> np.ndarray:
        """The last sampled token of each sequence, waiting (bounded) while a step that samples it
        is still downstream."""
        rows = self.rows(seq_ids, create=False)
        if (rows < 0).any():
            b = int(np.argmax(rows < 0))
            raise StepPrecondition(f"sequence {seq_ids[b]}: input -1 refers to a sampled token this stage "
                                   f"never saw (new cache epoch or evicted): send the token itself")
        with self.cond:
            if not self.cond.wait_for(lambda: not self.pending[rows].any(), timeout=timeout_s):
                raise StepPrecondition(f"the tokens of {int((self.pending[rows] > 0).sum())} sequences did "
                                       f"not come back within {timeout_s:.0f}s")
            toks = self.last_token[rows].copy()
        if (toks < 0).any():
            b = int(np.argmax(toks < 0))
            raise StepPrecondition(f"sequence {seq_ids[b]}: no sampled token to use as input -1 "
                                   f"(the step that was to sample it failed)")
        return toks


class Ticket:
    """Rows of a forwarded step's sampled sequences and the life (serial) each row was in."""
    __slots__ = ("rows", "serials")

    def __init__(self, rows: np.ndarray, serials: np.ndarray):
        self.rows, self.serials = rows, serials

    @property
    def size(self) -> int:
        return int(self.rows.size)
