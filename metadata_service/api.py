"""MetadataService: the gRPC face of the metadata plane.

Generation and jobs go to the Engine and JobManager (the job RPCs are in job_api.py); the block API
goes to BlockApi over a pool of its own (block ids are chain-local, so it cannot share a replica's);
workers register here. Every handler validates before it changes anything."""
from __future__ import annotations

import logging
import queue
import threading
import time

import grpc
import numpy as np

from minipaged.constants import WAITING_KEY
from minipaged.tokenizer import IncrementalDetokenizer
from minipaged.v1 import metadata_pb2, metadata_pb2_grpc
from minipaged.wire import FLOAT32, INT32, pack

from . import prompt_logprobs
from .block_api import BlockApi
from .block_manager import KVBlockManager
from .job_api import JobRpcs
from .jobs import JobManager
from .requests import RequestError, normalize, to_sequence
from .results import final_text, set_stop_reason, usage
from .workers import WorkerRejected

log = logging.getLogger("metadata_service.api")

class MetadataServicer(JobRpcs, metadata_pb2_grpc.MetadataServiceServicer):
    def __init__(self, engine, jobs: JobManager, max_waiting: int = 4096, block_api_enabled: bool = True):
        self.engine = engine
        self.jobs = jobs
        self.max_waiting = max_waiting
        self.block_api_enabled = block_api_enabled
        self.block_api = BlockApi(engine.default_manager, threading.Lock())
        engine.on_chain_started.append(self._size_block_api_pool)
        self._pending = 0                 # admitted, unfinished requests (for --max-waiting)
        self._pending_lock = threading.Lock()
        self._waiting_logged = False      # "a request is waiting for a worker" logged once
        self.open_streams: set = set()    # the event queues of Generate calls still answering

    def _size_block_api_pool(self, chain) -> None:
        """The block API's pool takes the size of a chain's while it holds nothing (so a client of the
        seed's API sees the capacity the workers really have)."""
        with self.block_api.lock:
            m = self.block_api.manager
            if not m.sequences and m.num_physical_blocks != chain.manager.num_physical_blocks:
                self.engine.retired.update(prefix_cache_queries=m.prefix_cache_queries,   # counters go on
                                           prefix_cache_hits=m.prefix_cache_hits)
                self.block_api.manager = self.engine.default_manager = KVBlockManager(
                    chain.manager.num_physical_blocks, m.block_size, enable_prefix_caching=m.enable_prefix_caching)
                self.block_api._dirty = True

    # ------------------------------------------------------------------ admission
    def _admit(self, reqs, context) -> list:
        if not self.engine.model_known.is_set():
            # Before the first chain the model (tokenizer, limits) is unknown: wait for it up to the
            # call's deadline (gRPC wait_for_ready semantics), at most --worker-wait seconds.
            left = context.time_remaining()
            wait = self.engine.worker_wait_s if left is None else min(left - 0.2, self.engine.worker_wait_s)
            self._say_waiting(context, max(0.0, wait))
            self._wait_for_model(context, max(0.0, wait))
        normed = []
        for i, r in enumerate(reqs):
            try:
                normed.append(normalize(r, self.engine))
            except RequestError as e:    # in a job, which request (the sharded front shifts the index)
                context.abort(e.code, f"request {i}: {e.message}" if len(reqs) > 1 else e.message)
        if len(normed) > self.max_waiting:   # no retry could admit it: say so, not "queue full"
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{len(normed)} requests in one call; the service admits at most {self.max_waiting} "
                          f"at a time (--max-waiting): submit them in parts")
        with self._pending_lock:
            if self._pending + len(normed) > self.max_waiting:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"queue full: {self._pending} requests pending, limit {self.max_waiting} "
                              f"(--max-waiting); retry after a short backoff")
            self._pending += len(normed)
        return normed

    def _wait_for_model(self, context, wait: float) -> None:
        """Park until the first chain names the model; a caller that goes away meanwhile (Ctrl-C, a
        cancelled task) ends the wait, so its request never runs once a worker comes."""
        end = time.monotonic() + wait
        while (not self.engine.model_known.wait(max(0.0, min(0.5, end - time.monotonic())))
               and context.is_active() and time.monotonic() < end):
            pass
        if not context.is_active():
            context.abort(grpc.StatusCode.CANCELLED, "the caller went away while waiting for a worker")
        if not self.engine.model_known.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"no worker chain is ready ({self.engine.not_ready_reason}); waited {wait:.1f}s")

    def _say_waiting(self, context, wait: float) -> None:
        """A call parked until the first worker registers is told so at once (initial metadata
        `minipaged-waiting`, which the SDK prints), and the service logs it once per wait."""
        note = f"waiting for a worker to register (up to {wait:.0f}s): {self.engine.not_ready_reason}"
        try:
            context.send_initial_metadata(((WAITING_KEY, note.encode("ascii", "replace").decode()),))
        except ValueError:  # metadata already sent
            pass
        with self._pending_lock:
            first, self._waiting_logged = not self._waiting_logged, True
        if first:
            log.info("a request is %s", note)

    def _done(self, n: int = 1) -> None:
        with self._pending_lock:
            self._pending -= n

    # ------------------------------------------------------------------ generation
    def Generate(self, request, context):
        # best_of > n: which choices win is known only at the end, so the stream is quiet until then
        # and carries the n winners whole (the SDK's stream() and the gateway refuse to "stream" it).
        req = self._admit([request], context)[0]
        events: queue.SimpleQueue = queue.SimpleQueue()
        seq = to_sequence(req, self.engine, sink=lambda s, ev: events.put((s, ev)))
        # a group's head may have ended (a beam not chosen) while its request goes on: abort the group
        if not context.add_callback(lambda: (seq.group is not None or seq.status.value != "finished")
                                    and self.engine.abort(seq)):
            self._done()                 # the caller is already gone: nothing to run, nothing to answer
            return
        self.open_streams.add(events)
        self.engine.add(seq)
        grouped = seq.group is not None
        hold = max((len(s) for s in seq.params.stop), default=1) - 1  # never stream a stop string
        choices: dict[int, list] = {}                                  # choice -> [detokenizer, chars sent]
        try:
            while True:
                try:
                    s, ev = events.get(timeout=0.5)
                except queue.Empty:
                    if not context.is_active():
                        return
                    continue
                if s is None:                                          # end_open_streams
                    context.abort(grpc.StatusCode.UNAVAILABLE, ev)
                if ev.error:
                    context.abort(grpc.StatusCode[ev.error_code or "UNAVAILABLE"], ev.error)
                if ev.finished and ev.finish_reason == "group":        # every choice has ended
                    if seq.params.best_of > seq.params.n:
                        yield from self._winners(seq)
                    return
                state = choices.setdefault(s.choice, [IncrementalDetokenizer(self.engine), 0])
                detok, sent = state
                chunk = metadata_pb2.GenerateChunk(token_ids=pack(ev.new_token_ids, INT32), index=s.choice,
                                                   logprobs=pack(ev.new_logprobs, FLOAT32)
                                                   if seq.params.show_logprobs else b"")
                prompt_logprobs.attach_once(chunk, seq.prompt_lp)   # the first chunk carries them
                if ev.new_top:
                    chunk.top_logprob_ids = pack(np.concatenate([t[0] for t in ev.new_top]))
                    chunk.top_logprobs = pack(np.concatenate([t[1] for t in ev.new_top]), FLOAT32)
                if ev.beam_score is not None:                          # beam search: whole choices
                    chunk.beam_score, chunk.cumulative_logprob = ev.beam_score, ev.cumulative_logprob
                if ev.finished:
                    chunk.text, chunk.finish_reason = final_text(s, self.engine)[sent:], ev.finish_reason
                    chunk.usage.CopyFrom(usage(s))
                    set_stop_reason(chunk, s, self.engine, ev.finish_reason)
                    if request.final_only and s.first_token_at:
                        chunk.decode_seconds = max(0.0, time.monotonic() - s.first_token_at)
                    yield chunk
                    if not grouped:
                        return
                    continue
                detok.push(ev.new_token_ids)
                visible = detok.emitted[:max(0, len(detok.emitted) - hold)] if hold else detok.emitted
                chunk.text = visible[sent:] if len(visible) > sent else ""
                state[1] = sent + len(chunk.text)
                yield chunk
        finally:
            self.open_streams.discard(events)
            self._done()

    def end_open_streams(self, why: str) -> None:
        """Shutting down, the grace nearly spent: every Generate call still answering ends now with
        UNAVAILABLE and `why`, rather than with gRPC's bare "Cancelling all calls" when the server
        cancels it (a job is durable and needs none: it recomputes after a restart)."""
        for events in list(self.open_streams):
            events.put((None, why))

    def _winners(self, seq):
        """best_of > n: the n chosen choices (best cumulative logprob first, as a job's), one whole
        chunk each, renumbered 0..n-1."""
        for i, m in enumerate(seq.group.chosen()):
            chunk = metadata_pb2.GenerateChunk(
                token_ids=pack(m.output_token_ids, INT32), index=i, text=final_text(m, self.engine),
                finish_reason=seq.group.ended[m.choice].finish_reason, usage=usage(m),
                logprobs=pack(m.output_logprobs, FLOAT32) if seq.params.show_logprobs else b"")
            if m.output_top:
                chunk.top_logprob_ids = pack(np.concatenate([t[0] for t in m.output_top]))
                chunk.top_logprobs = pack(np.concatenate([t[1] for t in m.output_top]), FLOAT32)
            chunk.cumulative_logprob = float(sum(m.output_logprobs))   # what chose it (a job's result has it too)
            set_stop_reason(chunk, m, self.engine, chunk.finish_reason)
            prompt_logprobs.attach_once(chunk, seq.prompt_lp)   # the request's: on the first winner
            if m.first_token_at:        # whole choices: when their first token came (TTFT, ITL)
                chunk.decode_seconds = max(0.0, time.monotonic() - m.first_token_at)
            yield chunk

    # ------------------------------------------------------------------ stats
    def Stats(self, request, context):
        st = self.engine.stats()
        q, h = st.get("prefix_cache_queries", 0), st.get("prefix_cache_hits", 0)
        api_ok = self.block_api.invariants_ok()
        chains = [metadata_pb2.ChainStats(
            chain_id=c["chain_id"], ready=c["ready"], num_blocks=c["num_blocks"], used_blocks=c["used_blocks"],
            free_blocks=c["free_blocks"], cached_blocks=c["cached_blocks"], shared_blocks=c["shared_blocks"],
            running=c["running"], waiting=c["waiting"], prefix_cache_queries=c["prefix_cache_queries"],
            prefix_cache_hits=c["prefix_cache_hits"], steps=c["steps"], steps_per_second=c["steps_per_second"],
            tokens_per_second=c["tokens_per_second"], cache_epoch=c["cache_epoch"], micro_batches=c["micro_batches"],
            group=c["group"], generated_tokens=c["generated_tokens"], invariants_ok=c["invariants_ok"],
            tier_blocks=c["tier_blocks"], tier_used_blocks=c["tier_used_blocks"], tier_hits=c["tier_hits"],
            tier_saved_blocks=c["tier_saved_blocks"], tier_loaded_blocks=c["tier_loaded_blocks"],
            role=c["role"], kv_moves=c["kv_moves"], kv_moved_blocks=c["kv_moved_blocks"],
            kv_move_failures=c["kv_move_failures"],
            stages=[metadata_pb2.StageStats(**stage) for stage in c["stages"]]) for c in st["chains"]]
        return metadata_pb2.StatsReply(
            num_blocks=st["num_blocks"], block_size=st["block_size"], used_blocks=st["used_blocks"],
            free_blocks=st["free_blocks"], cached_blocks=st["cached_blocks"], shared_blocks=st["shared_blocks"],
            internal_fragmentation_tokens=st["internal_fragmentation_tokens"],
            kv_utilization=st["kv_utilization"], running=st["running"], waiting=st["waiting"],
            preemptions=st["preemptions"], prefix_cache_queries=q, prefix_cache_hits=h,
            prefix_cache_hit_rate=h / q if q else 0.0, invariants_ok=st["invariants_ok"] and api_ok,
            steps=st["steps"], generated_tokens=st["generated_tokens"], prompt_tokens=st["prompt_tokens"],
            tokens_per_second=st["tokens_per_second"], metadata_ms_per_step=st["metadata_ms_per_step"],
            num_workers=st["num_workers"], ready=st["ready"], cache_epoch=st["cache_epoch"],
            live_sequences=st["live_sequences"], not_ready_reason=st["not_ready_reason"],
            chains=chains, num_chains=st["num_chains"], standby_workers=st["standby_workers"],
            metadata_cpu_seconds=time.process_time(), model=self.engine.model_name,
            max_model_len=self.engine.max_model_len, model_fingerprint=self.engine.model_fingerprint,
            model_shape=self.engine.model_shape, tier_block_bytes=st["tier_block_bytes"], max_waiting=self.max_waiting,
            block_api_blocks=st["block_api_blocks"], block_api_used_blocks=st["block_api_used_blocks"],
            **{k: st[k] for k in ("tier_blocks", "tier_used_blocks", "tier_queries", "tier_hits",
                                  "tier_saved_blocks", "tier_loaded_blocks", "kv_moves", "kv_moved_blocks",
                                  "kv_move_failures")})

    def PoolSnapshot(self, request, context):
        max_blocks = request.max_blocks if request.max_blocks > 0 else 4096
        max_seqs = request.max_sequences if request.max_sequences > 0 else 64
        if max_blocks > 1 << 20 or max_seqs > 4096:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_blocks <= 1048576 and max_sequences <= 4096")
        return metadata_pb2.PoolSnapshotReply(
            chains=[c.snapshot(max_blocks, max_seqs) for c in self.engine.pools()], time=time.time())

    # ------------------------------------------------------------------ block API
    def _block(self, name, request, context):
        if not self.block_api_enabled:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "the block API is switched off (--no-block-api)")
        return getattr(self.block_api, name)(request, context)

    def CreateSequence(self, request, context):
        return self._block("CreateSequence", request, context)

    def AppendTokens(self, request, context):
        return self._block("AppendTokens", request, context)

    def ForkSequence(self, request, context):
        return self._block("ForkSequence", request, context)

    def ReleaseSequence(self, request, context):
        return self._block("ReleaseSequence", request, context)

    def GetBlockTables(self, request, context):
        return self._block("GetBlockTables", request, context)

    # ------------------------------------------------------------------ workers
    def RegisterWorker(self, request, context):
        try:
            handle = self.engine.registry.register(request.info)
        except WorkerRejected as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT if e.invalid else grpc.StatusCode.FAILED_PRECONDITION, str(e))
        self.engine.notify_workers_changed()
        lease = self.engine.registry.lease_s
        return metadata_pb2.RegisterWorkerReply(  # four heartbeats per lease: one late one is no failure
            worker_id=handle.worker_id, heartbeat_interval_ms=max(50, int(lease * 250)), lease_ms=int(lease * 1000))

    def Heartbeat(self, request, context):
        registry = self.engine.registry
        if registry.heartbeat(request.worker_id):
            return metadata_pb2.HeartbeatReply(known=True)
        return metadata_pb2.HeartbeatReply(known=False, reason=registry.drop_reasons.pop(request.worker_id, ""))

    def DeregisterWorker(self, request, context):
        known = self.engine.registry.deregister(request.worker_id)
        if known:
            self.engine.notify_workers_changed()  # its chain stops now, not when the lease runs out
        return metadata_pb2.DeregisterWorkerReply(known=known)
