"""Beam search scoring, exactly as transformers' `generate(num_beams=K, do_sample=False)` keeps it.

A port of transformers' `_beam_search` (generation/utils.py, 4.5x / 5.x) for one request, kept in
float32 as transformers keeps it (logits cast to float32, log_softmax, running scores in float32):
- each step takes the best M = max(2, 1 + #EOS) * K continuations over every live beam's
  vocabulary (each beam's own top M suffice: the global top M are among them);
- the best K of those that hit no stopping rule (EOS, or the length limit) run on;
- those among the best K that do hit one become finished hypotheses, scored
  cumulative logprob / generated_length ** length_penalty, kept in a heap of the best K;
- the search stops when the heap cannot improve (early_stopping False: the best running beam's
  score at its current length; "never": at the longest length when length_penalty > 0), when
  the heap is full and early_stopping is True, or when every candidate hit a stopping rule.
No sequences or blocks here: metadata_service/beam.py applies the choices to the KV cache."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

NEG = np.float32(-1.0e9)        # transformers' "very large negative" (added in float32)


def parse_early_stopping(value: str) -> bool | str:
    """The wire's string -> transformers' value ("" and "false" -> False)."""
    v = (value or "false").strip().lower()
    if v not in ("false", "true", "never"):
        raise ValueError(f'early_stopping must be "false", "true" or "never", got {value!r}')
    return {"false": False, "true": True, "never": "never"}[v]


def candidates_per_beam(k: int, num_eos: int) -> int:
    """M: how many continuations a step keeps (and the top logprobs each beam needs)."""
    return max(2, 1 + num_eos) * k


@dataclass
class Hypothesis:
    score: np.float32                 # cumulative_logprob / length ** length_penalty
    cumulative_logprob: np.float32
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"


@dataclass
class Pick:
    parent: int                       # index of the live beam it continues
    token: int
    logprob: float
    score: np.float32                 # the new running score


class BeamScorer:
    def __init__(self, k: int, eos_ids, max_new_tokens: int, length_penalty: float = 1.0,
                 early_stopping: bool | str = False):
        self.k, self.eos = k, frozenset(int(t) for t in eos_ids)
        self.max_new, self.lp, self.early = max_new_tokens, float(length_penalty), early_stopping
        self.m = candidates_per_beam(k, len(self.eos))
        self.finished: list[Hypothesis] = []      # best first, at most k
        self.unsatisfied = True                   # the heap may still improve

    def step(self, gen_len: int, scores: np.ndarray, top_ids: np.ndarray, top_lps: np.ndarray,
             history: Callable[[int], tuple[list[int], list[float]]]) -> tuple[list[Pick], bool]:
        """One step. gen_len: tokens each live beam has generated; scores float32 [B] running
        scores; top_ids / top_lps [B, >= M] each beam's best next tokens, best first; history(b):
        beam b's (token ids, logprobs) so far. Returns the K running beams (best first) and done."""
        B, w = top_lps.shape
        acc = (top_lps.astype(np.float32) + scores.astype(np.float32)[:, None]).reshape(-1)
        m = min(self.m, acc.size)
        order = np.argsort(-acc, kind="stable")[:m]
        cand, parent = acc[order], order // w
        tok, lp = top_ids.reshape(-1)[order], top_lps.reshape(-1)[order]
        eos_hit = np.fromiter((int(t) in self.eos for t in tok), dtype=bool, count=m)
        hits = eos_hit | (gen_len + 1 >= self.max_new)
        running = cand + hits.astype(np.float32) * NEG
        keep = np.argsort(-running, kind="stable")[:self.k]
        self._finish(cand, hits, eos_hit, parent, tok, lp, gen_len, history)
        hyp_len = self.max_new if (self.early == "never" and self.lp > 0.0) else gen_len + 1
        best = running[keep[0]] / np.float32(hyp_len ** self.lp)
        worst = self.finished[-1].score if len(self.finished) == self.k else NEG
        self.unsatisfied = self.unsatisfied and bool(best > worst)
        full = len(self.finished) == self.k and self.early is True
        done = not self.unsatisfied or full or bool(hits.all())
        picks = [Pick(int(parent[i]), int(tok[i]), float(lp[i]), running[i]) for i in keep]
        return picks, done

    def _finish(self, cand, hits, eos_hit, parent, tok, lp, gen_len, history) -> None:
        """Candidates among the best K that hit a stopping rule join the heap of the best K."""
        if not self.unsatisfied or (len(self.finished) == self.k and self.early is True):
            return
        norm = cand / np.float32((gen_len + 1) ** self.lp)
        new = []
        for i in range(min(self.k, cand.size)):
            if hits[i]:
                ids, lps = history(int(parent[i]))
                new.append(Hypothesis(norm[i], cand[i], ids + [int(tok[i])], lps + [float(lp[i])],
                                      "stop" if eos_hit[i] else "length"))
        if new:
            merged = self.finished + new
            order = np.argsort(-np.asarray([h.score for h in merged], dtype=np.float32), kind="stable")
            self.finished = [merged[i] for i in order[:self.k]]
