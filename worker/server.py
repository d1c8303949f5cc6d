"""The WorkerService: one pipeline stage (a contiguous layer range) serving Step RPCs.

Data flow: the metadata service calls Step on stage 0 only. Stage k runs its layers and forwards the
hidden states to stage k+1 over that stage's own Step RPC (same metadata fields, input_ids dropped,
hidden_states = raw bytes of the [T, hidden] tensor in its dtype, named by hidden_dtype). The last
stage samples and its reply travels back up the chain, each stage prepending its StageTiming. So the
metadata service only ever sees sampled tokens; hidden states go worker to worker.

Epochs: every InitCache gives this stage a fresh cache_epoch: the one in the request when the
metadata service picks a chain-wide epoch (it initialises the chain last stage first), else a random
one. A forwarding stage sends the next stage the chain epoch, or, without one, the next stage's own
epoch pinned at the first forward after InitCache (nothing was written down the chain in this epoch
before that). Either way, if the next stage restarts or is re-initialised its epoch changes and the
chain fails with FAILED_PRECONDITION instead of reading lost K/V.

No per-sequence state is kept: every Step carries the whole batch description."""
from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from minipaged import wire
from minipaged.rpc import DecodeGuardInterceptor
from minipaged.tls import add_port
from minipaged.v1 import worker_pb2 as pb
from minipaged.v1 import worker_pb2_grpc as pb_grpc
from worker.validation import StepLimits, StepValidationError, validate_step

log = logging.getLogger("worker.server")
MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # a long prefill's hidden states fit with room to spare
GRPC_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["WorkerService"].full_name
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64,
                "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def new_epoch() -> int:
    """Random 63-bit, never 0 (0 means 'no cache'): a restarted worker never repeats an epoch."""
    return secrets.randbits(63) or 1


# A block is a unit of allocation, not of context: larger ones only waste memory (and a huge one
# would be a memory bomb sized by the caller).
MAX_BLOCK_SIZE = 1024


class WorkerServicer(pb_grpc.WorkerServiceServicer):
    def __init__(self, runner, *, model_name: str, address: str = "", device: str = "cpu",
                 dtype: str = "float32", backend: str = "torch", kv_cache_bytes: int = 0,
                 fixed_num_blocks: int = 0, rpc_timeout_s: float = 120.0):
        if not kv_cache_bytes and not fixed_num_blocks:
            raise ValueError("a worker needs a K/V capacity: kv_cache_bytes or fixed_num_blocks")
        self.runner, self.cfg = runner, runner.config
        self.model_name, self.address, self.device, self.dtype = model_name, address, device, dtype
        self.backend, self.kv_cache_bytes, self.fixed_num_blocks = backend, kv_cache_bytes, fixed_num_blocks
        self.rpc_timeout_s = rpc_timeout_s
        self.dtype_bytes = torch.empty((), dtype=TORCH_DTYPES[dtype]).element_size()
        self.lock = threading.Lock()  # one model, one cache: Steps run one at a time
        self.epoch, self.num_blocks, self.block_size, self.steps_served = 0, 0, 0, 0
        self.limits: StepLimits | None = None
        self.next_address, self.next_meta, self.next_stub, self.next_channel = "", (), None, None
        # how to reach the next stage: plain by default, TLS when the worker was given a CA
        self.channel_factory = lambda address, options: grpc.insecure_channel(address, options=options)
        self.next_epoch: int | None = None

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
            block_size=self.block_size, backend=self.backend, dtype_bytes=self.dtype_bytes)

    def Info(self, request, context):
        return self.info()

    def Health(self, request, context):
        return pb.WorkerHealthReply(ready=self.epoch != 0, cache_epoch=self.epoch, steps_served=self.steps_served)

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
        with self.lock:
            # not ready while the old cache is dropped and the new one allocated
            self.epoch, self.num_blocks, self.block_size = 0, 0, 0
            try:
                self.runner.init_cache(nb, bs)  # frees the old cache before allocating the new one
            except (torch.OutOfMemoryError, RuntimeError, MemoryError) as e:  # CPU OOM is a RuntimeError
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"allocating {nb} blocks of {bs}: {e}")
            self._connect_next(request.next_stage_address, request.next_stage_token, request.cache_epoch)
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
        self.next_channel = self.channel_factory(address, GRPC_OPTIONS) if address else None
        self.next_stub = pb_grpc.WorkerServiceStub(self.next_channel) if address else None

    def _check_epoch(self, epoch: int, context) -> None:
        if self.epoch == 0:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "worker cache is not initialised: call InitCache first")
        if epoch != self.epoch:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"cache_epoch mismatch: request has {epoch}, this worker's cache is epoch {self.epoch} "
                          f"(the cache was re-initialised; its content is gone)")

    def _call_next(self, method: str, request, context):
        """Call the next stage with its pinned epoch; map its failures to a status naming it."""
        if self.next_epoch is None:  # first forward since InitCache: pin the next stage's epoch
            h = self._rpc_next("Health", pb.WorkerHealthRequest(), context)
            if not h.ready:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"next stage {self.next_address} has no cache: call InitCache on it")
            self.next_epoch = h.cache_epoch
        request.cache_epoch = self.next_epoch
        return self._rpc_next(method, request, context)

    def _rpc_next(self, method: str, request, context):
        try:
            return getattr(self.next_stub, method)(request, metadata=self.next_meta, timeout=self.rpc_timeout_s)
        except grpc.RpcError as e:
            code = e.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                code = grpc.StatusCode.UNAVAILABLE
            context.abort(code, f"next stage {self.next_address}: {e.details()}")

    def CopyBlocks(self, request, context):
        with self.lock:
            self._check_epoch(request.cache_epoch, context)
            try:
                src = wire.unpack(request.src_blocks, wire.INT32, name="src_blocks")
                dst = wire.unpack(request.dst_blocks, wire.INT32, name="dst_blocks", count=src.size)
            except wire.WireError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            for name, ids in (("src_blocks", src), ("dst_blocks", dst)):
                if ((ids < 0) | (ids >= self.num_blocks)).any():
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"{name}: block ids must be in [0, {self.num_blocks})")
            if np.unique(dst).size != dst.size:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "dst_blocks: duplicate destination blocks")
            if src.size:
                self.runner.kv_cache.copy_blocks(src, dst)
            if self.next_stub is not None:
                self._call_next("CopyBlocks", pb.CopyBlocksRequest(src_blocks=request.src_blocks,
                                                                   dst_blocks=request.dst_blocks), context)
        return pb.CopyBlocksReply(copied=int(src.size))

    # ---- step ------------------------------------------------------------------------------------
    def Step(self, request, context):
        with self.lock:
            self._check_epoch(request.cache_epoch, context)
            try:
                a = validate_step(request, self.limits)
            except StepValidationError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step {request.step_id}: {e}")
            t0 = time.perf_counter()
            try:
                out = self._compute(request, a)  # the sampled reply, or the request for the next stage
            except Exception as e:  # a bug or a device failure: say where, never hang the chain
                log.exception("step %d failed", request.step_id)
                code = (grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(e, torch.OutOfMemoryError)
                        else grpc.StatusCode.INTERNAL)
                context.abort(code, f"step {request.step_id} on stage [{self.runner.layer_start}, "
                                    f"{self.runner.layer_end}): {type(e).__name__}: {e}")
            compute_ms = (time.perf_counter() - t0) * 1e3  # excludes the downstream stages
            timing = pb.StageTiming(layer_start=self.runner.layer_start, layer_end=self.runner.layer_end,
                                    compute_ms=compute_ms)
            if not self.runner.is_last:
                down = self._call_next("Step", out, context)
                reply = pb.StepReply(step_id=request.step_id, sampled_token_ids=down.sampled_token_ids,
                                     logprobs=down.logprobs, logits=down.logits, timings=[timing, *down.timings])
            else:
                reply = out
                reply.timings.append(timing)
            reply.cache_epoch = self.epoch
            self.steps_served += 1
            return reply

    def _compute(self, request, a):
        hidden_in = None
        if a.hidden_states is not None:
            # bytearray: one copy into writable memory (the runner may compute in place)
            hidden_in = torch.frombuffer(bytearray(a.hidden_states), dtype=TORCH_DTYPES[a.hidden_dtype])
            hidden_in = hidden_in.view(a.num_tokens, self.cfg.hidden_size).to(self.device, TORCH_DTYPES[self.dtype])
        batch = self.runner.make_batch(a.input_ids, a.positions, a.slot_mapping, a.query_start_loc,
                                       a.seq_lens, a.block_tables)
        hidden = self.runner.execute(batch, hidden_in)
        return self._sample(request, a, hidden) if self.runner.is_last else self._forward_request(request, hidden)

    def _forward_request(self, request, hidden: torch.Tensor) -> pb.StepRequest:
        h = hidden.detach().contiguous().cpu()
        fwd = pb.StepRequest()
        fwd.CopyFrom(request)
        fwd.ClearField("input_ids")
        fwd.hidden_states = h.view(torch.uint8).numpy().tobytes()  # raw bytes: works for bfloat16 too
        fwd.hidden_dtype = DTYPE_NAMES[h.dtype]
        return fwd

    def _sample(self, request, a, hidden: torch.Tensor) -> pb.StepReply:
        reply = pb.StepReply(step_id=request.step_id)
        if not a.do_sample.any():
            return reply  # a prefill chunk that ends mid-prompt: nothing to sample
        ids, logprobs, logits = self.runner.sample(
            hidden, a.query_start_loc, a.do_sample, a.temperature, a.top_p, a.top_k, a.seeds, a.sample_offsets,
            request.return_logprobs, request.return_logits)
        reply.sampled_token_ids = wire.pack(ids)
        if request.return_logprobs and logprobs is not None:
            reply.logprobs = wire.pack(logprobs, wire.FLOAT32)
        if request.return_logits and logits is not None:
            if isinstance(logits, torch.Tensor):
                logits = logits.detach().to(torch.float64).cpu().numpy()
            reply.logits = wire.pack(logits, wire.FLOAT64)
        return reply

    def close(self) -> None:
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
                 max_workers: int = 8, tls=("", "", "")):
    """A started grpc.Server with the WorkerService, grpc.health.v1 (SERVING) and reflection.

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
        raise OSError(f"could not bind {host}:{port}")
    server.start()
    for name in ("", SERVICE_NAME):  # the model is loaded before the server is built
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer
