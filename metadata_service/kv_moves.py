"""Disaggregated prefill/decode on the metadata plane (docs/architecture.md section 9): a mixin of
ChainRunner, both ends of a move.

A prefill chain (its stages' --role) runs a request's prompt and samples its first token; then it
hands the request over (`_hand_off`): the Engine picks a decode chain (the router, over decode chains
of the same layer split), the prefill chain holds the prompt's full blocks and forgets the sequence.
The decode chain (`_move_in`) names the blocks it lacks, reserves a fresh block for each, and sends
a Step with no rows: each of its stages reads the held blocks from the prefill stage of its own layer
range and writes them into the reserved ones (worker/kv_move.py). When that Step comes back
(`_move_done`) the reserved blocks enter the decode chain's prefix cache under the prompt's hashes,
the sequence joins its queue and is admitted with those blocks as cache hits: only the prompt's
partial last block and the first token are computed there. The prefill chain's blocks are released
and stay in its prefix cache.

A move that fails (a prefill worker died or restarted mid-move) names nothing: the sequence joins
the queue all the same and recomputes its prompt on the decode chain. Either chain lost meanwhile
hands the sequence back to the Engine like every other one (section 9: a failure loses only cache)."""
from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field

from minipaged.v1 import worker_pb2
from minipaged.wire import pack

from .chain_config import InflightStep
from .sequence import SeqStatus, Sequence
from .step_channel import data_address

log = logging.getLogger("metadata_service.chain")


@dataclass
class Move:
    seq: Sequence
    src: object                                   # the prefill ChainRunner
    src_blocks: list[int]                         # the prompt's full blocks in its pool, held there
    dst_blocks: list[int] = field(default_factory=list)   # reserved here, in pairs with src_blocks[first:]
    keys: list = field(default_factory=list)      # (parent hash, tokens) of each reserved block
    saved_slots: list[int] = field(default_factory=list)  # tier saves the move Step carried


class KvMoves:
    """Mixed into ChainRunner: uses its manager, scheduler, lock, engine, channel and counters."""

    def _init_moves(self) -> None:
        self.role = self.stages[0].role
        self.moving: dict[int, Move] = {}         # step id -> the move it carries
        self.moves_in = self.moves_failed = self.moved_blocks = 0

    # ------------------------------------------------------------------ the prefill end
    def _hand_off(self, seqs) -> None:
        """After a reply on a prefill chain: requests whose first token is in go to a decode chain."""
        for s in seqs:
            if s.handed_off or s.status is not SeqStatus.RUNNING or not s.output_token_ids:
                continue
            s.handed_off = True                    # once: a request that stays here decodes here
            if s.group is not None or s.finish_reason or not self.engine.decode_chains_for(self):
                continue
            with self.lock:                        # gone from here before another chain owns it
                full = s.num_prompt_tokens // self.manager.block_size
                blocks = self.manager.sequences[s.seq_id].block_table[:full].tolist()
                self.manager.hold(("out", s.seq_id), blocks)
                self.scheduler.remove(s)
            s.status, s.num_computed_tokens, s.kv_moved_tokens = SeqStatus.WAITING, 0, 0
            dst = self.engine.route_to_decode(s, self)
            if dst is None:                        # the decode chains left meanwhile: recompute
                self._unhold(s.seq_id)
                self.engine.reroute([s])
            else:
                dst.events.put(("move_in", Move(s, self, blocks)))

    def _unhold(self, seq_id: int) -> None:
        with self.lock:
            self.manager.unhold(("out", seq_id))
        self._invariants_dirty = True

    # ------------------------------------------------------------------ the decode end
    def _move_in(self, mv: Move) -> None:
        """Reserve blocks for the prompt blocks this pool lacks and send the Step that fills them."""
        s, m = mv.seq, self.manager
        if s.abort_requested or s.finish_reason:
            m.hold(("in", s.seq_id), ())
            self._moved(mv, ok=False)
            return
        B, cache = m.block_size, m.pool.cache
        hits, pairs, parent = [], [], None
        with self.lock:
            for j, src in enumerate(mv.src_blocks):
                key = (parent, tuple(s.prompt_token_ids[j * B:(j + 1) * B]))
                parent = cache.hash_fn(*key)
                b = cache.block_of.get(parent)
                if b is not None and cache.key_of[b] == key:
                    hits.append(b)                 # held, so reserving the others cannot evict it
                    m.pool.touch([b])
                elif m.pool.num_free:
                    mv.dst_blocks.append(m.pool.allocate_one())   # an eviction's tier save rides along
                    mv.keys.append(key)
                    pairs.append(src)
                else:
                    break                          # no room: the rest of the prompt recomputes
            m.hold(("in", s.seq_id), (), fresh=hits + mv.dst_blocks)
            saves, loads = m.take_tier_moves() if pairs else ([], [])
        if not pairs:                              # this pool had every block already
            self._moved(mv, ok=True)
            return
        req = worker_pb2.StepRequest(step_id=self.next_step_id, cache_epoch=self.epoch,
                                     kv_pull_src_blocks=pack(pairs), kv_pull_dst_blocks=pack(mv.dst_blocks))
        self.next_step_id += 1
        for w in mv.src.stages:
            req.kv_sources.add(layer_start=w.info.layer_start, layer_end=w.info.layer_end,
                               data_address=data_address(w), cache_epoch=mv.src.epoch)
        if saves:
            req.tier_save_blocks, req.tier_save_slots = pack([b for b, _ in saves]), pack([t for _, t in saves])
            mv.saved_slots = [t for _, t in saves]
        if loads:   # (none: loads are taken with the batch that admits their sequence)
            req.tier_load_slots, req.tier_load_blocks = pack([t for t, _ in loads]), pack([b for _, b in loads])
        self.wire_bytes += self.channel.send(req)
        self.inflight[req.step_id] = InflightStep(None, req.step_id, time.monotonic())
        self.moving[req.step_id] = mv

    def _move_done(self, step_id: int, reply: worker_pb2.StepReply) -> None:
        mv = self.moving.pop(step_id)
        ok = not reply.error_code
        if not ok:
            log.warning("chain %d: K/V move of sequence %d from chain %d failed (%s): it recomputes here",
                        self.chain_id, mv.seq.seq_id, mv.src.chain_id, reply.error)
        self._moved(mv, ok)

    def _moved(self, mv: Move, ok: bool) -> None:
        """The move is over (or never needed a Step): name what arrived, let go of both holds, and
        queue the sequence (or end it, if it was cancelled meanwhile)."""
        s, m = mv.seq, self.manager
        with self.lock:
            if ok:
                for d, (parent, toks) in zip(mv.dst_blocks, mv.keys):
                    m.pool.cache.register(d, parent, toks)
                self.moves_in += 1
                self.moved_blocks += len(mv.dst_blocks)
                s.kv_moved_tokens = len(mv.dst_blocks) * m.block_size
            elif mv.dst_blocks:
                self.moves_failed += 1
                if m.tier is not None and mv.saved_slots:
                    m.tier.forget(mv.saved_slots)      # the Step failed before its saves ran
            m.unhold(("in", s.seq_id))
            self._invariants_dirty = True
            live = not (s.abort_requested or s.finish_reason)
            if live:
                self.scheduler.waiting.appendleft(s)   # its first token is out: it goes first
        mv.src.events.put(("unhold", s.seq_id))
        if not live:
            self.engine.finish(s, "cancelled")

    def _moving_seqs(self) -> list[Sequence]:
        """A lost chain's sequences in the middle of a move, or still queued for it (moves and adds
        not handled yet): they recompute elsewhere, and their prefill chains let go of the blocks."""
        moves, added = list(self.moving.values()), []
        self.moving.clear()
        while True:
            try:
                kind, item = self.events.get_nowait()
            except queue.Empty:
                break
            if kind == "move_in":
                moves.append(item)
            elif kind == "add":
                added.append(item)
        for mv in moves:
            mv.src.events.put(("unhold", mv.seq.seq_id))
        return [mv.seq for mv in moves if not mv.seq.finish_reason] + added
