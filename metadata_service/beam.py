"""Beam search with KV sharing: a request's K beams are sequences of one BeamGroup.

The head sequence prefills the prompt like any other; every step, the last stage returns each live
beam's top M logprobs (the existing top-logprobs path, M = (1 + #EOS) * K, see beam_scorer.py) and
the group picks the next K beams once every live beam has reported. A beam chosen once keeps its
sequence and appends the token; a beam chosen again is forked (KVBlockManager.fork: full blocks
shared by ref count, the partial last block copied on write, the copy riding on the next Step); a
beam not chosen is released at once, so its unshared blocks return to the pool that step.

Its next inputs depend on the choice, so a beam never runs ahead with async scheduling (the
scheduler waits for its tokens, as for penalized sequences). A preempted beam recomputes from its
tokens and reports again; a fork whose parent holds no blocks then (preempted) starts as a waiting
sequence and prefills from the prefix cache. Only the chain's thread touches the beams' progress.

The owner (a Generate stream or a job) hears nothing until the end: beams are not streamable.
Then a stream hears each returned hypothesis as one finished choice (best first) and "group"; a
job hears one event and builds its result from `hypotheses`."""
from __future__ import annotations

import threading
import time

import numpy as np

from minipaged.constants import STEP_MAX_TOP_LOGPROBS

from .block_manager import OutOfBlocksError
from .beam_scorer import BeamScorer, Hypothesis, candidates_per_beam
from .sequence import SeqEvent, Sequence, SeqStatus

MAX_BEAM_WIDTH = 16             # K; the worker returns at most 64 alternatives per row
MAX_BEAM_CANDIDATES = STEP_MAX_TOP_LOGPROBS   # a beam step's candidates are one Step's alternatives per row


def beam_eos(params, engine) -> set[int]:
    return set(params.stop_token_ids) | (set() if params.ignore_eos else set(engine.eos_ids))


def beam_candidates(params, engine) -> int:
    return candidates_per_beam(params.beam_width, len(beam_eos(params, engine)))


class BeamGroup:
    beam = True
    forked = True               # the scheduler's n / best_of fork path leaves these sequences alone

    def __init__(self, head: Sequence, engine):
        p = head.params
        self.engine, self.head, self.k = engine, head, p.beam_width
        self.scorer = BeamScorer(p.beam_width, beam_eos(p, engine), p.max_new_tokens, p.length_penalty,
                                 p.early_stopping)
        self.sink, self.tag = head.sink, head.tag
        head.sink = self.on_event
        self.live: list[Sequence] = [head]           # best first
        self.scores = np.zeros(1, dtype=np.float32)  # their running scores
        self.reports: dict[int, tuple] = {}          # seq_id -> (ids, logprobs) for this step
        self.members: list[Sequence] = [head]        # every beam ever (usage, tests)
        self.hypotheses: list[Hypothesis] = []
        self.lock = threading.Lock()
        self.aborted = self.closing = self.requeue = False
        self._choice_seqs: list[Sequence] = []

    def adopt_model(self, engine) -> None:
        """Made before the service knew its model (a job resumed at start): its EOS ids now."""
        p = self.head.params
        self.scorer = BeamScorer(p.beam_width, beam_eos(p, engine), p.max_new_tokens, p.length_penalty,
                                 p.early_stopping)

    # ------------------------------------------------------------------ the chain's thread
    def on_report(self, chain, seq: Sequence, ids: np.ndarray, lps: np.ndarray) -> int:
        """A beam's top-M for its next token. Returns tokens generated (for the chain's figures)."""
        if self.closing or seq not in self.live or seq.num_computed_tokens != seq.num_tokens:
            return 0                                  # dropped, or a stale recompute of an earlier step
        self.reports[seq.seq_id] = (ids[:self.scorer.m], lps[:self.scorer.m])
        if self.aborted:
            self._close(chain, "cancelled")
            return 0
        if len(self.reports) < len(self.live):
            return 0
        return self._select(chain)

    def _select(self, chain) -> int:
        beams = self.live
        ids = np.stack([self.reports[b.seq_id][0] for b in beams])
        lps = np.stack([self.reports[b.seq_id][1] for b in beams])
        self.reports = {}
        gen_len = len(beams[0].output_token_ids)
        picks, done = self.scorer.step(gen_len, self.scores, ids, lps,
                                       lambda i: (list(beams[i].output_token_ids), list(beams[i].output_logprobs)))
        if done:
            self.hypotheses = list(self.scorer.finished)
            self._close(chain, self.hypotheses[0].finish_reason if self.hypotheses else "length")
            return len(picks)
        used = {pk.parent for pk in picks}
        for i, b in enumerate(beams):   # dropped beams first: their blocks may serve the forks' copies
            if i not in used:
                self._retire(chain, b)
        seen: set[int] = set()
        new_live = []
        for pk in picks:                 # forks before appends: a fork copies its parent as it is now
            if pk.parent in seen:
                new_live.append(self._fork(chain, beams[pk.parent]))
            else:
                seen.add(pk.parent)
                new_live.append(beams[pk.parent])
        for b, pk in zip(new_live, picks):
            if not b.output_token_ids:
                b.first_token_at = time.monotonic()
            b.output_token_ids.append(pk.token)
            b.output_logprobs.append(pk.logprob)
            b.num_tokens += 1
        self.live = new_live
        self.scores = np.asarray([pk.score for pk in picks], dtype=np.float32)
        if self.requeue:                 # a fork found no block: the group waits, whole, for room
            self.requeue = False
            chain.scheduler.preempt_beams([b for b in new_live if b.chain is chain])
        return len(picks)

    def _fork(self, chain, p: Sequence) -> Sequence:
        c = Sequence(p.prompt_token_ids, p.params, sink=self.on_event, tag=p.tag)
        c.output_token_ids, c.output_logprobs = list(p.output_token_ids), list(p.output_logprobs)
        c.num_tokens, c.group, c.choice = p.num_tokens, self, 0
        c.chain, c.slot, c.admitted_at, c.first_token_at = chain, p.slot, p.admitted_at, p.first_token_at
        c.num_cached_tokens = p.num_cached_tokens
        sched, mgr = chain.scheduler, chain.manager
        self.members.append(c)
        if p.status is SeqStatus.RUNNING and p.seq_id in mgr.sequences:
            try:
                sched.copies += mgr.fork(p.seq_id, c.seq_id)
                c.num_computed_tokens = p.num_computed_tokens
                sched._admit_running(c, p.slot)
                return c
            except OutOfBlocksError:
                pass                     # no block for the partial copy: recompute it instead
        c.status = SeqStatus.WAITING     # prefills again (its full blocks come from the prefix cache)
        sched.waiting.appendleft(c)
        self.requeue = True              # ... and its group with it (Scheduler.preempt_beams)
        return c

    def _retire(self, chain, b: Sequence) -> None:
        """A dropped beam: its blocks go back now (shared ones lose one reference)."""
        if b.status is not SeqStatus.FINISHED:
            chain.scheduler.remove(b)
        if b is not self.head and not b.finish_reason:
            b.finish_reason = "dropped"
            if b.route is not None:      # routed on its own after a lost chain
                with self.engine.route_lock:
                    self.engine.router.done(chain.chain_id, b.route)
                b.route = None

    def _close(self, chain, reason: str, error: str = "", code: str = "") -> None:
        self.closing = True
        for b in self.live if chain is not None else ():   # (parked beams have no chain: the engine ends them)
            if b.chain is chain:
                self._retire(chain, b)
        self.live = []
        if self.head.finish_reason:      # the head was the beam whose end closes the group
            self._deliver(SeqEvent([], [], finished=True, finish_reason=reason, error=error, error_code=code))
        else:
            self.engine.finish(self.head, reason, error=error, code=code or "UNAVAILABLE")

    # ------------------------------------------------------------------ any thread
    def abort(self) -> list[Sequence]:
        with self.lock:
            self.aborted = True
            return [b for b in self.live if b.status is not SeqStatus.FINISHED]

    def on_event(self, seq: Sequence, ev: SeqEvent) -> None:
        """Beams' own events: only endings (cancelled, failed) matter; the head's ends the group."""
        if not ev.finished:
            return
        if self.closing:
            if seq is self.head:
                self._deliver(ev)
            return
        with self.lock:
            if seq in self.live:
                self.live.remove(seq)
                self.reports.pop(seq.seq_id, None)
            rest = [b for b in self.live if b.status is not SeqStatus.FINISHED]
        if ev.error or not rest:
            self._close(seq.chain, ev.finish_reason, ev.error, ev.error_code)

    def _deliver(self, ev: SeqEvent) -> None:
        if self.sink is None:
            return
        if ev.error or not self.hypotheses:
            if self.tag is None and not ev.error:
                self.sink(self.head, SeqEvent([], [], finished=True, finish_reason="group"))
            else:
                self.sink(self.head, ev)
            return
        if self.tag is not None:         # a job: results.result reads the hypotheses
            self.sink(self.head, SeqEvent([], [], finished=True, finish_reason=self.hypotheses[0].finish_reason))
            return
        show = self.head.params.show_logprobs
        for s, h in zip(self.choice_sequences(), self.hypotheses):
            self.sink(s, SeqEvent(list(h.token_ids), list(h.logprobs) if show else [], finished=True,
                                  finish_reason=h.finish_reason, beam_score=float(h.score),
                                  cumulative_logprob=float(h.cumulative_logprob)))
        self.sink(self.head, SeqEvent([], [], finished=True, finish_reason="group"))

    def choice_sequences(self) -> list[Sequence]:
        """The returned hypotheses as finished sequences (for text, usage and results)."""
        if not self._choice_seqs:
            for i, h in enumerate(self.hypotheses):
                s = Sequence(self.head.prompt_token_ids, self.head.params, output_token_ids=list(h.token_ids),
                             output_logprobs=list(h.logprobs), status=SeqStatus.FINISHED,
                             finish_reason=h.finish_reason)
                s.choice, s.num_cached_tokens = i, self.head.num_cached_tokens
                s.preemptions = sum(m.preemptions for m in self.members) if i == 0 else 0
                self._choice_seqs.append(s)
        return self._choice_seqs


def on_beam_rows(chain, rows: list, top) -> int:
    """From ChainRunner._apply: each (beam, row) of a reply; returns the tokens the beams kept."""
    if top is None:
        raise RuntimeError("a beam search step came back without its top logprobs")
    kept = 0
    for seq, j in rows:
        kept += seq.group.on_report(chain, seq, top[0][j], top[1][j])
    return kept
