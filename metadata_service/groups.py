"""n > 1 and best_of: one request, several choices sharing one prefill.

The request's sequence prefills its prompt except the last token; then the scheduler forks it into
`best_of` sequences (KVBlockManager.fork: the full blocks are shared, ref count + 1; the partial last
block is copied on write, the copy riding on the next Step). Each choice then decodes on its own
from the last prompt token, with its own seed (choice 0 keeps the request's; choice i uses a mix of
it and i), so seeded choices are reproducible. With best_of > n, the n choices with the highest
cumulative logprob are returned (not streamable: which ones win is known only at the end).

The group stands between the choices and the request's owner (a Generate stream or a job): streams
hear every choice's tokens tagged with its index; the owner hears the end once all have ended."""
from __future__ import annotations

import threading
from dataclasses import replace

from minipaged.rng import GOLDEN_GAMMA

from .sequence import SeqEvent, Sequence, SeqStatus


_U64, _SIGN = (1 << 64) - 1, 1 << 63


def choice_seed(seed: int, i: int) -> int:
    """Choice i's seed: the request's low 63 bits mixed with i, its sign bit kept, so every int64
    seed has choices of its own (seed and seed + 2^63 do not alias) and a non-negative seed's choices
    are what they always were."""
    if i == 0:
        return seed
    s = seed & _U64
    c = (s & _SIGN) | ((s ^ (GOLDEN_GAMMA * i)) & (_SIGN - 1))
    return c - (1 << 64) if c & _SIGN else c


class SequenceGroup:
    beam = False                              # (metadata_service/beam.py's BeamGroup is True)
    def __init__(self, parent: Sequence, engine):
        self.engine = engine
        self.size, self.n = parent.params.best_of, parent.params.n
        self.members: list[Sequence] = [parent]
        self.sink, self.tag = parent.sink, parent.tag
        parent.sink, parent.choice = self.on_event, 0
        self.forked = False
        self.aborted = False
        self.lock = threading.Lock()
        self.ended: dict[int, SeqEvent] = {}

    @property
    def parent(self) -> Sequence:
        return self.members[0]

    def prefill_target(self) -> int:
        """Tokens the parent computes before the fork: all of the prompt but its last token."""
        return self.parent.num_prompt_tokens - 1

    def fork(self) -> list[Sequence]:
        """The other choices, as copies of the parent at the fork point (the scheduler forks their
        blocks). Empty when the request was cancelled meanwhile."""
        from .requests import prepare
        with self.lock:
            if self.aborted or self.forked:
                return []
            self.forked = True
            p = self.parent
            children = []
            for i in range(1, self.size):
                c = Sequence(p.prompt_token_ids, replace(p.params, seed=choice_seed(p.params.seed, i)),
                             sink=self.on_event, tag=p.tag)
                c.group, c.choice = self, i
                c.num_computed_tokens, c.num_cached_tokens = p.num_computed_tokens, p.num_cached_tokens
                c.chain, c.slot, c.admitted_at = p.chain, p.slot, p.admitted_at
                prepare(c, self.engine)
                children.append(c)
            self.members.extend(children)
            return children

    def abort(self) -> list[Sequence]:
        """Mark the request cancelled; returns the live choices to abort."""
        with self.lock:
            self.aborted = True
            return [m for m in self.members if m.status is not SeqStatus.FINISHED]

    def on_event(self, seq: Sequence, ev: SeqEvent) -> None:
        if not ev.finished:
            if self.sink is not None and self.size == self.n:
                self.sink(seq, ev)            # streamed, tagged by seq.choice
            return
        with self.lock:
            self.ended[seq.choice] = ev
            expected = self.size if self.forked else 1
            done = len(self.ended) >= expected
        if self.size == self.n and self.tag is None and self.sink is not None:
            self.sink(seq, replace(ev, finished=True))          # the stream hears each choice end
        if done and self.sink is not None:
            if self.tag is None:
                self.sink(seq, SeqEvent([], [], finished=True, finish_reason="group", error=ev.error,
                                        error_code=ev.error_code))
            else:
                self.sink(self.parent, self.final_event())

    def chosen(self) -> list[Sequence]:
        """The n choices returned: all of them, or the best n by cumulative logprob."""
        members = [m for m in self.members if m.choice in self.ended]
        if self.size > self.n:
            members = sorted(members, key=lambda m: -sum(m.output_logprobs))[:self.n]
        return members[:self.n]

    def final_event(self) -> SeqEvent:
        first_error = next((e for e in self.ended.values() if e.error), None)
        ev = self.ended.get(0) or next(iter(self.ended.values()))
        if first_error is not None:
            return replace(first_error, new_token_ids=[], new_logprobs=[])
        return replace(ev, new_token_ids=[], new_logprobs=[])
