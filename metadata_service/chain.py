"""ChainRunner: one replica chain (stages covering every layer) and the thread that drives it.

A chain owns its KVBlockManager (block ids are chain-local) and its Scheduler, and talks to its
stage 0 over one StepStream. Its thread keeps up to `depth` Steps in flight: with N stages, N + 1
micro-batches (disjoint sets of sequences), so every stage has work while the host applies one
micro-batch's tokens and schedules its next step; with one stage, two steps, the second scheduled
from the first's sampled tokens before they are known (async scheduling, input id -1). Replies are
applied as they come: tokens appended, stop rules checked, sinks told.

Threading: only this thread touches the Scheduler and its Sequences' progress. Other threads post
to `events` (add, abort) and read `stats()` / `snapshot()` under `self.lock`. When a step fails
because the chain's state is gone (a worker died, restarted or hung), the chain stops and hands every
unfinished sequence back to the Engine, which recomputes them on another chain.

Its settings and micro-batch count are chain_config.py's (ChainConfig and default_micro_batches are
importable from here too); its figures (`stats()`, `snapshot()`, the invariants check) chain_stats.py's."""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import grpc
import numpy as np

from minipaged.v1 import worker_pb2
from minipaged.wire import INT32, unpack

from . import prompt_logprobs
from .apply import apply_plain, apply_reply
from .block_manager import KVBlockManager
from .chain_config import ChainConfig, InflightStep, default_micro_batches
from .chain_stats import ChainStats
from .kv_moves import KvMoves
from .scheduler import ScheduledBatch, Scheduler
from .sequence import SeqStatus, Sequence
from .step_channel import SocketResultsChannel, open_channels
from .step_request import build_step_request

log = logging.getLogger("metadata_service.chain")

# Step failures that say something about this batch, not about the chain's state: recomputing
# would only repeat them, so the batch's requests fail and the chain goes on.
BATCH_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                grpc.StatusCode.RESOURCE_EXHAUSTED}


class ChainRunner(ChainStats, KvMoves):
    def __init__(self, chain_id: int, stages: list, num_blocks: int, epoch: int, cfg: ChainConfig, engine,
                 group: str = ""):
        self.chain_id, self.stages, self.epoch, self.cfg, self.engine = chain_id, stages, epoch, cfg, engine
        self.group = group
        n = len(stages)
        host_compute = all(w.info.device == "cpu" and not w.info.simulate for w in stages)
        self.micro_batches = cfg.micro_batches or default_micro_batches(n, host_compute)
        # One protocol for every chain: steps go down the StepStream to stage 0 and on; the last
        # stage answers on StepResults. Async scheduling sends a micro-batch's next step before its
        # tokens are back (inputs -1): stage 0 embeds them once the last stage has sent it their
        # tokens (the SampledTokens stream), so no micro-batch waits for the service's round trip
        # (with N + 1 micro-batches too: 4 simulated stages 3.01 / 3.05x -> 3.07 / 3.09x).
        overlap = cfg.async_scheduling
        self.slot_cap = 2 if overlap else 1            # steps in flight per micro-batch
        self.depth = self.micro_batches * self.slot_cap
        self.tokens_to_first = overlap and n > 1       # one stage samples and embeds: it knows them
        self.manager = KVBlockManager(num_blocks, cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.manager, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                                   self.micro_batches, overlap, cfg.full_block_tables)
        self.lock = threading.RLock()
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.inflight: dict[int, InflightStep] = {}
        self.slot_inflight = [0] * self.micro_batches
        self.order: deque[int] = deque()       # slots in the order their turn comes
        self.order.extend(range(self.micro_batches))
        self.next_step_id = 1
        self.alive = True
        self.lost_reason = ""
        self.missed_deadline = False           # lost because a step did not come back in time
        self.last_reply_at = time.monotonic()
        self.slowest_s_per_token = 0.0         # the deadline's variable part, from this chain's replies
        self._thread = threading.Thread(target=self._run, name=f"chain-{chain_id}", daemon=True)
        # figures for Stats
        self.started = time.monotonic()
        self.steps = self.generated_tokens = 0
        self.metadata_s = 0.0
        self.stage_busy_ms = [0.0] * n
        self.wire_bytes = 0
        # invariants_ok is O(pool) in Python: checked by this thread when the chain goes idle, never
        # on the step path nor under Stats (the gateway polls Stats for /health and /metrics)
        self.invariants_checked = True
        self._invariants_dirty = False
        self._init_moves()                     # role, and prefill -> decode moves (kv_moves.py)

    @property
    def label(self) -> str:
        return " -> ".join(w.address for w in self.stages)

    # ------------------------------------------------------------------ any thread
    def start(self) -> "ChainRunner":
        self._thread.start()
        return self

    def add(self, seq: Sequence) -> None:
        self.events.put(("add", seq))

    def abort(self, seq: Sequence) -> None:
        self.events.put(("abort", seq))

    def release(self, count: int) -> None:
        """Hand up to `count` never-started waiting sequences back to be routed again (a chain joined)."""
        self.events.put(("release", count))

    def stop(self, why: str) -> None:
        """Lost from outside (a stage's lease ran out): end the stream, hand the sequences back."""
        self.events.put(("lost", why))

    def join(self, timeout: float = 5.0) -> None:
        self._thread.join(timeout)

    def load(self) -> int:
        """Sequences on this chain (the router's balance term; read without the lock: a hint)."""
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        self.channel = self.results = None
        try:
            self.channel, self.results = open_channels(self.stages, self.engine.registry.channel_factory,
                                                       self.epoch, self.cfg.worker_token, self.events)
            log.info("chain %d: steps and results on %s", self.chain_id,
                     "the data link" if isinstance(self.results, SocketResultsChannel) else "gRPC")
            while self.alive:
                self._fill_pipeline()
                self._check_deadline()
                if self._invariants_dirty and not self.inflight:
                    self._check_invariants()
                try:
                    kind, item = self.events.get(timeout=0.5 if self.inflight else 0.05)
                except queue.Empty:
                    continue
                self._handle(kind, item)
                while self.alive:                      # everything that is already there, at once
                    try:
                        kind, item = self.events.get_nowait()
                    except queue.Empty:
                        break
                    self._handle(kind, item)
        except Exception as e:  # never die silently: the sequences must go somewhere
            log.exception("chain %d failed", self.chain_id)
            self._lose(f"internal error: {type(e).__name__}: {e}")
        finally:
            for c in (self.channel, self.results):
                if c is not None:
                    c.cancel()

    def _handle(self, kind: str, item) -> None:
        if kind == "reply":
            self._on_reply(item)
        elif kind == "add":
            if item.abort_requested:
                self.engine.finish(item, "cancelled")
            elif prompt_logprobs.trivial(item):       # a one-token prompt, max_new_tokens 0
                self.engine.finish(item, "length")
            else:
                with self.lock:
                    self.scheduler.add(item)
        elif kind == "abort":
            if item.status is not SeqStatus.FINISHED and item.chain is self:
                with self.lock:
                    self.scheduler.remove(item)
                self.engine.finish(item, "cancelled")
        elif kind == "release":
            with self.lock:
                seqs = self.scheduler.release_waiting(item)
            if seqs:
                self.engine.reroute(seqs)
        elif kind == "move_in":
            self._move_in(item)
        elif kind == "unhold":
            self._unhold(item)
        elif kind == "broken":
            self._lose(item)
        elif kind == "lost":
            self._lose(item)

    def step_deadline_s(self, step: InflightStep) -> float:
        """--step-timeout, plus 4x what this chain's slowest step per token so far predicts for
        this step's tokens: a legitimate long prefill chunk on a slow device never trips it."""
        return self.cfg.step_timeout_s + 4.0 * step.batch.num_tokens * self.slowest_s_per_token

    def _check_deadline(self) -> None:
        """The oldest step in flight must come back within its deadline, counted from when it was
        sent or from the last reply, whichever is later (steps ahead of it in the pipe are not its
        delay). A late step fails the chain exactly as a lost lease does: heartbeats say the
        processes live, the deadline says their devices still work."""
        if self.cfg.step_timeout_s <= 0:
            return
        self._check_move_deadline()
        if not self.inflight or not self.alive:
            return
        head = next(iter(self.inflight.values()))
        waited = time.monotonic() - max(head.sent_at, self.last_reply_at)
        limit = self.step_deadline_s(head)
        if waited > limit:
            self.missed_deadline = True
            self._lose(f"step {head.step_id} has not come back after {waited:.1f}s (deadline {limit:.1f}s: "
                       f"--step-timeout {self.cfg.step_timeout_s:g}s + 4x the predicted time): a stage's "
                       f"device is hung or far slower than before")

    def _fill_pipeline(self) -> None:
        """Send steps while the pipeline has room and some micro-batch has work."""
        while self.alive and self.move_parts:
            self._send_move_part()                     # K/V moves run beside the steps: no slot needed
        tried = 0
        while self.alive and len(self.inflight) < self.depth and tried < self.micro_batches:
            slot = self.order[0]
            self.order.rotate(-1)
            tried += 1
            if self.slot_inflight[slot] >= self.slot_cap:
                continue
            t0 = time.perf_counter()
            with self.lock:
                batch = self.scheduler.schedule(slot) if self.scheduler.has_work() else None
                if batch is None:
                    continue
                release, self.scheduler.released = self.scheduler.released, []
            req = self._step_request(batch, release)
            self.wire_bytes += self.channel.send(req)
            self.inflight[req.step_id] = InflightStep(batch, req.step_id, time.monotonic())
            self.slot_inflight[slot] += 1
            self.metadata_s += time.perf_counter() - t0
            tried = 0

    def _step_request(self, b: ScheduledBatch, release: list[int]) -> worker_pb2.StepRequest:
        step_id, self.next_step_id = self.next_step_id, self.next_step_id + 1
        vocab = self.stages[-1].info.vocab_size if b.special else 0    # grammar bitmasks only
        return build_step_request(b, release, step_id, self.epoch, self.tokens_to_first, vocab)

    # ------------------------------------------------------------------ replies
    def _on_reply(self, reply: worker_pb2.StepReply) -> None:
        if reply.step_id in self.moving:               # a prefill -> decode K/V move (kv_moves.py)
            self._move_done(reply.step_id, reply)
            return
        step = self.inflight.pop(reply.step_id, None)
        if step is None:
            if reply.error_code and reply.step_id == 0:   # a stage lost the steps it had sent on
                self._lose(f"the chain broke: {reply.error}")
            return  # an acknowledgement, or a step of an earlier epoch
        t0 = time.perf_counter()
        self.last_reply_at = time.monotonic()
        b = step.batch
        self.slot_inflight[b.slot] -= 1
        if reply.error_code:
            code = _CODES.get(reply.error_code, grpc.StatusCode.UNKNOWN)
            with self.lock:
                self.scheduler.step_done(b)
            if code in BATCH_ERRORS:
                self._fail_batch(b, f"worker rejected the step: {code.name}: {reply.error}", code.name)
            else:
                self._lose(f"step failed: {code.name}: {reply.error}")
            return
        step_ms = 0.0
        for i, t in enumerate(reply.timings[:len(self.stage_busy_ms)]):
            self.stage_busy_ms[i] += t.compute_ms
            step_ms += t.compute_ms
        if b.num_tokens:
            self.slowest_s_per_token = max(self.slowest_s_per_token, step_ms / 1e3 / b.num_tokens)
        done = ()
        with self.engine.finish_batch():               # the step's finished results: one store write
            with self.lock:
                if b.plain and not reply.logprobs and not reply.top_logprob_ids:
                    self._apply_plain(b, unpack(reply.sampled_token_ids, INT32, count=len(b.seqs)))
                else:
                    self.scheduler.step_done(b)
                    done = prompt_logprobs.apply(b, reply) if b.prompt_rows is not None else ()
                    for seq in done:              # max_new_tokens 0: ended before any token is applied
                        self.scheduler.remove(seq)
                    self._apply(b, reply)
            self._invariants_dirty = True
            for seq in done:
                self.engine.finish(seq, "length")
        if self.role == "prefill":
            self._hand_off(b.seqs)
        self.steps += 1
        self.metadata_s += time.perf_counter() - t0

    def _apply(self, b: ScheduledBatch, reply: worker_pb2.StepReply) -> None:
        apply_reply(self, b, reply)

    def _apply_plain(self, b: ScheduledBatch, tokens: np.ndarray) -> None:
        apply_plain(self, b, tokens)

    def _fail_batch(self, b: ScheduledBatch, error: str, code: str) -> None:
        log.error("chain %d: %s; failing %d sequences", self.chain_id, error, len(b.seqs))
        victims = [s for s, g in zip(b.seqs, b.gens) if s.gen == g and s.status is not SeqStatus.FINISHED]
        with self.lock:
            for seq in victims:
                self.scheduler.remove(seq)
            # the step may have written part of its K/V: no prefix hit may read those blocks
            self.manager.reset_prefix_cache()
        for seq in victims:
            self.engine.finish(seq, "error", error=error, code="INTERNAL")

    def _lose(self, why: str) -> None:
        """The chain's K/V are gone or unreachable: stop, and hand every sequence back."""
        if not self.alive:
            return
        self.alive = False
        self.lost_reason = why
        log.warning("chain %d (%s) lost: %s", self.chain_id, self.label, why)
        for c in (getattr(self, "channel", None), getattr(self, "results", None)):
            if c is not None:
                c.cancel()
        with self.lock:
            seqs = self.scheduler.drain() + self._moving_seqs()
            self.inflight.clear()
        self.engine.on_chain_lost(self, seqs, why)


_CODES = {c.value[0]: c for c in grpc.StatusCode}
