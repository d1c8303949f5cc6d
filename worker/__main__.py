"""`python -m worker --metadata HOST:PORT --port 50061 --model tiny|PATH [...]`: serve one pipeline stage.

Loads the stage's layers, serves the WorkerService (+ grpc.health.v1 and reflection), registers with
the metadata service (if --metadata is given) and heartbeats. SIGTERM/SIGINT: health goes
NOT_SERVING, the server drains with a grace period, exit 0."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading

from minipaged.cli import prog_name
from minipaged.config import check_weights_present, load_model_config

log = logging.getLogger("worker")

def keep_freed_memory() -> None:
    """Ask glibc to keep freed memory instead of unmapping it: each step allocates the same large
    activations again, and on CPU re-faulting fresh pages cost as much as the attention itself
    (a decode step was ~2x slower). RSS then stays at its peak, as a server's should."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)      # M_MMAP_THRESHOLD: serve blocks up to 1 GiB from the heap
        libc.mallopt(-1, 2**31 - 1)    # M_TRIM_THRESHOLD: never give the heap's top back
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


DEFAULT_CPU_KV_BYTES = 256 * 1024 * 1024
# ... or room for this many tokens if that is more (capped at a quarter of the free RAM): at the
# real Qwen3 shapes a token's K/V is 229 KB in float32, so 256 MiB held only ~1,170 tokens and a
# batch of 16 long prompts ran a few sequences at a time (issue 18 measured with it)
DEFAULT_CPU_KV_TOKENS = 8192
DEFAULT_GPU_MEMORY_FRACTION = 0.9
SHUTDOWN_GRACE_S = 5.0
DEFAULT_METADATA = "127.0.0.1:50051"   # the metadata service's default port, as client and gateway use


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog_name("worker"), description="MiniPaged-Qwen worker: one pipeline stage.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--metadata", default=os.environ.get("MINIPAGED_ADDRESS", DEFAULT_METADATA),
                   help="metadata service HOST:PORT to register with, as the client's and gateway's default "
                        "(env MINIPAGED_ADDRESS)")
    p.add_argument("--standalone", action="store_true",
                   help="register with no metadata service: serve WorkerService calls only (tests, debugging)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 in containers)")
    p.add_argument("--port", type=int, default=50061, help="port to serve on (0 = pick a free one)")
    p.add_argument("--advertise-address", default="", help="HOST:PORT others reach this worker at "
                   "(default: --host:bound port, or hostname:port when bound to 0.0.0.0)")
    p.add_argument("--model", default="tiny", help="'tiny' (embedded) or a local Qwen3 checkpoint directory")
    p.add_argument("--layers", default="", help="A:B, the layer range [A, B) this stage serves (default: all)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=["auto", "float32", "float64", "bfloat16", "float16"], default="auto",
                   help="auto: the checkpoint's dtype where the device computes it well, else float32 "
                        "(worker/dtype_choice.py: bfloat16 on cuda; float32 on a CPU without "
                        "AVX512_BF16/AMX; tiny: float32 on cpu, bfloat16 on cuda)")
    cap = p.add_mutually_exclusive_group()
    cap.add_argument("--num-blocks", type=int, default=0, help="fixed K/V capacity in blocks")
    cap.add_argument("--kv-memory-fraction", type=float, default=None,
                     help="fraction of device memory this process may use in all (weights + K/V); "
                          f"default {DEFAULT_GPU_MEMORY_FRACTION} on cuda")
    p.add_argument("--kv-cache-bytes", type=int, default=None,
                   help=f"K/V byte budget (default {DEFAULT_CPU_KV_BYTES} on cpu)")
    p.add_argument("--backend", choices=["torch", "pycuda"], default=None,
                   help="attention backend (default: torch on cpu, pycuda on cuda)")
    p.add_argument("--tls-cert", default="", help="serve TLS with this certificate (PEM)")
    p.add_argument("--tls-key", default="", help="private key of --tls-cert (PEM)")
    p.add_argument("--tls-client-ca", default="",
                   help="require client certificates signed by this CA (mutual TLS on the worker links)")
    p.add_argument("--tls-ca", default="",
                   help="CA that signed the metadata service's and the next stage's certificates; "
                        "this worker then presents --tls-cert/--tls-key as its client certificate")
    p.add_argument("--worker-token", default=None,
                   help="require 'authorization: Bearer TOKEN' on WorkerService calls; default: "
                        "$MINIPAGED_WORKER_TOKEN")
    p.add_argument("--worker-token-file", default="",
                   help="read the worker token from this file (a compose/Kubernetes secret)")
    p.add_argument("--heartbeat-ms", type=int, default=1000,
                   help="heartbeat interval until the metadata service names its own")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads for this worker (default: torch's own choice, all cores)")
    p.add_argument("--replica-group", default="",
                   help="chains form among workers of the same group (default: one group for all)")
    p.add_argument("--simulate", default="", metavar="h200|PROFILE.json",
                   help="a simulated worker: no weights, no compute; each step sleeps for a roofline timing "
                        "model's time (worker/simulator.py) and returns deterministic pseudo-random tokens")
    p.add_argument("--data-port", type=int, default=0,
                   help="TCP data link for hidden states from the previous stage (0 picks a port, -1 = none: "
                        "they come on the gRPC stream; never with TLS, whose stream is encrypted)")
    p.add_argument("--metrics-port", type=int, default=-1,
                   help="serve Prometheus text on this port (0 picks one; default off)")
    p.add_argument("--log-level", default="INFO")
    return p


def parse_layers(spec: str, num_layers: int) -> tuple[int, int]:
    """'A:B' -> (A, B) with 0 <= A < B <= num_layers; '' = all layers."""
    if not spec:
        return 0, num_layers
    try:
        a, b = spec.split(":")
        start, end = int(a) if a else 0, int(b) if b else num_layers
    except ValueError:
        raise ValueError(f"--layers {spec!r}: expected A:B, e.g. 0:{num_layers // 2}") from None
    if not 0 <= start < end <= num_layers:
        raise ValueError(f"--layers {spec!r}: need 0 <= A < B <= {num_layers} (the model has {num_layers} "
                         f"layers; the range must not be empty)")
    return start, end


def resolve_args(argv=None) -> argparse.Namespace:
    """Parse and check the flags against the model config (cheap: config.json only, no weights)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.worker_token = args.worker_token or os.environ.get("MINIPAGED_WORKER_TOKEN", "")  # not a default: --help
    if args.standalone or not args.metadata:   # --metadata "" still means standalone, as it used to
        args.metadata = ""
    try:
        args.config = load_model_config(args.model)
        if not args.simulate:  # a simulated worker has no weights to load
            check_weights_present(args.model)
    except (ValueError, OSError) as e:  # one line naming the file and field, no usage wall
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        args.layer_start, args.layer_end = parse_layers(args.layers, args.config.num_hidden_layers)
    except ValueError as e:
        parser.error(str(e))
    cuda = args.device.startswith("cuda")
    if args.simulate:
        from worker.simulator import load_profile
        try:
            args.profile = load_profile(args.simulate)
        except (ValueError, OSError) as e:
            parser.error(str(e))
        cuda = True  # it stands in for a GPU: bfloat16 by default
    from worker.dtype_choice import resolve_dtype
    args.dtype = resolve_dtype(args.dtype, args.config, "cuda" if cuda else "cpu")
    args.backend = args.backend or ("pycuda" if cuda else "torch")
    if args.num_blocks < 0:
        parser.error("--num-blocks must be > 0")
    if args.kv_memory_fraction is not None and not 0 < args.kv_memory_fraction < 1:
        parser.error("--kv-memory-fraction must be in (0, 1): activations need room beyond the cache")
    if args.kv_cache_bytes is not None and args.kv_cache_bytes <= 0:
        parser.error("--kv-cache-bytes must be > 0")
    if not 0 <= args.port < 65536:
        parser.error(f"--port {args.port} out of range")
    if args.worker_token_file:
        try:
            with open(args.worker_token_file) as f:
                args.worker_token = f.read().strip()
        except OSError as e:
            parser.error(f"--worker-token-file: {e}")
        if not args.worker_token:  # an empty secret file would silently mean "no token"
            parser.error(f"--worker-token-file {args.worker_token_file} is empty")
    return args


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


def main(argv=None) -> int:
    args = resolve_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()  # handlers first: a SIGTERM at any point below means a clean exit 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    keep_freed_memory()
    from minipaged.tokenizer import byte_fallback_problem
    problem = byte_fallback_problem(args.model, args.config.vocab_size)
    if problem:  # said at start, not as an ids-range error on the first text prompt
        log.warning("%s", problem)
    if not _torch_importable():
        return 2
    if args.threads > 0:
        import torch
        torch.set_num_threads(args.threads)
    from worker.registration import Registration
    from minipaged.tls import make_channel
    from minipaged.units import human_bytes
    from worker.server import SERVICE_NAME, WorkerServicer, build_server

    if args.simulate:  # the one substitution: a runner that sleeps instead of computing
        from worker.simulator import SimRunner
        runner = SimRunner(args.model, args.layer_start, args.layer_end, args.dtype, args.profile)
        budget = 0 if args.num_blocks else (args.kv_cache_bytes or runner.timing.kv_budget_bytes())
        device, backend = f"sim:{args.profile.name}", "simulated"
    else:
        from worker.model_runner import ModelRunner
        if args.device.startswith("cuda"):  # what this process grows outside torch counts as its own
            from worker import memory
            args.memory_baseline = memory.take_baseline(args.device)
        runner = ModelRunner(args.model, args.layer_start, args.layer_end, args.dtype, args.device, args.backend)
        budget = kv_budget_bytes(args)
        device, backend = args.device, args.backend
    if not args.num_blocks and budget <= 0:
        log.error("no memory left for the K/V cache on %s (use --kv-cache-bytes or --num-blocks)", args.device)
        return 2
    from minipaged.gc_tuning import tune_for_serving
    tune_for_serving()  # the model is loaded: freeze it out of the collector's sight
    servicer = WorkerServicer(runner, model_name=args.model, device=device, dtype=args.dtype,
                              backend=backend, kv_cache_bytes=budget, fixed_num_blocks=args.num_blocks,
                              replica_group=args.replica_group, simulate=args.simulate)
    servicer.channel_factory = lambda address, options: make_channel(address, options, args.tls_ca,
                                                                     args.tls_cert, args.tls_key)
    try:
        server, port, health_servicer = build_server(servicer, args.host, args.port, args.worker_token,
                                                     tls=(args.tls_cert, args.tls_key, args.tls_client_ca),
                                                     ready=not args.metadata)
    except OSError as e:
        log.error("cannot serve on %s:%d: %s", args.host, args.port, e)
        print(f"error: cannot serve on {args.host}:{args.port}: {e}", file=sys.stderr, flush=True)
        return 1
    if args.data_port >= 0 and not args.tls_cert and not runner.is_first:
        from worker.data_link import DataServer
        try:
            servicer.data_server = DataServer(servicer, args.host, args.data_port, args.worker_token)
        except OSError as e:
            print(f"error: cannot serve the data link on {args.host}:{args.data_port}: {e}", file=sys.stderr, flush=True)
            return 1
    if args.metrics_port >= 0:
        from worker import metrics
        try:
            mport = metrics.serve(servicer, args.metrics_port, args.host)
            print(f"metrics on http://{args.host}:{mport}/metrics", file=sys.stderr, flush=True)
        except OSError as e:
            print(f"error: cannot serve metrics on {args.host}:{args.metrics_port}: {e}", file=sys.stderr, flush=True)
            return 1
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

    registration, rejected = None, []
    if args.metadata:
        from grpc_health.v1 import health_pb2
        ready = lambda ok: health_servicer.set(  # noqa: E731 - readiness follows registration
            SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING)
        registration = Registration(args.metadata, servicer.info, lambda: servicer.epoch,
                                    default_interval_ms=args.heartbeat_ms, token=args.worker_token,
                                    channel_factory=servicer.channel_factory,
                                    steps_fn=lambda: servicer.steps_served, on_ready=ready,
                                    on_rejected=lambda why: (rejected.append(why), stop.set())).start()

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
    sys.exit(main())
