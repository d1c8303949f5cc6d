"""docker-compose.yml, docker-compose.host.yml and docker/ without Docker: the structure, the
safe defaults, the two files describing one stack, every service's command run through the real
argument parsers (a renamed flag fails here), the healthcheck and entrypoint scripts run for real.
`make compose-test` (scripts/compose_test.py) builds and runs the stack itself."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from client.cluster import split_layers
from minipaged.config import load_model_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_WORKERS, CPU_WORKERS = ("worker0", "worker1"), ("worker0-cpu", "worker1-cpu")
WORKERS = GPU_WORKERS + CPU_WORKERS
SERVICES = {"metadata", "gateway", *WORKERS}
FILES = ("docker-compose.yml", "docker-compose.host.yml")
# what the test of the host variant sets (scripts/compose_test.py uses ports like these)
HOST_ENV = {"METADATA_PORT": "51051", "METADATA_WORKER_PORT": "51052", "WORKER0_PORT": "51061", "WORKER1_PORT": "51062",
            "GATEWAY_PORT": "51080", "METADATA_METRICS_PORT": "51100", "WORKER0_METRICS_PORT": "51101",
            "WORKER1_METRICS_PORT": "51102"}
SECRETS = {"client_token", "worker_token", "gateway_token"}


def load(name: str) -> dict:
    with open(os.path.join(REPO, name)) as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def bridge():
    return load("docker-compose.yml")


@pytest.fixture(scope="module")
def host():
    return load("docker-compose.host.yml")


@pytest.fixture(scope="module", params=FILES)
def compose(request):
    return load(request.param)


def expand(value, env: dict | None = None) -> str:
    """Compose interpolation, the subset we use: ${VAR:-default}, ${VAR} and $$."""
    env = env or {}
    value = re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: env.get(m.group(1)) or (m.group(2) or ""), str(value))
    return value.replace("$$", "$")


def command(service: dict, env: dict | None = None) -> list[str]:
    return [expand(x, env) for x in service["command"]]


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def parse(cmd: list[str]):
    """Through the real parser of the module the command runs."""
    assert cmd[:2] == ["python", "-m"], cmd
    module = cmd[2]
    if module == "metadata_service":
        from metadata_service.__main__ import build_parser
    elif module == "worker":
        from worker.__main__ import build_parser
    elif module == "gateway":
        from gateway.__main__ import parse_args   # reads the tokens from the environment too
        return parse_args(cmd[3:])
    else:
        raise AssertionError(f"unknown module {module}")
    return build_parser().parse_args(cmd[3:])


# ------------------------------------------------------------------ both files

def test_services_profiles_and_restart(compose):
    services = compose["services"]
    assert set(services) == SERVICES
    assert "profiles" not in services["metadata"]       # both profiles need it
    assert services["gateway"]["profiles"] == ["cpu", "gpu"]
    for name in GPU_WORKERS:                            # `--profile cpu` never starts a GPU worker
        assert services[name]["profiles"] == ["gpu"] and services[name]["image"] == "minipaged-qwen:cuda"
    for name in CPU_WORKERS:
        assert services[name]["profiles"] == ["cpu"] and "deploy" not in services[name]
    for name, svc in services.items():
        assert svc["restart"] == "unless-stopped" and svc["init"] is True, name
    assert "jobs" in compose["volumes"] and "jobs:/data" in services["metadata"]["volumes"]


def test_dependencies_follow_readiness(compose):
    """Workers need the service *started* (it is ready only once they register); the gateway needs
    it *ready*."""
    services = compose["services"]
    assert "depends_on" not in services["metadata"]
    for name in WORKERS:
        assert services[name]["depends_on"] == {"metadata": {"condition": "service_started"}}, name
    assert services["gateway"]["depends_on"] == {"metadata": {"condition": "service_healthy"}}


def test_tokens_come_from_secret_files(compose):
    """No token in the file or in the environment: each *_FILE variable names a mounted secret."""
    assert set(compose["secrets"]) == SECRETS
    for name, spec in compose["secrets"].items():
        assert spec == {"file": f"${{MINIPAGED_SECRETS_DIR:-./docker/secrets}}/{name}"}
    wanted = {"metadata": {"MINIPAGED_TOKEN_FILE": "client_token", "MINIPAGED_WORKER_TOKEN_FILE": "worker_token"},
              # the gateway: its API key (--token, env MINIPAGED_TOKEN) and the client token it presents
              # to the metadata service (--metadata-token, env MINIPAGED_METADATA_TOKEN)
              "gateway": {"MINIPAGED_TOKEN_FILE": "gateway_token", "MINIPAGED_METADATA_TOKEN_FILE": "client_token"},
              **{w: {"MINIPAGED_WORKER_TOKEN_FILE": "worker_token"} for w in WORKERS}}
    for name, svc in compose["services"].items():
        env = svc["environment"]
        files = {k: v for k, v in env.items() if k.endswith("_FILE")}
        assert files == {k: f"/run/secrets/{s}" for k, s in wanted[name].items()}, name
        assert sorted(svc["secrets"]) == sorted(wanted[name].values()), name
        assert not {"MINIPAGED_TOKEN", "MINIPAGED_WORKER_TOKEN", "MINIPAGED_METADATA_TOKEN"} & set(env), name
        assert not any(a.startswith(("--token", "--worker-token", "--metadata-token")) for a in command(svc)), name


def test_model_volume_and_variable(compose):
    for name, svc in compose["services"].items():
        mounts = [v for v in svc["volumes"] if v.endswith(":/models:ro")]
        assert mounts == ["${MODELS_DIR:-./models}:/models:ro"], name  # the service reads tokenizers too
    for name in WORKERS:
        svc = compose["services"][name]
        assert flag(command(svc), "--model") == "tiny"
        assert flag(command(svc, {"MODEL": "/models/Qwen3-0.6B"}), "--model") == "/models/Qwen3-0.6B"


def test_metadata_command_parses(compose):
    args = parse(command(compose["services"]["metadata"]))
    assert (args.port, args.worker_port, args.block_size, args.db) == (50051, 50052, 16, "/data/jobs.db")
    assert args.metrics_port == 9100
    assert args.token is None or args.token == os.environ.get("MINIPAGED_TOKEN")  # from the secret, at run time


@pytest.mark.parametrize("name", WORKERS)
def test_worker_commands_parse(compose, name):
    args = parse(command(compose["services"][name]))
    assert args.model == "tiny"
    if name in GPU_WORKERS:
        assert (args.device, args.dtype) == ("cuda", "bfloat16")
        assert 0 < args.kv_memory_fraction <= 0.5  # two stages share one GPU by default
        devices = compose["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "device_ids": [f"${{WORKER{name[-1]}_GPU:-0}}"],
                            "capabilities": ["gpu"]}]
    else:
        assert (args.device, args.dtype) == ("cpu", "auto")       # tiny: float32; a bfloat16 checkpoint: README
        assert parse(command(compose["services"][name], {"CPU_DTYPE": "float64"})).dtype == "float64"
        assert args.threads == 0 and parse(command(compose["services"][name], {"CPU_THREADS": "4"})).threads == 4
        assert compose["services"][name]["environment"]["OMP_WAIT_POLICY"] == "PASSIVE"


def test_gateway_command_takes_its_tokens_from_the_environment(compose, monkeypatch):
    cmd = command(compose["services"]["gateway"])
    assert cmd[:3] == ["python", "-m", "gateway"] and flag(cmd, "--model") == "tiny"
    monkeypatch.setenv("MINIPAGED_TOKEN", "api-key")              # what the entrypoint exports
    monkeypatch.setenv("MINIPAGED_METADATA_TOKEN", "client-token")
    args = parse(cmd)  # skips until gateway/ exists
    assert (args.token, args.metadata_token) == ("api-key", "client-token")


def test_default_layers_split_tiny_evenly(compose):
    n = load_model_config("tiny").num_hidden_layers
    for pair in (GPU_WORKERS, CPU_WORKERS):
        layers = [tuple(map(int, flag(command(compose["services"][w]), "--layers").split(":"))) for w in pair]
        assert layers == split_layers(n, 2)
    env = {"WORKER0_LAYERS": "0:14", "WORKER1_LAYERS": "14:28"}
    assert flag(command(compose["services"]["worker1"], env), "--layers") == "14:28"


def test_healthchecks_mean_ready(compose):
    for env in ({}, HOST_ENV):
        for name, svc in compose["services"].items():
            hc = svc["healthcheck"]
            test = [expand(x, env) for x in hc["test"]]
            assert test[:3] == ["CMD", "python", "/app/docker/healthcheck.py"], name
            cmd = command(svc, env)
            if name == "gateway":
                assert test[3:] == [f"http://127.0.0.1:{flag(cmd, '--port')}/health"], name
            else:
                service = "minipaged.v1.MetadataService" if name == "metadata" else "minipaged.v1.WorkerService"
                assert test[3:] == [f"127.0.0.1:{flag(cmd, '--port')}", service], name
            for key in ("interval", "timeout", "retries", "start_period"):
                assert key in hc, (name, key)


def test_graceful_stop_fits_the_grace_period(compose):
    """SIGTERM -> drain: the service's own grace must end before compose's SIGKILL."""
    def seconds(text):
        return float(text.rstrip("s"))
    svc = compose["services"]["metadata"]
    assert parse(command(svc)).grace + 5 <= seconds(svc["stop_grace_period"])
    from worker.__main__ import SHUTDOWN_GRACE_S
    for name in WORKERS:
        assert SHUTDOWN_GRACE_S + 5 <= seconds(compose["services"][name]["stop_grace_period"]), name
    assert "stop_grace_period" in compose["services"]["gateway"]


def test_build_args_match_the_dockerfiles(compose):
    for name, svc in compose["services"].items():
        build = svc["build"]
        dockerfile = _dockerfile(os.path.basename(build["dockerfile"]))
        defaults = dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile, re.M))
        for arg, value in build["args"].items():
            assert expand(value) == defaults[arg].strip('"'), (name, arg)  # the default is the Dockerfile's
        assert build["context"] == "."


# ------------------------------------------------------------------ the default (bridge) file

def test_bridge_exposure_is_safe_by_default(bridge):
    services = bridge["services"]
    assert services["metadata"]["ports"] == ["${METADATA_BIND:-127.0.0.1}:${METADATA_PORT:-50051}:50051"]
    assert services["gateway"]["ports"] == ["${GATEWAY_BIND:-0.0.0.0}:${GATEWAY_PORT:-8000}:8000"]
    for name in WORKERS:
        assert "ports" not in services[name], name   # worker ports stay on the compose network
    for name, svc in services.items():
        assert "network_mode" not in svc and "networks" not in svc, name  # the default network


@pytest.mark.parametrize("name", WORKERS)
def test_bridge_workers_use_service_names(bridge, name):
    args = parse(command(bridge["services"][name]))
    worker_port = parse(command(bridge["services"]["metadata"])).worker_port
    assert args.metadata == f"metadata:{worker_port}" and args.host == "0.0.0.0"   # the internal surface
    assert args.advertise_address == f"{name}:{args.port}"  # the compose DNS name of this service


def test_prometheus_scrape_targets_exist(bridge):
    """monitoring/prometheus.yml scrapes compose service names: each target is a service of the
    default file serving metrics on that port."""
    path = os.path.join(REPO, "monitoring", "prometheus.yml")
    if not os.path.exists(path):
        pytest.skip("no monitoring/prometheus.yml in this tree")
    with open(path) as f:
        targets = [t for job in yaml.safe_load(f)["scrape_configs"] for sc in job["static_configs"]
                   for t in sc["targets"]]
    for target in targets:
        name, port = target.rsplit(":", 1)
        cmd = command(bridge["services"][name])
        served = flag(cmd, "--port") if name == "gateway" else flag(cmd, "--metrics-port")
        assert served == port, target


# ------------------------------------------------------------------ the host-networking file

def test_host_file_creates_no_network(host):
    """Every service compose knows on the host network, none publishes ports (incompatible)."""
    assert "networks" not in host
    for name, svc in host["services"].items():
        assert svc["network_mode"] == "host" and "ports" not in svc and "networks" not in svc, name
        assert svc["build"]["network"] == "host", name


@pytest.mark.parametrize("env", [{}, HOST_ENV], ids=["defaults", "ci-ports"])
def test_host_services_on_loopback_with_own_ports(host, env):
    services = host["services"]
    meta = parse(command(services["metadata"], env))
    assert meta.host == "127.0.0.1" and meta.worker_host in (None, "", "127.0.0.1")
    for profile, workers in (("cpu", CPU_WORKERS), ("gpu", GPU_WORKERS)):
        ports = [meta.port, meta.worker_port, meta.metrics_port]
        for name in workers:
            args = parse(command(services[name], env))
            assert args.host == "127.0.0.1" and args.metadata == f"127.0.0.1:{meta.worker_port}", name
            assert args.advertise_address == f"127.0.0.1:{args.port}", name
            ports += [args.port, args.metrics_port]
        gw = command(services["gateway"], env)
        assert flag(gw, "--metadata") == f"127.0.0.1:{meta.port}" and flag(gw, "--host") == "127.0.0.1"
        ports.append(int(flag(gw, "--port")))
        assert len(set(ports)) == len(ports), (profile, ports)   # one port per service


def normalised(svc: dict) -> dict:
    """A service without what legitimately differs between the files: addresses, ports, network."""
    out = {k: v for k, v in svc.items() if k not in ("ports", "network_mode", "healthcheck", "command")}
    out["build"] = {k: v for k, v in svc["build"].items() if k != "network"}
    cmd, address_flags = command(svc), {"--host", "--port", "--metadata", "--advertise-address"}
    out["command"] = [x for i, x in enumerate(cmd) if x not in address_flags and cmd[i - 1] not in address_flags]
    out["healthcheck"] = {k: v for k, v in svc["healthcheck"].items() if k != "test"}
    return out


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_both_files_describe_one_stack(bridge, host, name):
    assert normalised(bridge["services"][name]) == normalised(host["services"][name])


def test_both_files_same_volumes_and_secrets(bridge, host):
    assert bridge["volumes"].keys() == host["volumes"].keys() and bridge["secrets"] == host["secrets"]


# ------------------------------------------------------------------ docker/ scripts, for real

def test_health_probe_against_a_health_server(monkeypatch):
    """docker/healthcheck.py against a real grpc.health.v1 server: 0 when the named service is
    SERVING, 1 when NOT_SERVING, unknown or unreachable."""
    sys.path.insert(0, os.path.join(REPO, "docker"))
    try:
        import healthcheck
    finally:
        sys.path.pop(0)
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        name = "minipaged.v1.MetadataService"
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        assert healthcheck.main([f"127.0.0.1:{port}", name]) == 0
        servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        assert healthcheck.main([f"127.0.0.1:{port}", name]) == 1
        assert healthcheck.main([f"127.0.0.1:{port}", "no.such.Service"]) == 1
    finally:
        server.stop(0)
    assert healthcheck.main([f"127.0.0.1:{port}", name]) == 1          # nothing listens any more
    assert healthcheck.main([f"http://127.0.0.1:{port}/health"]) == 1
    assert healthcheck.main([]) == 2


ENTRYPOINT = os.path.join(REPO, "docker", "entrypoint.sh")


@pytest.mark.parametrize("content", ["s3cret\n", "s3cret", "s3cret\r\n", "  s3cret \r\n\n"])
def test_entrypoint_turns_secret_files_into_variables(tmp_path, content):
    """CRs and the whitespace around the token go (a file saved with CRLF line ends once exported
    'tok\\r', and every worker's registration failed with gRPC's "Invalid metadata")."""
    token = tmp_path / "client_token"
    token.write_bytes(content.encode())
    env = {"PATH": os.environ["PATH"], "MINIPAGED_TOKEN_FILE": str(token)}
    out = subprocess.run([ENTRYPOINT, "sh", "-c", 'echo "$MINIPAGED_TOKEN|${MINIPAGED_TOKEN_FILE-unset}"'],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout == "s3cret|unset\n"


@pytest.mark.parametrize("case", ["missing", "empty", "directory", "blank"])
def test_entrypoint_refuses_to_start_without_the_secret(tmp_path, case):
    path = tmp_path / "worker_token"
    if case in ("empty", "blank"):      # blank: a newline alone once exported an empty token (no auth)
        path.write_text("" if case == "empty" else "\n \r\n")
    elif case == "directory":   # what a bind mount of a missing file turns into
        path.mkdir()
    env = {"PATH": os.environ["PATH"], "MINIPAGED_WORKER_TOKEN_FILE": str(path)}
    out = subprocess.run([ENTRYPOINT, "echo", "started"], env=env, capture_output=True, text=True)
    assert out.returncode == 78 and "started" not in out.stdout
    assert "MINIPAGED_WORKER_TOKEN_FILE" in out.stderr
    assert ("only whitespace" if case == "blank" else "make-secrets") in out.stderr


def test_make_secrets(tmp_path):
    d = tmp_path / "secrets"
    script = os.path.join(REPO, "docker", "make-secrets.sh")
    env = {"PATH": os.environ["PATH"], "MINIPAGED_SECRETS_DIR": str(d)}
    subprocess.run([script], env=env, check=True, capture_output=True)
    tokens = {n: (d / n).read_text() for n in SECRETS}
    assert len(set(tokens.values())) == 3 and all(len(t) >= 32 and t.isalnum() for t in tokens.values())
    assert oct(d.stat().st_mode & 0o777) == "0o700"
    subprocess.run([script], env=env, check=True, capture_output=True)   # kept, not rotated
    assert tokens == {n: (d / n).read_text() for n in SECRETS}


# ------------------------------------------------------------------ images

def _dockerfile(name: str) -> str:
    with open(os.path.join(REPO, "docker", name)) as f:
        return f.read()


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfiles(name):
    text = _dockerfile(name)
    for src in re.findall(r"^COPY\s+(?!--from)(\S+)\s+\S+$", text, re.M):  # every copied path exists
        src = re.sub(r"\$\{(\w+)\}", lambda m: re.search(rf"^ARG {m.group(1)}=(\S+)$", text, re.M).group(1), src)
        assert os.path.exists(os.path.join(REPO, src)), f"{name}: COPY {src}"
    assert text.index("ARG BASE_IMAGE=") < text.index("\nFROM ")                 # the base is a build arg
    assert set(re.findall(r"^FROM (\S+)", text, re.M)) == {"${BASE_IMAGE}"}, "every stage on that base"
    for arg in ("TORCH_VERSION=2.13.0", "TORCH_INDEX_URL=", "TORCH_WHEELS=docker/wheels/"):
        assert f"ARG {arg}" in text, arg
    assert not re.search(r"^RUN --mount", text, re.M)  # docker-compose 1.29 builds with the classic builder
    assert 'ENTRYPOINT ["/app/docker/entrypoint.sh"]' in text
    cmd = __import__("json").loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    parse(cmd)
    if name == "Dockerfile.cpu":
        assert "ARG BASE_IMAGE=python:3.11-slim" in text and "whl/cpu" in text
    else:
        assert re.search(r"^ARG BASE_IMAGE=nvidia/cuda:\S+-devel", text, re.M)  # nvcc for PyCUDA
        assert "pycuda" in text and "whl/cu128" in text


def test_image_requirements_drop_only_dev_tools():
    """The images install requirements.txt minus DEV_ONLY: each name there must exist (a stale list
    would silently install test tools) and be something no service imports."""
    with open(os.path.join(REPO, "requirements.txt")) as f:
        names = {re.match(r"[A-Za-z0-9_.-]+", line).group(0).lower() for line in f
                 if line.strip() and not line.startswith("#")}
    for name in ("Dockerfile.cpu", "Dockerfile.cuda"):
        dev_only = re.search(r'^ARG DEV_ONLY="([^"]+)"$', _dockerfile(name), re.M).group(1).split()
        assert set(dev_only) <= names, set(dev_only) - names
        assert not {"grpcio", "torch", "numpy", "protobuf", "transformers", "safetensors"} & set(dev_only)


def test_dockerignore_is_an_allowlist():
    with open(os.path.join(REPO, ".dockerignore")) as f:
        lines = [x.strip() for x in f if x.strip() and not x.startswith("#")]
    assert lines[0] == "*"                     # nothing unless named: never .venv, .git, secrets
    allowed = {x[1:].rstrip("/") for x in lines if x.startswith("!")}
    for pkg in ("minipaged", "metadata_service", "worker", "client", "gateway", "requirements.txt",
                "docker/entrypoint.sh", "docker/healthcheck.py", "docker/wheels"):
        assert pkg in allowed, pkg
    assert not any(a.startswith(("docker/secrets", ".venv", "tests", ".git")) for a in allowed)
    for folder in ("docker/wheels/cpu", "docker/wheels/cuda", "docker/secrets"):  # exist, never committed
        with open(os.path.join(REPO, folder, ".gitignore")) as f:
            assert f.read().splitlines()[-2:] == ["*", "!.gitignore"], folder
