"""LocalCluster: the metadata service and a chain of workers as subprocesses on loopback.

For tests, the demo and notebooks. The services are started as processes (`python -m ...`), never
imported: the client stays on its side of the wire (docs/architecture.md section 1)."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import grpc

from minipaged.config import lm_head_layers, load_model_config

from .errors import MiniPagedError
from .procs import LIVE, Proc, log_tail, spawn, stop_all
from .sdk import Client

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ClusterError(RuntimeError):
    """The cluster did not come up (the message carries the tail of every process's log)."""


def split_layers(num_layers: int, workers: int, head_layers: float = 0.0) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges, even, the first stages taking the remainder; with
    `head_layers` (lm_head_layers: the weights the last stage reads beside its layers on every
    decode step), the last stage takes as many fewer layers as makes the busiest stage's decode
    reads smallest (vLLM's VLLM_PP_LAYER_PARTITION does this by hand). A prefill-heavy load would
    rather have the even split: the lm_head runs only for sampled rows there."""
    if workers < 1 or workers > num_layers:
        raise ValueError(f"cannot split {num_layers} layers over {workers} workers "
                         f"(need 1 <= workers <= num_layers)")
    if workers > 1 and head_layers > 0:
        # the last stage's size that minimises the busiest stage (ties: the larger, nearer even)
        cost = lambda last: (max(-(-(num_layers - last) // (workers - 1)), last + head_layers), -last)  # noqa: E731
        last = min(range(1, num_layers - workers + 2), key=cost)
        return split_layers(num_layers - last, workers - 1) + [(num_layers - last, num_layers)]
    base, extra = divmod(num_layers, workers)
    out, start = [], 0
    for i in range(workers):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def free_port() -> int:
    """A port the kernel just gave us; released before the child binds it (tiny race, fine on loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_threads(n_procs: int, standby: int) -> int:
    """The cores shared out among the CPU workers: on a quiet 2-core machine one worker with 2
    threads ran the e2e workload ~1.4x faster than with 1 (the service's work overlaps); on cores
    busy with other jobs pass threads=1: OpenMP threads whose partner is descheduled wait at every
    op's barrier. Standbys (of a multi-stage chain) idle, so they get no share."""
    return max(1, (os.cpu_count() or 1) // max(1, n_procs - standby))


def _worker_flags(dtype, simulate, device, threads, num_blocks, extra) -> list[str]:
    """The flags every worker of the cluster gets, after its own --port, --model and --layers."""
    flags = ["--dtype", dtype] if dtype else []
    flags += ["--simulate", simulate] if simulate else ["--device", device]
    flags += ["--threads", str(threads)] if threads else []
    if num_blocks is not None:
        flags += ["--num-blocks", str(num_blocks)]
    return flags + [str(x) for x in extra]


class LocalCluster:
    """`with LocalCluster(model="tiny", workers=2) as c: c.client.generate(...)`.

    Starts on construction (like dask's LocalCluster) and waits until the service reports ready.
    `token` starts the service with --token and gives it to `.client`; `root` is the directory the
    packages are run from (the repo root; tests point it at fakes). Logs: `log_dir`, `logs()`.
    `http=True` also starts the HTTP gateway (`python -m gateway`, with the same token) once the
    service is ready, and waits for its GET /health; `.http_url` is its base URL (None without)."""

    popen_kwargs: dict = {}  # e.g. start_new_session (`minipaged serve`: Ctrl-C reaches only the runner)

    def __init__(self, model: str = "tiny", workers: int = 1, dtype: str | None = "float32",
                 num_blocks: int | None = None, block_size: int = 16, device: str = "cpu",
                 extra_service_args=(), extra_worker_args=(), db: str | None = None,
                 env: dict | None = None, startup_timeout: float = 120.0, grace: float = 5.0,
                 token: str | None = None, root: str | None = None, replicas: int = 1, standby: int = 0,
                 simulate: str | None = None, threads: int | None = None, http: bool = False,
                 http_host: str = "127.0.0.1", http_port: int | None = None, extra_gateway_args=(),
                 roles=None):
        """`workers` stages per chain, `replicas` chains (workers x replicas processes), plus
        `standby` spare workers for the last stage's layers: they wait, outside any chain, to replace
        a lost stage (with one stage per chain a spare is simply one more replica). `simulate` ('h200' or a profile JSON) starts
        simulated workers (no weights; dtype None = their default, bfloat16). `threads`: torch
        threads per worker (default: the machine's cores shared out among the CPU workers).
        `http_host`/`http_port` (default: a free port) and `extra_gateway_args` go to the gateway.
        `roles`: one worker --role per replica (["prefill", "decode"]: disaggregated prefill/decode)."""
        # the children run in the package's directory: a relative checkpoint path is the caller's
        model = os.path.abspath(model) if model != "tiny" and os.path.isdir(model) else model
        self.model, self.root, self.grace = model, root or ROOT, grace
        self.startup_timeout = startup_timeout
        if replicas < 1 or standby < 0:
            raise ValueError("replicas must be >= 1 and standby >= 0")
        if roles is not None and (len(roles) != replicas or not set(roles) <= {"prefill", "decode", "both"}):
            raise ValueError(f"roles: one of prefill / decode / both per replica ({replicas}), got {roles}")
        cfg = load_model_config(model)
        stages = split_layers(cfg.num_hidden_layers, workers, lm_head_layers(cfg))  # may raise
        self.layers = stages * replicas + [stages[-1]] * standby
        self.replicas = replicas
        self.log_dir = tempfile.mkdtemp(prefix="minipaged-cluster-")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = self._child_env(env)
        if threads is None and not simulate and device == "cpu":
            threads = _cpu_threads(len(self.layers), standby if workers > 1 else 0)
        service_cmd = [sys.executable, "-m", "metadata_service", "--host", "127.0.0.1", "--port", str(self.port),
                       "--block-size", str(block_size), "--db", db or os.path.join(self.log_dir, "jobs.db"),
                       "--grace", f"{self.grace:g}"]
        service_cmd += (["--token", token] if token else []) + [str(x) for x in extra_service_args]
        self._procs = [Proc("metadata_service", service_cmd, self._log_path("metadata_service"))]
        worker_flags = _worker_flags(dtype, simulate, device, threads, num_blocks, extra_worker_args)
        role = lambda i: ["--role", roles[i // workers]] if roles is not None and i < workers * replicas else []
        self._procs += [self._worker_proc(i, a, b, worker_flags + role(i)) for i, (a, b) in enumerate(self.layers)]
        self.client = Client(self.address, token=token)
        self.stopped = False              # stop() ran: the processes are gone for good
        self.http_url: str | None = None
        self._http = (http_host, http_port, [str(x) for x in extra_gateway_args])
        try:
            for p in self._procs:
                self._spawn(p)
            self.wait_ready()
            if http:
                self._start_gateway(sys.executable, self._log_path("gateway"), token)
        except BaseException as e:   # a failure keeps its logs to explain it; an interrupt does not
            self.stop(keep_logs=not isinstance(e, KeyboardInterrupt))
            raise

    def _child_env(self, env: dict | None) -> dict:
        out = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        out["PYTHONPATH"] = os.pathsep.join(p for p in (self.root, out.get("PYTHONPATH")) if p)
        if len(self.layers) > 1:  # processes on one machine take turns: idle OpenMP threads must not spin on its cores
            out.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        return out

    def _log_path(self, name: str) -> str:
        return os.path.join(self.log_dir, f"{name}.log")

    def _worker_proc(self, i: int, start: int, end: int, flags: list[str]) -> Proc:
        cmd = [sys.executable, "-m", "worker", "--metadata", self.address, "--host", "127.0.0.1",
               "--port", str(free_port()), "--model", self.model, "--layers", f"{start}:{end}", *flags]
        return Proc(f"worker{i}", cmd, self._log_path(f"worker{i}"))

    # ------------------------------------------------------------ processes

    @property
    def processes(self) -> list[subprocess.Popen]:
        """[metadata service, worker0, worker1, ...] (current ones, after any restart)."""
        return [p.popen for p in self._procs]

    def _spawn(self, p: Proc) -> None:
        spawn(p, self.root, self.env, **self.popen_kwargs)

    def logs(self, lines: int = 30) -> str:
        """The tail of every process's log, for error messages and debugging."""
        return "\n".join(log_tail(p, lines) for p in self._procs)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Until Stats says every chain is ready (caches initialised) and every worker registered,
        or a process exits."""
        end = time.monotonic() + (self.startup_timeout if timeout is None else timeout)
        while True:
            dead = [p.name for p in self._procs if p.popen.poll() is not None and not self._rebind(p)]
            if dead:
                raise ClusterError(f"{', '.join(dead)} exited before the cluster was ready; "
                                   f"logs in {self.log_dir}\n" + self.logs())
            try:
                st = self.client.stats(timeout=2.0)
                # every chain formed and every worker (standbys too) registered
                if st.ready and st.num_chains >= self.replicas and st.num_workers >= len(self.layers):
                    return
            except MiniPagedError:
                pass  # not listening yet
            if time.monotonic() > end:
                raise ClusterError(f"cluster at {self.address} not ready after {self.startup_timeout:.0f}s; "
                                   f"logs in {self.log_dir}\n" + self.logs())
            time.sleep(0.2)

    def _rebind(self, p: Proc) -> bool:
        """A worker that lost its --port to another process (free_port's port is free only until
        some process binds an ephemeral port, e.g. another worker's data link) starts again on a
        fresh one, at most 3 times. True when it was restarted."""
        if not p.name.startswith("worker") or p.rebinds >= 3 or "--port" not in p.cmd:
            return False
        try:
            with open(p.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(p.log_path) - 4096))
                if b"could not bind" not in f.read():
                    return False
        except OSError:
            return False
        p.rebinds += 1
        p.cmd[p.cmd.index("--port") + 1] = str(free_port())
        self._spawn(p)
        return True

    def _start_gateway(self, py: str, log_path: str, token: str | None) -> None:
        import urllib.error
        import urllib.request
        host, port, extra = self._http
        port = port or free_port()
        # its --grace ends a little before ours (stop() SIGKILLs at `grace`), so streams still open
        # end with an error event and [DONE] rather than mid-body
        cmd = [py, "-m", "gateway", "--metadata", self.address, "--port", str(port), "--host", host,
               "--model", self.model, "--grace", f"{max(0.5, self.grace - 1.5):g}"] + \
            (["--token", token] if token else []) + extra
        p = Proc("gateway", cmd, log_path)
        self._procs.append(p)  # last: workers keep their indices in .processes
        self._spawn(p)
        near = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host  # where we can reach it
        url, end = f"http://{near}:{port}", time.monotonic() + self.startup_timeout
        while True:
            if p.popen.poll() is not None:
                raise ClusterError(f"gateway exited before it was ready; logs in {self.log_dir}\n" + self.logs())
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2.0) as r:
                    if r.status == 200:
                        self.http_url = url
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or 503 while not ready
            if time.monotonic() > end:
                raise ClusterError(f"gateway at {url} not healthy after {self.startup_timeout:.0f}s; "
                                   f"logs in {self.log_dir}\n" + self.logs())
            time.sleep(0.2)

    def kill_worker(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Simulate a crash of worker i (reliability tests)."""
        p = self._procs[1 + i].popen
        p.send_signal(sig)
        p.wait()
        LIVE.discard(p)

    def restart_worker(self, i: int, wait: bool = True) -> None:
        """(Re)start worker i with the same command and port: it comes back with a fresh cache."""
        self._restart(self._procs[1 + i], wait)

    def restart_service(self, wait: bool = True) -> None:
        """Stop and restart the metadata service on the same port and job database."""
        self._restart(self._procs[0], wait)

    def _restart(self, p: Proc, wait: bool) -> None:
        stop_all([p.popen], self.grace)
        self._spawn(p)
        if wait:
            # The service may still report the old chain as ready: first wait for the new process
            # to open its port (a worker does so once its weights are loaded), then for ready.
            port = p.cmd[p.cmd.index("--port") + 1]
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                future, end = grpc.channel_ready_future(ch), time.monotonic() + self.startup_timeout
                while not future.done():
                    if p.popen.poll() is not None or time.monotonic() > end:
                        future.cancel()
                        raise ClusterError(f"{p.name} did not come back; logs in {self.log_dir}\n" + self.logs())
                    time.sleep(0.1)
            self.wait_ready()

    def stop(self, keep_logs: bool = False) -> None:
        """Stop in waves, each SIGTERM, up to `grace`, then SIGKILL: the gateway first (its streams in
        flight still have workers to finish on while it drains), then the workers (they deregister
        from a live service), then the service. Idempotent."""
        self.stopped = True
        self.client.close()
        waves = ([p for p in self._procs if p.name == "gateway"], [p for p in self._procs if p.name.startswith("worker")],
                 [p for p in self._procs if p.name == "metadata_service"])
        for wave in waves:
            stop_all([p.popen for p in wave if p.popen is not None], self.grace)
        if not keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        if self.stopped:
            raise ClusterError("this LocalCluster was stopped: its processes are gone; start a new one")
        return self

    def __exit__(self, exc_type, *exc) -> None:
        failed = exc_type is not None  # an error inside the block: keep the logs that explain it
        self.stop(keep_logs=failed)
        if failed:
            print(f"LocalCluster: the logs of this failed run are kept in {self.log_dir}", file=sys.stderr, flush=True)
