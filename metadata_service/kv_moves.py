"""Disaggregated prefill/decode on the metadata plane (docs/architecture.md section 9): a mixin of
ChainRunner, both ends of a move.

A prefill chain (its stages' --role) runs a request's prompt and samples its first token; then it
hands the request over (`_hand_off`): the Engine picks a decode chain (the router, over decode chains
of the same layer split), the prefill chain holds the prompt's full blocks and forgets the sequence.
The decode chain (`_move_in`) finds the blocks it lacks, reserves a fresh block for each, and sends
a Step with no rows at once (or, with --kv-move-part-bytes, several, each reading about that many
bytes: a bound on a worker's read buffer): each of its stages takes it in stream order, then reads
the held blocks from the prefill stage of its own layer range and writes them into the reserved
ones beside its decode steps (worker/kv_move.py), so a long prompt's move stalls no decode. Moves
take no pipeline slot: they are in `moving`, not `inflight`. When every part is back (`_move_done`)
the reserved blocks enter the decode chain's prefix cache under the prompt's hashes, the sequence
joins its queue and is admitted with those blocks as cache hits: only the prompt's partial last
block and the first token are computed there. The prefill chain's blocks are released and stay in
its prefix cache.

A move that fails (a prefill worker died or restarted mid-move) names nothing: the sequence joins
the queue all the same and recomputes its prompt on the decode chain. A move not back within
--step-timeout plus the workers' read timeout fails the decode chain like a late step (its stages
may still write those blocks, so they cannot be given to anyone else in this epoch). Either chain
lost meanwhile hands the sequence back to the Engine like every other one (section 9: a failure
loses only cache)."""
from __future__ import annotations

import logging
import queue
import time
from collections import deque
from dataclasses import dataclass, field

from minipaged.constants import KV_MOVE_TIMEOUT_S
from minipaged.v1 import worker_pb2
from minipaged.wire import pack

from .block_append import blocks_for_tokens, kv_tokens
from .sequence import SeqStatus, Sequence
from .step_channel import data_address
from .step_request import add_tier_moves

log = logging.getLogger("metadata_service.chain")


@dataclass
class Move:
    seq: Sequence
    src: object                                   # the prefill ChainRunner
    src_blocks: list[int]                         # the prompt's full blocks in its pool, held there
    dst_blocks: list[int] = field(default_factory=list)   # fresh blocks reserved here (block_moves.py)
    saved_slots: list[int] = field(default_factory=list)  # tier saves its first part carried
    parts: int = 0                                # Steps of the move still out
    sent_at: float = 0.0                          # time.monotonic() its last part left
    failed: bool = False


class KvMoves:
    """Mixed into ChainRunner: uses its manager, scheduler, lock, engine, channel and counters."""

    def _init_moves(self) -> None:
        self.role = self.stages[0].role
        self.moving: dict[int, Move] = {}         # step id -> the move it carries part of
        self.move_parts: deque = deque()          # (move, src blocks, dst blocks, tier moves | None) to send
        self.moves_in = self.moves_failed = self.moved_blocks = 0
        self.last_move_at = 0.0                   # when the last move's part came back

    # ------------------------------------------------------------------ the prefill end
    def _hand_off(self, seqs) -> None:
        """After a reply on a prefill chain: requests whose first token is in go to a decode chain."""
        for s in seqs:
            if s.handed_off or s.status is not SeqStatus.RUNNING or not s.output_token_ids:
                continue
            s.handed_off = True                    # once: a request that stays here decodes here
            need = blocks_for_tokens(kv_tokens(s.num_prompt_tokens, s.params.max_new_tokens), self.manager.block_size)
            if s.group is not None or s.finish_reason or not self.engine.decode_chains_for(self, need):
                continue
            with self.lock:                        # gone from here before another chain owns it
                full = s.num_prompt_tokens // self.manager.block_size
                blocks = self.manager.sequences[s.seq_id].block_table[:full].tolist()
                self.manager.hold(("out", s.seq_id), blocks)
                self.scheduler.remove(s)
            s.status, s.num_computed_tokens = SeqStatus.WAITING, 0
            dst = self.engine.route_to_decode(s, self, need)
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
            self._moved(mv, ok=False)
            return
        with self.lock:
            todo, mv.dst_blocks = m.reserve_move(("in", s.seq_id), s.prompt_token_ids, len(mv.src_blocks))
            saves, loads = m.take_tier_moves() if todo else ([], [])
        if not todo:                               # this pool had every block already (or no room)
            self._moved(mv, ok=True)
            return
        src = [mv.src_blocks[j] for j in todo]
        part = self.cfg.kv_move_part_bytes
        per = max(1, part // max(1, sum(w.block_bytes(m.block_size) for w in self.stages))) if part else len(src)
        mv.parts = -(-len(src) // per)
        mv.saved_slots = [t for _, t in saves]
        for i in range(0, len(src), per):          # the first part carries the tier moves: it runs first
            self.move_parts.append((mv, src[i:i + per], mv.dst_blocks[i:i + per], (saves, loads) if i == 0 else None))

    def _send_move_part(self) -> None:
        mv, src, dst, tier = self.move_parts.popleft()
        req = worker_pb2.StepRequest(step_id=self.next_step_id, cache_epoch=self.epoch,
                                     kv_pull_src_blocks=pack(src), kv_pull_dst_blocks=pack(dst))
        self.next_step_id += 1
        for w in mv.src.stages:
            req.kv_sources.add(layer_start=w.info.layer_start, layer_end=w.info.layer_end,
                               data_address=data_address(w), cache_epoch=mv.src.epoch)
        add_tier_moves(req, *(tier or ((), ())))
        self.wire_bytes += self.channel.send(req)
        mv.sent_at = time.monotonic()
        self.moving[req.step_id] = mv

    def _check_move_deadline(self) -> None:
        """The oldest move must come back within --step-timeout plus the workers' read timeout,
        counted from its sending or the last move's reply (a stage pulls one move at a time)."""
        if not self.moving:
            return
        step_id, mv = next(iter(self.moving.items()))
        waited = time.monotonic() - max(mv.sent_at, self.last_move_at)
        limit = self.cfg.step_timeout_s + KV_MOVE_TIMEOUT_S
        if waited > limit:
            self.missed_deadline = True
            self._lose(f"K/V move step {step_id} has not come back after {waited:.1f}s (deadline {limit:.1f}s: "
                       f"--step-timeout {self.cfg.step_timeout_s:g}s + the {KV_MOVE_TIMEOUT_S:g}s read timeout)")

    def _move_done(self, step_id: int, reply: worker_pb2.StepReply) -> None:
        mv = self.moving.pop(step_id)
        self.last_move_at = time.monotonic()
        if reply.error_code and not mv.failed:
            mv.failed = True
            log.warning("chain %d: K/V move of sequence %d from chain %d failed (%s): it recomputes here",
                        self.chain_id, mv.seq.seq_id, mv.src.chain_id, reply.error)
        mv.parts -= 1
        if mv.parts == 0:
            self._moved(mv, not mv.failed)

    def _moved(self, mv: Move, ok: bool) -> None:
        """The move is over (or never needed a Step): name what arrived, let go of both holds, and
        queue the sequence (or end it, if it was cancelled meanwhile)."""
        s, m = mv.seq, self.manager
        with self.lock:
            moved = m.finish_move(("in", s.seq_id), ok)
            if ok:
                self.moves_in += 1
                self.moved_blocks += moved
            elif mv.dst_blocks:
                self.moves_failed += 1
                if m.tier is not None and mv.saved_slots:
                    m.tier.forget(mv.saved_slots)      # the Step failed before its saves ran
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
        moves = list({id(mv): mv for mv in [*self.moving.values(), *(p[0] for p in self.move_parts)]}.values())
        added = []                                 # (a move in several parts appears once)
        self.moving.clear()
        self.move_parts.clear()
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
