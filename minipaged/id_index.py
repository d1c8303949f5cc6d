"""IdIndex: a batch lookup over a {sequence id: row} dict with no per-id Python.

The metadata service's KVBlockManager and a worker's SequenceStore both keep a row per sequence
id. A step names a few hundred ids; looking each up in the dict is a Python loop per step. The
index keeps the dict's items as two sorted arrays, rebuilt only after the dict changed (a sequence
came or went), so a step's lookup is one searchsorted over the batch."""
from __future__ import annotations

import numpy as np


class IdIndex:
    def __init__(self, row_of: dict[int, int]):
        self.row_of = row_of                       # the owner's dict (the truth; this is a cache)
        self._ids = np.zeros(0, dtype=np.int64)
        self._rows = np.zeros(0, dtype=np.int64)
        self._stale = True

    def changed(self) -> None:
        """Call after adding or removing an entry of the dict."""
        self._stale = True

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """int64 rows of int64 ids, -1 where the id is unknown."""
        if self._stale:
            n = len(self.row_of)
            keys = np.fromiter(self.row_of.keys(), dtype=np.int64, count=n)
            vals = np.fromiter(self.row_of.values(), dtype=np.int64, count=n)
            order = np.argsort(keys)
            self._ids, self._rows, self._stale = keys[order], vals[order], False
        if not self._ids.size:
            return np.full(ids.size, -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(self._ids, ids), self._ids.size - 1)
        return np.where(self._ids[pos] == ids, self._rows[pos], -1)


def has_duplicates(ids: np.ndarray) -> bool:
    ordered = np.sort(ids)
    return bool((ordered[1:] == ordered[:-1]).any())
