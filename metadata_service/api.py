"""MetadataService: the gRPC face of the metadata plane.

Generation and jobs go to the Engine and JobManager; the block API goes to BlockApi over the same
KVBlockManager; workers register here. Every handler validates before it changes anything."""
from __future__ import annotations

import queue
import threading

import grpc

from minipaged.tokenizer import IncrementalDetokenizer
from minipaged.v1 import metadata_pb2, metadata_pb2_grpc
from minipaged.wire import FLOAT32, INT32, pack

from .block_api import BlockApi
from .jobs import JobManager
from .requests import RequestError, final_text, normalize, to_sequence, usage
from .workers import WorkerRejected, clip


class MetadataServicer(metadata_pb2_grpc.MetadataServiceServicer):
    def __init__(self, engine, jobs: JobManager, max_waiting: int = 4096, block_api_enabled: bool = True):
        self.engine = engine
        self.jobs = jobs
        self.max_waiting = max_waiting
        self.block_api_enabled = block_api_enabled
        self.block_api = BlockApi(engine.manager, engine.lock)
        engine.on_manager_replaced.append(lambda m: setattr(self.block_api, "manager", m))
        self._pending = 0                 # admitted, unfinished requests (for --max-waiting)
        self._pending_lock = threading.Lock()

    # ------------------------------------------------------------------ admission
    def _admit(self, reqs, context) -> list:
        try:
            normed = [normalize(r, self.engine) for r in reqs]
        except RequestError as e:
            context.abort(e.code, e.message)
        with self._pending_lock:
            if self._pending + len(normed) > self.max_waiting:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"queue full: {self._pending} requests pending, limit {self.max_waiting} "
                              f"(--max-waiting); retry after a short backoff")
            self._pending += len(normed)
        return normed

    def _done(self, n: int = 1) -> None:
        with self._pending_lock:
            self._pending -= n

    # ------------------------------------------------------------------ generation
    def Generate(self, request, context):
        req = self._admit([request], context)[0]
        events: queue.SimpleQueue = queue.SimpleQueue()
        seq = to_sequence(req, self.engine, sink=lambda s, ev: events.put(ev))
        context.add_callback(lambda: seq.status.value != "finished" and self.engine.abort(seq))
        self.engine.add(seq)
        detok = IncrementalDetokenizer(self.engine)
        hold = max((len(s) for s in seq.params.stop), default=1) - 1  # never stream a stop string
        sent = 0
        try:
            while True:
                try:
                    ev = events.get(timeout=0.5)
                except queue.Empty:
                    if not context.is_active():
                        return
                    continue
                detok.push(ev.new_token_ids)
                lp = pack(ev.new_logprobs, FLOAT32) if seq.params.return_logprobs else b""
                if ev.finished:
                    if ev.error:
                        context.abort(grpc.StatusCode[ev.error_code or "UNAVAILABLE"], ev.error)
                    text = final_text(seq, self.engine)
                    yield metadata_pb2.GenerateChunk(token_ids=pack(ev.new_token_ids, INT32), text=text[sent:],
                                                     finish_reason=ev.finish_reason, usage=usage(seq), logprobs=lp)
                    return
                visible = detok.emitted[:len(detok.emitted) - hold] if hold else detok.emitted
                delta = visible[sent:] if len(visible) > sent else ""
                sent += len(delta)
                yield metadata_pb2.GenerateChunk(token_ids=pack(ev.new_token_ids, INT32), text=delta, logprobs=lp)
        finally:
            self._done()

    # ------------------------------------------------------------------ jobs
    def SubmitJob(self, request, context):
        if not request.requests:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a job needs at least one request")
        try:
            reqs = self._admit(request.requests, context)
        except RequestError as e:  # pragma: no cover - _admit aborts
            context.abort(e.code, e.message)
        job_id = self.jobs.submit(reqs)
        job = self.jobs.get(job_id)
        threading.Thread(target=self._release_when_done, args=(job,), daemon=True).start()
        return metadata_pb2.SubmitJobReply(job_id=job_id)

    def _release_when_done(self, job) -> None:
        with job.cond:
            job.cond.wait_for(lambda: len(job.results) == job.total or job.state == "cancelled")
        self._done(job.total)

    def _job(self, job_id, context):
        job = self.jobs.get(job_id)
        if job is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown job id {clip(job_id)}")
        return job

    def GetJob(self, request, context):
        job = self._job(request.job_id, context)
        with job.cond:
            return job.proto(with_results=True)

    def CancelJob(self, request, context):
        job = self.jobs.cancel(request.job_id)
        if job is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown job id {clip(request.job_id)}")
        with job.cond:
            return job.proto(with_results=True)

    def WatchJob(self, request, context):
        job = self._job(request.job_id, context)
        sent = 0
        while context.is_active():
            with job.cond:
                job.cond.wait_for(lambda: len(job.order) > sent or self._settled(job), timeout=0.5)
                new = [job.results[i] for i in job.order[sent:]]
                sent += len(new)
                final = self._settled(job) and sent == len(job.order)
                msg = metadata_pb2.JobProgress(job_id=job.job_id, state=job.state, total=job.total,
                                               completed=len(job.results), new_results=new)
            if new or final:
                yield msg
            if final:
                return

    @staticmethod
    def _settled(job) -> bool:
        """Done, or cancelled with every aborted sequence's partial result in."""
        return job.state in ("done", "cancelled") and not job.seqs

    # ------------------------------------------------------------------ stats
    def Stats(self, request, context):
        st = self.engine.stats()
        q, h = st.get("prefix_cache_queries", 0), st.get("prefix_cache_hits", 0)
        return metadata_pb2.StatsReply(
            num_blocks=st["num_blocks"], block_size=st["block_size"], used_blocks=st["used_blocks"],
            free_blocks=st["free_blocks"], cached_blocks=st.get("cached_blocks", 0),
            internal_fragmentation_tokens=st["internal_fragmentation_tokens"],
            kv_utilization=st.get("kv_utilization", 1.0), running=st["running"], waiting=st["waiting"],
            preemptions=st["preemptions"], prefix_cache_queries=q, prefix_cache_hits=h,
            prefix_cache_hit_rate=h / q if q else 0.0, invariants_ok=st["invariants_ok"], steps=st["steps"],
            generated_tokens=st["generated_tokens"], prompt_tokens=st["prompt_tokens"],
            tokens_per_second=st["tokens_per_second"], metadata_ms_per_step=st["metadata_ms_per_step"],
            num_workers=st["num_workers"], ready=st["ready"], cache_epoch=st["cache_epoch"],
            live_sequences=st.get("live_sequences", 0))

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
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        self.engine.notify_workers_changed()
        return metadata_pb2.RegisterWorkerReply(
            worker_id=handle.worker_id, heartbeat_interval_ms=int(self.engine.registry.heartbeat_timeout_s * 100))

    def Heartbeat(self, request, context):
        return metadata_pb2.HeartbeatReply(known=self.engine.registry.heartbeat(request.worker_id))
