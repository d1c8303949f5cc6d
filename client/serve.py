"""`minipaged serve MODEL` (= `python -m client serve MODEL`): the whole local stack in the
foreground, as `vllm serve MODEL` does it in one process.

It starts a LocalCluster (the metadata service, `--stages` x `--replicas` workers, then the HTTP
gateway on `--host:--port`), prints every process's log lines prefixed by its name, reports
loading progress (workers registered, chains ready), then one line with the URL. Ctrl-C or
SIGTERM stops everything (gateway first, then workers and service, SIGTERM then SIGKILL after
`--grace` seconds) and exits 0; a second Ctrl-C kills every process at once (exit 130). The
children run in their own session, so the terminal's Ctrl-C reaches only this runner, which stops
them in order; PR_SET_PDEATHSIG still takes them down if the runner itself is killed."""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import threading
import time

from minipaged.cli import port
from minipaged import generation_defaults as gd
from minipaged.config import load_model_config, parse_rope_scaling
from minipaged.constants import DTYPE_BYTES

from . import cluster as cl
from .errors import MiniPagedError
from .sdk import Client

PREFIX_WIDTH = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="'tiny' or a local Hugging Face Qwen3 checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="HTTP interface (0.0.0.0: every interface)")
    p.add_argument("--port", type=port, default=8000, help="HTTP port of the OpenAI API")
    p.add_argument("--stages", type=int, default=1, help="pipeline stages per chain (layers split by weight: the first and last stages hold the embedding and lm_head)")
    p.add_argument("--replicas", type=int, default=1, help="worker chains behind the one service")
    p.add_argument("--shards", type=int, default=1,
                   help="metadata processes behind the one service (--shards of python -m metadata_service): "
                        "one-stage replicas spread over them")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's name(s) in the API (default: MODEL); responses carry the first, requests may "
                        "name any. Give MODEL before this flag: the names take every word after it")
    p.add_argument("--api-key", default=None,
                   help="clients must send 'Authorization: Bearer KEY' (env MINIPAGED_API_KEY); the "
                        "service and gateway share it")
    p.add_argument("--dtype", default=None, choices=list(DTYPE_BYTES),
                   help="compute dtype (default: the worker's auto, the checkpoint's dtype where the device "
                        "computes it well: bfloat16 on cuda and on a CPU with AVX512_BF16/AMX for a "
                        "bfloat16 checkpoint, else float32)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--rope-scaling", default=None, metavar="JSON",
                   help="RoPE scaling instead of config.json's (every worker gets it), e.g. Qwen3's 131k "
                        "context: '{\"rope_type\":\"yarn\",\"factor\":4.0,"
                        "\"original_max_position_embeddings\":32768}'; the context limit follows it")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output tokens per sequence (default: the model's context)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--num-blocks", type=int, default=None, help="KV blocks per worker (default: by memory)")
    kv.add_argument("--kv-memory-fraction", type=float, default=None,
                    help="fraction of device memory a worker may use (weights + K/V)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="running sequences per micro-batch")
    p.add_argument("--generation-config", default="auto",
                   help="what a request's unset sampling fields take: auto (the checkpoint's generation_config.json, "
                        "as vLLM), vllm (OpenAI's defaults) or a directory holding generation_config.json")
    p.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="sampling defaults merged over --generation-config's, e.g. '{\"temperature\": 0.7}'")
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="max_tokens of chat requests that give none (the gateway's flag; default: the checkpoint's "
                        "generation_config.json max_new_tokens, else 256; within the model's context)")
    p.add_argument("--reasoning-parser", default="qwen3", choices=["qwen3", "none"],
                   help="qwen3: <think>...</think> of a Qwen3 template goes to message.reasoning; none: off")
    p.add_argument("--threads", type=int, default=None, help="torch threads per CPU worker")
    p.add_argument("--db", default=None, help="SQLite job store (default: a temporary file)")
    p.add_argument("--grace", type=float, default=10.0, help="seconds to drain on stop before SIGKILL")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for ready")


class _Logs(threading.Thread):
    """Follows every `*.log` in the cluster's log directory and prints new lines as
    `name | line` (the files are the children's stdout and stderr)."""

    def __init__(self, log_dir: str, out=sys.stdout):
        super().__init__(daemon=True, name="serve-logs")
        self.log_dir, self.out = log_dir, out
        self.offsets: dict[str, int] = {}
        self.partial: dict[str, bytes] = {}
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.1):
            self.poll()
        self.poll()

    def poll(self) -> None:
        try:
            names = sorted(f for f in os.listdir(self.log_dir) if f.endswith(".log"))
        except OSError:
            return
        for f in names:
            try:
                with open(os.path.join(self.log_dir, f), "rb") as fh:
                    fh.seek(self.offsets.get(f, 0))
                    data = fh.read()
            except OSError:
                continue
            self.offsets[f] = self.offsets.get(f, 0) + len(data)
            lines = (self.partial.pop(f, b"") + data).split(b"\n")
            if lines[-1]:
                self.partial[f] = lines[-1]     # an unfinished line: wait for its end
            for line in lines[:-1]:
                say(line.decode("utf-8", "replace").rstrip("\r"), f[:-4], self.out)

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=5)


def say(text: str, who: str = "serve", out=sys.stdout) -> None:
    out.write(f"{who:<{PREFIX_WIDTH}}| {text}\n")
    out.flush()


class _ServeCluster(cl.LocalCluster):
    """A LocalCluster whose children are in their own session, and which shows its progress."""

    popen_kwargs = {"start_new_session": True}
    logs_thread: _Logs | None = None

    def __init__(self, **kw):
        self.token = kw.get("token")
        super().__init__(**kw)

    def wait_ready(self, timeout: float | None = None) -> None:
        if self.logs_thread is None:  # first call: everything is spawned, the log files exist
            self.logs_thread = _Logs(self.log_dir)
            self.logs_thread.start()
            done = threading.Event()
            threading.Thread(target=self._progress, args=(done,), daemon=True).start()
            try:
                return super().wait_ready(timeout)
            finally:
                done.set()
        return super().wait_ready(timeout)

    def _progress(self, done: threading.Event) -> None:
        """A line each time a worker registers or a chain becomes ready."""
        want_workers = len(self.layers)
        client, last = Client(self.address, token=self.token), None
        try:
            while not done.wait(0.5):
                try:
                    st = client.stats(timeout=2.0)
                except MiniPagedError:
                    continue
                now = (st.num_workers, st.num_chains)
                if now != last:
                    last = now
                    say(f"loading: {st.num_workers}/{want_workers} workers registered, "
                        f"{st.num_chains}/{self.replicas} chains ready")
        finally:
            client.close()


def _cluster_kwargs(a) -> dict:
    service = ["--max-model-len", a.max_model_len] if a.max_model_len else []
    service += ["--max-num-seqs", a.max_num_seqs] if a.max_num_seqs is not None else []
    service += ["--shards", a.shards] if a.shards > 1 else []
    worker = ["--kv-memory-fraction", a.kv_memory_fraction] if a.kv_memory_fraction is not None else []
    worker += ["--rope-scaling", a.rope_scaling] if a.rope_scaling else []
    gateway = ["--reasoning-parser", a.reasoning_parser, "--generation-config", a.generation_config]
    gateway += ["--override-generation-config", a.override_generation_config] if a.override_generation_config else []
    gateway += ["--default-max-tokens", str(a.default_max_tokens)] if a.default_max_tokens is not None else []
    # the API's model id is what the user typed (vLLM's), though the workers get an absolute path
    gateway += ["--served-model-name", *(a.served_model_name or [a.model])]
    return dict(model=a.model, workers=a.stages, replicas=a.replicas, dtype=a.dtype, device=a.device,
                num_blocks=a.num_blocks, block_size=a.block_size, threads=a.threads, db=a.db,
                token=a.api_key, http=True, http_host=a.host, http_port=a.port, grace=a.grace,
                startup_timeout=a.startup_timeout, extra_service_args=service, extra_worker_args=worker,
                extra_gateway_args=gateway)


class _Signals:
    """First SIGINT/SIGTERM: KeyboardInterrupt in the main thread (a clean, ordered stop).
    Second: SIGKILL every child now and exit 130."""

    def __init__(self):
        self.count = 0
        self.old = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def handle(self, sig, frame) -> None:
        self.count += 1
        if self.count == 1:
            raise KeyboardInterrupt
        for p in list(cl.LIVE):
            try:
                p.kill()
            except OSError:
                pass
        sys.stderr.write("killed\n")
        os._exit(130)

    def restore(self) -> None:
        for s, h in self.old.items():
            signal.signal(s, h)


def _run_until_stopped(c: _ServeCluster) -> int:
    """Ready: wait for a signal (0) or a process that dies on its own (1)."""
    while True:
        dead = [(p.name, p.popen.poll()) for p in c._procs if p.popen.poll() is not None]
        if dead:
            say(f"{', '.join(f'{n} exited with code {rc}' for n, rc in dead)}: stopping the rest")
            return 1
        time.sleep(0.5)


def _check_port_free(host: str, port: int) -> None:
    import socket
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as the gateway's server binds
        try:
            s.bind((host, port))
        except OSError as e:
            raise OSError(f"cannot serve on {host}:{port}: {e.strerror or e}") from None


def _check_max_model_len(flag: int, model: str, rope) -> None:
    """vLLM's rule: --max-model-len may not exceed the model's context (its positions past that
    were never trained, and the workers refuse them)."""
    try:
        limit = load_model_config(model, rope).max_context
    except (OSError, ValueError, KeyError):
        return                 # the workers name what is wrong with the checkpoint
    if flag > limit:
        raise ValueError(f"--max-model-len {flag} is longer than the model's context, {limit} tokens "
                         f"(max_position_embeddings, or what --rope-scaling extends it to)")


def serve(a) -> int:
    if a.api_key is None:
        a.api_key = os.environ.get("MINIPAGED_API_KEY")
    try:                      # before any process starts: the workers / the gateway would refuse these
        for flag, value in (("--block-size", a.block_size), ("--max-num-seqs", a.max_num_seqs),
                            ("--default-max-tokens", a.default_max_tokens)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        _check_port_free(a.host, a.port)      # before minutes of loading weights, not after
        rope = parse_rope_scaling(a.rope_scaling) if a.rope_scaling else None
        if a.max_model_len:
            _check_max_model_len(int(a.max_model_len), a.model, rope)
        if a.generation_config not in gd.SOURCES:    # a directory: the gateway runs elsewhere (cwd)
            a.generation_config = os.path.abspath(a.generation_config)
        gd.load(a.generation_config, a.model, gd.parse_override(a.override_generation_config))
    except (ValueError, OSError) as e:
        say(f"error: {e}")
        return 1
    signals = _Signals()
    c = None
    t0 = time.monotonic()
    say(f"starting {a.model}: metadata service, {a.stages} stage(s) x {a.replicas} replica(s), "
        f"gateway on {a.host}:{a.port}")
    try:
        try:
            c = _ServeCluster(**_cluster_kwargs(a))
        except KeyboardInterrupt:
            say("interrupted while starting; stopped")
            return 0
        except (cl.ClusterError, ValueError, OSError) as e:
            say(f"error: {e}")
            return 1
        name = (a.served_model_name or [a.model])[0]
        try:                  # a signal while the ready line prints is a stop like any other
            say(f"ready in {time.monotonic() - t0:.1f}s: model {name!r}, OpenAI API at {c.http_url}/v1 "
                f"(dashboard {c.http_url}/, SDK Client({c.address!r})); Ctrl-C stops")
            code = _run_until_stopped(c)
        except KeyboardInterrupt:
            say("stopping (Ctrl-C again kills)")
            code = 0
        c.stop(keep_logs=True)
        say("stopped")
        return code
    finally:
        if c is not None:
            if c.logs_thread is not None:
                c.logs_thread.stop()
            shutil.rmtree(c.log_dir, ignore_errors=True)
        signals.restore()
