"""The docker side of `make compose-test` (scripts/compose_test.py runs the steps): its settings,
a logged and timed step, commands that fail the run, the compose stack of docker-compose.host.yml,
and what the host sees of it (listening addresses, a container's process)."""
from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from client import Client  # noqa: E402

SHARED = os.environ.get("MINIPAGED_SHARED_DOCKER", os.path.join(REPO, "..", "shared", "docker"))
PROJECT = os.environ.get("COMPOSE_TEST_PROJECT", "minipaged-ci")
COMPOSE_FILE = "docker-compose.host.yml"
BASE_IMAGE = os.environ.get("COMPOSE_TEST_BASE_IMAGE", "local/python:3.11-bookworm")
PORTS = {name: int(os.environ.get(f"COMPOSE_TEST_{name}", default)) for name, default in
         (("METADATA_PORT", 51051), ("METADATA_WORKER_PORT", 51052), ("WORKER0_PORT", 51061),
          ("WORKER1_PORT", 51062), ("GATEWAY_PORT", 51080), ("METADATA_METRICS_PORT", 51100),
          ("WORKER0_METRICS_PORT", 51101), ("WORKER1_METRICS_PORT", 51102))}
DAEMON_PIDFILE = os.environ.get("DOCKERD_PID", "/tmp/minipaged-compose-test-dockerd.pid")
MODEL, DTYPE = "tiny", "float64"   # float64: greedy tokens do not depend on batch composition
CPU_SERVICES = ["metadata", "worker0-cpu", "worker1-cpu"]
GATEWAY_PROMPT = {"prompt": "Once upon a time", "max_new_tokens": 16}   # /v1/completions; tiny answers in visible text
HAS_GATEWAY = os.path.isdir(os.path.join(REPO, "gateway"))
T0 = time.monotonic()
TIMINGS: list[tuple[str, float]] = []


class Failed(Exception):
    pass


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f}s] {msg}", flush=True)


class step:
    """`with step("name"):` logs the start and the duration, and keeps it for the summary."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.t = time.monotonic()
        log(f"== {self.name}")
        return self

    def __exit__(self, exc_type, exc, tb):
        dt = time.monotonic() - self.t
        TIMINGS.append((self.name + ("" if exc is None else "  (FAILED)"), dt))
        log(f"   {self.name}: {dt:.1f}s" + ("" if exc is None else f"  FAILED: {exc}"))


def run(cmd: list[str], *, env: dict | None = None, check: bool = True, capture: bool = False,
        show: bool = True, timeout: float = 1800) -> subprocess.CompletedProcess:
    if show:
        log("$ " + " ".join(cmd))
    p = subprocess.run(cmd, cwd=REPO, env=env, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                       stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None)
    if check and p.returncode != 0:
        detail = ((p.stdout or "") + (p.stderr or ""))[-4000:] if capture else ""
        raise Failed(f"{' '.join(cmd)} exited {p.returncode}\n{detail}")
    return p


def docker_answers() -> bool:
    return shutil.which("docker") is not None and subprocess.run(
        ["docker", "info"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def networks() -> list[str]:
    return run(["docker", "network", "ls", "--format", "{{.Name}}"], capture=True, show=False).stdout.split()


def check_networks(when: str) -> None:
    names = networks()
    log(f"docker network ls ({when}): {' '.join(sorted(names))}")
    if set(names) != {"host", "none"}:
        raise Failed(f"networks other than host and none exist ({when}): {names}; remove them "
                     f"(docker network rm NAME): only loopback traffic is allowed on these machines")


class Stack:
    """docker-compose on the host-networking file, with this run's ports, secrets and dtype."""

    def __init__(self, workdir: str):
        self.secrets = os.path.join(workdir, "secrets")
        self.models = os.path.join(workdir, "models")
        os.makedirs(self.models)
        self.env = {**os.environ, "MINIPAGED_SECRETS_DIR": self.secrets, "MODELS_DIR": self.models,
                    "BASE_IMAGE": BASE_IMAGE, "MODEL": MODEL, "CPU_DTYPE": DTYPE,
                    # the cores shared out between the two workers, as LocalCluster does
                    "CPU_THREADS": str(max(1, (os.cpu_count() or 1) // 2)),
                    **{k: str(v) for k, v in PORTS.items()}}
        run([os.path.join(REPO, "docker", "make-secrets.sh")], env=self.env, capture=True)
        self.client_token = self.read_secret("client_token")
        self.address = f"127.0.0.1:{PORTS['METADATA_PORT']}"

    def read_secret(self, name: str) -> str:
        with open(os.path.join(self.secrets, name)) as f:
            return f.read().strip()

    def compose(self, *args: str, capture: bool = False, check: bool = True) -> subprocess.CompletedProcess:
        return run(["docker-compose", "-p", PROJECT, "-f", COMPOSE_FILE, *args], env=self.env,
                   capture=capture, check=check)

    def up(self) -> None:
        if HAS_GATEWAY:
            self.compose("--profile", "cpu", "up", "-d", "--no-build")
        else:
            log("gateway/ is not in this tree yet: the gateway service is not started, the HTTP checks "
                "do not run (they run once gateway/ exists)")
            self.compose("up", "-d", "--no-build", *CPU_SERVICES)

    def containers(self) -> dict[str, dict]:
        """service -> {id, status, health, restarts, pid}, for this project's containers."""
        ids = run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}"],
                  capture=True, show=False).stdout.split()
        if not ids:
            return {}
        fmt = ('{{index .Config.Labels "com.docker.compose.service"}}|{{.Id}}|{{.State.Status}}|'
               '{{if .State.Health}}{{.State.Health.Status}}{{end}}|{{.RestartCount}}|{{.State.Pid}}|'
               '{{.State.ExitCode}}')
        out = {}
        for line in run(["docker", "inspect", "-f", fmt, *ids], capture=True, show=False).stdout.splitlines():
            service, cid, status, health, restarts, pid, code = line.split("|")
            out[service] = {"id": cid, "status": status, "health": health, "restarts": int(restarts),
                            "pid": int(pid), "exit_code": int(code)}
        return out

    def wait_healthy(self, timeout: float = 600.0) -> float:
        """Until every container is healthy and the service reports a ready chain."""
        t, end = time.monotonic(), time.monotonic() + timeout
        expected = set(CPU_SERVICES + (["gateway"] if HAS_GATEWAY else []))
        while True:
            c = self.containers()
            healthy = {s for s, v in c.items() if v["status"] == "running" and v["health"] == "healthy"}
            if healthy >= expected and self.ready():
                return time.monotonic() - t
            if time.monotonic() > end:
                raise Failed(f"not healthy after {timeout:.0f}s: {c}")
            time.sleep(1.0)

    def ready(self) -> bool:
        try:
            with Client(self.address, token=self.client_token, timeout=3) as c:
                return c.stats().ready
        except Exception:
            return False

    def client(self) -> Client:
        return Client(self.address, token=self.client_token)

    def logs(self) -> None:
        self.compose("logs", "--no-color", "--tail", "60", check=False)


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a listening TCP socket on `port` (host networking: the host's table);
    IPv4-mapped IPv6 addresses (gRPC binds 127.0.0.1 that way) as IPv4."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                addr, p = fields[1].split(":")
                if fields[3] != "0A" or int(p, 16) != port:   # 0A: LISTEN
                    continue
                raw = b"".join(bytes.fromhex(addr[i:i + 8])[::-1] for i in range(0, len(addr), 8))
                ip = ipaddress.ip_address(raw)
                found.add(str(ip.ipv4_mapped or ip) if ip.version == 6 else str(ip))
    return found


def python_child(pid: int) -> int:
    """The service process under the container's init (compose `init: true`)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(x) for x in f.read().split()]
    if len(children) != 1:
        raise Failed(f"expected one process under the container's init {pid}, found {children}")
    return children[0]


# ------------------------------------------------------------------ the run's bookkeeping

@dataclass
class Run:
    """What the cleanup needs to know however far the run got."""
    workdir: str
    started_daemon: bool = False
    stack: Stack | None = None
    ok: bool = False


def clean_up(r: Run) -> None:
    """`down -v`, the networks checked once more (a leftover fails the run), the daemon this run
    started stopped, the work directory removed."""
    if r.stack is not None:
        r.stack.compose("down", "-v", check=False)
    if docker_answers():
        try:
            check_networks("after down -v")
        except Failed as e:
            log(str(e))
            r.ok = False
    if r.started_daemon:
        run([os.path.join(SHARED, "dockerd-down.sh")], env={**os.environ, "DOCKERD_PID": DAEMON_PIDFILE},
            check=False)
    shutil.rmtree(r.workdir, ignore_errors=True)


def print_summary(ok: bool) -> None:
    print("\ncompose-test timings", flush=True)
    for name, dt in TIMINGS:
        print(f"  {dt:7.1f}s  {name}")
    print(f"  {time.monotonic() - T0:7.1f}s  total", flush=True)
    print("compose-test " + ("PASSED" if ok else "FAILED"), flush=True)
