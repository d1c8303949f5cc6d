"""Registered workers and the stage chain that serves layers [0, L).

Workers register themselves (address, layer range, model fingerprint, capacity). The engine asks
`WorkerRegistry.form_chain()` for a set of stages that tile the layers contiguously; all stages
use the smallest capacity any of them can hold, because one block id names the same slots in every
layer of every stage."""
from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

import grpc

from minipaged.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("metadata_service.workers")

GRPC_OPTIONS = [("grpc.max_send_message_length", 256 << 20),
                ("grpc.max_receive_message_length", 256 << 20)]


def clip(text: str, limit: int = 64) -> str:
    """Caller-supplied text inside an error message, cut short: gRPC caps the metadata that carries it."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} chars)"


class WorkerRejected(Exception):
    """A worker that cannot join (different model, bad layer range)."""


@dataclass
class WorkerHandle:
    worker_id: str
    info: worker_pb2.WorkerInfo
    last_seen: float = field(default_factory=time.monotonic)
    channel: grpc.Channel | None = None
    stub: worker_pb2_grpc.WorkerServiceStub | None = None

    @property
    def address(self) -> str:
        return self.info.address

    def capacity_blocks(self, block_size: int) -> int:
        i = self.info
        if i.fixed_num_blocks > 0:
            return i.fixed_num_blocks
        per_block = 2 * (i.layer_end - i.layer_start) * i.num_kv_heads * block_size * i.head_dim * i.dtype_bytes
        return int(i.kv_cache_bytes // max(per_block, 1))

    def connect(self, channel_factory) -> worker_pb2_grpc.WorkerServiceStub:
        if self.stub is None:
            self.channel = channel_factory(self.address, GRPC_OPTIONS)
            self.stub = worker_pb2_grpc.WorkerServiceStub(self.channel)
        return self.stub

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.channel = self.stub = None


class WorkerRegistry:
    def __init__(self, heartbeat_timeout_s: float = 10.0, channel_factory=None):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        # (address, options) -> channel: plain text unless the service was given a worker CA
        self.channel_factory = channel_factory or (lambda a, o: grpc.insecure_channel(a, options=o))
        # () -> (fingerprint, model name) that every worker must serve, or None: the engine pins
        # the model while requests admitted for it are still pending (their token ids are its)
        self.pinned = lambda: None
        self.lock = threading.Lock()
        self.workers: dict[str, WorkerHandle] = {}   # by worker_id
        self.version = 0                              # bumped on every change: the engine re-forms

    def register(self, info: worker_pb2.WorkerInfo) -> WorkerHandle:
        if not info.address or info.layer_end <= info.layer_start or info.layer_start < 0 \
                or info.layer_end > info.num_layers:
            raise WorkerRejected(f"bad registration: address={clip(info.address)} layers "
                                 f"[{info.layer_start}, {info.layer_end}) of {info.num_layers}")
        pin = self.pinned()
        if pin is not None and pin[0] != info.model_fingerprint:
            raise WorkerRejected(
                f"model mismatch: worker {clip(info.address)} serves {clip(info.model_name)} (fingerprint "
                f"{info.model_fingerprint[:12]}) but requests admitted for {clip(pin[1])} (fingerprint "
                f"{pin[0][:12]}) are still pending; they must finish (or be cancelled) first")
        with self.lock:
            others = [w for w in self.workers.values() if w.address != info.address]
            for w in others:
                if w.info.model_fingerprint != info.model_fingerprint:
                    raise WorkerRejected(
                        f"model mismatch: worker {clip(info.address)} serves {clip(info.model_name)} "
                        f"(fingerprint {info.model_fingerprint[:12]}) but {w.address} serves "
                        f"{clip(w.info.model_name)} (fingerprint {w.info.model_fingerprint[:12]})")
            for w in [w for w in self.workers.values() if w.address == info.address]:
                w.close()
                del self.workers[w.worker_id]  # a restarted worker replaces its old entry
            handle = WorkerHandle(worker_id=uuid.uuid4().hex[:12], info=info)
            self.workers[handle.worker_id] = handle
            self.version += 1
        log.info("worker %s registered: layers [%d, %d) of %s", info.address, info.layer_start,
                 info.layer_end, info.model_name)
        return handle

    def heartbeat(self, worker_id: str) -> bool:
        with self.lock:
            w = self.workers.get(worker_id)
            if w is None:
                return False
            w.last_seen = time.monotonic()
            return True

    def drop(self, worker_ids) -> None:
        with self.lock:
            for wid in worker_ids:
                w = self.workers.pop(wid, None)
                if w is not None:
                    log.warning("worker %s dropped", w.address)
                    w.close()
                    self.version += 1

    def expired(self) -> list[str]:
        now = time.monotonic()
        with self.lock:
            return [w.worker_id for w in self.workers.values()
                    if now - w.last_seen > self.heartbeat_timeout_s]

    def form_chain(self) -> list[WorkerHandle] | None:
        """Stages covering [0, L) contiguously, preferring the most recently registered worker for
        each start layer. None while the layers are not covered."""
        with self.lock:
            workers = sorted(self.workers.values(), key=lambda w: w.last_seen, reverse=True)
        if not workers:
            return None
        num_layers = workers[0].info.num_layers
        by_start: dict[int, WorkerHandle] = {}
        for w in workers:
            by_start.setdefault(w.info.layer_start, w)
        chain, layer = [], 0
        while layer < num_layers:
            w = by_start.get(layer)
            if w is None:
                return None
            chain.append(w)
            layer = w.info.layer_end
        return chain

    def __len__(self) -> int:
        return len(self.workers)
