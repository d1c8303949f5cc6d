"""The WorkerService: one pipeline stage (a contiguous layer range) serving Steps.

Data flow: the metadata service sends Steps to stage 0 only. Stage k runs its layers and forwards
the hidden states to stage k+1 (same metadata fields, input_ids dropped, hidden_states = raw bytes
of the [T, hidden] tensor, named by hidden_dtype). The last stage samples; its reply travels back
up the chain, each stage prepending its StageTiming. So the metadata service only ever sees sampled
tokens; hidden states go worker to worker.

The parts: this module holds the stage's state, Info/Health, InitCache and the gRPC server;
worker/step_execution.py runs one step; worker/step_rpcs.py has the RPCs that carry steps
(StepStream, StepResults, unary Step); worker/next_stage.py reaches the next stage.

Epochs: every InitCache gives this stage a fresh cache_epoch (the chain's, chosen by the metadata
service, which initialises the chain last stage first). A Step carrying another epoch fails with
FAILED_PRECONDITION instead of reading lost K/V; so does one that assumes remembered state this
stage does not hold (worker/step_state.py)."""
from __future__ import annotations

import hmac
import queue
import secrets
import threading
from concurrent import futures

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from minipaged import wire
from minipaged.constants import DTYPE_BYTES
from minipaged.rpc import DecodeGuardInterceptor
from minipaged.tls import add_port
from minipaged.v1 import worker_pb2 as pb
from minipaged.v1 import worker_pb2_grpc as pb_grpc
from worker.busy_clock import BusyClock
from worker.kv_move import PullQueue
from worker.first_stage import FirstStageLink
from worker.next_stage import GRPC_OPTIONS, NextStage, insecure_channel
from worker.omp_pool import in_own_thread
from worker.step_execution import StepExecution
from worker.step_rpcs import StepRpcs
from worker.step_state import SequenceStore, Ticket
from worker.validation import StepLimits

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["WorkerService"].full_name
# A block is a unit of allocation, not of context: larger ones only waste memory (and a huge one
# would be a memory bomb sized by the caller).
MAX_BLOCK_SIZE = 1024


def new_epoch() -> int:
    """Random 63-bit, never 0 (0 means 'no cache'): a restarted worker never repeats an epoch."""
    return secrets.randbits(63) or 1


class WorkerServicer(StepExecution, StepRpcs, pb_grpc.WorkerServiceServicer):
    def __init__(self, runner, *, model_name: str, address: str = "", device: str = "cpu",
                 dtype: str = "float32", backend: str = "torch", kv_cache_bytes: int = 0,
                 fixed_num_blocks: int = 0, rpc_timeout_s: float = 120.0, replica_group: str = "",
                 simulate: str = "", kv_tier_bytes: int = 0, role: str = "both"):
        if not kv_cache_bytes and not fixed_num_blocks:
            raise ValueError("a worker needs a K/V capacity: kv_cache_bytes or fixed_num_blocks")
        self.runner, self.cfg = runner, runner.config
        self.model_name, self.address, self.device, self.dtype = model_name, address, device, dtype
        self.backend, self.kv_cache_bytes, self.fixed_num_blocks = backend, kv_cache_bytes, fixed_num_blocks
        self.rpc_timeout_s, self.replica_group, self.simulate = rpc_timeout_s, replica_group, simulate
        self.kv_tier_bytes = kv_tier_bytes   # the second KV tier's budget; the service picks its slot count
        self.role = role                     # prefill, decode or both: which chains this stage joins
        self.peer_token = ""                 # the token other workers' data links expect (InitCache's)
        self.dtype_bytes = DTYPE_BYTES[dtype]
        self.lock = threading.Lock()  # one model, one cache: Steps run one at a time
        self.busy = BusyClock()       # Health's busy_ms: the age of the step computing now
        self.epoch, self.num_blocks, self.block_size, self.steps_served = 0, 0, 0, 0
        self.compute_s = 0.0
        self.limits: StepLimits | None = None
        self.store = SequenceStore()  # remembered tables and sampled tokens, per cache epoch
        self.next_stage = NextStage(rpc_timeout_s)
        self.first_stage = FirstStageLink()   # the last stage of a pipeline: tokens back to stage 0
        self.awaiting: dict[int, Ticket] = {}   # stage 0: step id -> sequences whose tokens it awaits
        # how to reach the next stage: plain by default, TLS when the worker was given a CA
        self.channel_factory = insecure_channel
        self.streams: set = set()     # live StepStreams (InitCache ends them: their epoch is over)
        self.results: queue.SimpleQueue | None = None   # the StepResults subscriber of this epoch
        self.data_server = None            # worker/data_link.py: hidden states from the previous stage
        self.pulls = PullQueue()           # K/V moves' reads, beside the steps (worker/kv_move.py)

    # ---- capacity / info -------------------------------------------------------------------------
    def max_blocks(self, block_size: int) -> int:
        if self.fixed_num_blocks:
            return self.fixed_num_blocks
        return self.kv_cache_bytes // self.runner.kv_bytes_per_block(block_size)

    def info(self) -> pb.WorkerInfo:
        c = self.cfg   # max_position_embeddings below carries the served context (RoPE scaling included)
        return pb.WorkerInfo(
            address=self.address, model_name=self.model_name, model_fingerprint=self.runner.fingerprint,
            num_layers=c.num_hidden_layers, layer_start=self.runner.layer_start, layer_end=self.runner.layer_end,
            hidden_size=c.hidden_size, vocab_size=c.vocab_size, num_attention_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=self.dtype, device=self.device,
            max_position_embeddings=c.max_context, eos_token_ids=wire.pack(c.eos_token_ids),
            kv_cache_bytes=0 if self.fixed_num_blocks else self.kv_cache_bytes,
            fixed_num_blocks=self.fixed_num_blocks, cache_epoch=self.epoch, num_blocks=self.num_blocks,
            block_size=self.block_size, backend=self.backend, dtype_bytes=self.dtype_bytes,
            replica_group=self.replica_group, simulate=self.simulate,
            weight_bytes=int(getattr(self.runner, "weight_bytes", 0)),
            data_port=self.data_server.port if self.data_server is not None else 0,
            kv_tier_bytes=self.kv_tier_bytes, role=self.role,
            host_link_bytes_per_s=getattr(self.runner, "host_link", 0.0), peak_flops=getattr(self.runner, "peak_flops", 0.0))

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
        tier_limit = self.kv_tier_bytes // self.runner.kv_bytes_per_block(bs)
        if not 0 <= request.tier_blocks <= tier_limit:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"tier_blocks {request.tier_blocks} exceeds this stage's KV tier of {tier_limit} blocks "
                          f"of {bs} (--kv-tier-bytes {self.kv_tier_bytes})")
        for stream in list(self.streams):  # steps of the old epoch must not reach the new cache
            stream.cancel()
        if self.results is not None:
            self.results.put(None)
            self.results = None
        with self.lock:
            # not ready while the old cache is dropped and the new one allocated
            self.epoch, self.num_blocks, self.block_size = 0, 0, 0
            self.store.clear()
            what = f"allocating {nb} blocks of {bs}"
            try:
                # frees the old cache before allocating the new one; on a thread of its own, which
                # takes its OpenMP pool with it when done (worker/omp_pool.py)
                in_own_thread(self.runner.init_cache, nb, bs)
                if request.tier_blocks:
                    what = f"allocating the KV tier's {request.tier_blocks} blocks (--kv-tier-bytes {self.kv_tier_bytes})"
                    in_own_thread(self.runner.kv_cache.attach_tier, request.tier_blocks)
            except (RuntimeError, MemoryError) as e:  # CPU OOM is a RuntimeError (torch's OOM is one too)
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{what}: {e}")
            self.next_stage.connect(request.next_stage_address, request.next_stage_token, request.cache_epoch,
                                    request.next_stage_data_address, self.channel_factory)
            self.first_stage.connect(request.first_stage_address, request.next_stage_token, self.channel_factory,
                                     GRPC_OPTIONS, request.first_stage_data_address, request.cache_epoch)
            self.awaiting.clear()
            self.peer_token = request.next_stage_token
            self.num_blocks, self.block_size = nb, bs
            self.limits = StepLimits(self.cfg.vocab_size, self.cfg.hidden_size, self.cfg.max_context,
                                     nb, bs, self.runner.is_first, request.tier_blocks,
                                     self.runner.is_last)
            self.epoch = request.cache_epoch or new_epoch()  # the chain's epoch when the caller picks one
        return pb.InitCacheReply(cache_epoch=self.epoch, num_blocks=nb, block_size=bs)

    def close(self) -> None:
        if self.data_server is not None:
            self.data_server.close()
        for stream in list(self.streams):
            stream.cancel()
        self.next_stage.close()
        self.first_stage.close()


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
