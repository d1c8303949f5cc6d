"""Where a sequence goes, from admission to its end (the Engine's routing half, a mixin).

A new or re-routed sequence goes to a ready chain (the policy is router.py's; a beam group's beams
stay on one chain, since beam.py forks their tables there), or is parked until a chain forms. A
chain that is lost hands its unfinished sequences back here, and they recompute elsewhere from
their tokens, exactly (sampling is a pure function of seed and position). `finish` ends a sequence
exactly once, from whichever thread ends it, and tells its sink. With prefill and decode chains
(worker --role), prompts go to prefill chains and a prefilled request moves to a decode chain
(`route_to_decode`; metadata_service/kv_moves.py).

Threading: `route_lock` guards `chains`, the router and `parked`; sinks are told outside it."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from .block_append import blocks_for_tokens, kv_tokens
from .sequence import SeqEvent, Sequence, SeqStatus
from .step_channel import data_address

if TYPE_CHECKING:
    from .chain import ChainRunner

log = logging.getLogger("metadata_service.engine")


class SequenceRouting:
    """Mixed into Engine: uses its route_lock, chains, router, parked and callbacks."""

    # ------------------------------------------------------------------ admission (any thread)
    def add(self, seq: Sequence) -> None:
        self.prompt_tokens += seq.num_prompt_tokens
        seq.admitted_at = time.monotonic()
        self._route([seq])

    def abort(self, seq: Sequence) -> None:
        if seq.group is not None:             # a request with several choices: all of them
            for member in seq.group.abort():
                self._abort_one(member)
            return
        self._abort_one(seq)

    def fail_parked(self, seq: Sequence, error: str, code: str) -> None:
        """A parked sequence that cannot run (a resumed request its model refuses): it ends with
        an error, not "cancelled"."""
        with self.route_lock:
            if seq in self.parked:
                self.parked.remove(seq)
        self.finish(seq, "error", error=error, code=code)

    def _abort_one(self, seq: Sequence) -> None:
        seq.abort_requested = True
        with self.route_lock:
            if seq in self.parked:
                self.parked.remove(seq)
                parked = True
            else:
                parked = False
            chain = seq.chain
        if parked:
            self.finish(seq, "cancelled")
        elif chain is not None:
            chain.abort(seq)

    # ------------------------------------------------------------------ sinks (any thread)
    def stream_tokens(self, seq: Sequence, tokens: list[int], logprobs: list[float], top=()) -> None:
        seq.sink(seq, SeqEvent(tokens, logprobs, new_top=list(top)))

    def finish(self, seq: Sequence, reason: str, error: str = "", code: str = "UNAVAILABLE") -> None:
        """Exactly once per sequence, from whichever thread ends it."""
        with self.route_lock:
            if seq.finish_reason:
                return
            seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
            chain = seq.chain
            if chain is not None:
                self.router.done(chain.chain_id, seq.route)
        for cb in self.on_sequence_finished:
            cb(seq)
        if seq.sink is not None:
            if seq.tag is None and not seq.params.per_token_events and not error:   # final_only: all at once
                new, lp, top = list(seq.output_token_ids), list(seq.output_logprobs), list(seq.output_top)
            else:
                new = seq.output_token_ids[-1:] if reason in ("stop", "length") and seq.tag is None else []
                lp = seq.output_logprobs[-1:] if new and seq.output_logprobs else []
                top = seq.output_top[-1:] if new and seq.output_top else []
            seq.sink(seq, SeqEvent(new, lp, finished=True, finish_reason=reason, error=error,
                                   error_code=code if error else "", new_top=top))

    # ------------------------------------------------------------------ routing
    def reroute(self, seqs: list[Sequence]) -> None:
        """Sequences that left their chain without finishing: they recompute on another."""
        with self.route_lock:
            for s in seqs:
                if s.chain is not None:
                    self.router.done(s.chain.chain_id, s.route)
                s.chain = s.route = None
        self._route(seqs)

    def decode_chains_for(self, src: ChainRunner, need_blocks: int = 0) -> list[ChainRunner]:
        """Live decode chains a prefill chain's requests can move to: the same layer split (a move
        pairs stages of equal layer ranges), every prefill stage offers its data link, and the
        pool holds `need_blocks` (a request larger than every decode pool decodes where it prefilled,
        rather than wait forever for room that will never exist)."""
        split = [(w.info.layer_start, w.info.layer_end) for w in src.stages]
        decode = [c for c in list(self.chains.values()) if c.alive and c.role == "decode"]
        linked = all(data_address(w) for w in src.stages)
        fit = [c for c in decode if [(w.info.layer_start, w.info.layer_end) for w in c.stages] == split]
        if decode and (not fit or not linked):
            self._warn_unpaired(src, split, decode, linked)
        if not linked:
            return []
        return [c for c in fit if c.manager.pool.num_blocks >= need_blocks]

    def _warn_unpaired(self, src, split, decode, linked: bool) -> None:
        """Once per prefill chain: decode chains are up but its requests cannot move to any, so they
        decode where they prefilled. Said in the log, since nothing else fails."""
        warned = self.__dict__.setdefault("_unpaired_warned", set())
        if src.chain_id in warned:
            return
        warned.add(src.chain_id)
        why = ("a prefill stage offers no data link (worker --data-port -1)" if not linked else
               f"no decode chain has its layer split {split} (theirs: "
               f"{sorted({str([(w.info.layer_start, w.info.layer_end) for w in c.stages]) for c in decode})})")
        log.warning("prefill chain %s: its requests decode where they prefilled: %s", src.chain_id, why)

    def route_to_decode(self, seq: Sequence, src: ChainRunner, need_blocks: int = 0) -> ChainRunner | None:
        """The decode chain a prefilled request moves to (routed like a new request among them: the
        exact router prefers the one that already holds most of its blocks), or None."""
        with self.route_lock:
            chains = self.decode_chains_for(src, need_blocks)
            if not chains:
                return None
            cid, route = self.router.choose([c.chain_id for c in chains], seq.all_token_ids, seq.params.max_new_tokens)
            self.router.done(src.chain_id, seq.route)
            seq.chain, seq.route = self.chains[cid], route
            return seq.chain

    def _route(self, seqs: list[Sequence]) -> None:
        with self.route_lock:
            live = [c for c in self.chains.values() if c.alive]
            # prompts go to chains that prefill (decode chains only get moved-in requests) when any is up
            live = [c for c in live if c.role != "decode"] or live
            never: list[Sequence] = []
            if not live:
                self.parked.extend(s for s in seqs if not s.abort_requested)
                cancelled = [s for s in seqs if s.abort_requested]
            else:
                cancelled = []
                fit, never = self._fitting(seqs, live)
                pools = [(c.manager.pool.num_blocks, c.chain_id) for c in live]
                beam_chain: dict[int, int] = {}   # a beam group's beams stay on one chain (beam.py forks)
                for s, need in fit:
                    g = s.group if s.group is not None and s.group.beam else None
                    if g is not None and id(g) in beam_chain:
                        cid, route = beam_chain[id(g)], None
                    else:    # only a chain whose pool can hold it (an aborted one that fits none: any)
                        ids = [cid for blocks, cid in pools if blocks >= need] or [cid for _, cid in pools]
                        cid, route = self.router.choose(ids, s.all_token_ids, s.params.max_new_tokens)
                        if g is not None:
                            beam_chain[id(g)] = cid
                    s.chain, s.route = self.chains[cid], route
                    s.chain.add(s)
        for s in cancelled:
            self.finish(s, "cancelled")
        for s, need, pool in never:
            self.finish(s, "error", code="RESOURCE_EXHAUSTED",
                        error=f"this request needs {need} blocks of {self.block_size} tokens but the largest pool "
                              f"now holds {pool}: it could never run (the pools shrank since it was admitted)")

    def _fitting(self, seqs: list[Sequence], live: list) -> tuple[list, list]:
        """Admission checked a request against the pools of its time; one restored from the job
        store, or rerouted after its chain was lost, may meet smaller ones, where it would wait
        forever. ([(those that fit, blocks needed)], [(those that never can, blocks needed, largest pool)])"""
        pool = max(c.manager.pool.num_blocks for c in live)
        fit, never = [], []
        for s in seqs:
            need = blocks_for_tokens(kv_tokens(s.num_prompt_tokens, s.params.max_new_tokens), self.block_size)
            if s.params.beam_width and not self.cfg.enable_prefix_caching:   # (as admission: unshared)
                need *= s.params.beam_width
            if need <= pool or s.abort_requested:
                fit.append((s, need))
            else:
                never.append((s, need, pool))
        return fit, never

    def on_chain_lost(self, chain: ChainRunner, seqs: list[Sequence], why: str) -> None:
        """From the chain's thread: its sequences recompute elsewhere; upkeep re-forms chains."""
        with self.route_lock:
            if self.chains.pop(chain.chain_id, None) is not None:
                self.retired.update(chain.counters())     # its counts stay in the service's totals
            self.router.remove_chain(chain.chain_id)
            for s in seqs:
                s.chain = None
                s.handed_off = False              # recomputed on a prefill chain, it may move again
        self._events.put(("lost", chain))
        live = [s for s in seqs if s.status is not SeqStatus.FINISHED]
        for s in live:
            s.status = SeqStatus.WAITING
        self._route(live)
        reason = self._unready_reason()   # at once, not at the next upkeep: Stats must not say "not ready" for no reason
        with self.route_lock:
            self.not_ready_reason = reason
        self._refresh_ready()
        self._wakeup.set()

    def _fail_streams_if_waited_too_long(self) -> None:
        """Interactive streams do not wait forever for a chain; jobs do (they are durable)."""
        if self.ready or time.monotonic() - self.unready_since < self.worker_wait_s:
            return
        with self.route_lock:
            doomed = [s for s in self.parked if s.tag is None]
            for s in doomed:
                self.parked.remove(s)
        msg = f"no worker chain for {self.worker_wait_s:.0f}s: {self.not_ready_reason}"
        for s in doomed:
            self.finish(s, "error", error=msg)
