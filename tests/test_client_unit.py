"""Client SDK without the real services: error mapping, request building, Stats, the CLI parser,
layer splitting, round trips (sync and asyncio) against an in-process fake MetadataService, and
LocalCluster's process handling against fake `python -m` packages."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import textwrap
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest

import client
from client import AsyncClient, Client, ClusterError, LocalCluster, Stats, split_layers
from client.__main__ import build_parser, main as cli_main
from client.errors import from_rpc_error
from client.sdk import build_generate_request, build_submit_request
from minipaged import wire
from minipaged.v1 import metadata_pb2 as pb
from minipaged.v1 import metadata_pb2_grpc as pb_grpc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- pure pieces

class _FakeRpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._c, self._d = code, details

    def code(self):
        return self._c

    def details(self):
        return self._d


@pytest.mark.parametrize("code,cls", [
    (grpc.StatusCode.INVALID_ARGUMENT, client.InvalidArgument),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, client.ResourceExhausted),
    (grpc.StatusCode.NOT_FOUND, client.NotFound), (grpc.StatusCode.UNAVAILABLE, client.Unavailable),
    (grpc.StatusCode.FAILED_PRECONDITION, client.FailedPrecondition),
    (grpc.StatusCode.UNAUTHENTICATED, client.Unauthenticated),
    (grpc.StatusCode.DEADLINE_EXCEEDED, client.DeadlineExceeded),
    (grpc.StatusCode.CANCELLED, client.Cancelled), (grpc.StatusCode.INTERNAL, client.MiniPagedError)])
def test_error_mapping(code, cls):
    e = from_rpc_error(_FakeRpcError(code, "what was wrong"))
    assert type(e) is cls and isinstance(e, client.MiniPagedError)
    assert e.code == code and e.details == "what was wrong"
    assert str(e) == f"{code.name}: what was wrong"


def test_generate_request_packing_and_seed():
    req = build_generate_request(prompt_token_ids=[1, 2, 300], max_new_tokens=5, stop="\n",
                                 stop_token_ids=np.array([7, 8]), top_k=3)
    assert wire.unpack(req.prompt_token_ids).tolist() == [1, 2, 300]
    assert wire.unpack(req.stop_token_ids).tolist() == [7, 8]
    assert list(req.stop) == ["\n"] and req.top_k == 3 and req.prompt == ""
    assert not req.HasField("seed")  # None -> unset: the service picks
    assert build_generate_request(prompt="x", seed=0).HasField("seed")
    with pytest.raises(TypeError):
        build_generate_request(prompt=123)
    with pytest.raises(TypeError):
        build_generate_request(prompt_token_ids=[1.5])
    with pytest.raises(TypeError):
        build_generate_request(prompt="x", max_new_tokens="3")
    with pytest.raises(TypeError, match="unknown keys"):
        build_submit_request([{"prompt": "x", "max_tokens": 3}])
    assert len(build_submit_request([{"prompt": "a"}, {"prompt_token_ids": [1]}]).requests) == 2


def test_stats_covers_every_proto_field():
    proto_fields = [f.name for f in pb.StatsReply.DESCRIPTOR.fields]
    assert [f.name for f in dataclasses.fields(Stats)] == proto_fields
    reply = pb.StatsReply(num_blocks=64, used_blocks=10, free_blocks=54, kv_utilization=0.5,
                          invariants_ok=True, prefix_cache_hit_rate=0.25)
    s = Stats.from_proto(reply)
    assert s.used_blocks == 10 and s["free_blocks"] == 54 and s.as_dict()["invariants_ok"] is True
    assert set(s.as_dict()) == set(proto_fields)
    assert "invariants_ok" in s.table() and "50.0%" in s.table()


def test_split_layers():
    assert split_layers(4, 2) == [(0, 2), (2, 4)]
    assert split_layers(4, 1) == [(0, 4)]
    assert split_layers(28, 3) == [(0, 10), (10, 19), (19, 28)]
    for n, w in [(5, 2), (7, 7), (36, 5)]:
        parts = split_layers(n, w)
        assert parts[0][0] == 0 and parts[-1][1] == n and all(a < b for a, b in parts)
        assert all(parts[i][1] == parts[i + 1][0] for i in range(w - 1))
    with pytest.raises(ValueError):
        split_layers(4, 5)


def test_cli_parser():
    p = build_parser()
    a = p.parse_args(["generate", "--address", "h:1", "--prompt-ids", "1,2,3", "--stop", "a",
                      "--stop", "b", "--seed", "4", "--stream"])
    assert a.prompt_ids == [1, 2, 3] and a.stop == ["a", "b"] and a.seed == 4 and a.stream
    assert p.parse_args(["submit", "--file", "-", "--wait"]).wait
    assert p.parse_args(["watch", "j1"]).job_id == "j1"
    assert p.parse_args(["stats", "--token", "t"]).token == "t"
    with pytest.raises(SystemExit):
        p.parse_args(["generate", "--prompt", "x", "--prompt-ids", "1"])  # exactly one source


# ---------------------------------------------------------------- fake service round trips

def _result(i, req):
    ids = wire.unpack(req.prompt_token_ids).tolist() or list(req.prompt.encode())
    toks = [(sum(ids) + k) % 26 + 97 for k in range(req.max_new_tokens)]
    return pb.GenerationResult(index=i, token_ids=wire.pack(toks), text=bytes(toks).decode(),
                               finish_reason="length", usage=pb.Usage(prompt_tokens=len(ids),
                                                                      completion_tokens=len(toks)))


class FakeService(pb_grpc.MetadataServiceServicer):
    """Deterministic stand-in: token k of a reply is (sum(prompt) + k) % 26 + 'a'."""

    def __init__(self):
        self.requests, self.metadata, self.jobs = [], [], {}
        self.stream_cancelled = threading.Event()

    def _check(self, context):
        md = dict(context.invocation_metadata())
        self.metadata.append(md.get("authorization"))
        if md.get("authorization") == "Bearer wrong":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad token")

    def Generate(self, req, context):
        self._check(context)
        self.requests.append(req)
        if req.max_new_tokens <= 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"max_new_tokens must be >= 1, got {req.max_new_tokens}")
        if req.prompt == "slow":
            time.sleep(1.0)
        context.add_callback(self.stream_cancelled.set)
        r = _result(0, req)
        toks = wire.unpack(r.token_ids).tolist()
        for k, t in enumerate(toks):
            last = k == len(toks) - 1
            yield pb.GenerateChunk(token_ids=wire.pack([t]), text=chr(t),
                                   finish_reason="length" if last else "",
                                   usage=r.usage if last else None,
                                   logprobs=wire.pack([-0.5], wire.FLOAT32) if req.return_logprobs else b"")
            if req.prompt == "long":
                time.sleep(0.05)

    def SubmitJob(self, req, context):
        self._check(context)
        job_id = f"job-{len(self.jobs)}"
        self.jobs[job_id] = [_result(i, r) for i, r in enumerate(req.requests)]
        return pb.SubmitJobReply(job_id=job_id)

    def _job(self, job_id, context):
        if job_id not in self.jobs:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no job {job_id!r}")
        return self.jobs[job_id]

    def GetJob(self, req, context):
        res = self._job(req.job_id, context)
        return pb.Job(job_id=req.job_id, state="done", total=len(res), completed=len(res), results=res)

    def WatchJob(self, req, context):
        res = self._job(req.job_id, context)
        yield pb.JobProgress(job_id=req.job_id, state="running", total=len(res), completed=0)
        # Out of order, and the last result is only in GetJob: the client must merge both.
        for k, r in enumerate(reversed(res[:-1])):
            yield pb.JobProgress(job_id=req.job_id, state="running", total=len(res), completed=k + 1,
                                 new_results=[r])
        yield pb.JobProgress(job_id=req.job_id, state="done", total=len(res), completed=len(res))

    def CancelJob(self, req, context):
        res = self._job(req.job_id, context)
        return pb.Job(job_id=req.job_id, state="cancelled", total=len(res), completed=1, results=res[:1])

    def Stats(self, req, context):
        self._check(context)
        return pb.StatsReply(num_blocks=8, block_size=16, free_blocks=8, invariants_ok=True, ready=True)


@pytest.fixture(scope="module")
def fake():
    service = FakeService()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_MetadataServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield service, f"127.0.0.1:{port}"
    server.stop(0)


def test_sync_round_trips(fake):
    service, address = fake
    with Client(address, token="secret") as c:
        r = c.generate(prompt_token_ids=[1, 2], max_new_tokens=4, return_logprobs=True)
        assert r.token_ids == [100, 101, 102, 103] and r.text == "defg" and r.finish_reason == "length"
        assert r.usage.prompt_tokens == 2 and r.usage.completion_tokens == 4 and r.logprobs == [-0.5] * 4
        assert service.metadata[-1] == "Bearer secret" and not service.requests[-1].HasField("seed")
        chunks = list(c.stream(prompt="ab", max_new_tokens=3, seed=7))
        assert [ch.text for ch in chunks] == ["n", "o", "p"] and service.requests[-1].seed == 7
        assert chunks[-1].finish_reason == "length" and chunks[0].finish_reason is None
        assert chunks[-1].usage.completion_tokens == 3 and chunks[0].usage is None
        assert c.generate("ab", max_new_tokens=2).text == "no"  # prompt may be positional
        with pytest.raises(TypeError):
            c.generate("ab", max_tokens=2)  # a misspelt parameter fails before any RPC

        items = [{"prompt_token_ids": [i], "max_new_tokens": 2} for i in range(5)]
        job_id = c.submit(items)
        results = c.wait(job_id, progress=True)
        assert [r.index for r in results] == list(range(5))
        assert [r.token_ids for r in results] == [[(i % 26) + 97, (i + 1) % 26 + 97] for i in range(5)]
        assert c.get_job(job_id).done
        cancelled = c.cancel(job_id)
        assert cancelled.state == "cancelled" and len(cancelled.results) == 1
        st = c.stats()
        assert st.ready and st.invariants_ok and st.num_blocks == 8

        with pytest.raises(client.InvalidArgument, match="max_new_tokens must be >= 1"):
            c.generate(prompt="x", max_new_tokens=0)
        with pytest.raises(client.NotFound):
            c.wait("nope")
        with pytest.raises(client.DeadlineExceeded):
            c.generate(prompt="slow", max_new_tokens=1, timeout=0.2)
        service.stream_cancelled.clear()
        for _ in c.stream(prompt="long", max_new_tokens=50):
            break  # leaving early must cancel the server-side stream
        assert service.stream_cancelled.wait(2.0)
    with Client(address, token="wrong") as c, pytest.raises(client.Unauthenticated, match="bad token"):
        c.stats()
    with Client("127.0.0.1:1", timeout=2.0) as c, pytest.raises(client.Unavailable):
        c.stats()


def test_async_round_trips(fake):
    service, address = fake

    async def go():
        async with AsyncClient(address, token="secret") as c:
            r = await c.generate(prompt_token_ids=[1, 2], max_new_tokens=4)
            assert r.text == "defg" and r.finish_reason == "length" and r.usage.completion_tokens == 4
            texts = [ch.text async for ch in c.stream(prompt="ab", max_new_tokens=3)]
            assert texts == ["n", "o", "p"]
            job_id = await c.submit([{"prompt": "a", "max_new_tokens": 1}, {"prompt": "b", "max_new_tokens": 1}])
            results = await c.wait(job_id)
            assert [r.text for r in results] == ["t", "u"]
            assert (await c.get_job(job_id)).state == "done"
            assert (await c.cancel(job_id)).state == "cancelled"
            assert (await c.stats()).free_blocks == 8
            with pytest.raises(client.InvalidArgument):
                await c.generate(prompt="x", max_new_tokens=0)
            with pytest.raises(client.NotFound):
                await c.get_job("nope")
            service.stream_cancelled.clear()
            agen = c.stream(prompt="long", max_new_tokens=50)
            async for _ in agen:
                break
            await agen.aclose()  # closing the iterator early cancels the server-side stream
            assert service.stream_cancelled.wait(2.0)

    asyncio.run(go())


def test_cli_against_fake(fake, capsys, tmp_path, monkeypatch):
    _, address = fake
    assert cli_main(["generate", "--address", address, "--prompt-ids", "1,2", "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().out.strip() == "de"
    jobs = tmp_path / "p.jsonl"
    jobs.write_text('{"prompt_token_ids": [0], "max_new_tokens": 1}\n\n{"prompt": "b", "max_new_tokens": 1}\n')
    assert cli_main(["submit", "--address", address, "--file", str(jobs), "--wait", "--no-progress"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("job-") and [json.loads(x)["text"] for x in lines[1:]] == ["a", "u"]
    assert cli_main(["stats", "--address", address]) == 0
    assert "invariants_ok" in capsys.readouterr().out
    assert cli_main(["generate", "--address", address, "--prompt", "x", "--max-new-tokens", "0"]) == 1
    assert "INVALID_ARGUMENT: max_new_tokens" in capsys.readouterr().err


# ---------------------------------------------------------------- LocalCluster with fake packages

FAKE_SERVICE = '''
import argparse, time
from concurrent import futures
import grpc
from minipaged.v1 import metadata_pb2 as pb, metadata_pb2_grpc as pb_grpc
ap = argparse.ArgumentParser()
for f in ("--host", "--port", "--block-size", "--db"):
    ap.add_argument(f, required=True)
a = ap.parse_args()
layers = set()
class S(pb_grpc.MetadataServiceServicer):
    def RegisterWorker(self, req, ctx):
        layers.update(range(req.info.layer_start, req.info.layer_end))
        return pb.RegisterWorkerReply(worker_id=str(len(layers)))
    def Stats(self, req, ctx):
        ready = layers == set(range(4))
        return pb.StatsReply(ready=ready, num_workers=len(layers) // 2, num_chains=int(ready))
server = grpc.server(futures.ThreadPoolExecutor(4))
pb_grpc.add_MetadataServiceServicer_to_server(S(), server)
server.add_insecure_port(f"{a.host}:{a.port}")
server.start()
print("fake service up", flush=True)
server.wait_for_termination()
'''

FAKE_WORKER = '''
import argparse, os, sys, time
import grpc
from minipaged.v1 import metadata_pb2 as pb, metadata_pb2_grpc as pb_grpc, worker_pb2
ap = argparse.ArgumentParser()
for f in ("--metadata", "--host", "--port", "--model", "--layers", "--dtype", "--device"):
    ap.add_argument(f, required=True)
ap.add_argument("--threads")
a = ap.parse_args()
if os.environ.get("FAKE_FAIL") and a.layers != "0:2":
    sys.exit("boom: cannot load layers " + a.layers)
start, end = map(int, a.layers.split(":"))
from concurrent import futures
server = grpc.server(futures.ThreadPoolExecutor(1))  # opens its port like a real worker
server.add_insecure_port(f"{a.host}:{a.port}")
server.start()
stub = pb_grpc.MetadataServiceStub(grpc.insecure_channel(a.metadata))
stub.RegisterWorker(pb.RegisterWorkerRequest(info=worker_pb2.WorkerInfo(layer_start=start, layer_end=end)),
                    wait_for_ready=True, timeout=30)
while True:
    time.sleep(1)
'''


@pytest.fixture
def fake_root(tmp_path):
    for pkg, src in (("metadata_service", FAKE_SERVICE), ("worker", FAKE_WORKER)):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
        (tmp_path / pkg / "__main__.py").write_text(textwrap.dedent(src))
    return str(tmp_path)


def test_local_cluster_processes(fake_root):
    with LocalCluster(model="tiny", workers=2, root=fake_root, env={"PYTHONPATH": REPO},
                      startup_timeout=60, grace=2) as cluster:
        assert cluster.client.stats().ready and len(cluster.processes) == 3
        worker_cmds = [p.args for p in cluster.processes[1:]]
        assert [c[c.index("--layers") + 1] for c in worker_cmds] == ["0:2", "2:4"]
        assert all(c[c.index("--metadata") + 1] == cluster.address for c in worker_cmds)
        cluster.kill_worker(1)
        assert cluster.processes[2].poll() is not None
        cluster.restart_worker(1)
        assert cluster.processes[2].poll() is None
        procs = list(cluster.processes)
    assert all(p.poll() is not None for p in procs)  # nothing left running
    assert not os.path.exists(cluster.log_dir)


def test_local_cluster_startup_failure_shows_logs(fake_root):
    with pytest.raises(ClusterError, match="boom: cannot load layers 2:4") as info:
        LocalCluster(model="tiny", workers=2, root=fake_root, env={"PYTHONPATH": REPO, "FAKE_FAIL": "1"},
                     startup_timeout=60, grace=2)
    assert "worker1 exited before the cluster was ready" in str(info.value)
    shutil.rmtree(str(info.value).split("logs in ")[1].split()[0])  # kept for the user; not for us
