"""The worker's command line (`python -m worker ...`, DESIGN section 2): the flags, their defaults,
and the checks that need only the model's config.json (no weights are read here)."""
from __future__ import annotations

import argparse
import os
import re
import sys

from minipaged import cli
from minipaged.cli import host_port_ok, port, port_or_off, prog_name
from minipaged.config import check_weights_present, load_model_config, parse_rope_scaling
from minipaged.constants import DEFAULT_METADATA_ADDRESS, DTYPE_BYTES

DEFAULT_CPU_KV_BYTES = 256 * 1024 * 1024
# ... or room for this many tokens if that is more (capped at a quarter of the free RAM): at the
# real Qwen3 shapes a token's K/V is 229 KB in float32, so 256 MiB held only ~1,170 tokens and a
# batch of 16 long prompts ran a few sequences at a time (issue 18 measured with it)
DEFAULT_CPU_KV_TOKENS = 8192
DEFAULT_GPU_MEMORY_FRACTION = 0.9


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog_name("worker"), description="MiniPaged-Qwen worker: one pipeline stage.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--metadata", default=os.environ.get("MINIPAGED_ADDRESS") or DEFAULT_METADATA_ADDRESS,
                   help="metadata service HOST:PORT to register with, as the client's and gateway's default "
                        "(env MINIPAGED_ADDRESS)")
    p.add_argument("--standalone", action="store_true",
                   help="register with no metadata service: serve WorkerService calls only (tests, debugging)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 in containers)")
    p.add_argument("--port", type=port, default=50061, help="port to serve on (0 = pick a free one)")
    p.add_argument("--advertise-address", default="", help="HOST:PORT others reach this worker at "
                   "(default: --host:bound port, or hostname:port when bound to 0.0.0.0)")
    p.add_argument("--model", default="tiny", help="'tiny' (embedded) or a local Qwen3 checkpoint directory")
    p.add_argument("--layers", default="", help="A:B, the layer range [A, B) this stage serves (default: all)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=["auto", *DTYPE_BYTES], default="auto",
                   help="auto: the checkpoint's dtype where the device computes it well, else float32 "
                        "(worker/dtype_choice.py: bfloat16 on cuda, and on a CPU with AVX512_BF16/AMX "
                        "for a bfloat16 checkpoint; tiny: float32 on cpu, bfloat16 on cuda); float32 "
                        "and float64 give transformers' tokens exactly")
    p.add_argument("--rope-scaling", default=None, metavar="JSON",
                   help="RoPE scaling instead of config.json's, e.g. Qwen3's 131k context: "
                        "'{\"rope_type\":\"yarn\",\"factor\":4.0,\"original_max_position_embeddings\":32768}' "
                        "(default, linear or yarn; every stage of a model must be given the same)")
    cap = p.add_mutually_exclusive_group()
    cap.add_argument("--num-blocks", type=int, default=0, help="fixed K/V capacity in blocks")
    cap.add_argument("--kv-memory-fraction", type=float, default=None,
                     help="fraction of device memory this process may use in all (weights + K/V); "
                          f"default {DEFAULT_GPU_MEMORY_FRACTION} on cuda")
    p.add_argument("--kv-cache-bytes", type=int, default=None,
                   help=f"K/V byte budget (default on cpu: {DEFAULT_CPU_KV_BYTES >> 20} MiB, or "
                        f"{DEFAULT_CPU_KV_TOKENS} tokens of this stage's K/V if that is more, capped at a quarter "
                        f"of the free RAM; on cuda: --kv-memory-fraction)")
    p.add_argument("--kv-tier-bytes", type=int, default=0,
                   help="byte budget of a second KV tier in host RAM behind the cache (default 0: none)")
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
    p.add_argument("--role", choices=["prefill", "decode", "both"], default="both",
                   help="disaggregated prefill/decode: prompts run on prefill chains, their K/V move to a decode "
                        "chain, which generates (a chain's stages share one role; default both)")
    p.add_argument("--simulate", default="", metavar="h200|PROFILE.json",
                   help="a simulated worker: no weights, no compute; each step sleeps for a roofline timing "
                        "model's time (worker/simulator.py) and returns deterministic pseudo-random tokens")
    p.add_argument("--data-port", type=port_or_off, default=0,
                   help="TCP data link: the metadata service's Steps and results, and hidden states from "
                        "the previous stage (0 picks a port, -1 = none: all on the gRPC streams; never with "
                        "TLS, whose streams are encrypted)")
    p.add_argument("--metrics-port", type=port_or_off, default=-1,
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
    # not a default: --help would print it
    args.worker_token = cli.token(parser, args.worker_token, "MINIPAGED_WORKER_TOKEN", "--worker-token",
                                  args.worker_token_file) or ""
    if args.standalone or not args.metadata:   # --metadata "" still means standalone, as it used to
        args.metadata = ""
    try:
        args.rope_scaling = parse_rope_scaling(args.rope_scaling) if args.rope_scaling else None
        args.config = load_model_config(args.model, args.rope_scaling)
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
    if not (args.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", args.device)):
        parser.error(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if args.simulate:
        from worker.simulator import load_profile
        try:
            args.profile = load_profile(args.simulate)
        except (ValueError, OSError) as e:
            parser.error(str(e))
        cuda = True  # it stands in for a GPU: bfloat16 by default
    if args.dtype == "float16" and not cuda:
        parser.error("--dtype float16 needs --device cuda: on a CPU use float32, float64 or bfloat16")
    from worker.dtype_choice import resolve_dtype
    args.dtype = resolve_dtype(args.dtype, args.config, "cuda" if cuda else "cpu")
    args.backend = _choose_backend(parser, args, cuda)
    if args.threads < 0:
        parser.error(f"--threads must be >= 0 (0: torch's choice), got {args.threads}")
    if args.num_blocks < 0:
        parser.error("--num-blocks must be > 0")
    if args.kv_memory_fraction is not None and not 0 < args.kv_memory_fraction < 1:
        parser.error("--kv-memory-fraction must be in (0, 1): activations need room beyond the cache")
    if args.kv_tier_bytes < 0:
        parser.error("--kv-tier-bytes must be >= 0")
    ram = _physical_memory()
    if args.kv_tier_bytes > ram and not args.simulate:    # host RAM holds the tier, on CPU and GPU workers
        parser.error(f"--kv-tier-bytes {args.kv_tier_bytes} is more than this machine's memory ({ram} bytes)")
    if args.kv_cache_bytes is not None and args.kv_cache_bytes <= 0:
        parser.error("--kv-cache-bytes must be > 0")
    if args.advertise_address and not host_port_ok(args.advertise_address):
        parser.error(f"--advertise-address must be HOST:PORT (PORT 1-65535), got {args.advertise_address!r}")
    return args


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):   # no sysconf: no check
        return 1 << 62


def _choose_backend(parser, args, cuda: bool) -> str:
    """--backend, or the device's default: the CUDA kernels on a GPU, unless the model's attention
    shape is one they are not built for (then the torch backend, which runs any shape on the GPU
    too, with a warning); asked for by name, such a shape is an error at start, not at every step."""
    chosen = args.backend or ("pycuda" if cuda else "torch")
    if chosen != "pycuda" or args.simulate:      # (a simulated worker runs no kernels)
        return chosen
    from worker.kernels.launch import unsupported_shape
    c = args.config
    why = unsupported_shape(c.head_dim, c.num_attention_heads, c.num_key_value_heads)
    if why is None:
        return "pycuda"
    if args.backend == "pycuda":
        parser.error(f"--backend pycuda cannot run this model: {why}; use --backend torch")
    print(f"{parser.prog}: warning: {why}: attention runs on the torch backend", file=sys.stderr)
    return "torch"


def cuda_problem(device: str) -> str | None:
    """Why `--device cuda[:N]` cannot run here (no CUDA build or device, no such index), or None. At
    start, not in resolve_args: a GPU deployment's flags are checked on any machine."""
    import torch
    if not torch.cuda.is_available():
        return (f"--device {device}: this torch sees no CUDA device (torch {torch.__version__}, built for CUDA: "
                f"{torch.version.cuda or 'no'}); use --device cpu here, or the GPU install path (README, GPU) on a "
                f"machine with one")
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        return f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None
