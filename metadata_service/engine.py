"""The Engine: the front door for sequences, the router, and the upkeep of replica chains.

Requests come in on RPC threads (`add`, `abort`); `add` routes each new sequence to a ready chain
(metadata_service/router.py) and hands it to that chain's thread (metadata_service/chain.py), which
runs it to the end. With no chain ready, sequences are parked until one forms.

The upkeep thread keeps the chains: workers whose lease ran out are dropped and their chains
stopped; free workers (new, standby, or the survivors of a lost chain) are formed into chains
(metadata_service/workers.py), each initialised with a fresh cache epoch (last stage first) and
started. A chain that is lost hands its sequences back here: they are routed again and recompute
from their tokens on the other chains, exactly (sampling is a pure function of seed and position).

Sinks (Generate streams, jobs) hear about tokens and endings from whichever thread applies them."""
from __future__ import annotations

import contextlib

import itertools
import logging
import queue
import secrets
import threading
import time
from collections import deque

import grpc

from minipaged.config import shape_signature
from minipaged.tokenizer import ByteTokenizer, byte_fallback_problem, load_tokenizer
from minipaged.units import kv_capacity
from minipaged.v1 import worker_pb2
from minipaged.wire import INT32, unpack

from .backlog import CANCEL_COMMAND, refusal_hint, waiting_reason
from .block_manager import KVBlockManager
from .chain import ChainConfig, ChainRunner
from .grammar import Grammars
from .router import Router
from .sequence import SeqEvent, Sequence, SeqStatus
from .workers import WorkerRegistry

log = logging.getLogger("metadata_service.engine")


class Engine:
    def __init__(self, *, block_size=16, num_blocks=0, max_num_batched_tokens=2048, max_num_seqs=256,
                 max_model_len=0, enable_prefix_caching=True, worker_token=None, step_timeout_s=120.0,
                 worker_wait_s=60.0, registry: WorkerRegistry | None = None, micro_batches=0,
                 async_scheduling=True, router="prefix", full_block_tables=False, init_timeout_s=30.0,
                 default_num_blocks=1024):
        self.block_size = block_size
        self.num_blocks_cap = num_blocks            # --num-blocks: an upper bound on each chain's pool
        self.max_model_len_flag = max_model_len
        self.max_model_len = max_model_len or 0
        self.worker_token = worker_token
        self.step_timeout_s, self.worker_wait_s, self.init_timeout_s = step_timeout_s, worker_wait_s, init_timeout_s
        self.cfg = ChainConfig(block_size=block_size, max_num_batched_tokens=max_num_batched_tokens,
                               max_num_seqs=max_num_seqs, micro_batches=micro_batches,
                               async_scheduling=async_scheduling, enable_prefix_caching=enable_prefix_caching,
                               full_block_tables=full_block_tables, worker_token=worker_token or "",
                               step_timeout_s=step_timeout_s)
        self.registry = registry if registry is not None else WorkerRegistry()  # (an empty one is falsy)
        self.registry.pinned = self._pinned_model
        self.router = Router(router, block_size)
        self.chains: dict[int, ChainRunner] = {}
        self._chain_ids = itertools.count(1)
        self.route_lock = threading.RLock()        # chains, router and parked change under it
        self.parked: deque[Sequence] = deque()     # admitted, waiting for a chain
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.model_known = threading.Event()       # a chain registered once: tokenizer and limits known
        self.ready_event = threading.Event()       # some chain is ready now
        self.unready_since = time.monotonic()
        self.not_ready_reason = "no worker has registered"
        self.tokenizer = ByteTokenizer()
        self.model_name = ""
        self.model_fingerprint = ""                # of the last chain; kept while it is down
        self.model_shape = ""                      # shape_signature of the served model (Stats, the gateway)
        self.text_prompt_problem = None            # why text prompts cannot be tokenized (tiny vocab, no files)
        self.model_label = ""                      # its name, for messages (also known after a restart)
        self.on_model_changed = []                 # callbacks(fingerprint, name): the job store records it
        self.on_ready_changed = []                 # callbacks(bool): health readiness follows
        self.on_sequence_finished = []             # callbacks(seq): metrics
        self.finish_batch = contextlib.nullcontext  # () -> context: finishes inside it share one store write
        self.on_chain_started = []                 # callbacks(chain): the block API sizes its pool
        self.backlog = lambda: []                  # () -> [Backlog]: unfinished job work (JobManager's)
        self.cancel_command = CANCEL_COMMAND       # how a user drops it (main() adds --address)
        self._backlog_note = (0.0, "")             # (when, text): recomputed at most once a second
        self.registry.refusal_hint = lambda: refusal_hint(next(iter(self.backlog()), None), self.cancel_command)
        self.eos_ids: set[int] = set()
        self.vocab_size = 0
        self._grammars = None                      # (model key, Grammars): structured outputs
        self._grammars_lock = threading.Lock()
        self.prompt_tokens = 0
        self.max_pool_blocks = 0                   # the largest chain pool seen (admission bound)
        self._quarantine_polled = 0.0
        # the pool the block API serves (and Stats reports) before any chain exists
        self.default_manager = KVBlockManager(num_blocks or default_num_blocks, block_size,
                                              enable_prefix_caching=enable_prefix_caching)

    # ------------------------------------------------------------------ public (any thread)
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wakeup.set()
        self._thread.join(timeout=5)
        for c in list(self.chains.values()):
            c.stop("shutting down")

    @property
    def ready(self) -> bool:
        return self.ready_event.is_set()

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

    def notify_workers_changed(self) -> None:
        self._wakeup.set()

    def wait_ready(self, timeout: float | None) -> bool:
        return self.ready_event.wait(timeout)

    # the model's tokenizer, whichever chain is current (stop checkers and results use these)
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids)

    def grammars(self) -> Grammars:
        """The served model's grammar compiler (structured outputs), made on first use and again
        when the model (tokenizer, vocab size or EOS ids) changes."""
        key = (id(self.tokenizer), self.vocab_size, frozenset(self.eos_ids))
        with self._grammars_lock:
            if self._grammars is None or self._grammars[0] != key:
                self._grammars = (key, Grammars(self.tokenizer, self.vocab_size, self.eos_ids))
            return self._grammars[1]

    def _pinned_model(self):
        """While admitted requests are pending, only workers of their model may join."""
        pending = bool(self.parked) or any(c.load() for c in list(self.chains.values()))
        return (self.model_fingerprint, self.model_label or "the previous model") \
            if pending and self.model_fingerprint else None

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
                self.router.done(chain.chain_id, seq.route_load)
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
    def _route(self, seqs: list[Sequence]) -> None:
        with self.route_lock:
            live = [c for c in self.chains.values() if c.alive]
            if not live:
                self.parked.extend(s for s in seqs if not s.abort_requested)
                cancelled = [s for s in seqs if s.abort_requested]
            else:
                cancelled = []
                ids = [c.chain_id for c in live]
                beam_chain: dict[int, int] = {}   # a beam group's beams stay on one chain (beam.py forks)
                for s in seqs:
                    g = s.group if s.group is not None and s.group.beam else None
                    if g is not None and id(g) in beam_chain:
                        cid, load = beam_chain[id(g)], 0.0
                    else:
                        cid, load = self.router.choose(ids, s.all_token_ids, s.params.max_new_tokens)
                        if g is not None:
                            beam_chain[id(g)] = cid
                    s.chain, s.route_load = self.chains[cid], load
                    s.chain.add(s)
        for s in cancelled:
            self.finish(s, "cancelled")

    def on_chain_lost(self, chain: ChainRunner, seqs: list[Sequence], why: str) -> None:
        """From the chain's thread: its sequences recompute elsewhere; upkeep re-forms chains."""
        with self.route_lock:
            self.chains.pop(chain.chain_id, None)
            self.router.remove_chain(chain.chain_id)
            for s in seqs:
                s.chain = None
        self._events.put(("lost", chain))
        live = [s for s in seqs if s.status is not SeqStatus.FINISHED]
        for s in live:
            s.status = SeqStatus.WAITING
        self._route(live)
        self._refresh_ready()
        self._wakeup.set()

    # ------------------------------------------------------------------ upkeep
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._maintain()
            except Exception:  # never let the upkeep thread die silently
                log.exception("engine upkeep failed")
                time.sleep(0.1)
            self._wakeup.wait(0.05)
            self._wakeup.clear()

    def _maintain(self) -> None:
        while True:
            try:
                kind, chain = self._events.get_nowait()
            except queue.Empty:
                break
            chain.join(1.0)
            self.registry.drop([w.worker_id for w in chain.stages if not self._alive(w)])
            if chain.missed_deadline:  # which stage hangs is not known yet: none joins a chain until idle
                self.registry.quarantine([w.worker_id for w in chain.stages], chain.lost_reason)
        self._release_idle_quarantined()
        expired = set(self.registry.expired())
        if expired:
            for c in list(self.chains.values()):
                silent = [w.address for w in c.stages if w.worker_id in expired]
                if silent:
                    c.stop(f"worker {', '.join(silent)} missed its heartbeat lease "
                           f"({self.registry.lease_s:.1f}s): hung or gone")
            self.registry.drop(expired)
        known = {w.worker_id for w in self.registry.workers.values()}
        for c in list(self.chains.values()):  # a stage that re-registered (restarted) voids its chain
            if c.alive and any(w.worker_id not in known for w in c.stages):
                c.stop("a worker of the chain stopped (deregistered) or restarted")
        busy = {w.worker_id for c in self.chains.values() for w in c.stages} | set(self.registry.quarantined)
        for stages in self.registry.form_chains(busy):
            self._start_chain(stages)
        busy = {w.worker_id for c in self.chains.values() for w in c.stages} | set(self.registry.quarantined)
        reason = "" if self.chains else "; ".join(
            r for r in (self.registry.explain(busy) or "no chain is ready", self._waiting_note()) if r)
        with self.route_lock:
            self.not_ready_reason = reason
            parked = list(self.parked) if self.chains else []
            self.parked.clear() if parked else None
        if parked:
            self._route(parked)
        self._refresh_ready()
        self._fail_streams_if_waited_too_long()

    def _waiting_note(self) -> str:
        """Which model's pending job requests wait, and how to drop them (for not_ready_reason)."""
        now = time.monotonic()
        if now - self._backlog_note[0] >= 1.0:
            self._backlog_note = (now, waiting_reason(self.backlog(), self.cancel_command))
        return self._backlog_note[1]

    def _start_chain(self, stages) -> None:
        cap = min(w.capacity_blocks(self.block_size) for w in stages)
        if self.num_blocks_cap:
            cap = min(cap, self.num_blocks_cap)
        label = " -> ".join(w.address for w in stages)
        if cap < 1:
            log.error("chain %s can hold no block of size %d", label, self.block_size)
            return
        epoch = secrets.randbits(62) + 1
        try:
            for i in reversed(range(len(stages))):
                nxt = stages[i + 1] if i + 1 < len(stages) else None
                data = (f"{nxt.address.rsplit(':', 1)[0]}:{nxt.info.data_port}"
                        if nxt is not None and nxt.info.data_port else "")
                reply = stages[i].connect(self.registry.channel_factory).InitCache(worker_pb2.InitCacheRequest(
                    num_blocks=cap, block_size=self.block_size, next_stage_address=nxt.address if nxt else "",
                    next_stage_token=self.worker_token or "", cache_epoch=epoch, next_stage_data_address=data),
                    timeout=self.init_timeout_s, metadata=self._auth())
            epoch = reply.cache_epoch  # stage 0's word is what Steps must carry
        except grpc.RpcError as e:
            log.warning("InitCache on chain %s failed: %s %s", label, e.code().name, e.details())
            self.registry.drop([w.worker_id for w in stages if not self._alive(w)])
            return
        self._adopt_model(stages)
        self.max_pool_blocks = max(cap, self.max_pool_blocks if self.chains else 0)
        chain = ChainRunner(next(self._chain_ids), stages, cap, epoch, self.cfg, self, stages[0].info.replica_group)
        with self.route_lock:
            self.chains[chain.chain_id] = chain
            self.router.add_chain(chain.chain_id, cap)
        chain.start()
        for cb in self.on_chain_started:
            cb(chain)
        kv_bytes = cap * sum(w.block_bytes(self.block_size) for w in stages)
        log.info("chain %d ready: %s, KV cache %s (%d stage(s)), %d micro-batches, epoch %d", chain.chain_id,
                 label, kv_capacity(cap, self.block_size, kv_bytes), len(stages), chain.micro_batches, epoch)

    def _adopt_model(self, stages) -> None:
        info = stages[0].info
        if info.model_fingerprint != self.model_fingerprint or info.model_name != self.model_name:
            self.tokenizer = load_tokenizer(info.model_name)
            self.model_name = self.model_label = info.model_name
            if info.model_fingerprint != self.model_fingerprint:
                self.model_fingerprint = info.model_fingerprint
                for cb in self.on_model_changed:
                    cb(info.model_fingerprint, info.model_name)
        self.eos_ids = set(unpack(stages[-1].info.eos_token_ids, INT32).tolist())
        self.vocab_size = info.vocab_size
        self.text_prompt_problem = byte_fallback_problem(info.model_name, info.vocab_size)
        if self.text_prompt_problem:
            log.warning("%s", self.text_prompt_problem)
        self.model_shape = shape_signature(info.vocab_size, info.hidden_size, info.num_layers,
                                           info.num_attention_heads, info.num_kv_heads, info.head_dim)
        self.max_model_len = self.max_model_len_flag or info.max_position_embeddings
        self.model_known.set()

    def _refresh_ready(self) -> None:
        ready = any(c.alive for c in list(self.chains.values()))
        if ready != self.ready_event.is_set():
            (self.ready_event.set if ready else self.ready_event.clear)()
            if not ready:
                self.unready_since = time.monotonic()
            for cb in self.on_ready_changed:
                cb(ready)

    def _auth(self):
        return (("authorization", f"Bearer {self.worker_token}"),) if self.worker_token else None

    def _release_idle_quarantined(self) -> None:
        """A stage of a chain that missed its step deadline rejoins once its Health says it computes
        nothing (busy_ms 0): the healthy stages of that chain at once, the hung one when (if ever) its
        step ends. Polled at most once a second."""
        now = time.monotonic()
        if not self.registry.quarantined or now - self._quarantine_polled < 1.0:
            return
        self._quarantine_polled = now
        for wid in list(self.registry.quarantined):
            w = self.registry.workers.get(wid)
            if w is None:
                self.registry.quarantined.pop(wid, None)
                continue
            try:
                busy_ms = w.connect(self.registry.channel_factory).Health(
                    worker_pb2.WorkerHealthRequest(), timeout=1.0, metadata=self._auth()).busy_ms
            except grpc.RpcError:
                continue  # the lease decides about a worker that does not answer
            if busy_ms == 0:
                log.info("worker %s is idle again: it may join a chain", w.address)
                self.registry.quarantined.pop(wid, None)

    def _alive(self, w) -> bool:
        try:
            w.connect(self.registry.channel_factory).Health(worker_pb2.WorkerHealthRequest(), timeout=2,
                                                            metadata=self._auth())
            return True
        except grpc.RpcError:
            return False

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

    # ------------------------------------------------------------------ figures
    def pools(self) -> list:
        with self.route_lock:
            return [c for c in self.chains.values() if c.alive]

    def stats(self) -> dict:
        chains = [c.stats() for c in self.pools()]
        keys = ("num_blocks", "used_blocks", "free_blocks", "cached_blocks", "shared_blocks",
                "internal_fragmentation_tokens", "prefix_cache_queries", "prefix_cache_hits", "live_sequences",
                "running", "waiting", "preemptions", "steps", "generated_tokens")
        st = {k: sum(c.get(k, 0) for c in chains) for k in keys}
        if not chains:
            st.update({k: v for k, v in self.default_manager.stats().items() if k in keys})
        used = sum(c["kv_used_tokens"] for c in chains)
        alloc = sum(c["kv_allocated_tokens"] for c in chains)
        meta_s = sum(c["metadata_s"] for c in chains)
        busy = max((time.monotonic() - min(c_.started for c_ in self.pools())) if chains else 0.0, 1e-9)
        st.update(block_size=self.block_size, kv_utilization=used / alloc if alloc else 0.0,
                  invariants_ok=all(c["invariants_ok"] for c in chains), waiting=st["waiting"] + len(self.parked),
                  tokens_per_second=st["generated_tokens"] / busy if chains else 0.0,
                  metadata_ms_per_step=1e3 * meta_s / st["steps"] if st["steps"] else 0.0,
                  num_workers=len(self.registry), ready=self.ready, num_chains=len(chains),
                  cache_epoch=chains[0]["cache_epoch"] if chains else 0, chains=chains,
                  standby_workers=len(self.registry) - sum(len(c["stages"]) for c in chains),
                  not_ready_reason="" if chains else self.not_ready_reason, prompt_tokens=self.prompt_tokens)
        return st
