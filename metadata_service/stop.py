"""Stop strings: detect a match in the decoded output and remember where the text must be cut."""
from __future__ import annotations

from minipaged.tokenizer import IncrementalDetokenizer


class StopChecker:
    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.stop = tuple(stop)   # never empty: refused at the door (requests.py)
        self.detok = IncrementalDetokenizer(tokenizer)
        self.cut: int | None = None  # index in the output text where the first match starts
        self.end: int | None = None  # and where it ends (include_stop_str_in_output keeps it)
        self.matched: str | None = None  # which stop string (vLLM's stop_reason)

    def push(self, token_id: int, check: bool = True) -> bool:
        """Feed one generated token; True once a stop string appears. check=False: the text grows,
        no match is looked for (vLLM's min_tokens: no stop string before that many tokens)."""
        if self.cut is not None:
            return True
        before = len(self.detok.emitted)
        self.detok.push([token_id])
        if not check:
            return False
        text = self.detok.emitted
        # a new match ends in the new text (vLLM's window): it starts at most len(s) - 1 before it
        hits = [(i, i + len(s), s) for s in self.stop if (i := text.find(s, max(0, before - len(s) + 1))) >= 0]
        if hits:
            self.cut, self.end, self.matched = min(hits)
            return True
        return False
