"""Running one Step on this stage, whatever transport brought it: check the epoch, validate, apply
what the step changes in the remembered state (released sequences, delta tables, copy-on-write
copies), run the layers, then sample (last stage) or build the next stage's request.

A mixin of WorkerServicer (worker/server.py), which owns the state it reads: `lock`, `epoch`,
`limits`, `store`, `runner`, `busy`, `next_stage`, and the counters `steps_served`, `compute_s`."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import grpc
import numpy as np

from minipaged import wire
from minipaged.v1 import worker_pb2 as pb
from worker import prompt_logprobs
from worker.data_link import payload_bytes
from worker.kv_move import MOVE_TIMEOUT_S, KvMove, parse_move, read_remote_blocks
from worker.validate_cache import tier_moves
from worker.validate_common import StepValidationError as _Invalid
from worker.step_stream import PendingHidden, StepError
from worker.validation import StepPrecondition, StepValidationError, validate_step

log = logging.getLogger("worker.server")
PLACEHOLDER_WAIT_S = 30.0


@dataclass
class StepOutcome:
    reply: pb.StepReply | None           # the last stage's answer
    forward: pb.StepRequest | None       # or what goes to the next stage
    timing: pb.StageTiming
    sampled_ids: np.ndarray              # int64: sequence ids this step samples (stage 0 tracks their tokens)
    ready_at: float = 0.0                # time.monotonic() when the device has the results (see below)
    hidden: bytes | None = None          # the forward's hidden states when they travel outside it


@dataclass
class PendingMove:
    request: pb.StepRequest
    move: KvMove
    epoch: int             # the cache it was checked against: written only if still this one
    after: float           # when the device has run the steps before it (a simulator's ready_at)


class StepExecution:
    def _check_epoch(self, epoch: int) -> None:
        if self.epoch == 0:
            raise StepError(grpc.StatusCode.FAILED_PRECONDITION, "worker cache is not initialised: call InitCache first")
        if epoch != self.epoch:
            raise StepError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"cache_epoch mismatch: request has {epoch}, this worker's cache is epoch {self.epoch} "
                            f"(the cache was re-initialised; its content is gone)")

    def _validated(self, request, hidden: bytes | None):
        """The step's decoded arrays, or StepError: INVALID_ARGUMENT for a bad request or one this
        runner cannot serve, FAILED_PRECONDITION for state this stage does not hold."""
        try:
            a = validate_step(request, self.limits, self.store, PLACEHOLDER_WAIT_S, hidden)
        except StepValidationError as e:
            raise StepError(grpc.StatusCode.INVALID_ARGUMENT, f"step {request.step_id}: {e}") from None
        except StepPrecondition as e:
            raise StepError(grpc.StatusCode.FAILED_PRECONDITION, f"step {request.step_id}: {e}") from None
        if a.prompt_rows is not None and not hasattr(self.runner, "prompt_logprobs"):
            raise StepError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"step {request.step_id}: this worker (simulated) computes no prompt logprobs")
        if a.extras is not None and not getattr(self.runner, "supports_extras", False):
            raise StepError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"step {request.step_id}: this worker's sampler has no penalties / min tokens / "
                            f"top logprobs")
        return a

    def _process(self, request, hidden: bytes | None = None) -> StepOutcome:
        """Validate, then run one step on this stage. Raises StepError; a rejected step leaves the
        cache and the remembered state untouched. `hidden`: the previous stage's hidden states when
        they came outside the message (the TCP data link)."""
        if request.kv_pull_dst_blocks or request.kv_sources:
            return self._process_move(request)
        if isinstance(hidden, PendingHidden):     # a split step: checked while the previous stage computes
            with self.lock:
                self._check_epoch(request.cache_epoch)
                a = self._validated(request, hidden)
            a.hidden_states = hidden.get()        # outside the lock: a stalled upstream blocks no InitCache
            with self.lock:
                self._check_epoch(request.cache_epoch)   # a new cache since: the check is void
                return self._run(request, a)
        with self.lock:
            self._check_epoch(request.cache_epoch)
            return self._run(request, self._validated(request, hidden))

    def _run(self, request, a) -> StepOutcome:
        """A validated step, under the lock."""
        t0 = time.perf_counter()
        self.busy.begin()
        try:
            self.store.release(a.release_ids)
            if a.table_delta is not None:
                self.store.commit_tables(a.seq_ids, a.block_tables, *a.table_delta)
            if a.tier is not None:          # saves, then loads, then copies: the order the plan assumes
                self.runner.kv_cache.tier_moves(*a.tier)
            if a.copy_src is not None and a.copy_src.size:
                self.runner.kv_cache.copy_blocks(a.copy_src, a.copy_dst)
            out, payload = self._compute(request, a)  # the sampled reply, or the next stage's request
        except Exception as e:  # a bug or a device failure: say where, never hang the chain
            self.busy.end()
            log.exception("step %d failed", request.step_id)
            code = (grpc.StatusCode.RESOURCE_EXHAUSTED if "out of memory" in str(e).lower()
                    else grpc.StatusCode.INTERNAL)
            raise StepError(code, f"step {request.step_id} on stage [{self.runner.layer_start}, "
                                  f"{self.runner.layer_end}): {type(e).__name__}: {e}") from None
        # A runner may model an asynchronous device (the simulator does): the call returns at once,
        # the results exist at `ready_at`, and the stage's busy time is the device's.
        device_s = getattr(self.runner, "last_step_s", None)
        self.busy.end(device_s, getattr(self.runner, "ready_at", 0.0))
        timing = pb.StageTiming(layer_start=self.runner.layer_start, layer_end=self.runner.layer_end,
                                compute_ms=1e3 * (device_s if device_s is not None else time.perf_counter() - t0))
        return self._outcome(request, a, out, payload, timing)

    def _process_move(self, request) -> StepOutcome:
        """A prefill -> decode move (worker/kv_move.py), at once (a unary Step)."""
        return self._finish_move(self._start_move(request))

    def _start_move(self, request) -> PendingMove:
        """The part of a move that runs in stream order: check it, then its tier saves (evictions that
        made room for it: saved before anything overwrites those blocks)."""
        with self.lock:
            self._check_epoch(request.cache_epoch)
            try:
                mv = parse_move(request, self.num_blocks, self.runner.layer_start, self.runner.layer_end)
                tier = tier_moves(request, self.limits)
            except (_Invalid, wire.WireError) as e:
                raise StepError(grpc.StatusCode.INVALID_ARGUMENT, f"step {request.step_id}: {e}") from None
            if tier is not None:
                self.runner.kv_cache.tier_moves(*tier)
            return PendingMove(request, mv, self.epoch, getattr(self.runner, "ready_at", 0.0))

    def _finish_move(self, p: PendingMove) -> StepOutcome:
        """Read the source stage's blocks and write them here (the PullQueue's thread, beside the
        steps), then the reply or the next stage's request. A simulated runner times the bytes over
        its K/V link (`pull_ready_at`); the outcome is ready then."""
        request, mv, sid = p.request, p.move, p.request.step_id
        t0 = time.perf_counter()
        try:
            data = read_remote_blocks(mv.address, self.peer_token, mv.epoch, mv.src, MOVE_TIMEOUT_S)
            check = getattr(self.runner.kv_cache, "check_block_bytes", None)
            if check is not None:
                check(mv.dst.size, len(data))       # a source of another layout: nothing written
        except (OSError, ConnectionError, ValueError) as e:
            raise StepError(grpc.StatusCode.UNAVAILABLE,
                            f"step {sid}: K/V move from {mv.address}: {type(e).__name__}: {e}") from None
        with self.lock:
            if self.epoch != p.epoch:               # re-initialised meanwhile: these blocks are not ours
                raise StepError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"step {sid}: the cache was re-initialised during the K/V move")
            self.runner.kv_cache.write_blocks(mv.dst, data)
            self.steps_served += 1
        timed = getattr(self.runner, "pull_ready_at", None)
        ready_at = timed(mv.dst.size, p.after) if timed is not None else 0.0
        seconds = max(0.0, ready_at - time.monotonic()) if timed is not None else time.perf_counter() - t0
        timing = pb.StageTiming(layer_start=self.runner.layer_start, layer_end=self.runner.layer_end,
                                compute_ms=1e3 * seconds)
        none = np.zeros(0, dtype=np.int64)
        if self.runner.is_last:
            reply = pb.StepReply(step_id=sid, cache_epoch=p.epoch)
            reply.timings.extend(request.upstream_timings)
            reply.timings.append(timing)
            return StepOutcome(reply, None, timing, none, ready_at)
        fwd = pb.StepRequest()
        fwd.CopyFrom(request)
        fwd.cache_epoch = self.next_stage.pin_epoch()
        fwd.upstream_timings.append(timing)
        return StepOutcome(None, fwd, timing, none, ready_at, b"" if self.next_stage.data_address else None)

    def _outcome(self, request, a, out, payload, timing: pb.StageTiming) -> StepOutcome:
        """Count the step and stamp what leaves this stage: the reply (last stage) or the forward."""
        ready_at = getattr(self.runner, "ready_at", 0.0)
        self.compute_s += timing.compute_ms / 1e3
        sampled = a.seq_ids[a.do_sample] if a.seq_ids.size else a.seq_ids
        self.steps_served += 1
        if self.runner.is_last:
            out.timings.extend(request.upstream_timings)   # the stages before this one
            out.timings.append(timing)
            out.cache_epoch = self.epoch
            # stage 0 of a one-stage chain fills -1 inputs from these; any last stage the histories
            # of penalized sequences (whose every sampling step carries the penalties)
            penalized = a.extras is not None and a.extras.repetition is not None
            if (self.store is not None and sampled.size and out.sampled_token_ids
                    and (self.runner.is_first or penalized)):
                self.store.record_sampled(sampled, wire.unpack(out.sampled_token_ids))
            return StepOutcome(out, None, timing, sampled, ready_at)
        out.cache_epoch = self.next_stage.pin_epoch()
        out.upstream_timings.append(timing)
        return StepOutcome(None, out, timing, sampled, ready_at, payload)

    def _compute(self, request, a):
        hidden_in = None
        if a.hidden_states is not None:
            hidden_in = self.runner.decode_hidden(a.hidden_states, a.hidden_dtype, a.num_tokens)
        batch = self.runner.make_batch(a.input_ids, a.positions, a.slot_mapping, a.query_start_loc,
                                       a.seq_lens, a.block_tables)
        hidden = self.runner.execute(batch, hidden_in)
        if self.runner.is_last:
            return self._sample(request, a, hidden), None
        return self._forward_request(request, hidden)

    def _forward_request(self, request, hidden) -> tuple[pb.StepRequest, bytes | None]:
        """The next stage's request; the hidden-state bytes go inside it, or beside it (returned)
        when the TCP data link carries them."""
        request.ClearField("hidden_states")  # (already decoded) not copied into the forward
        fwd = pb.StepRequest()
        fwd.CopyFrom(request)
        fwd.ClearField("input_ids")
        payload, fwd.hidden_dtype = self.runner.encode_hidden(hidden)
        if self.next_stage.data_address:
            return fwd, payload
        fwd.hidden_states = payload_bytes(payload)
        return fwd, None

    def _sample(self, request, a, hidden) -> pb.StepReply:
        reply = pb.StepReply(step_id=request.step_id)
        if a.prompt_rows is not None:   # only steps whose requests asked: the others pay nothing
            prompt_logprobs.fill_reply(reply, self.runner, hidden, a.prompt_rows)
        if not a.do_sample.any():
            return reply  # a prefill chunk that ends mid-prompt: nothing to sample
        kw = {"extras": a.extras} if a.extras is not None else {}
        ids, logprobs, logits, *top = self.runner.sample(
            hidden, a.query_start_loc, a.do_sample, a.temperature, a.top_p, a.top_k, a.seeds, a.sample_offsets,
            request.return_logprobs, request.return_logits, **kw)
        reply.sampled_token_ids = wire.pack(ids)
        if request.return_logprobs and logprobs is not None:
            reply.logprobs = wire.pack(logprobs, wire.FLOAT32)
        if request.return_logits and logits is not None:
            reply.logits = wire.pack(np.asarray(logits, dtype=np.float64), wire.FLOAT64)
        if top and top[0] is not None:
            top_ids, top_lp = top[0]
            reply.top_logprob_ids, reply.top_logprobs = wire.pack(top_ids), wire.pack(top_lp, wire.FLOAT32)
        return reply
