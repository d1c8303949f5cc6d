"""Stop strings: detect a match in the decoded output and remember where the text must be cut."""
from __future__ import annotations

from minipaged.tokenizer import IncrementalDetokenizer


class StopChecker:
    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.stop = tuple(s for s in stop if s)
        self.detok = IncrementalDetokenizer(tokenizer)
        self.cut: int | None = None  # index in the output text where the first match starts
        self._longest = max((len(s) for s in self.stop), default=0)

    def push(self, token_id: int) -> bool:
        """Feed one generated token; True once a stop string appears."""
        if self.cut is not None:
            return True
        before = len(self.detok.emitted)
        self.detok.push([token_id])
        text = self.detok.emitted
        # only the tail can hold a new match: the new text plus a stop string's length before it
        start = max(0, before - self._longest)
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.cut = min(hits)
            return True
        return False
