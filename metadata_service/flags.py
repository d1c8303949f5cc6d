"""The metadata service's command line: `python -m metadata_service --help` (metadata_service/__main__.py
runs it)."""
from __future__ import annotations

import argparse

from minipaged.cli import port, port_or_off, prog_name
from minipaged.constants import DEFAULT_METADATA_PORT

from .router import OVERLAP_WEIGHT, POLICIES

USAGE = "`python -m metadata_service --port 50051 [--host 127.0.0.1] [--block-size 16] [--db PATH] ...`"


def build_parser() -> argparse.ArgumentParser:
    # no abbreviations: a sharded front hands its flags on to the shards by their full names
    p = argparse.ArgumentParser(prog=prog_name("metadata_service"), description=USAGE, allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=DEFAULT_METADATA_PORT, help="0 picks a free port")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=0,
                   help="cap on the pool (default: the smallest capacity of the worker chain; 1024 before "
                        "any worker registers, for the block API alone)")
    p.add_argument("--db", default="", metavar="PATH",
                   help="SQLite job store (WAL): jobs survive a restart on the same PATH, which one service owns "
                        "at a time (PATH.lock). Default: in memory, gone when the service stops")
    _scheduling_flags(p)
    p.add_argument("--no-block-api", action="store_true", help="switch the block API off (public ports)")
    p.add_argument("--worker-port", type=port_or_off, default=-1,
                   help="serve the internal surface (worker registration, heartbeats, block API) on this port "
                        "of its own; leave it unpublished (default: the client port serves both; 0 picks one)")
    p.add_argument("--worker-host", default="", help="interface of --worker-port (default: --host)")
    _security_flags(p)
    p.add_argument("--worker-lease", "--heartbeat-timeout", dest="worker_lease", type=float, default=4.0,
                   help="seconds a worker may stay silent (no heartbeat) before its chain fails over")
    p.add_argument("--worker-wait", type=float, default=60.0,
                   help="seconds streams wait for a lost worker chain before failing with UNAVAILABLE")
    p.add_argument("--step-timeout", type=float, default=120.0,
                   help="a step not back within this many seconds, plus 4x the time the chain's slowest "
                        "step per token so far predicts for it, fails its chain as a lost lease does "
                        "(recompute elsewhere; the late stage joins no chain until idle); 0: no deadline")
    p.add_argument("--grace", type=float, default=10.0, help="shutdown grace period (SIGTERM)")
    p.add_argument("--metrics-port", type=port_or_off, default=-1,
                   help="serve Prometheus text on this port (vLLM's metric names; 0 picks one; default off; with "
                        "--shards N: every shard's, labelled shard=K)")
    p.add_argument("--log-stats-interval", type=float, default=10.0, metavar="S",
                   help="log running/waiting requests, throughput, KV usage and prefix hits every S seconds "
                        "while there is activity (0: never)")
    p.add_argument("--shards", type=int, default=1,
                   help="run N shard services (each a whole metadata service in a process of its own: its "
                        "chains never wait for another's interpreter lock) behind this one address")
    p.add_argument("--shard-addresses", default="", metavar="HOST:PORT,...",
                   help="front shard services already running (on this or other hosts) instead of starting them")
    p.add_argument("--log-level", default="INFO")
    return p


def _scheduling_flags(p: argparse.ArgumentParser) -> None:
    """Batches, micro-batches, routing, the prefix cache and the KV tier."""
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    p.add_argument("--max-num-seqs", type=int, default=256, help="running sequences per micro-batch")
    p.add_argument("--micro-batches", type=int, default=0,
                   help="micro-batches in flight per chain (0: one stage 1; N CPU stages N; N GPU or simulated "
                        "stages N + 1). Up to N are overlapped by async scheduling")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="schedule a micro-batch's next step only after its tokens are back")
    p.add_argument("--router", choices=POLICIES, default="exact",
                   help="how new sequences pick a replica chain: exact (what each chain's pool holds), prefix "
                        "(approximate: an LRU of what was routed there), round_robin, least_loaded")
    p.add_argument("--router-overlap-weight", type=float, default=OVERLAP_WEIGHT,
                   help="how many blocks of a chain's queued load one prompt block it would have to compute "
                        "weighs, for exact and prefix routing (Dynamo's overlap score weight)")
    p.add_argument("--full-block-tables", action="store_true",
                   help="send whole block tables every step instead of deltas (to compare wire costs)")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="default and upper bound: the model's context (max_position_embeddings, or what its "
                        "RoPE scaling extends it to; a larger value serves that, with a warning)")
    p.add_argument("--max-waiting", type=int, default=4096, help="pending requests before RESOURCE_EXHAUSTED")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--kv-move-part-bytes", type=int, default=0,
                   help="disaggregated prefill/decode: move a prompt's K/V in reads of about this many bytes "
                        "(a bound on a decode worker's read buffer; default 0: one read per move)")
    p.add_argument("--kv-tier-policy", choices=["write-back", "write-through", "off"], default="write-back",
                   help="the second KV tier, on chains whose workers have one (--kv-tier-bytes): save a cached "
                        "block when the pool evicts it (write-back) or once it is computed (write-through)")


def _security_flags(p: argparse.ArgumentParser) -> None:
    """Tokens and TLS, for clients and for the worker links."""
    p.add_argument("--token", default=None, help="client token (Bearer); default: $MINIPAGED_TOKEN")
    p.add_argument("--token-file", default="", help="read the client token from this file (a secret)")
    p.add_argument("--worker-token", default=None,
                   help="token workers present to register and this service presents to workers; required "
                        "whenever the internal surface is bound to a non-loopback address; default: "
                        "$MINIPAGED_WORKER_TOKEN")
    p.add_argument("--worker-token-file", default="", help="read the worker token from this file (a secret)")
    p.add_argument("--tls-cert", default="", help="serve TLS with this certificate (PEM)")
    p.add_argument("--tls-key", default="", help="private key of --tls-cert")
    p.add_argument("--tls-client-ca", default="", help="require client certificates signed by this CA (mTLS)")
    p.add_argument("--worker-tls-ca", default="", help="CA of the workers' certificates: talk TLS to workers")
    p.add_argument("--worker-tls-cert", default="", help="client certificate for the worker links (mTLS)")
    p.add_argument("--worker-tls-key", default="", help="key of --worker-tls-cert")
