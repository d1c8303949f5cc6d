"""The sharded metadata service's front: one address, N shard services behind it (shards.py).

Jobs are split over the shards by their ready chains (front_jobs.py); a Generate stream goes to the
shard its prompt's prefix went to unless another is much less busy (front_routing.py); a worker registers into one shard (stages of one chain together); Stats and pool
snapshots are the shards' merged; the block API is shard 0's. The front keeps no state that a
restart would lose: job ids say how they were split, worker ids say their shard."""
from __future__ import annotations

import os
import sys
import threading
import time

import grpc

from minipaged.constants import WAITING_KEY
from minipaged.v1 import metadata_pb2, metadata_pb2_grpc

from .front_jobs import FrontJobRpcs
from .shards import ShardSet
from .workers import clip

RECENT_S = 5.0            # a registration counts this long before the shards' polled Stats show it
CHAIN_ID_STRIDE = 1000   # shard k's chain c is chain k * 1000 + c in Stats and pool snapshots
SUMMED = ("num_blocks", "used_blocks", "free_blocks", "cached_blocks", "internal_fragmentation_tokens",
          "running", "waiting", "preemptions", "prefix_cache_queries", "prefix_cache_hits", "steps",
          "generated_tokens", "prompt_tokens", "tokens_per_second", "num_workers", "live_sequences",
          "shared_blocks", "num_chains", "standby_workers", "metadata_cpu_seconds", "tier_blocks",
          "tier_used_blocks", "tier_queries", "tier_hits", "tier_saved_blocks", "tier_loaded_blocks",
          "kv_moves", "kv_moved_blocks", "kv_move_failures", "max_waiting")
FIRST = ("block_size", "model", "max_model_len", "model_fingerprint", "model_shape", "tier_block_bytes")


def merge_stats(parts: list[metadata_pb2.StatsReply], front_cpu_s: float) -> metadata_pb2.StatsReply:
    out = metadata_pb2.StatsReply()
    for name in SUMMED:
        setattr(out, name, sum(getattr(p, name) for p in parts))
    ready = [p for p in parts if p.ready] or parts
    for name in FIRST:
        setattr(out, name, next((getattr(p, name) for p in ready if getattr(p, name)), getattr(out, name)))
    out.metadata_cpu_seconds += front_cpu_s
    if parts:                                      # the block API is shard 0's
        out.block_api_blocks, out.block_api_used_blocks = parts[0].block_api_blocks, parts[0].block_api_used_blocks
    out.ready = any(p.ready for p in parts)
    out.invariants_ok = all(p.invariants_ok for p in parts)
    out.cache_epoch = max((p.cache_epoch for p in parts), default=0)
    out.prefix_cache_hit_rate = out.prefix_cache_hits / out.prefix_cache_queries if out.prefix_cache_queries else 0.0
    out.kv_utilization = max((p.kv_utilization for p in parts), default=0.0)
    busy = [p for p in parts if p.steps]
    out.metadata_ms_per_step = sum(p.metadata_ms_per_step for p in busy) / len(busy) if busy else 0.0
    if not out.ready:
        out.not_ready_reason = "; ".join(f"shard {k}: {p.not_ready_reason}" for k, p in enumerate(parts))
    for k, p in enumerate(parts):
        for c in p.chains:
            c.chain_id += k * CHAIN_ID_STRIDE
            out.chains.append(c)
    return out


# gRPC's own words for a connection that went (a shard's status never says these)
_TRANSPORT = ("Socket closed", "Stream removed", "Connection reset", "failed to connect", "Broken pipe")


def pass_waiting_note(calls, context) -> None:
    """A shard parked until its first worker registers says so in its headers (before its reply):
    the first such note of `calls` goes on in ours. A parked shard sends its headers at once, and
    any other call's come at the latest with its reply, so reading them in turn waits for no park."""
    for call in calls:
        try:
            note = dict(call.initial_metadata() or ()).get(WAITING_KEY)
        except grpc.RpcError:
            continue
        if note:
            context.send_initial_metadata(((WAITING_KEY, note),))
            return


def _transport_lost(details: str) -> bool:
    return any(t in details for t in _TRANSPORT)


class FrontServicer(FrontJobRpcs, metadata_pb2_grpc.MetadataServiceServicer):
    def __init__(self, shards: ShardSet):
        self.shards = shards
        # registrations are decided one at a time, and those the shards' Stats may not show yet are
        # remembered a while: two workers of different models registering at once both got in
        self._registering = threading.Lock()
        self._recent: list[tuple[float, str, str]] = []    # (when, fingerprint, model) of accepted workers

    # ------------------------------------------------------------------ forwarding
    @staticmethod
    def _metadata(context) -> tuple:
        """What a shard must see of the caller: its token."""
        return tuple((k, v) for k, v in context.invocation_metadata() if k == "authorization")

    @staticmethod
    def _timeout(context) -> float | None:
        """The caller's deadline, for the call to a shard (no deadline: a huge number, which gRPC refuses)."""
        left = context.time_remaining()
        return None if left is None or left > 1e6 else max(0.0, left)

    def _forward(self, k: int, method: str, request, context):
        try:
            return getattr(self.shards.stubs[k], method)(request, metadata=self._metadata(context),
                                                         timeout=self._timeout(context))
        except grpc.RpcError as e:
            context.abort(e.code(), e.details())

    def _each(self, calls: dict, method: str, context, pass_note: bool = False) -> dict:
        """{shard: request} -> {shard: reply or grpc.RpcError}, the calls made at once. `pass_note`:
        a shard's "waiting for a worker" note goes on to the caller before the replies (SubmitJob)."""
        md, left = self._metadata(context), self._timeout(context)
        futures = {k: getattr(self.shards.stubs[k], method).future(r, metadata=md, timeout=left)
                   for k, r in calls.items()}
        if pass_note:
            pass_waiting_note(futures.values(), context)
        out = {}
        for k, f in futures.items():
            try:
                out[k] = f.result()
            except grpc.RpcError as e:
                out[k] = e
        return out

    # ------------------------------------------------------------------ generation
    def Generate(self, request, context):
        k, blocks = self.shards.router.choose(request, self.shards.stats)
        context.add_callback(lambda: self.shards.router.finished(k, blocks))
        stream = self.shards.stubs[k].Generate(request, metadata=self._metadata(context),
                                               timeout=self._timeout(context))
        context.add_callback(stream.cancel)
        try:
            pass_waiting_note([stream], context)
            yield from stream
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE and _transport_lost(e.details() or ""):
                # the shard itself went (a transport error, not its own status): say so
                context.abort(grpc.StatusCode.UNAVAILABLE, f"metadata shard {k} was lost while this request ran "
                                                           f"({e.details()}); the front restarts it: retry the request")
            if e.code() != grpc.StatusCode.CANCELLED or context.is_active():
                context.abort(e.code(), e.details())

    # ------------------------------------------------------------------ stats
    def Stats(self, request, context):
        answers = self._each({k: request for k in range(len(self.shards))}, "Stats", context)
        parts = [a for a in answers.values() if not isinstance(a, grpc.RpcError)]
        if not parts:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no shard answers")
        out = merge_stats(parts, time.process_time())
        if len(parts) < len(self.shards):
            out.invariants_ok = False
            down = [k for k, a in answers.items() if isinstance(a, grpc.RpcError)]
            out.not_ready_reason = (out.not_ready_reason + f"; shards {down} do not answer").lstrip("; ")
        return out

    def PoolSnapshot(self, request, context):
        answers = self._each({k: request for k in range(len(self.shards))}, "PoolSnapshot", context)
        out = metadata_pb2.PoolSnapshotReply(time=time.time())
        for k, a in sorted(answers.items()):
            if isinstance(a, grpc.RpcError):
                context.abort(a.code(), a.details())
            for c in a.chains:
                c.chain_id += k * CHAIN_ID_STRIDE
                out.chains.append(c)
        return out

    # ------------------------------------------------------------------ block API: shard 0's pool
    def CreateSequence(self, request, context):
        return self._forward(0, "CreateSequence", request, context)

    def AppendTokens(self, request, context):
        return self._forward(0, "AppendTokens", request, context)

    def ForkSequence(self, request, context):
        return self._forward(0, "ForkSequence", request, context)

    def ReleaseSequence(self, request, context):
        return self._forward(0, "ReleaseSequence", request, context)

    def GetBlockTables(self, request, context):
        return self._forward(0, "GetBlockTables", request, context)

    # ------------------------------------------------------------------ workers
    def RegisterWorker(self, request, context):
        info = request.info
        with self._registering:
            now = time.monotonic()
            self._recent = [r for r in self._recent if now - r[0] < RECENT_S]
            served = [(s.model_fingerprint, s.model) for s in self.shards.stats if s is not None and s.model_fingerprint]
            for fp, model in served + [(fp, model) for _, fp, model in self._recent]:
                if fp != info.model_fingerprint:   # every shard serves one model: a worker of another is refused
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"model mismatch: worker {clip(info.address)} serves {clip(info.model_name)} "
                                  f"(fingerprint {info.model_fingerprint[:12]}) but this service serves "
                                  f"{clip(model)} (fingerprint {fp[:12]})")
            k = self.shards.shard_for_worker(info)
            reply = self._forward(k, "RegisterWorker", request, context)
            self._recent.append((now, info.model_fingerprint, info.model_name))
        reply.worker_id = f"{k}/{reply.worker_id}"
        return reply

    def _worker_shard(self, worker_id: str) -> tuple[int, str] | None:
        k, _, wid = worker_id.partition("/")
        return (int(k), wid) if k.isdigit() and int(k) < len(self.shards) and wid else None

    def Heartbeat(self, request, context):
        where = self._worker_shard(request.worker_id)
        if where is None:
            return metadata_pb2.HeartbeatReply(known=False)
        return self._forward(where[0], "Heartbeat", metadata_pb2.HeartbeatRequest(
            worker_id=where[1], cache_epoch=request.cache_epoch, steps_served=request.steps_served), context)

    def DeregisterWorker(self, request, context):
        where = self._worker_shard(request.worker_id)
        if where is None:
            return metadata_pb2.DeregisterWorkerReply(known=False)
        return self._forward(where[0], "DeregisterWorker",
                             metadata_pb2.DeregisterWorkerRequest(worker_id=where[1]), context)


def _shard_stores_problem(db: str, shards: int) -> str | None:
    """Why the shards' job stores (--db PATH: PATH.shardK each) cannot open, in one line, or None.
    Each is opened and closed here: a missing directory, a store in use, a foreign file."""
    if not db:
        return None
    if os.path.isdir(db):
        return f"--db {db} is a directory; give a file path, e.g. {db}/jobs.db (the shards use PATH.shardK)"
    from .job_store import JobStore, JobStoreError
    for k in range(shards):
        try:
            JobStore(f"{db}.shard{k}", owner="a sharded front checking its stores").close()
        except JobStoreError as e:
            return str(e)
    return None


def run_front(args, argv: list[str], serve, wait_for_signal, log) -> int:
    """main() of a sharded service: start (or reach) the shards, serve the one address, stop them."""
    from grpc_health.v1 import health_pb2
    from .auth import TokenInterceptor
    from .shards import ShardProcesses
    from minipaged.rpc import DecodeGuardInterceptor
    procs, addresses = None, [a for a in args.shard_addresses.split(",") if a]
    if not addresses:
        why = _shard_stores_problem(args.db, args.shards)
        if why:      # each shard would fail on it, and be started again, for a minute
            print(f"error: {why}", file=sys.stderr, flush=True)
            return 1
        try:
            procs = ShardProcesses(args.shards, argv, args.db, metrics=args.metrics_port >= 0)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 1
        addresses = procs.addresses
    shards = ShardSet(addresses, procs, args.token).start()
    auth = [TokenInterceptor(args.token, args.worker_token)] if args.token or args.worker_token else []
    server, port, health = serve(f"{args.host}:{args.port}", FrontServicer(shards), auth + [DecodeGuardInterceptor()],
                                 (args.tls_cert, args.tls_key, args.tls_client_ca), args.max_waiting)
    if port == 0:
        shards.stop()
        if procs is not None:
            procs.stop()
        print(f"error: cannot serve on {args.host}:{args.port}: the port is taken or the address is not "
              f"this machine's", file=sys.stderr, flush=True)
        return 1
    if procs is not None and args.metrics_port >= 0 and not _serve_metrics(procs, args):
        server.stop(0)
        shards.stop()
        procs.stop()
        return 1
    name = metadata_pb2.DESCRIPTOR.services_by_name["MetadataService"].full_name
    health.set("", health_pb2.HealthCheckResponse.SERVING)
    shards.on_ready_changed.append(lambda ok: health.set(name, health_pb2.HealthCheckResponse.SERVING if ok
                                                         else health_pb2.HealthCheckResponse.NOT_SERVING))
    health.set(name, health_pb2.HealthCheckResponse.SERVING if shards._ready
               else health_pb2.HealthCheckResponse.NOT_SERVING)
    server.start()
    log.info("sharded metadata service listening on %s:%d, shards at %s", args.host, port, ", ".join(addresses))
    print(f"LISTENING {args.host}:{port}", flush=True)
    wait_for_signal()
    health.enter_graceful_shutdown()
    server.stop(args.grace).wait()
    shards.stop()
    if procs is not None:
        procs.stop(args.grace)
    return 0


def _serve_metrics(procs, args) -> bool:
    """--metrics-port of a front: its shards' metrics, each sample labelled by shard (front_metrics.py)."""
    from .front_metrics import serve_front_metrics
    try:
        mport = serve_front_metrics(lambda: procs.metrics_urls, args.metrics_port, args.host)
    except OSError as e:
        print(f"error: cannot serve metrics on {args.host}:{args.metrics_port}: {e}", file=sys.stderr, flush=True)
        return False
    print(f"metrics on http://{args.host}:{mport}/metrics (every shard's, labelled shard=K)", file=sys.stderr, flush=True)
    return True
