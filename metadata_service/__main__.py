"""`python -m metadata_service --port 50051 [--host 127.0.0.1] [--block-size 16] [--db PATH] ...`"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from minipaged import cli
from minipaged.constants import DEFAULT_METADATA_PORT
from minipaged.rpc import DecodeGuardInterceptor
from minipaged.signals import StopFlag, die_with_parent
from minipaged.tls import add_port, make_channel
from minipaged.v1 import metadata_pb2, metadata_pb2_grpc

from .api import MetadataServicer
from .auth import SurfaceInterceptor, TokenInterceptor, is_loopback
from .engine import Engine
from .flags import build_parser
from .job_store import JobStore, JobStoreError
from .workers import SERVER_OPTIONS, WorkerRegistry

SERVICE_NAME = metadata_pb2.DESCRIPTOR.services_by_name["MetadataService"].full_name


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    # secrets are read here, not as argparse defaults, so --help never prints one
    args.token = cli.token(parser, args.token, "MINIPAGED_TOKEN", "--token", args.token_file)
    args.worker_token = cli.token(parser, args.worker_token, "MINIPAGED_WORKER_TOKEN", "--worker-token",
                                  args.worker_token_file)
    args.worker_host = args.worker_host or args.host
    _check_numbers(parser, args)
    if args.kv_move_part_bytes < 0:
        parser.error("--kv-move-part-bytes must be >= 0")
    if args.shards < 1:
        parser.error("--shards must be >= 1")
    if (args.shards > 1 or args.shard_addresses) and args.worker_port >= 0:
        parser.error("--worker-port is a shard's: give it to each shard started with --shard-addresses, "
                     "not to a sharded front")
    if args.shard_addresses and args.metrics_port >= 0:
        parser.error("--metrics-port with --shard-addresses: give it to each shard you started (the front "
                     "serves its shards' metrics only for --shards N, which it starts itself)")
    internal = (args.worker_host, args.worker_port) if args.worker_port >= 0 else (args.host, args.port)
    if not args.worker_token and not is_loopback(internal[0]):
        parser.error(f"refusing to accept worker registration on {internal[0]}:{internal[1]} without a worker "
                     f"token: anyone who can reach it could register a rogue worker (it would see prompts' "
                     f"hidden states and choose every token). Set --worker-token / --worker-token-file "
                     f"(workers get the same), or serve the internal surface on loopback with "
                     f"--worker-port N --worker-host 127.0.0.1.")
    return args


def _owner(args, port: int) -> str:
    """The lock file's words: who to stop before another service may take the store."""
    return (f"metadata service pid {os.getpid()} on {socket.gethostname()}, port {port} "
            f"(since {time.strftime('%Y-%m-%d %H:%M:%S')})")


def _cancel_command(host: str, port: int, tls: bool = False) -> str:
    """`minipaged jobs --cancel-all`, with the address when the CLI's default would not reach us (and
    --tls-ca when we serve TLS)."""
    tls_flag = " --tls-ca CA.pem" if tls else ""
    if host in ("127.0.0.1", "localhost", "0.0.0.0", "::", "[::]") and port == DEFAULT_METADATA_PORT:
        return "minipaged jobs --cancel-all" + tls_flag
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "[::]") else host
    return f"minipaged jobs --cancel-all --address {host}:{port}" + tls_flag


MAX_NUM_BLOCKS = 1 << 24   # --num-blocks: 16.7M blocks (268M tokens of 16) is far past any worker's pool

# Threads the server keeps beyond one per admitted request (--max-waiting): a sync gRPC server holds a
# thread for each open Generate stream, and a worker's RegisterWorker / Heartbeat, Stats and health
# calls need one too. With a fixed 128, 128 open streams left a worker's heartbeat queued until its
# lease ran out and the chain was dropped under the very requests it was serving. Threads are made
# only when needed.
CONTROL_THREADS = 256


def _serve(port_spec: str, servicer, interceptors, tls, max_streams: int) -> tuple:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_streams + CONTROL_THREADS),
                         interceptors=interceptors, options=SERVER_OPTIONS)
    metadata_pb2_grpc.add_MetadataServiceServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return server, add_port(server, port_spec, *tls), health_servicer


def _build(args, jobs_store: JobStore) -> tuple:
    """The engine, the job manager and the servicer over them, tied to the store's model."""
    registry = WorkerRegistry(args.worker_lease, channel_factory=lambda address, options: make_channel(
        address, options, args.worker_tls_ca, args.worker_tls_cert, args.worker_tls_key))
    engine = Engine(block_size=args.block_size, num_blocks=args.num_blocks,
                    max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                    max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
                    worker_token=args.worker_token, step_timeout_s=args.step_timeout,
                    worker_wait_s=args.worker_wait, registry=registry, micro_batches=args.micro_batches,
                    async_scheduling=not args.no_async_scheduling, router=args.router,
                    router_overlap_weight=args.router_overlap_weight,
                    full_block_tables=args.full_block_tables, kv_tier_policy=args.kv_tier_policy,
                    kv_move_part_bytes=args.kv_move_part_bytes)
    # the model the stored jobs were admitted for: after a restart, only its workers may take them
    engine.model_fingerprint = jobs_store.get_meta("model_fingerprint") or ""
    engine.model_label = jobs_store.get_meta("model_name") or ""
    engine.on_model_changed.append(lambda fp, name: (jobs_store.set_meta("model_fingerprint", fp),
                                                     jobs_store.set_meta("model_name", name)))
    from .jobs import JobManager
    jobs = JobManager(engine, jobs_store)
    engine.backlog = jobs.backlog
    servicer = MetadataServicer(engine, jobs, max_waiting=args.max_waiting,
                                block_api_enabled=not args.no_block_api)
    return engine, jobs, servicer


def _bind(args, servicer, log) -> tuple | None:
    """A server per surface (client; internal with --worker-port), bound but not started:
    (servers, their health servicers, {surface: port}), or None when a port cannot be had."""
    auth = [TokenInterceptor(args.token, args.worker_token)] if args.token or args.worker_token else []
    tls = (args.tls_cert, args.tls_key, args.tls_client_ca)
    split = args.worker_port >= 0
    ports: dict[str, int] = {}  # filled once bound: each port's refusals name the other one
    surfaces = [("client", f"{args.host}:{args.port}")] + ([("internal", f"{args.worker_host}:{args.worker_port}")]
                                                           if split else [])
    servers, healths = [], []
    for surface, spec in surfaces:
        guard = [SurfaceInterceptor(surface, ports)] if split else []
        server, bound, h = _serve(spec, servicer, auth + guard + [DecodeGuardInterceptor()], tls, args.max_waiting)
        if bound == 0:
            log.error("cannot serve on %s: the port is taken (or the address is not this machine's)", spec)
            print(f"error: cannot serve on {spec}: the port is taken or the address is not this machine's",
                  file=sys.stderr, flush=True)
            return None
        ports[surface] = bound
        servers.append(server)
        healths.append(h)
    return servers, healths, ports


def _track_readiness(engine, healths) -> None:
    """Health "" is liveness; the named service is readiness: SERVING only while a chain is ready."""
    for h in healths:
        h.set("", health_pb2.HealthCheckResponse.SERVING)
        h.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    engine.on_ready_changed.append(lambda ok: [h.set(
        SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING)
        for h in healths])


def _serve_metrics(args, engine) -> int | None:
    """--metrics-port: the bound port, -1 when off, None when its port cannot be had (a start error)."""
    if args.metrics_port < 0:
        return -1
    from .metrics import ServiceMetrics
    try:
        mport = ServiceMetrics(engine).serve(args.metrics_port, args.host)
        print(f"metrics on http://{args.host}:{mport}/metrics", file=sys.stderr, flush=True)
    except OSError as e:
        print(f"error: cannot serve metrics on {args.host}:{args.metrics_port}: {e}", file=sys.stderr, flush=True)
        return None
    return mport


def _check_numbers(parser, args) -> None:
    """Durations and weights out of their range (NaN included) stop the start with one line."""
    if not args.worker_lease > 0:       # 0 drops every worker at its first check: no chain would form
        parser.error(f"--worker-lease must be > 0 seconds, got {args.worker_lease}")
    for flag, value in (("--block-size", args.block_size), ("--max-num-seqs", args.max_num_seqs),
                        ("--max-num-batched-tokens", args.max_num_batched_tokens)):
        if value < 1:                   # no token / no sequence per step: nothing would ever run
            parser.error(f"{flag} must be >= 1, got {value}")
    for flag, value, what in (("--micro-batches", args.micro_batches, "0: by the chain's stages"),
                              ("--max-model-len", args.max_model_len, "0: the model's context")):
        if value < 0:
            parser.error(f"{flag} must be >= 0 ({what}), got {value}")
    for cert, key in (("--tls-cert", "--tls-key"), ("--worker-tls-cert", "--worker-tls-key")):
        if bool(getattr(args, cert[2:].replace("-", "_"))) != bool(getattr(args, key[2:].replace("-", "_"))):
            parser.error(f"{cert} and {key} go together: give both or neither")
    if args.num_blocks < 0:
        parser.error(f"--num-blocks must be >= 0 (0: the workers' pools), got {args.num_blocks}")
    if args.num_blocks > MAX_NUM_BLOCKS:  # the block API's pool is allocated at start (a byte per block and more)
        parser.error(f"--num-blocks {args.num_blocks} is past {MAX_NUM_BLOCKS:,}: no worker holds that many, and the "
                     f"service's own tables for them would not fit in memory")
    for flag, value in (("--step-timeout", args.step_timeout), ("--worker-wait", args.worker_wait),
                        ("--grace", args.grace), ("--router-overlap-weight", args.router_overlap_weight)):
        if not value >= 0:
            parser.error(f"{flag} must be >= 0, got {value}" + (" (0: no deadline)" if flag == "--step-timeout" else ""))


def main(argv=None) -> int:
    args = parse_args(argv)
    stop = StopFlag().on_signals()   # first: a SIGTERM at any point below means a clean stop, not death
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log = logging.getLogger("metadata_service")
    if not die_with_parent():  # a shard whose front is already gone
        return 1
    if args.shards > 1 or args.shard_addresses:
        from .front import run_front
        return run_front(args, sys.argv[1:] if argv is None else list(argv), _serve, stop.wait, log)
    try:  # first: a store another service owns (or a bad path) is a start error, before any port
        jobs_store = JobStore(args.db, owner=_owner(args, args.port))
    except JobStoreError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    engine, jobs, servicer = _build(args, jobs_store)
    bound = _bind(args, servicer, log)
    if bound is None:
        return 1
    servers, healths, ports = bound
    split = args.worker_port >= 0
    port = ports["client"]
    jobs_store.set_owner(_owner(args, port))
    jobs.cancel_command = engine.cancel_command = _cancel_command(args.host, port, bool(args.tls_cert))
    _track_readiness(engine, healths)
    mport = _serve_metrics(args, engine)
    if mport is None:
        return 1
    from minipaged.gc_tuning import tune_for_serving
    tune_for_serving()
    engine.start()
    jobs.resume()
    from .stats_log import StatsLogger
    stats_logger = StatsLogger(engine, args.log_stats_interval).start()
    for srv in servers:
        srv.start()
    log.info("metadata service listening on %s:%d%s (block size %d, job store %s)", args.host, port,
             f", internal surface on {args.worker_host}:{ports.get('internal')}" if split else "",
             args.block_size, args.db or "in memory: jobs end with this process; --db PATH keeps them")
    print(f"LISTENING {args.host}:{port}" + (f" internal {args.worker_host}:{ports['internal']}" if split else "")
          + (f" metrics {args.host}:{mport}" if mport >= 0 else ""), flush=True)   # (a front reads the last)

    stop.wait()   # until SIGTERM or SIGINT
    log.info("shutting down: health NOT_SERVING, %.0fs grace", args.grace)
    engine.registry.draining = True   # the closed port refuses heartbeats: keep the chains for the grace
    for h in healths:
        h.enter_graceful_shutdown()
    for srv in servers:
        srv.stop(args.grace)
    _end_streams_before_the_grace(servicer, args.grace)
    for srv in servers:
        srv.stop(args.grace).wait()
    stats_logger.stop()
    engine.stop()
    jobs_store.close()
    return 0


def _end_streams_before_the_grace(servicer, grace: float) -> None:
    """Streams that finish within the grace finish; the rest end a moment before it with a reason
    a caller can act on (the SDK and the gateway show it)."""
    deadline = time.monotonic() + grace - min(1.0, grace / 4)
    while servicer.open_streams and time.monotonic() < deadline:
        time.sleep(0.05)
    if servicer.open_streams:
        servicer.end_open_streams(f"the metadata service is shutting down: this request was still running after "
                                  f"its --grace of {grace:g}s; retry it (jobs are kept: they recompute after a "
                                  f"restart)")


if __name__ == "__main__":
    sys.exit(main())
