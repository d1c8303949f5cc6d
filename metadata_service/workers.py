"""Registered workers, and how they form chains that serve layers [0, L).

Workers register themselves (address, layer range, model fingerprint, capacity, replica group) and
then heartbeat; one silent for longer than the lease is dropped. The rule for chains: within a
replica group, as many disjoint chains as the free workers allow, each a set of stages that tile
the layers contiguously, fewest stages first (so four workers serving all layers are four replicas;
two 0:2 and two 2:4 are two 2-stage chains). Workers left over are standbys: when a chain loses a
stage, its surviving workers and the standbys form new chains. A chain's stages all use the smallest
capacity any of them can hold, because one block id names the same slots in every layer of every
stage."""
from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

import grpc

from minipaged.constants import grpc_options, kv_bytes_per_block
from minipaged.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("metadata_service.workers")

GRPC_OPTIONS = grpc_options()
# Our servers: the same caps, and a port already taken is a start error, never a shared port.
SERVER_OPTIONS = grpc_options(so_reuseport=0)


def clip(text: str, limit: int = 64) -> str:
    """Caller-supplied text inside an error message, cut short: gRPC caps the metadata that carries it."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} chars)"


class WorkerRejected(Exception):
    """A worker that cannot join: a malformed WorkerInfo (`invalid`: INVALID_ARGUMENT), or one that
    does not fit now (another model is pinned: FAILED_PRECONDITION)."""

    def __init__(self, message: str, invalid: bool = False):
        super().__init__(message)
        self.invalid = invalid


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

    @property
    def role(self) -> str:
        return self.info.role or "both"

    def block_bytes(self, block_size: int) -> int:
        """K and V of one block over this worker's layers."""
        i = self.info
        return kv_bytes_per_block(i.layer_end - i.layer_start, i.num_kv_heads, i.head_dim, block_size, i.dtype_bytes)

    def capacity_blocks(self, block_size: int) -> int:
        i = self.info
        if i.fixed_num_blocks > 0:
            return i.fixed_num_blocks
        return int(i.kv_cache_bytes // max(self.block_bytes(block_size), 1))

    def tier_capacity_blocks(self, block_size: int) -> int:
        """Blocks of this stage's layers its second KV tier can hold (--kv-tier-bytes)."""
        return int(self.info.kv_tier_bytes // max(self.block_bytes(block_size), 1))

    def load_seconds(self, block_size: int) -> float:
        """A tier load of one block into this stage (0: its link is unknown)."""
        link = self.info.host_link_bytes_per_s
        return self.block_bytes(block_size) / link if link > 0 else 0.0

    def recompute_seconds(self, block_size: int) -> float:
        """Recomputing one block's tokens on this stage: 2 FLOPs a weight a token (0: unknown)."""
        i = self.info
        if i.peak_flops <= 0 or i.weight_bytes <= 0:
            return 0.0
        return 2.0 * i.weight_bytes / max(1, i.dtype_bytes) * block_size / i.peak_flops

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
    def __init__(self, lease_s: float = 4.0, channel_factory=None):
        self.lease_s = lease_s
        # (address, options) -> channel: plain text unless the service was given a worker CA
        self.channel_factory = channel_factory or (lambda a, o: grpc.insecure_channel(a, options=o))
        # () -> (fingerprint, model name) that every worker must serve, or None: the engine pins
        # the model while requests admitted for it are still pending (their token ids are its)
        self.pinned = lambda: None
        self.refusal_hint = lambda: ""                # what a refused worker's operator should do
        self.last_refusal = ""                        # for "no worker is registered" (not_ready_reason)
        self.lock = threading.Lock()
        self.workers: dict[str, WorkerHandle] = {}   # by worker_id
        # worker_id -> why: stages of a chain that missed its step deadline; none joins a chain until
        # its Health says it is idle (the engine polls), so a hung device is not handed new work
        self.quarantined: dict[str, str] = {}
        # SIGTERM's grace: the server takes no new RPCs, heartbeats included, while the streams in
        # flight finish on their chains; leases are not held against the workers meanwhile
        self.draining = False
        self.drop_reasons: dict[str, str] = {}      # worker_id -> why it was dropped (its next heartbeat)

    def register(self, info: worker_pb2.WorkerInfo) -> WorkerHandle:
        if not info.address or info.layer_end <= info.layer_start or info.layer_start < 0 \
                or info.layer_end > info.num_layers:
            raise WorkerRejected(f"bad registration: address={clip(info.address)} layers "
                                 f"[{info.layer_start}, {info.layer_end}) of {info.num_layers}", invalid=True)
        pin = self.pinned()
        if pin is not None and pin[0] != info.model_fingerprint:
            self.last_refusal = (f"refused worker {clip(info.address)} of model {clip(info.model_name)} "
                                 f"at {time.strftime('%H:%M:%S')}")
            log.warning("%s: pending requests are for %s", self.last_refusal, pin[1])
            raise WorkerRejected(
                f"model mismatch: worker {clip(info.address)} serves {clip(info.model_name)} (fingerprint "
                f"{info.model_fingerprint[:12]}) but requests admitted for {clip(pin[1])} (fingerprint "
                f"{pin[0][:12]}) are still pending; {self.refusal_hint()}")
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
            self.last_refusal = ""  # a worker joined: an old refusal explains nothing any more
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

    def quarantine(self, worker_ids, why: str) -> None:
        with self.lock:
            for wid in worker_ids:
                if wid in self.workers:
                    self.quarantined[wid] = why
                    log.warning("worker %s held out of chains until idle: %s", self.workers[wid].address, why)

    def drop(self, worker_ids, why: str = "") -> None:
        """Forget these workers; `why` is said to each at its next heartbeat (HeartbeatReply.reason)."""
        with self.lock:
            for wid in worker_ids:
                self.quarantined.pop(wid, None)
                w = self.workers.pop(wid, None)
                if w is not None:
                    log.warning("worker %s dropped%s", w.address, f": {why}" if why else "")
                    w.close()
                    if why:
                        self.drop_reasons[wid] = why
                        while len(self.drop_reasons) > 256:      # (only the recent ones are asked for)
                            self.drop_reasons.pop(next(iter(self.drop_reasons)))

    def deregister(self, worker_id: str) -> bool:
        """A worker stopping cleanly: gone now, not after its lease runs out."""
        with self.lock:
            self.quarantined.pop(worker_id, None)
            w = self.workers.pop(worker_id, None)
            if w is None:
                return False
            w.close()
        log.info("worker %s deregistered (stopped cleanly)", w.address)
        return True

    def expired(self) -> list[str]:
        if self.draining:     # our port is closed to their heartbeats: silence is ours, not theirs
            return []
        now = time.monotonic()
        with self.lock:
            return [w.worker_id for w in self.workers.values() if now - w.last_seen > self.lease_s]

    def form_chains(self, busy: set[str]) -> list[list[WorkerHandle]]:
        """New chains from the workers not in `busy` (ids of workers already in a chain)."""
        with self.lock:
            free = [w for w in self.workers.values() if w.worker_id not in busy]
        groups: dict[tuple, list[WorkerHandle]] = {}
        for w in sorted(free, key=lambda w: w.info.address):   # a chain's stages share a role
            groups.setdefault((w.info.replica_group, w.role), []).append(w)
        chains = []
        for members in groups.values():
            while True:
                chain = shortest_chain(members)
                if chain is None:
                    break
                chains.append(chain)
                members = [w for w in members if w not in chain]
        return chains

    def explain(self, busy: set[str]) -> str:
        """Why the free workers form no chain, in words ("layers 2:4 have no worker")."""
        with self.lock:
            free = [w for w in self.workers.values() if w.worker_id not in busy]
        if not self.workers:
            return "no worker is registered" + (f" ({self.last_refusal})" if self.last_refusal else "")
        held = [f"{w.address} ({self.quarantined[w.worker_id]})" for w in self.workers.values()
                if w.worker_id in self.quarantined]
        held_s = f"; held out until idle after a missed step deadline: {', '.join(held)}" if held else ""
        if not free:
            return held_s.lstrip("; ")
        return coverage_gaps(free) + held_s

    def __len__(self) -> int:
        return len(self.workers)



def shortest_chain(workers: list[WorkerHandle]) -> list[WorkerHandle] | None:
    """Fewest stages tiling [0, L) (breadth-first over layer boundaries), or None."""
    if not workers:
        return None
    num_layers = workers[0].info.num_layers
    by_start: dict[int, list[WorkerHandle]] = {}
    for w in workers:
        by_start.setdefault(w.info.layer_start, []).append(w)
    paths: dict[int, list[WorkerHandle]] = {0: []}
    frontier = [0]
    while frontier:
        nxt = []
        for layer in frontier:
            for w in by_start.get(layer, []):
                end = w.info.layer_end
                if end not in paths:
                    paths[end] = paths[layer] + [w]
                    nxt.append(end)
        if num_layers in paths:
            return paths[num_layers]
        frontier = nxt
    return None


def coverage_gaps(workers: list[WorkerHandle]) -> str:
    num_layers = workers[0].info.num_layers
    reach, frontier = {0}, [0]
    while frontier:
        layer = frontier.pop()
        for w in workers:
            if w.info.layer_start == layer and w.info.layer_end not in reach:
                reach.add(w.info.layer_end)
                frontier.append(w.info.layer_end)
    r = max(reach)
    if r >= num_layers:       # the layers are covered, but not by workers that may form one chain
        each = ", ".join(f"{w.info.layer_start}:{w.info.layer_end} {w.role}"
                         + (f" group {w.info.replica_group!r}" if w.info.replica_group else "") + f" at {w.address}"
                         for w in workers)
        return (f"no chain forms: its stages must share one --role and --replica-group, and no such set of free "
                f"workers covers layers 0:{num_layers} ({each})")
    starts = sorted({w.info.layer_start for w in workers if w.info.layer_start > r})
    gap_end = starts[0] if starts else num_layers
    parts = [f"layers {r}:{gap_end} have no worker"]
    for w in workers:
        a, b = w.info.layer_start, w.info.layer_end
        if a not in reach and a < r + 1 and any(x.info.layer_start < a < x.info.layer_end for x in workers):
            other = next(x for x in workers if x.info.layer_start < a < x.info.layer_end)
            parts.append(f"worker {w.address} serves {a}:{b}, overlapping {other.info.layer_start}:"
                         f"{other.info.layer_end} ({other.address})")
    served = ", ".join(f"{w.info.layer_start}:{w.info.layer_end} at {w.address}" for w in workers)
    return "; ".join(parts) + f" (free workers: {served})"
