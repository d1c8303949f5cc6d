"""The engine thread: keeps a worker chain initialised, runs one Step per iteration, applies outputs.

Only this thread touches the Scheduler and Sequences. RPC threads talk to it through `add()` and
`abort()` (an inbox drained at each step boundary) and hear back through each Sequence's sink. The
block manager is shared with the block API under `self.lock`."""
from __future__ import annotations

import logging
import queue
import secrets
import threading
import time

import grpc
import numpy as np

from minipaged.tokenizer import ByteTokenizer, load_tokenizer
from minipaged.v1 import worker_pb2
from minipaged.wire import FLOAT32, INT32, INT64, pack, unpack

from .block_manager import KVBlockManager
from .scheduler import ScheduledBatch, Scheduler
from .sequence import SAMPLING_ROW, SeqEvent, Sequence, SeqStatus
from .workers import WorkerRegistry

log = logging.getLogger("metadata_service.engine")


class Engine:
    def __init__(self, *, block_size=16, num_blocks=0, default_num_blocks=1024, max_num_batched_tokens=2048,
                 max_num_seqs=256, max_model_len=0, enable_prefix_caching=True, worker_token=None,
                 step_timeout_s=120.0, worker_wait_s=60.0, registry: WorkerRegistry | None = None):
        self.block_size = block_size
        self.num_blocks_cap = num_blocks            # --num-blocks: an upper bound on the pool
        self.max_model_len_flag = max_model_len
        self.max_model_len = max_model_len or 0
        self.enable_prefix_caching = enable_prefix_caching
        self.worker_token = worker_token
        self.step_timeout_s = step_timeout_s
        self.worker_wait_s = worker_wait_s
        self.registry = registry if registry is not None else WorkerRegistry()  # (an empty one is falsy)
        self.lock = threading.RLock()
        self.manager = KVBlockManager(num_blocks or default_num_blocks, block_size,
                                      enable_prefix_caching=enable_prefix_caching)
        self.scheduler = Scheduler(self.manager, max_num_batched_tokens, max_num_seqs)
        self.on_manager_replaced = []              # callbacks(manager): the block API follows
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        # chain state
        self.chain = []
        self.chain_version = -1
        self.cache_epoch = 0
        self.ready = False
        self.unready_since = time.monotonic()
        self.tokenizer = ByteTokenizer()
        self.model_name = ""
        self.model_fingerprint = ""                # of the last chain; kept while it is down
        self.model_label = ""                      # its name, for messages (also known after a restart)
        self.on_model_changed = []                 # callbacks(fingerprint, name): the job store records it
        self.registry.pinned = self._pinned_model
        self.eos_ids: set[int] = set()
        self.vocab_size = 0
        # counters for Stats
        self.steps = 0
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.busy_s = 0.0
        self.metadata_s = 0.0

    # ------------------------------------------------------------------ public (any thread)
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wakeup.set()
        self._thread.join(timeout=5)

    def add(self, seq: Sequence) -> None:
        self._inbox.put(("add", seq))
        self._wakeup.set()

    def abort(self, seq: Sequence) -> None:
        self._inbox.put(("abort", seq))
        self._wakeup.set()

    def _pinned_model(self):
        """While admitted requests are pending, only workers of their model may join."""
        pending = self.scheduler.has_work() or not self._inbox.empty()
        return (self.model_fingerprint, self.model_label or "the previous model") \
            if pending and self.model_fingerprint else None

    def notify_workers_changed(self) -> None:
        self._wakeup.set()

    # the model's tokenizer, whichever chain is current (stop checkers and results use these)
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids)

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain_inbox()
                self._maintain_chain()
                if not (self.ready and self.scheduler.has_work()):
                    self._wakeup.wait(0.05)
                    self._wakeup.clear()
                    continue
                self._step()
            except Exception:  # never let the engine thread die silently
                log.exception("engine iteration failed")
                time.sleep(0.1)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, seq = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self.prompt_tokens += seq.num_prompt_tokens
                self.scheduler.add(seq)
            elif seq.status is not SeqStatus.FINISHED:
                with self.lock:
                    self.scheduler.remove(seq)
                self._finish(seq, "cancelled")

    def _step(self) -> None:
        t0 = time.perf_counter()
        with self.lock:
            batch = self.scheduler.schedule()
        if batch is None:
            return
        req = self._step_request(batch)
        t1 = time.perf_counter()
        try:
            reply = self.chain[0].stub.Step(req, timeout=self.step_timeout_s, metadata=self._auth())
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL,
                            grpc.StatusCode.UNKNOWN, grpc.StatusCode.RESOURCE_EXHAUSTED):
                # the worker refused or broke on this batch: recomputing would only repeat it
                self._fail_batch(batch, f"worker rejected the step: {e.code().name}: {e.details()}")
            else:  # UNAVAILABLE, FAILED_PRECONDITION (epoch), DEADLINE_EXCEEDED: the chain's state
                self._on_chain_failure(f"Step failed: {e.code().name}: {e.details()}")
            return
        t2 = time.perf_counter()
        self._apply(batch, reply)
        t3 = time.perf_counter()
        self.steps += 1
        self.metadata_s += (t1 - t0) + (t3 - t2)
        self.busy_s += t3 - t0

    def _step_request(self, b: ScheduledBatch) -> worker_pb2.StepRequest:
        seqs = b.seqs
        rows = np.frombuffer(b"".join([s.sampling_row for s in seqs]), dtype=SAMPLING_ROW)
        return worker_pb2.StepRequest(
            step_id=self.steps, cache_epoch=self.cache_epoch,
            sequence_ids=pack([s.seq_id for s in seqs], INT64),
            input_ids=pack(b.input_ids), positions=pack(b.positions), slot_mapping=pack(b.slot_mapping),
            query_start_loc=pack(b.query_start_loc), seq_lens=pack(b.seq_lens),
            block_tables=pack(b.block_tables), max_blocks_per_seq=b.block_tables.shape[1],
            do_sample=b.do_sample.tobytes(),
            temperature=rows["temperature"].tobytes(), top_p=rows["top_p"].tobytes(),
            top_k=rows["top_k"].tobytes(), seeds=rows["seed"].tobytes(),
            sample_offsets=pack([len(s.output_token_ids) for s in seqs], INT32),
            return_logprobs=any(s.params.return_logprobs for s in seqs))

    def _apply(self, b: ScheduledBatch, reply: worker_pb2.StepReply) -> None:
        """Append each sampled token and apply the stop rules (hot: one pass, locals only)."""
        tokens = unpack(reply.sampled_token_ids, INT32).tolist()
        logprobs = unpack(reply.logprobs, FLOAT32).tolist() if reply.logprobs else None
        sampled = b.seqs if b.do_sample.all() else [s for s, d in zip(b.seqs, b.do_sample.tolist()) if d]
        eos, finished_status = self.eos_ids, SeqStatus.FINISHED
        finished = []
        for j, (seq, tok) in enumerate(zip(sampled, tokens)):
            if seq.status is finished_status:  # aborted while the step ran
                continue
            seq.output_token_ids.append(tok)
            seq.num_tokens += 1
            if logprobs is not None:
                seq.output_logprobs.append(logprobs[j])
            p = seq.params
            if (tok in eos and not p.ignore_eos) or tok in p.stop_token_ids:
                finished.append((seq, "stop"))
            elif seq.stop_checker is not None and seq.stop_checker.push(tok):
                finished.append((seq, "stop"))
            elif len(seq.output_token_ids) >= p.max_new_tokens:
                finished.append((seq, "length"))
            elif seq.sink is not None and seq.tag is None:  # streams hear every token
                seq.sink(seq, SeqEvent([tok], [logprobs[j]] if logprobs else []))
        self.generated_tokens += len(tokens)
        if finished:
            with self.lock:
                for seq, _ in finished:
                    self.scheduler.remove(seq)
            for seq, reason in finished:
                self._finish(seq, reason)

    def _fail_batch(self, batch: ScheduledBatch, error: str) -> None:
        log.error("%s; failing %d sequences", error, len(batch.seqs))
        with self.lock:
            for seq in batch.seqs:
                self.scheduler.remove(seq)
        for seq in batch.seqs:
            self._finish(seq, "error", error=error, code="INTERNAL")

    def _finish(self, seq: Sequence, reason: str, error: str = "", code: str = "UNAVAILABLE") -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if seq.sink is not None:
            new = seq.output_token_ids[-1:] if reason in ("stop", "length") and seq.tag is None else []
            lp = seq.output_logprobs[-1:] if new and seq.output_logprobs else []
            seq.sink(seq, SeqEvent(new, lp, finished=True, finish_reason=reason, error=error,
                                   error_code=code if error else ""))

    # ------------------------------------------------------------------ chain
    def _auth(self):
        return (("authorization", f"Bearer {self.worker_token}"),) if self.worker_token else None

    def _maintain_chain(self) -> None:
        expired = self.registry.expired()
        if expired:
            self.registry.drop(expired)
        if self.ready and self.registry.version == self.chain_version:
            return
        if self.ready:  # membership changed: re-form only if a chain stage is gone
            ids = {w.worker_id for w in self.registry.workers.values()}
            if all(w.worker_id in ids for w in self.chain):
                self.chain_version = self.registry.version
                return
            self._on_chain_failure("a worker of the chain left")
        chain = self.registry.form_chain()
        if chain is None:
            self._fail_streams_if_waited_too_long()
            return
        self._init_chain(chain)

    def _init_chain(self, chain) -> None:
        version = self.registry.version
        cap = min(w.capacity_blocks(self.block_size) for w in chain)
        if self.num_blocks_cap:
            cap = min(cap, self.num_blocks_cap)
        if cap < 1:
            log.error("worker chain can hold no block of size %d", self.block_size)
            return
        epoch = secrets.randbits(62) + 1
        try:
            for i in reversed(range(len(chain))):
                nxt = chain[i + 1].address if i + 1 < len(chain) else ""
                reply = chain[i].connect(self.registry.channel_factory).InitCache(worker_pb2.InitCacheRequest(
                    num_blocks=cap, block_size=self.block_size, next_stage_address=nxt,
                    next_stage_token=self.worker_token or "", cache_epoch=epoch),
                    timeout=60, metadata=self._auth())
            epoch = reply.cache_epoch  # stage 0's word is what Steps must carry
        except grpc.RpcError as e:
            log.warning("InitCache failed: %s %s", e.code().name, e.details())
            self.registry.drop([w.worker_id for w in chain if not self._alive(w)])
            return
        with self.lock:
            self.scheduler.requeue_all()
            if self.manager.num_physical_blocks != cap and not self.manager.sequences:
                self.manager = KVBlockManager(cap, self.block_size, enable_prefix_caching=self.enable_prefix_caching)
                self.scheduler.manager = self.manager
                for cb in self.on_manager_replaced:
                    cb(self.manager)
            else:
                self.manager.reset_prefix_cache()
        info = chain[0].info
        if info.model_fingerprint != self.model_fingerprint or info.model_name != self.model_name:
            self.tokenizer = load_tokenizer(info.model_name)
            self.model_name = self.model_label = info.model_name
            if info.model_fingerprint != self.model_fingerprint:
                self.model_fingerprint = info.model_fingerprint
                for cb in self.on_model_changed:
                    cb(info.model_fingerprint, info.model_name)
        self.eos_ids = set(unpack(chain[-1].info.eos_token_ids, INT32).tolist())
        self.vocab_size = info.vocab_size
        self.max_model_len = self.max_model_len_flag or info.max_position_embeddings
        self.chain, self.cache_epoch, self.chain_version, self.ready = chain, epoch, version, True
        log.info("chain ready: %s, %d blocks of %d tokens, epoch %d",
                 " -> ".join(w.address for w in chain), cap, self.block_size, epoch)

    def _alive(self, w) -> bool:
        try:
            w.connect(self.registry.channel_factory).Health(worker_pb2.WorkerHealthRequest(), timeout=2, metadata=self._auth())
            return True
        except grpc.RpcError:
            return False

    def _on_chain_failure(self, why: str) -> None:
        """KV content is lost or unreachable: requeue everything for recompute, re-form the chain."""
        log.warning("chain failure: %s", why)
        self.registry.drop([w.worker_id for w in self.chain if not self._alive(w)])
        with self.lock:
            self.scheduler.requeue_all()
            self.manager.reset_prefix_cache()
        self.ready = False
        self.chain = []
        self.unready_since = time.monotonic()

    def _fail_streams_if_waited_too_long(self) -> None:
        if time.monotonic() - self.unready_since < self.worker_wait_s or not self.scheduler.has_work():
            return
        msg = f"no worker chain for {self.worker_wait_s:.0f}s"
        for seq in [s for s in list(self.scheduler.waiting) + self.scheduler.running if s.tag is None]:
            with self.lock:
                self.scheduler.remove(seq)
            self._finish(seq, "error", error=msg)

    def stats(self) -> dict:
        with self.lock:
            st = dict(self.manager.stats())
            st["invariants_ok"] = bool(self.manager.invariants_ok())
        st.update(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                  preemptions=self.scheduler.num_preemptions, steps=self.steps,
                  generated_tokens=self.generated_tokens, prompt_tokens=self.prompt_tokens,
                  tokens_per_second=self.generated_tokens / self.busy_s if self.busy_s else 0.0,
                  metadata_ms_per_step=1000 * self.metadata_s / self.steps if self.steps else 0.0,
                  num_workers=len(self.registry), ready=self.ready, cache_epoch=self.cache_epoch)
        return st
