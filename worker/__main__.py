"""`python -m worker --metadata HOST:PORT --port 50061 --model tiny|PATH [...]`: serve one pipeline stage.

Loads the stage's layers, serves the WorkerService (+ grpc.health.v1 and reflection), registers with
the metadata service (if --metadata is given) and heartbeats. SIGTERM/SIGINT: health goes
NOT_SERVING, the server drains with a grace period, exit 0."""
from __future__ import annotations

import logging
import os
import socket
import sys

from minipaged.signals import StopFlag

# build_parser: every program's __main__ offers it (tests check the deploy files' flags against it)
from worker.flags import (DEFAULT_CPU_KV_BYTES, DEFAULT_CPU_KV_TOKENS, DEFAULT_GPU_MEMORY_FRACTION,  # noqa: F401
                          build_parser, resolve_args)

log = logging.getLogger("worker")
SHUTDOWN_GRACE_S = 5.0


def _glibc():
    """glibc, for its malloc tuning, or None (not Linux, not glibc: nothing to tune)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def keep_freed_memory() -> None:
    """Ask glibc to keep freed memory instead of unmapping it: each step allocates the same large
    activations again, and on CPU re-faulting fresh pages cost as much as the attention itself
    (a decode step was ~2x slower). RSS then stays at its peak, as a server's should."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(-3, 1 << 30)      # M_MMAP_THRESHOLD: serve blocks up to 1 GiB from the heap
        libc.mallopt(-1, 2**31 - 1)    # M_TRIM_THRESHOLD: never give the heap's top back


def release_freed_memory() -> None:
    """Hand back, once, what loading freed (float32 weights replaced by their packed copies): it
    sat in the loading thread's malloc arena, which keep_freed_memory's settings never trim
    (Qwen3-0.6B shape: ~840 MB)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def default_cpu_kv_bytes(args) -> int:
    """DEFAULT_CPU_KV_BYTES, or DEFAULT_CPU_KV_TOKENS tokens of this stage's K/V if more, but no
    more than a quarter of the RAM free now (the weights are loaded by then)."""
    from worker.paged_cache import bytes_per_block
    c = args.config
    per_token = bytes_per_block(args.layer_end - args.layer_start, c.num_key_value_heads, 1, c.head_dim,
                                args.dtype)
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(DEFAULT_CPU_KV_BYTES, min(DEFAULT_CPU_KV_TOKENS * per_token, free // 4))


def kv_budget_bytes(args) -> int:
    """K/V byte budget once the weights are loaded (0 when --num-blocks fixes the capacity).
    Only this process's own device memory counts against --kv-memory-fraction (worker/memory.py)."""
    from worker import memory
    return memory.kv_budget_bytes(args.device, args.kv_memory_fraction, args.kv_cache_bytes, args.num_blocks,
                                  default_gpu_fraction=DEFAULT_GPU_MEMORY_FRACTION,
                                  default_cpu_bytes=default_cpu_kv_bytes(args),
                                  baseline=getattr(args, "memory_baseline", None))


def _warn_unused_lm_head(args) -> None:
    """config.json ties the lm_head to the embedding, yet the checkpoint has an lm_head of its own:
    it is not used (vLLM's reading; transformers 5 would use it), and a user should hear so."""
    if args.simulate or args.model == "tiny" or not args.config.tie_word_embeddings \
            or args.layer_end != args.config.num_hidden_layers:
        return
    from worker.weights import tensor_names
    if "lm_head.weight" in tensor_names(args.model):
        log.warning("config.json says tie_word_embeddings but the checkpoint also has an lm_head.weight: it is "
                    "ignored and the embedding computes the logits (as vLLM; transformers 5 would use it)")


def _cache_never_fits(args, runner, budget: int) -> str:
    """Why no K/V cache of these flags can ever be made on this stage, or "": a budget below one
    token's K/V, or --num-blocks past the device's whole memory even at one token a block."""
    if args.simulate:
        return ""
    per_token = runner.kv_bytes_per_block(1)
    if not args.num_blocks and budget < per_token:
        return f"a K/V budget of {budget} bytes holds no token (one takes {per_token} bytes on this stage)"
    if args.num_blocks:
        import torch
        total = (torch.cuda.get_device_properties(torch.device(args.device)).total_memory
                 if args.device.startswith("cuda") else os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        if args.num_blocks * per_token > total:
            return (f"--num-blocks {args.num_blocks} needs at least {args.num_blocks * per_token / 2**30:.1f} GiB "
                    f"of K/V (one token a block), more than {args.device}'s {total / 2**30:.1f} GiB")
    return ""


def _torch_importable() -> bool:
    """A plain `pip install .` has no PyTorch (it is the [worker] extra): say so, not a traceback."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        print(f"error: the worker needs PyTorch ({e}): pip install 'minipaged-qwen[worker]' (in a checkout: "
              f"pip install '.[worker]'; on a CPU-only machine install the CPU build of torch first, see the "
              f"README)", file=sys.stderr, flush=True)
        return False
    return True


def _start(args) -> StopFlag:
    """Logging, the stop signals and the process-wide tuning, before anything slow."""
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = StopFlag().on_signals()  # first: a SIGTERM at any point below means a clean exit 0
    keep_freed_memory()
    from minipaged.tokenizer import byte_fallback_problem
    problem = byte_fallback_problem(args.model, args.config.vocab_size)
    if problem:  # said at start, not as an ids-range error on the first text prompt
        log.warning("%s", problem)
    return stop


def build_runner(args):
    """The stage's runner and its K/V budget: (runner, budget bytes, device, backend)."""
    if args.simulate:  # the one substitution: a runner that sleeps instead of computing
        from worker.simulator import SimRunner
        runner = SimRunner(args.model, args.layer_start, args.layer_end, args.dtype, args.profile,
                           rope_scaling=args.rope_scaling)
        budget = 0 if args.num_blocks else (args.kv_cache_bytes or runner.timing.kv_budget_bytes())
        return runner, budget, f"sim:{args.profile.name}", "simulated"
    from worker.model_runner import ModelRunner
    if args.device.startswith("cuda"):  # what this process grows outside torch counts as its own
        from worker import memory
        args.memory_baseline = memory.take_baseline(args.device)
    runner = ModelRunner(args.model, args.layer_start, args.layer_end, args.dtype, args.device, args.backend,
                         rope_scaling=args.rope_scaling)
    return runner, kv_budget_bytes(args), args.device, args.backend


def _cannot_serve(what: str, host: str, port: int, e: OSError) -> None:
    print(f"error: cannot serve {what} on {host}:{port}: {e}", file=sys.stderr, flush=True)


def serve(args, servicer):
    """The gRPC server, the data link and the metrics page: (server, port, health servicer), or
    None (said on stderr) when one of them cannot bind."""
    from worker.server import build_server
    try:
        server, port, health_servicer = build_server(servicer, args.host, args.port, args.worker_token,
                                                     tls=(args.tls_cert, args.tls_key, args.tls_client_ca),
                                                     ready=not args.metadata)
    except OSError as e:
        log.error("cannot serve on %s:%d: %s", args.host, args.port, e)
        print(f"error: cannot serve on {args.host}:{args.port}: {e}", file=sys.stderr, flush=True)
        return None
    if args.data_port >= 0 and not args.tls_cert:   # the service's Steps (stage 0), results (last), hidden states
        from worker.data_link import DataServer
        try:
            servicer.data_server = DataServer(servicer, args.host, args.data_port, args.worker_token)
        except OSError as e:
            return _cannot_serve("the data link", args.host, args.data_port, e)
        print(f"data link on {args.host}:{servicer.data_server.port}", file=sys.stderr, flush=True)
    if args.metrics_port >= 0:
        from worker import metrics
        try:
            mport = metrics.serve(servicer, args.metrics_port, args.host)
            print(f"metrics on http://{args.host}:{mport}/metrics", file=sys.stderr, flush=True)
        except OSError as e:
            return _cannot_serve("metrics", args.host, args.metrics_port, e)
    return server, port, health_servicer


def _announce(args, servicer, port: int, budget: int) -> None:
    from minipaged.units import human_bytes
    host = args.host if args.host not in ("0.0.0.0", "::", "[::]") else socket.gethostname()
    servicer.address = args.advertise_address or f"{host}:{port}"
    log.info("worker serving layers [%d, %d) of %s on %s:%d (advertised %s), %s %s/%s, capacity %s",
             args.layer_start, args.layer_end, args.model, args.host, port, servicer.address, args.device,
             args.dtype, args.backend,
             f"{args.num_blocks} blocks" if args.num_blocks else f"{human_bytes(budget)} of K/V")
    print(f"worker listening on {args.host}:{port}", file=sys.stderr, flush=True)
    if not args.metadata:
        print("STANDALONE: registered with no metadata service, so no chain will use this worker "
              "(drop --standalone and give --metadata HOST:PORT to serve requests)", file=sys.stderr, flush=True)
    else:
        print(f"registering with the metadata service at {args.metadata}", file=sys.stderr, flush=True)


def register(args, servicer, health_servicer, stop: StopFlag, rejected: list):
    """Register and heartbeat (None when standalone). Readiness follows registration; a refusal
    (another model) is noted in `rejected` and stops the worker."""
    if not args.metadata:
        return None
    from grpc_health.v1 import health_pb2
    from worker.registration import Registration
    from worker.server import SERVICE_NAME
    ready = lambda ok: health_servicer.set(  # noqa: E731 - readiness follows registration
        SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING)
    return Registration(args.metadata, servicer.info, lambda: servicer.epoch,
                        default_interval_ms=args.heartbeat_ms, token=args.worker_token,
                        channel_factory=servicer.channel_factory,
                        steps_fn=lambda: servicer.steps_served, on_ready=ready,
                        on_rejected=lambda why: (rejected.append(why), stop.set())).start()


def main(argv=None) -> int:
    args = resolve_args(argv)
    stop = _start(args)
    if not _torch_importable():
        return 2
    if args.device.startswith("cuda") and not args.simulate:
        from worker.flags import cuda_problem
        problem = cuda_problem(args.device)
        if problem:
            print(f"error: {problem}", file=sys.stderr, flush=True)
            return 2
    if args.threads > 0:
        import torch
        torch.set_num_threads(args.threads)
    from minipaged.tls import make_channel
    from worker.server import WorkerServicer
    from worker.omp_pool import in_own_thread
    try:
        runner, budget, device, backend = in_own_thread(build_runner, args)   # its OpenMP pool goes with it
    except (ValueError, OSError, KeyError, RuntimeError) as e:   # a broken checkpoint: one line, its cause
        log.debug("loading %s failed", args.model, exc_info=True)
        log.error("cannot load %s: %s: %s", args.model, type(e).__name__, e)
        return 2
    release_freed_memory()
    if not args.num_blocks and budget <= 0:
        log.error("no memory left for the K/V cache on %s (use --kv-cache-bytes or --num-blocks)", args.device)
        return 2
    _warn_unused_lm_head(args)
    problem = _cache_never_fits(args, runner, budget)
    if problem:       # else the service would retry InitCache on this worker forever
        log.error("%s", problem)
        return 2
    from minipaged.gc_tuning import tune_for_serving
    tune_for_serving()  # the model is loaded: freeze it out of the collector's sight
    servicer = WorkerServicer(runner, model_name=args.model, device=device, dtype=args.dtype,
                              backend=backend, kv_cache_bytes=budget, fixed_num_blocks=args.num_blocks,
                              replica_group=args.replica_group, simulate=args.simulate,
                              kv_tier_bytes=args.kv_tier_bytes, role=args.role)
    servicer.channel_factory = lambda address, options: make_channel(address, options, args.tls_ca,
                                                                     args.tls_cert, args.tls_key, ca_required=True)
    served = serve(args, servicer)
    if served is None:
        return 1
    server, port, health_servicer = served
    _announce(args, servicer, port, budget)
    rejected: list = []
    registration = register(args, servicer, health_servicer, stop, rejected)
    while not stop.wait(1.0):  # a timed wait keeps the main thread responsive to signals
        pass
    log.info("shutting down (grace %.0fs)", SHUTDOWN_GRACE_S)
    health_servicer.enter_graceful_shutdown()  # every service NOT_SERVING from here on
    if registration is not None:
        registration.stop()
    server.stop(SHUTDOWN_GRACE_S).wait()
    servicer.close()
    return 3 if rejected else 0  # refused by the service (another model): fail fast, visibly


if __name__ == "__main__":
    code = main()
    # Everything is stopped and flushed by now; skip the interpreter's teardown, where a native
    # thread of gRPC or torch still running has been seen to abort a clean stop (SIGABRT, -6)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
