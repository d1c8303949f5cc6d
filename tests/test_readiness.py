"""What real deployments do at start: ports already taken, probes asking whether a service is ready
(not merely alive), requests arriving before any chain exists, and a worker with the wrong token.
Real processes on loopback, started the way a user starts them."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import Client
from client.cluster import free_port
from client.errors import InvalidArgument, Unavailable, error_for

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def start(module, *args, tmp_path=None):
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", module, *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def service(port, db, *extra):
    return start("metadata_service", "--port", port, "--db", db, "--worker-wait", 30, *extra)


def worker(meta_port, port, layers, *extra):
    return start("worker", "--metadata", f"127.0.0.1:{meta_port}", "--port", port, "--model", "tiny",
                 "--layers", layers, "--num-blocks", 64, *extra)


def health(port, name=""):
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=name), timeout=2).status
        except grpc.RpcError:
            return None


def wait_for(pred, timeout=60.0, what="condition"):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)


def stop(*procs):
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def test_a_taken_port_is_a_start_error(tmp_path):
    mp, wp = free_port(), free_port()
    first = service(mp, tmp_path / "a.db")
    w1 = worker(mp, wp, "0:4")
    try:
        wait_for(lambda: health(wp, "minipaged.v1.WorkerService") == SERVING, what="the first worker")
        second = service(mp, tmp_path / "b.db")
        out, _ = second.communicate(timeout=60)
        assert second.returncode == 1 and f"cannot serve on 127.0.0.1:{mp}" in out and "taken" in out
        w2 = worker(mp, wp, "0:4")
        out, _ = w2.communicate(timeout=120)
        assert w2.returncode == 1 and f"cannot serve on 127.0.0.1:{wp}" in out
        assert health(wp, "minipaged.v1.WorkerService") == SERVING and first.poll() is None
    finally:
        stop(w1, first)


def test_liveness_is_not_readiness_and_early_requests_wait(tmp_path):
    mp = free_port()
    meta = service(mp, tmp_path / "j.db")
    procs = [meta]
    try:
        wait_for(lambda: health(mp) == SERVING, what="liveness")
        assert health(mp, "minipaged.v1.MetadataService") == NOT_SERVING
        c = Client(f"127.0.0.1:{mp}")
        assert c.stats().not_ready_reason == "no worker is registered"

        # a request before any chain: it waits (up to its deadline) instead of failing at once
        result = {}
        early = threading.Thread(target=lambda: result.setdefault(
            "r", c.generate(prompt="hello", max_new_tokens=4, timeout=120)))
        early.start()

        wp0 = free_port()
        procs.append(worker(mp, wp0, "0:2"))
        wait_for(lambda: health(wp0, "minipaged.v1.WorkerService") == SERVING, what="worker 0:2 registered")
        st = c.stats()
        assert not st.ready and "layers 2:4 have no worker" in st.not_ready_reason
        assert health(mp, "minipaged.v1.MetadataService") == NOT_SERVING

        wp1 = free_port()
        procs.append(worker(mp, wp1, "1:3"))                   # overlaps: no chain, and it says why
        wait_for(lambda: c.stats().num_workers == 2, what="worker 1:3 registered")
        assert "overlapping 0:2" in c.stats().not_ready_reason

        procs.append(worker(mp, free_port(), "2:4"))
        wait_for(lambda: health(mp, "minipaged.v1.MetadataService") == SERVING, what="readiness")
        early.join(120)
        assert len(result["r"].token_ids) == 4 and c.stats().ready and c.stats().standby_workers == 1
        with pytest.raises(InvalidArgument, match="top_p"):    # an explicit 0 is an error, not "off"
            c.generate(prompt_token_ids=[1, 2], top_p=0.0)
        c.close()
    finally:
        stop(*reversed(procs))


def test_a_worker_that_holds_no_block_says_so_to_clients(tmp_path):
    mp, wp = free_port(), free_port()
    procs = [service(mp, tmp_path / "b.db")]
    try:
        wait_for(lambda: health(mp) == SERVING, what="liveness")
        procs.append(start("worker", "--metadata", f"127.0.0.1:{mp}", "--port", wp, "--model", "tiny",
                           "--kv-cache-bytes", 10 * 8192))      # 10 tokens of tiny's 4 layers: no block of 16
        c = Client(f"127.0.0.1:{mp}")
        wait_for(lambda: "can hold no block" in c.stats().not_ready_reason, what="the reason in Stats")
        reason = c.stats().not_ready_reason
        assert "--block-size" in reason and "--kv-cache-bytes" in reason and not c.stats().ready
        c.close()
    finally:
        stop(*reversed(procs))


def test_a_worker_with_a_wrong_token_exits_with_a_clear_error(tmp_path):
    mp = free_port()
    meta = service(mp, tmp_path / "t.db", "--worker-token", "right")
    try:
        w = worker(mp, free_port(), "0:4", "--worker-token", "wrong")
        out, _ = w.communicate(timeout=120)
        assert w.returncode == 3 and "refused this worker" in out and "UNAUTHENTICATED" not in out.split("refused")[0]
    finally:
        stop(meta)


def test_local_cluster_restarts_a_worker_whose_port_was_taken(monkeypatch):
    """free_port's port is free only until some process binds an ephemeral port (another worker's
    data link can take it): the worker says "could not bind" and LocalCluster starts it again on
    a fresh port, instead of failing the whole cluster."""
    import socket

    import client.cluster as cluster
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    calls = []
    real = cluster.free_port

    def free_port():
        calls.append(1)
        return taken.getsockname()[1] if len(calls) == 2 else real()   # 1: the service, 2: worker0

    monkeypatch.setattr(cluster, "free_port", free_port)
    try:
        with cluster.LocalCluster(model="tiny", workers=1, startup_timeout=120) as c:
            assert c._procs[1].rebinds == 1
            assert len(c.client.generate(prompt_token_ids=[1, 2, 3], max_new_tokens=3).token_ids) == 3
    finally:
        taken.close()


def test_the_reason_names_roles_when_the_layers_are_covered():
    """Workers that cover every layer but may not form one chain (a prefill and a decode stage) are
    told apart by role, not reported as an empty gap ("layers 3:3 have no worker")."""
    from types import SimpleNamespace as NS

    from metadata_service.workers import coverage_gaps

    def worker(a, b, role):
        return NS(info=NS(layer_start=a, layer_end=b, num_layers=3, replica_group=""), role=role, address=f"w{a}")
    why = coverage_gaps([worker(0, 2, "prefill"), worker(2, 3, "decode")])
    assert why.startswith("no chain forms: its stages must share one --role") and "3:3" not in why
    assert "0:2 prefill at w0" in why and "2:3 decode at w2" in why
    assert coverage_gaps([worker(0, 2, "both")]).startswith("layers 2:3 have no worker")


def _sigterm_during_a_stream(tmp_path, grace: int, new_tokens: int, *service_args):
    """Start a service and a worker, SIGTERM the service while a stream of `new_tokens` runs:
    (what the stream ended with: (tokens, finish_reason) or the exception, the service's exit code)."""
    mp, wp = free_port(), free_port()
    svc = service(mp, str(tmp_path / "jobs.db"), "--grace", grace, *service_args)
    w = worker(mp, wp, "0:4", "--dtype", "float64", "--threads", 1)
    try:
        c = Client(f"127.0.0.1:{mp}", wait_ready=120)
        c.generate(prompt_token_ids=[1, 2, 3], max_new_tokens=2)
        first, out = threading.Event(), {}

        def run():
            try:
                n = 0
                for chunk in c.stream(prompt_token_ids=[1, 2, 3], max_new_tokens=new_tokens, ignore_eos=True):
                    n += len(chunk.token_ids)
                    first.set()
                out["r"] = (n, chunk.finish_reason)
            except Exception as e:   # noqa: BLE001 - the callers' assertions show it
                out["r"] = e
            first.set()
        t = threading.Thread(target=run)
        t.start()
        assert first.wait(60)
        svc.send_signal(signal.SIGTERM)
        t.join(120)
        return out["r"], svc.wait(60)
    finally:
        stop(svc, w)


def test_sigterm_gives_a_stream_in_flight_the_whole_grace(tmp_path):
    """Probe J: SIGTERM closed the service's port to new RPCs, heartbeats too, so after one lease
    the service dropped its own healthy worker and the stream in flight died with "Cancelling all
    calls". During the grace the leases are not held against the workers: the stream finishes."""
    assert _sigterm_during_a_stream(tmp_path, 60, 600, "--worker-lease", 1) == ((600, "length"), 0)


def test_a_stream_that_outlives_the_grace_is_told_why(tmp_path):
    """Probe O: a stream still running when the service's grace ran out died with gRPC's bare
    "Cancelling all calls". It now ends a moment before the grace with UNAVAILABLE and the reason."""
    ended, code = _sigterm_during_a_stream(tmp_path, 1, 1000)
    assert isinstance(ended, Unavailable), ended
    assert "the metadata service is shutting down" in ended.details and "--grace of 1s" in ended.details
    assert code == 0


def test_a_lost_connection_is_named_for_what_it_is():
    err = error_for(grpc.StatusCode.UNAVAILABLE, "Cancelling all calls")
    assert isinstance(err, Unavailable) and "ended while this call was running" in err.details
    assert "Cancelling all calls" in err.details
    for own in ("no chain", "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed",
                "no worker chain is ready (worker 1 ... (UNAVAILABLE: failed to connect ...: Socket closed)"):
        assert error_for(grpc.StatusCode.UNAVAILABLE, own).details == own     # not a call cut short

def test_a_worker_the_service_cannot_reach_is_told_why_and_backs_off(tmp_path):
    """Probe J: a worker whose registration came through but whose own port the service could not
    reach (a wrong --advertise-address, TLS on one side only) was registered and dropped every
    second, forever, and everyone was told "no worker is registered". Now clients read the reason,
    the worker's log says it, and the retries back off."""
    mp, wp = free_port(), free_port()
    svc = service(mp, str(tmp_path / "jobs.db"))
    w = worker(mp, wp, "0:4", "--advertise-address", f"127.0.0.1:{free_port()}")   # nobody listens there
    try:
        c = Client(f"127.0.0.1:{mp}", wait_ready=None)

        def reason() -> str:
            try:
                return c.stats(timeout=5).not_ready_reason
            except Exception:   # noqa: BLE001 - not up yet
                return ""
        wait_for(lambda: "cannot reach it there" in reason(), timeout=60, what="the reason")
        assert "--advertise-address" in c.stats().not_ready_reason and not c.stats().ready
        # dropped with that reason, the worker hears it at its next heartbeat and registers again
        wait_for(lambda: c.stats().num_workers == 1, timeout=30, what="the worker to register again")
    finally:
        stop(w, svc)
    assert "(it dropped it: worker 127.0.0.1:" in w.stdout.read()
    assert svc.stdout.read().count("registered:") <= 6      # 1, 2, 4, 8 s apart, not every second
