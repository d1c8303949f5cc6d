"""docker-compose.yml and docker/ without Docker: the structure, and every service's command run
through the real argument parsers of metadata_service and worker (so a renamed flag fails here)."""
from __future__ import annotations

import json
import os
import re
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


@pytest.fixture(scope="module")
def compose():
    with open(os.path.join(REPO, "docker-compose.yml")) as f:
        return yaml.safe_load(f)


def expand(value: str, env: dict | None = None) -> str:
    """Compose interpolation, the subset we use: ${VAR:-default} and ${VAR}."""
    env = env or {}
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)


def command(service: dict, env: dict | None = None) -> list[str]:
    return [expand(str(x), env) for x in service["command"]]


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_services_and_dependencies(compose):
    services = compose["services"]
    assert set(services) == {"metadata", *GPU_WORKERS, *CPU_WORKERS}
    assert "jobs" in compose["volumes"] and "jobs:/data" in services["metadata"]["volumes"]
    assert "profiles" not in services["metadata"]
    for name in GPU_WORKERS + CPU_WORKERS:
        assert services[name]["depends_on"] == {"metadata": {"condition": "service_healthy"}}, name
    for name in CPU_WORKERS:
        assert services[name]["profiles"] == ["cpu"] and "deploy" not in services[name]


def test_gpu_reservations(compose):
    for name in GPU_WORKERS:
        devices = compose["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}], name
        assert "profiles" not in compose["services"][name]  # the default `docker compose up`


def test_model_volume_and_variable(compose):
    for name, svc in compose["services"].items():
        mounts = [v for v in svc["volumes"] if v.endswith(":/models:ro")]
        assert mounts == ["${MODELS_DIR:-./models}:/models:ro"], name  # the service reads tokenizers too
    for name in GPU_WORKERS + CPU_WORKERS:
        cmd = compose["services"][name]["command"]
        assert flag(cmd, "--model") == "${MODEL:-tiny}"
        assert flag(command(compose["services"][name], {"MODEL": "/models/Qwen3-0.6B"}),
                    "--model") == "/models/Qwen3-0.6B"


def test_metadata_command_parses(compose):
    from metadata_service.__main__ import build_parser

    cmd = command(compose["services"]["metadata"])
    assert cmd[:3] == ["python", "-m", "metadata_service"]
    args = build_parser().parse_args(cmd[3:])
    assert (args.host, args.port, args.block_size, args.db) == ("0.0.0.0", 50051, 16, "/data/jobs.db")


@pytest.mark.parametrize("name", GPU_WORKERS + CPU_WORKERS)
def test_worker_commands_parse(compose, name):
    from worker.__main__ import build_parser

    cmd = command(compose["services"][name])
    assert cmd[:3] == ["python", "-m", "worker"]
    args = build_parser().parse_args(cmd[3:])
    assert args.metadata == f"metadata:{metadata_port(compose)}" and args.host == "0.0.0.0"
    assert args.advertise_address == f"{name}:{args.port}"  # the compose DNS name of this service
    assert args.model == "tiny"
    if name in GPU_WORKERS:
        assert (args.device, args.dtype) == ("cuda", "bfloat16")
        assert 0 < args.kv_memory_fraction <= 0.5  # two stages share one GPU by default
    else:
        assert (args.device, args.dtype) == ("cpu", "float32")


def metadata_port(compose) -> int:
    return int(flag(command(compose["services"]["metadata"]), "--port"))


def test_default_layers_split_tiny_evenly(compose):
    n = load_model_config("tiny").num_hidden_layers
    for pair in (GPU_WORKERS, CPU_WORKERS):
        layers = [tuple(map(int, flag(command(compose["services"][w]), "--layers").split(":"))) for w in pair]
        assert layers == split_layers(n, 2)
    env = {"WORKER0_LAYERS": "0:14", "WORKER1_LAYERS": "14:28"}
    assert flag(command(compose["services"]["worker1"], env), "--layers") == "14:28"


def test_healthchecks_probe_each_service_port(compose):
    for name, svc in compose["services"].items():
        hc = svc["healthcheck"]
        test = hc["test"]
        assert test[:3] == ["CMD", "python", "-c"] and len(test) == 5, name
        compile(test[3], f"{name} healthcheck", "exec")
        assert test[4] == f"127.0.0.1:{flag(command(svc), '--port')}", name
        for key in ("interval", "timeout", "retries", "start_period"):
            assert key in hc, (name, key)


def test_health_probe_against_a_health_server(compose, monkeypatch):
    """The probe itself, run against a real grpc.health.v1 server: exit 0 when SERVING, 1 when not."""
    probe = compose["services"]["metadata"]["healthcheck"]["test"][3]
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        monkeypatch.setattr(sys, "argv", ["-c", f"127.0.0.1:{port}"])
        for status, code in ((health_pb2.HealthCheckResponse.SERVING, 0),
                             (health_pb2.HealthCheckResponse.NOT_SERVING, 1)):
            servicer.set("", status)
            with pytest.raises(SystemExit) as e:
                exec(probe, {})
            assert e.value.code == code
    finally:
        server.stop(0)


def _dockerfile(name: str) -> str:
    with open(os.path.join(REPO, "docker", name)) as f:
        return f.read()


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfiles(name):
    text = _dockerfile(name)
    for src in re.findall(r"^COPY\s+(\S+)\s+\S+$", text, re.M):  # every copied path exists
        assert os.path.exists(os.path.join(REPO, src)), f"{name}: COPY {src}"
    assert "scripts/gen_proto.py" in text and "requirements.txt" in text
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    assert cmd[:2] == ["python", "-m"]
    if cmd[2] == "metadata_service":
        from metadata_service.__main__ import build_parser
    else:
        from worker.__main__ import build_parser
    build_parser().parse_args(cmd[3:])
    if name == "Dockerfile.cpu":
        assert text.startswith("#") and "FROM python:3.11-slim" in text
        assert re.search(r'torch==\$\{TORCH_VERSION\}.*--index-url https://download.pytorch.org/whl/cpu', text)
        assert "ARG TORCH_VERSION=2.13.0" in text
    else:
        assert re.search(r"^FROM nvidia/cuda:\$\{CUDA_VERSION\}-devel", text, re.M)  # nvcc for PyCUDA
        assert "pycuda" in text and "download.pytorch.org/whl/${TORCH_CUDA}" in text
