"""Authentication and exposure: client token, worker token, TLS and mutual TLS, block API switch."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import grpc
import pytest

from client import Client
from client.cluster import free_port
from client.errors import MiniPagedError, PermissionDenied, Unauthenticated, Unavailable
from minipaged.tls import make_channel
from minipaged.v1 import metadata_pb2, metadata_pb2_grpc, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make test certificates")
    d = tmp_path_factory.mktemp("certs")

    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=minipaged-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=localhost")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                               "extendedKeyUsage=serverAuth,clientAuth\n")
    run("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "node.pem", "-days", "2", "-extfile", "ext.cnf")
    return {k: str(d / v) for k, v in dict(ca="ca.pem", cert="node.pem", key="node.key").items()}


@pytest.fixture(scope="module")
def secure_cluster(certs, tmp_path_factory):
    """Service (TLS, client token, worker token, block API off) + one worker (mTLS, worker token)."""
    logs = tmp_path_factory.mktemp("logs")
    sport, wport = free_port(), free_port()
    tls = ["--tls-cert", certs["cert"], "--tls-key", certs["key"]]
    service = [sys.executable, "-m", "metadata_service", "--port", str(sport), "--db", str(logs / "jobs.db"),
               "--token", "client-secret", "--worker-token", "worker-secret", "--no-block-api", *tls,
               "--worker-tls-ca", certs["ca"], "--worker-tls-cert", certs["cert"], "--worker-tls-key", certs["key"]]
    worker = [sys.executable, "-m", "worker", "--metadata", f"127.0.0.1:{sport}", "--port", str(wport),
              "--model", "tiny", *tls, "--tls-client-ca", certs["ca"], "--tls-ca", certs["ca"],
              "--worker-token", "worker-secret"]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=open(logs / f"{i}.log", "wb"), stderr=subprocess.STDOUT)
             for i, cmd in enumerate((service, worker))]
    client = Client(f"127.0.0.1:{sport}", token="client-secret", tls_ca=certs["ca"])
    try:
        end = time.monotonic() + 90
        while True:
            try:
                if client.stats(timeout=2).ready:
                    break
            except MiniPagedError:
                pass
            assert time.monotonic() < end and all(p.poll() is None for p in procs), \
                "\n".join((logs / f"{i}.log").read_text()[-2000:] for i in range(2))
            time.sleep(0.2)
        yield dict(client=client, sport=sport, wport=wport, certs=certs)
    finally:
        client.close()
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=15)


def test_tls_client_with_token_generates(secure_cluster):
    r = secure_cluster["client"].generate(prompt="hello", max_new_tokens=4)
    assert len(r.token_ids) == 4


def test_the_cli_talks_tls_too(secure_cluster):
    """Probe J: the CLI had no TLS flags, so even the `minipaged jobs --cancel-all` the service tells
    operators to run could not reach a TLS service."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = [sys.executable, "-m", "client"]
    where = ["--address", f"127.0.0.1:{secure_cluster['sport']}", "--token", "client-secret"]
    r = subprocess.run(base + ["stats", *where, "--tls-ca", secure_cluster["certs"]["ca"]], capture_output=True,
                       text=True, timeout=60, cwd=root)
    assert r.returncode == 0 and "ready" in r.stdout, r.stderr
    env = {**os.environ, "MINIPAGED_TLS_CA": secure_cluster["certs"]["ca"]}
    r = subprocess.run(base + ["jobs", "--cancel-all", *where], capture_output=True, text=True, timeout=60, cwd=root,
                       env=env)
    assert r.returncode == 0, r.stderr


def test_wrong_or_missing_client_token_is_unauthenticated(secure_cluster):
    for token in (None, "guess"):
        with Client(f"127.0.0.1:{secure_cluster['sport']}", token=token, tls_ca=secure_cluster["certs"]["ca"]) as c:
            with pytest.raises(Unauthenticated):
                c.generate(prompt="hello", max_new_tokens=2)


def test_plain_text_client_cannot_talk_to_a_tls_service(secure_cluster):
    with Client(f"127.0.0.1:{secure_cluster['sport']}", token="client-secret") as c:
        with pytest.raises(Unavailable):
            c.stats(timeout=3)


def test_block_api_switched_off(secure_cluster):
    ch = make_channel(f"127.0.0.1:{secure_cluster['sport']}", ca=secure_cluster["certs"]["ca"])
    stub = metadata_pb2_grpc.MetadataServiceStub(ch)
    with pytest.raises(grpc.RpcError) as e:
        stub.CreateSequence(metadata_pb2.CreateSequenceRequest(sequence_id=1),
                            metadata=(("authorization", "Bearer client-secret"),), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED   # the block API is internal: worker token
    with pytest.raises(grpc.RpcError) as e:
        stub.CreateSequence(metadata_pb2.CreateSequenceRequest(sequence_id=1),
                            metadata=(("authorization", "Bearer worker-secret"),), timeout=5)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED  # and switched off
    ch.close()


def test_only_the_worker_token_may_register(secure_cluster):
    ch = make_channel(f"127.0.0.1:{secure_cluster['sport']}", ca=secure_cluster["certs"]["ca"])
    stub = metadata_pb2_grpc.MetadataServiceStub(ch)
    for token in ("client-secret", "guess"):  # the client token is not enough to join as a worker
        with pytest.raises(grpc.RpcError) as e:
            stub.RegisterWorker(metadata_pb2.RegisterWorkerRequest(), metadata=(("authorization", f"Bearer {token}"),),
                                timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    ch.close()


def test_nothing_but_the_service_can_drive_a_worker(secure_cluster):
    c = secure_cluster["certs"]
    addr = f"127.0.0.1:{secure_cluster['wport']}"
    # no client certificate: the mutual-TLS handshake fails
    with make_channel(addr, ca=c["ca"]) as ch:
        with pytest.raises(grpc.RpcError) as e:
            worker_pb2_grpc.WorkerServiceStub(ch).Info(worker_pb2.InfoRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # a certificate but no worker token: refused
    with make_channel(addr, ca=c["ca"], cert=c["cert"], key=c["key"]) as ch:
        with pytest.raises(grpc.RpcError) as e:
            worker_pb2_grpc.WorkerServiceStub(ch).Step(worker_pb2.StepRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_permission_denied_maps_to_a_typed_error():
    assert issubclass(PermissionDenied, MiniPagedError)


# ---------------------------------------------------------------- exposed deployments (issue 14)

def _start(cmd, logs, name):
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(logs / f"{name}.log", "wb"), stderr=subprocess.STDOUT)


def _wait_ready(client, procs, logs, names):
    end = time.monotonic() + 90
    while True:
        try:
            if client.stats(timeout=2).ready:
                return
        except MiniPagedError:
            pass
        assert time.monotonic() < end and all(p.poll() is None for p in procs), \
            "\n".join((logs / f"{n}.log").read_text()[-2000:] for n in names)
        time.sleep(0.2)


def test_exposing_registration_without_a_worker_token_is_refused(tmp_path):
    for extra in (["--host", "0.0.0.0"], ["--worker-port", "0", "--worker-host", "0.0.0.0"]):
        p = subprocess.run([sys.executable, "-m", "metadata_service", "--port", str(free_port()),
                            "--db", str(tmp_path / "x.db"), *extra], cwd=ROOT, capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 2 and "refusing to accept worker registration" in p.stderr, p.stderr
        assert "--worker-token" in p.stderr



@pytest.mark.parametrize("module", ["metadata_service", "gateway", "worker"])
def test_a_blank_or_unsendable_token_is_a_start_error(module):
    """A token variable set but blank once meant "no token" (the gateway served without its API
    key), and one holding a CR failed every call later with gRPC's "Invalid metadata"."""
    var = "MINIPAGED_WORKER_TOKEN" if module == "worker" else "MINIPAGED_TOKEN"
    args = {"metadata_service": ["--port", "0"], "gateway": ["--port", "0"],
            "worker": ["--metadata", "127.0.0.1:1", "--model", "tiny"]}[module]
    for value, message in (("\n", "is set but blank"), ("tok\r", "which a gRPC / HTTP header cannot carry")):
        p = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                           timeout=60, env={**os.environ, var: value})
        assert p.returncode == 2 and var in p.stderr and message in p.stderr, p.stderr


def test_a_token_file_wins_and_is_checked_like_the_variable(tmp_path, monkeypatch):
    from metadata_service.__main__ import parse_args
    from worker.flags import resolve_args
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text("s3cret\r\n")
    bad.write_text("t\u00f6k\n")
    monkeypatch.setenv("MINIPAGED_TOKEN", "")           # blank, but the file is what counts
    monkeypatch.setenv("MINIPAGED_WORKER_TOKEN", "")
    args = parse_args(["--port", "0", "--token-file", str(good), "--worker-token-file", str(good)])
    assert args.token == args.worker_token == "s3cret"
    assert resolve_args(["--model", "tiny", "--standalone", "--worker-token-file", str(good)]).worker_token == "s3cret"
    for argv in (["--port", "0", "--token-file", str(bad)], ["--port", "0", "--worker-token-file", str(bad)]):
        with pytest.raises(SystemExit):
            parse_args(argv)
    with pytest.raises(SystemExit):
        resolve_args(["--model", "tiny", "--standalone", "--worker-token-file", str(bad)])

def test_split_ports_and_rogue_workers(tmp_path):
    """Client API on a published port, registration on an unpublished one with a worker token: the
    client port refuses registration, and a worker without the token (or with another model) cannot
    join; the right worker can."""
    from tests.checkpoints import make_checkpoint
    sport, iport = free_port(), free_port()
    (tmp_path / "wtoken").write_text("s3cret\n")
    service = [sys.executable, "-m", "metadata_service", "--host", "0.0.0.0", "--port", str(sport),
               "--worker-host", "0.0.0.0", "--worker-port", str(iport), "--worker-token-file",
               str(tmp_path / "wtoken"), "--db", str(tmp_path / "j.db")]
    procs = [_start(service, tmp_path, "service")]
    client = Client(f"127.0.0.1:{sport}")
    try:
        rogue = subprocess.run([sys.executable, "-m", "worker", "--metadata", f"127.0.0.1:{iport}",
                                "--port", str(free_port()), "--model", "tiny", "--num-blocks", "32"],
                               cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert rogue.returncode == 3 and "refused this worker" in rogue.stderr
        with grpc.insecure_channel(f"127.0.0.1:{sport}") as ch:      # the published port: no registration
            with pytest.raises(grpc.RpcError) as e:
                metadata_pb2_grpc.MetadataServiceStub(ch).RegisterWorker(
                    metadata_pb2.RegisterWorkerRequest(), metadata=(("authorization", "Bearer s3cret"),), timeout=5)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and str(iport) in e.value.details()
        good = [sys.executable, "-m", "worker", "--metadata", f"127.0.0.1:{iport}", "--port", str(free_port()),
                "--model", "tiny", "--num-blocks", "32", "--worker-token-file", str(tmp_path / "wtoken")]
        procs.append(_start(good, tmp_path, "worker"))
        _wait_ready(client, procs, tmp_path, ["service", "worker"])
        assert len(client.generate(prompt="hi", max_new_tokens=3).token_ids) == 3
        other = make_checkpoint(num_layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, tie=True, vocab=96,
                                seed=3, directory=str(tmp_path / "other"))
        wrong_model = subprocess.run([sys.executable, "-m", "worker", "--metadata", f"127.0.0.1:{iport}",
                                      "--port", str(free_port()), "--model", other, "--num-blocks", "32",
                                      "--worker-token", "s3cret"], cwd=ROOT, capture_output=True, text=True,
                                     timeout=120)
        assert wrong_model.returncode == 3 and "model mismatch" in wrong_model.stderr
    finally:
        client.close()
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=15)
