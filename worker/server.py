"""The WorkerService: one pipeline stage (a contiguous layer range) serving Steps.

Data flow: the metadata service sends Steps to stage 0 only. Stage k runs its layers and forwards
the hidden states to stage k+1 (same metadata fields, input_ids dropped, hidden_states = raw bytes
of the [T, hidden] tensor, named by hidden_dtype). The last stage samples; its reply travels back
up the chain, each stage prepending its StageTiming. So the metadata service only ever sees sampled
tokens; hidden states go worker to worker.

Two transports, one step function (`_process`):
- `StepStream` (the metadata service's path): Steps arrive in order on one stream, several in
  flight. A pump thread runs them one after another (so micro-batches keep their order on every
  stage, which is what makes freeing and reusing blocks between micro-batches safe) and hands each
  one to the next stage's stream without waiting for it; a relay thread passes replies back up.
  Errors are in-band (StepReply.error_code) so one bad step does not end the stream.
- `Step` (unary, for tools and tests): one step, forwarded with a unary call.

Epochs: every InitCache gives this stage a fresh cache_epoch (the chain's, chosen by the metadata
service, which initialises the chain last stage first). A Step carrying another epoch fails with
FAILED_PRECONDITION instead of reading lost K/V; so does one that assumes remembered state this
stage does not hold (worker/step_state.py)."""
from __future__ import annotations

import hmac
import logging
import queue
import secrets
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from minipaged import wire
from minipaged.constants import DTYPE_BYTES, grpc_options
from minipaged.rpc import DecodeGuardInterceptor
from minipaged.tls import add_port
from minipaged.v1 import worker_pb2 as pb
from minipaged.v1 import worker_pb2_grpc as pb_grpc
from worker.busy_clock import BusyClock
from worker import prompt_logprobs
from worker.data_link import payload_bytes
from worker.stage_link import StageLink
from worker.step_stream import StepError, StepPipe, relayed, upstream_code, wait_until
from worker.step_state import SequenceStore
from worker.validation import StepLimits, StepPrecondition, StepValidationError, validate_step

log = logging.getLogger("worker.server")
GRPC_OPTIONS = grpc_options(so_reuseport=0)  # a second process on a taken port must fail, not share it
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["WorkerService"].full_name
PLACEHOLDER_WAIT_S = 30.0


def new_epoch() -> int:
    """Random 63-bit, never 0 (0 means 'no cache'): a restarted worker never repeats an epoch."""
    return secrets.randbits(63) or 1


# A block is a unit of allocation, not of context: larger ones only waste memory (and a huge one
# would be a memory bomb sized by the caller).
MAX_BLOCK_SIZE = 1024


@dataclass
class StepOutcome:
    reply: pb.StepReply | None           # the last stage's answer
    forward: pb.StepRequest | None       # or what goes to the next stage
    timing: pb.StageTiming
    sampled_ids: np.ndarray              # int64: sequence ids this step samples (stage 0 tracks their tokens)
    ready_at: float = 0.0                # time.monotonic() when the device has the results (see below)
    hidden: bytes | None = None          # the forward's hidden states when they travel outside it


class WorkerServicer(pb_grpc.WorkerServiceServicer):
    def __init__(self, runner, *, model_name: str, address: str = "", device: str = "cpu",
                 dtype: str = "float32", backend: str = "torch", kv_cache_bytes: int = 0,
                 fixed_num_blocks: int = 0, rpc_timeout_s: float = 120.0, replica_group: str = "",
                 simulate: str = ""):
        if not kv_cache_bytes and not fixed_num_blocks:
            raise ValueError("a worker needs a K/V capacity: kv_cache_bytes or fixed_num_blocks")
        self.runner, self.cfg = runner, runner.config
        self.model_name, self.address, self.device, self.dtype = model_name, address, device, dtype
        self.backend, self.kv_cache_bytes, self.fixed_num_blocks = backend, kv_cache_bytes, fixed_num_blocks
        self.rpc_timeout_s, self.replica_group, self.simulate = rpc_timeout_s, replica_group, simulate
        self.dtype_bytes = DTYPE_BYTES[dtype]
        self.lock = threading.Lock()  # one model, one cache: Steps run one at a time
        self.busy = BusyClock()       # Health's busy_ms: the age of the step computing now
        self.epoch, self.num_blocks, self.block_size, self.steps_served = 0, 0, 0, 0
        self.compute_s = 0.0
        self.limits: StepLimits | None = None
        self.store = SequenceStore()  # remembered tables and sampled tokens, per cache epoch
        self.next_address, self.next_meta, self.next_stub, self.next_channel = "", (), None, None
        # how to reach the next stage: plain by default, TLS when the worker was given a CA
        self.channel_factory = lambda address, options: grpc.insecure_channel(address, options=options)
        self.next_epoch: int | None = None
        self.streams: set = set()     # live StepStreams (InitCache ends them: their epoch is over)
        self.results: queue.SimpleQueue | None = None   # the StepResults subscriber of this epoch
        self.data_server = None            # worker/data_link.py: hidden states from the previous stage
        self.next_data_address = ""        # the next stage's data link ("" = forward on its StepStream)
        self.next_token = ""

    # ---- capacity / info -------------------------------------------------------------------------
    def max_blocks(self, block_size: int) -> int:
        if self.fixed_num_blocks:
            return self.fixed_num_blocks
        return self.kv_cache_bytes // self.runner.kv_bytes_per_block(block_size)

    def info(self) -> pb.WorkerInfo:
        c = self.cfg
        return pb.WorkerInfo(
            address=self.address, model_name=self.model_name, model_fingerprint=self.runner.fingerprint,
            num_layers=c.num_hidden_layers, layer_start=self.runner.layer_start, layer_end=self.runner.layer_end,
            hidden_size=c.hidden_size, vocab_size=c.vocab_size, num_attention_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=self.dtype, device=self.device,
            max_position_embeddings=c.max_position_embeddings, eos_token_ids=wire.pack(c.eos_token_ids),
            kv_cache_bytes=0 if self.fixed_num_blocks else self.kv_cache_bytes,
            fixed_num_blocks=self.fixed_num_blocks, cache_epoch=self.epoch, num_blocks=self.num_blocks,
            block_size=self.block_size, backend=self.backend, dtype_bytes=self.dtype_bytes,
            replica_group=self.replica_group, simulate=self.simulate,
            weight_bytes=int(getattr(self.runner, "weight_bytes", 0)),
            data_port=self.data_server.port if self.data_server is not None else 0)

    def Info(self, request, context):
        return self.info()

    def Health(self, request, context):
        return pb.WorkerHealthReply(ready=self.epoch != 0, cache_epoch=self.epoch, steps_served=self.steps_served,
                                    busy_ms=1e3 * self.busy.busy_s())

    # ---- cache -----------------------------------------------------------------------------------
    def InitCache(self, request, context):
        nb, bs = request.num_blocks, request.block_size
        if bs <= 0 or nb <= 0 or bs > MAX_BLOCK_SIZE:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"num_blocks ({nb}) must be > 0 and block_size ({bs}) in [1, {MAX_BLOCK_SIZE}]")
        limit = self.max_blocks(bs)
        if nb > limit:
            src = (f"--num-blocks {self.fixed_num_blocks}" if self.fixed_num_blocks else
                   f"{self.kv_cache_bytes} K/V bytes / {self.runner.kv_bytes_per_block(bs)} bytes per block")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"num_blocks {nb} exceeds this stage's capacity of {limit} blocks of {bs} ({src})")
        for stream in list(self.streams):  # steps of the old epoch must not reach the new cache
            stream.cancel()
        if self.results is not None:
            self.results.put(None)
            self.results = None
        with self.lock:
            # not ready while the old cache is dropped and the new one allocated
            self.epoch, self.num_blocks, self.block_size = 0, 0, 0
            self.store.clear()
            try:
                self.runner.init_cache(nb, bs)  # frees the old cache before allocating the new one
            except (RuntimeError, MemoryError) as e:  # CPU OOM is a RuntimeError (torch's OOM is one too)
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"allocating {nb} blocks of {bs}: {e}")
            self._connect_next(request.next_stage_address, request.next_stage_token, request.cache_epoch)
            self.next_data_address = request.next_stage_data_address
            self.num_blocks, self.block_size = nb, bs
            self.limits = StepLimits(self.cfg.vocab_size, self.cfg.hidden_size, self.cfg.max_position_embeddings,
                                     nb, bs, self.runner.is_first)
            self.epoch = request.cache_epoch or new_epoch()  # the chain's epoch when the caller picks one
        return pb.InitCacheReply(cache_epoch=self.epoch, num_blocks=nb, block_size=bs)

    def _connect_next(self, address: str, token: str, chain_epoch: int) -> None:
        if self.next_channel is not None:
            self.next_channel.close()
        # A chain epoch (the caller initialised the chain last stage first) is the next stage's too;
        # without one, the next stage's own epoch is pinned at the first forward.
        self.next_address, self.next_epoch = address, (chain_epoch or None)
        self.next_meta = (("authorization", f"Bearer {token}"),) if token else ()
        self.next_token = token
        self.next_channel = self.channel_factory(address, GRPC_OPTIONS) if address else None
        self.next_stub = pb_grpc.WorkerServiceStub(self.next_channel) if address else None

    def _pin_next_epoch(self) -> int:
        if self.next_epoch is None:  # first forward since InitCache: pin the next stage's epoch
            try:
                h = self.next_stub.Health(pb.WorkerHealthRequest(), metadata=self.next_meta, timeout=self.rpc_timeout_s)
            except grpc.RpcError as e:
                raise StepError(grpc.StatusCode.UNAVAILABLE, f"next stage {self.next_address}: {e.details()}") from None
            if not h.ready:
                raise StepError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"next stage {self.next_address} has no cache: call InitCache on it")
            self.next_epoch = h.cache_epoch
        return self.next_epoch

    def _check_epoch(self, epoch: int) -> None:
        if self.epoch == 0:
            raise StepError(grpc.StatusCode.FAILED_PRECONDITION, "worker cache is not initialised: call InitCache first")
        if epoch != self.epoch:
            raise StepError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"cache_epoch mismatch: request has {epoch}, this worker's cache is epoch {self.epoch} "
                            f"(the cache was re-initialised; its content is gone)")

    # ---- step ------------------------------------------------------------------------------------
    def _process(self, request, hidden: bytes | None = None) -> StepOutcome:
        """Validate, then run one step on this stage. Raises StepError; a rejected step leaves the
        cache and the remembered state untouched. `hidden`: the previous stage's hidden states when
        they came outside the message (the TCP data link)."""
        with self.lock:
            self._check_epoch(request.cache_epoch)
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
            t0 = time.perf_counter()
            self.busy.begin()
            try:
                self.store.release(a.release_ids)
                if a.table_delta is not None:
                    self.store.commit_tables(a.seq_ids, a.block_tables, *a.table_delta)
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
            ready_at = getattr(self.runner, "ready_at", 0.0)
            self.compute_s += timing.compute_ms / 1e3
            sampled = a.seq_ids[a.do_sample] if a.seq_ids.size else a.seq_ids
            self.steps_served += 1
            if self.runner.is_last:
                out.timings.extend(request.upstream_timings)   # empty unless the reply goes direct
                out.timings.append(timing)
                out.cache_epoch = self.epoch
                if self.runner.is_first and sampled.size and out.sampled_token_ids:
                    self.store.record_sampled(sampled, wire.unpack(out.sampled_token_ids), forwarded=False)
                return StepOutcome(out, None, timing, sampled, ready_at)
            out.cache_epoch = self._pin_next_epoch()
            if request.reply_direct:
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
        if self.next_data_address:
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

    def Step(self, request, context):
        """Unary: one step, forwarded to the next stage with a unary call."""
        try:
            o = self._process(request)
        except StepError as e:
            context.abort(e.code, e.message)
        wait_until(o.ready_at)
        if o.reply is not None:
            return o.reply
        first = self.runner.is_first and o.sampled_ids.size > 0
        if first:
            self.store.note_forwarded(o.sampled_ids)
        if o.hidden is not None:  # unary steps always carry the bytes inside the message
            o.forward.hidden_states = payload_bytes(o.hidden)
        try:
            down = self.next_stub.Step(o.forward, metadata=self.next_meta, timeout=self.rpc_timeout_s)
        except grpc.RpcError as e:
            if first:
                self.store.record_sampled(o.sampled_ids, None, forwarded=True)
            context.abort(upstream_code(e.code()), f"next stage {self.next_address}: {e.details()}")
        if first:
            self.store.record_sampled(o.sampled_ids, wire.unpack(down.sampled_token_ids), forwarded=True)
        return relayed(down, o.timing, request.step_id, self.epoch)

    def StepResults(self, request, context):
        """The last stage's replies to reply_direct steps of this epoch, in order."""
        if not self.runner.is_last or self.epoch == 0 or request.cache_epoch != self.epoch:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"StepResults needs the last stage at the chain's epoch (this stage serves "
                          f"[{self.runner.layer_start}, {self.runner.layer_end}), epoch {self.epoch})")
        q: queue.SimpleQueue = queue.SimpleQueue()
        if self.results is not None:
            self.results.put(None)               # one subscriber per epoch: the newest wins
        self.results = q
        context.add_callback(lambda: q.put(None))
        yield pb.StepReply(step_id=0, cache_epoch=self.epoch)   # subscribed: steps may flow now
        while True:
            item = q.get()
            if item is None:
                return
            reply, ready_at = item
            wait_until(ready_at)
            yield reply

    def StepStream(self, request_iterator, context):
        stream = StepPipe(self)
        context.add_callback(stream.cancel)
        self.streams.add(stream)
        threading.Thread(target=stream.pump, args=(request_iterator,), name="step-stream", daemon=True).start()
        try:
            while True:
                item = stream.out.get()
                if item is None:
                    return
                reply, ready_at = item
                wait_until(ready_at)  # an asynchronous device: not before its results exist
                yield reply
        finally:
            self.streams.discard(stream)
            stream.cancel()

    def open_link(self, on_reply, on_failed):
        """The link a pipe forwards on: the TCP data link when the next stage offers one, else its
        StepStream."""
        if self.next_data_address:
            from worker.data_link import TcpStageLink
            try:
                return TcpStageLink(self.next_data_address, self.next_token, self._pin_next_epoch(), on_reply,
                                    on_failed)
            except (OSError, ConnectionError) as e:
                raise StepError(grpc.StatusCode.UNAVAILABLE, f"data link to {self.next_data_address}: {e}") from None
        return StageLink(self.next_stub, self.next_address, self.next_meta, on_reply, on_failed)

    def close(self) -> None:
        if self.data_server is not None:
            self.data_server.close()
        for stream in list(self.streams):
            stream.cancel()
        if self.next_channel is not None:
            self.next_channel.close()


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """WorkerService calls need `authorization: Bearer <token>`; health and reflection stay open."""

    def __init__(self, token: str):
        self.expected = f"Bearer {token}".encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong worker token (authorization: Bearer ...)")
        self.deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, details):
        if details.method.startswith(f"/{SERVICE_NAME}/"):
            got = dict(details.invocation_metadata or ()).get("authorization", "")
            if not hmac.compare_digest(got.encode(), self.expected):
                return self.deny
        return continuation(details)


def build_server(servicer: WorkerServicer, host: str = "127.0.0.1", port: int = 0, token: str = "",
                 max_workers: int = 16, tls=("", "", ""), ready: bool = True):
    """A started grpc.Server with the WorkerService, grpc.health.v1 and reflection. Health "" is
    liveness (SERVING once started); the named service is readiness: SERVING now when `ready`,
    else when the caller says so (a worker that registers: once the metadata service took it).

    Returns (server, bound_port, health_servicer)."""
    interceptors = ([TokenAuthInterceptor(token)] if token else []) + [DecodeGuardInterceptor()]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), interceptors=interceptors,
                         options=GRPC_OPTIONS)
    pb_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    cert, key, client_ca = tls
    bound = add_port(server, f"{host}:{port}", cert, key, client_ca)
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}: the port is taken or the address is not this machine's")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)  # the model is loaded before this
    health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING if ready
                        else health_pb2.HealthCheckResponse.NOT_SERVING)
    return server, bound, health_servicer
