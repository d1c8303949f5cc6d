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
    # a wrong type is named, never coerced (True would sample; a dict's keys would become stop strings)
    for kw, field in ((dict(stop={"ab": 1}), "stop"), (dict(stop={"x"}), "stop"), (dict(stop=5), "stop"),
                      (dict(temperature=True), "temperature"), (dict(temperature="hot"), "temperature"),
                      (dict(top_p="1"), "top_p"), (dict(max_new_tokens=None), "max_new_tokens"),
                      (dict(temperature=None), "temperature")):
        with pytest.raises(TypeError, match=f"^{field} must be"):
            build_generate_request(prompt="x", **kw)
    with pytest.raises(TypeError, match="a list of request dicts"):
        build_submit_request({"prompt": "x"})
    with pytest.raises(client.InvalidArgument, match=r"logprobs must be True or an int in \[0, 20\]"):
        build_generate_request(prompt="x", logprobs=21)
    assert build_generate_request(prompt="x", temperature=np.float32(0.5), top_p=None).temperature == 0.5


def test_async_client_has_every_method_of_client():
    """DESIGN section 2: AsyncClient is Client with `async`."""
    assert {n for n in dir(Client) if not n.startswith("_")} <= set(dir(AsyncClient))


def test_stats_covers_every_proto_field():
    proto_fields = [f.name for f in pb.StatsReply.DESCRIPTOR.fields]
    assert [f.name for f in dataclasses.fields(Stats)] == proto_fields
    reply = pb.StatsReply(num_blocks=64, used_blocks=10, free_blocks=54, kv_utilization=0.5,
                          invariants_ok=True, prefix_cache_hit_rate=0.25)
    s = Stats.from_proto(reply)
    assert s.used_blocks == 10 and s["free_blocks"] == 54 and s.as_dict()["invariants_ok"] is True
    assert set(s.as_dict()) == set(proto_fields)
    assert "invariants_ok" in s.table() and "50.0%" in s.table() and "role" not in s.table()
    reply.chains.add(chain_id=1, role="prefill")
    reply.chains.add(chain_id=2, role="decode")
    assert "chains (role)" in Stats.from_proto(reply).table() and "1 prefill, 2 decode" in Stats.from_proto(reply).table()


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


def test_split_layers_gives_the_last_stage_fewer_layers_for_the_lm_head():
    from minipaged.config import lm_head_layers, load_model_config
    assert abs(lm_head_layers(load_model_config("tiny")) - 0.133) < 1e-3
    assert split_layers(4, 2, 0.133) == [(0, 2), (2, 4)]               # tiny: as even
    assert split_layers(28, 2, 9.9) == [(0, 19), (19, 28)]             # Qwen3-0.6B: 19 vs 9 + 9.9
    assert split_layers(36, 4, 3.2) == [(0, 10), (10, 20), (20, 30), (30, 36)]   # Qwen3-8B
    assert split_layers(28, 4, 30.0)[-1] == (27, 28)                   # never fewer than one layer
    assert split_layers(28, 1, 9.9) == [(0, 28)]
    for n, w, h in [(5, 2, 1.5), (7, 7, 3.0), (36, 5, 2.0), (3, 2, 0.4)]:
        parts = split_layers(n, w, h)
        assert parts[0][0] == 0 and parts[-1][1] == n and len(parts) == w and all(a < b for a, b in parts)
        assert all(parts[i][1] == parts[i + 1][0] for i in range(w - 1))


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


def test_sdk_and_cli_arguments_are_checked_before_any_call():
    """Probe K: a port out of range was wrapped by gRPC (":120636" reached 55100), and wrong types
    failed deep inside gRPC with words that named no argument."""
    for address in ("127.0.0.1:120636", "127.0.0.1:-1", "[::1]:99999", "h:0"):
        with pytest.raises(ValueError, match="port must be a number in 1-65535"):
            Client(address)
    with pytest.raises(TypeError, match="timeout must be a number"):
        Client("127.0.0.1:5", timeout="10")
    with pytest.raises(ValueError, match="timeout must be >= 0"):
        Client("127.0.0.1:5", timeout=-5)
    with pytest.raises(ValueError, match="token must be printable ASCII"):
        Client("127.0.0.1:5", token="a\nb")
    c = Client("127.0.0.1:5", timeout=np.float64(3))
    for method in (c.wait, c.cancel, c.get_job, c.delete_job):
        with pytest.raises(TypeError, match="job_id must be a str"):
            method(5)
    with pytest.raises(ValueError, match="timeout must be >= 0"):
        c.stats(timeout=-1)
    p = build_parser()
    for argv in (["generate", "--prompt-ids", "1,,2"], ["stats", "--timeout", "-1"]):
        with pytest.raises(SystemExit):
            p.parse_args(argv)
    assert p.parse_args(["generate", "--prompt-ids", "1,2,"]).prompt_ids == [1, 2]


@pytest.mark.parametrize("module", ["metadata_service", "worker", "gateway", "client serve tiny"])
def test_every_entry_point_refuses_a_port_out_of_range(module):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", *module.split(), "--port", "120686"], capture_output=True, text=True,
                       timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 2 and "a port is 0-65535, got 120686" in r.stderr, r.stderr[-500:]


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
        self.slow_jobs = {}
        self.ready_after = 0  # Stats says ready from this call on
        self.stats_calls = 0
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
        if req.prompt == "forever":  # streams until the client goes away (Ctrl-C tests)
            while context.is_active():
                yield pb.GenerateChunk(token_ids=wire.pack([120]), text="x")
                time.sleep(0.05)
            return
        r = _result(0, req)
        toks = wire.unpack(r.token_ids).tolist()
        for k, t in enumerate(toks):
            last = k == len(toks) - 1
            for choice in range(max(1, req.n)):  # choices interleave, token by token
                K = req.top_logprobs
                yield pb.GenerateChunk(token_ids=wire.pack([t + choice]), text=chr(t + choice),
                                       finish_reason="length" if last else "",
                                       usage=r.usage if last else None, index=choice,
                                       logprobs=wire.pack([-0.5], wire.FLOAT32) if req.return_logprobs else b"",
                                       top_logprob_ids=wire.pack([t + choice + j for j in range(K)]) if K else b"",
                                       top_logprobs=wire.pack([-0.5 - j for j in range(K)], wire.FLOAT32) if K else b"")
            if req.prompt == "long":
                time.sleep(0.05)

    def SubmitJob(self, req, context):
        self._check(context)
        job_id = f"job-{len(self.jobs)}"
        self.jobs[job_id] = [_result(i, r) for i, r in enumerate(req.requests)]
        self.slow_jobs[job_id] = req.requests[0].prompt == "slow-job"
        return pb.SubmitJobReply(job_id=job_id)

    def ListJobs(self, req, context):
        ids = [j for j in reversed(list(self.jobs)) if not req.state or req.state == "done"][:req.limit or 100]
        return pb.JobList(jobs=[pb.Job(job_id=j, state="done", total=len(self.jobs[j]), completed=len(self.jobs[j]),
                                       created=1.5e9) for j in ids])

    def DeleteJob(self, req, context):
        res = self._job(req.job_id, context)
        del self.jobs[req.job_id]
        return pb.Job(job_id=req.job_id, state="done", total=len(res), completed=len(res))

    def _job(self, job_id, context):
        if job_id not in self.jobs:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no job {job_id!r}")
        return self.jobs[job_id]

    def GetJob(self, req, context):
        res = self._job(req.job_id, context)
        return pb.Job(job_id=req.job_id, state="done", total=len(res), completed=len(res), results=res)

    def WatchJob(self, req, context):
        res = self._job(req.job_id, context)
        if self.slow_jobs.get(req.job_id):  # never finishes (Ctrl-C tests)
            while context.is_active():
                yield pb.JobProgress(job_id=req.job_id, state="running", total=len(res), completed=0)
                time.sleep(0.2)
            return
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
        self.stats_calls += 1
        ready = self.stats_calls > self.ready_after
        return pb.StatsReply(num_blocks=8, block_size=16, free_blocks=8, invariants_ok=True, ready=ready,
                             not_ready_reason="" if ready else "layers 2:4 have no worker")


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
ap.add_argument("--grace", type=float, required=True)    # LocalCluster passes its own
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


# ---------------------------------------------------------------- issue 9: request options, jobs, CLI manners

def test_generate_request_new_fields():
    from client.messages import normalize_address
    req = build_generate_request(prompt="x", n=3, best_of=5, min_new_tokens=2, repetition_penalty=1.3,
                                 presence_penalty=0.5, frequency_penalty=-0.5, logprobs=4)
    assert (req.n, req.best_of, req.min_new_tokens, req.top_logprobs) == (3, 5, 2, 4) and req.return_logprobs
    assert req.repetition_penalty == pytest.approx(1.3) and req.frequency_penalty == -0.5
    assert not req.HasField("top_p")  # unset = 1 (off)
    assert build_generate_request(prompt="x", top_p=0.5).top_p == 0.5
    assert build_generate_request(prompt="x", logprobs=True).return_logprobs
    assert build_generate_request(prompt="x", logprobs=True).top_logprobs == 0
    assert build_generate_request(prompt="x", return_logprobs=True).return_logprobs  # the older name
    with pytest.raises(client.InvalidArgument, match=r"top_p must be in \(0, 1\]"):
        build_generate_request(prompt="x", top_p=0)
    # values the wire would read as unset (proto3's 0 / empty) are refused, not dropped
    for kw, message in ((dict(n=0), r"n must be in \[1, 128\]"), (dict(best_of=0), "best_of must be in"),
                        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
                        (dict(choice=[]), "choice must be 1 to 1024 non-empty strings"),
                        (dict(regex=""), "regex must be a non-empty pattern"),
                        (dict(json_schema=""), "json_schema must be a JSON schema")):
        with pytest.raises(client.InvalidArgument, match=message):
            build_generate_request(prompt="x", **kw)
    with pytest.raises(client.InvalidArgument, match="choice must be"):
        build_submit_request([{"prompt": "x", "choice": []}])
    assert build_generate_request(prompt="x", min_p=0.25).min_p == 0.25
    with pytest.raises(client.InvalidArgument, match=r"min_p must be in \[0, 1\]"):
        build_generate_request(prompt="x", min_p=1.5)
    with pytest.raises(client.InvalidArgument, match="give prompt or prompt_token_ids, not both"):
        build_generate_request(prompt="hi", prompt_token_ids=[1, 2])
    with pytest.raises(client.InvalidArgument, match="logprobs"):
        build_generate_request(prompt="x", logprobs=-1)
    assert build_submit_request([{"prompt": "a", "n": 2, "logprobs": 1}]).requests[0].top_logprobs == 1
    assert normalize_address("myhost") == "myhost:50051" and normalize_address("h:7") == "h:7"
    assert normalize_address("::1") == "[::1]:50051" and normalize_address("[::1]:9") == "[::1]:9"
    assert normalize_address("unix:/tmp/s") == "unix:/tmp/s"


def test_n_choices_top_logprobs_batches_and_jobs(fake):
    service, address = fake
    with Client(address) as c:
        r = c.generate(prompt_token_ids=[1, 2], max_new_tokens=3, n=2, logprobs=2)
        assert [ch.choice for ch in r.choices] == [0, 1] and r.token_ids == r.choices[0].token_ids == [100, 101, 102]
        assert r.choices[1].token_ids == [101, 102, 103] and r.choices[1].text == "efg"
        assert r.top_logprobs == [{100: -0.5, 101: -1.5}, {101: -0.5, 102: -1.5}, {102: -0.5, 103: -1.5}]
        assert r.cumulative_logprob == pytest.approx(-1.5)
        assert service.requests[-1].n == 2 and service.requests[-1].top_logprobs == 2

        batch = c.generate(["ab", {"prompt": "cd", "max_new_tokens": 1}, [1, 2]], max_new_tokens=2)
        assert [b.text for b in batch] == ["no", "r", "de"] and [b.index for b in batch] == [0, 1, 2]
        assert [b.token_ids for b in c.generate(prompt_token_ids=[[1, 2], [3]], max_new_tokens=1)] == [[100], [100]]
        with pytest.raises(client.InvalidArgument):  # one bad request fails the batch
            c.generate(["ok", "bad"], max_new_tokens=0)
        with pytest.raises(TypeError):
            c.generate([1.5])

        job = c.submit([{"prompt": "a", "max_new_tokens": 1}])
        listed = c.list_jobs(limit=5)
        assert listed[0].job_id == job and listed[0].created == 1.5e9 and listed[0].done
        assert c.delete_job(job).job_id == job
        with pytest.raises(client.NotFound):
            c.get_job(job)

    async def go():
        async with AsyncClient(address) as ac:
            rs = await ac.generate(["ab", "cd"], max_new_tokens=2)
            assert [x.text for x in rs] == ["no", "rs"]
            r = await ac.generate(prompt="ab", max_new_tokens=2, n=3)
            assert len(r.choices) == 3
            assert (await ac.list_jobs())[0].state == "done"
    asyncio.run(go())


def test_wait_ready(fake):
    service, address = fake
    service.stats_calls, service.ready_after = 0, 3  # not ready for the first three Stats calls
    with Client(address, wait_ready=30) as c:
        assert c.generate("ab", max_new_tokens=1).text == "n"
    assert service.stats_calls > 3
    service.stats_calls, service.ready_after = 0, 10**9
    with Client(address, wait_ready=0.5) as c, pytest.raises(client.Unavailable, match="layers 2:4 have no worker"):
        c.generate("ab", max_new_tokens=1)
    with Client("127.0.0.1:1", wait_ready=0.5) as c, pytest.raises(client.Unavailable, match="wait_ready"):
        c.submit([{"prompt": "a"}])
    service.ready_after = 0


@pytest.fixture
def worker_like():
    """A server that looks like one of our workers: health says WorkerService, nothing else."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    hs = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    hs.set("minipaged.v1.WorkerService", health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_pointing_at_a_worker_says_so(worker_like, capsys):
    with Client(worker_like) as c, pytest.raises(client.Unimplemented, match="is a MiniPaged worker") as info:
        c.stats()
    assert "not the metadata service" in str(info.value)

    async def go():
        async with AsyncClient(worker_like) as ac:
            with pytest.raises(client.Unimplemented, match="is a MiniPaged worker"):
                await ac.generate("x", max_new_tokens=1)
    asyncio.run(go())
    assert cli_main(["stats", "--address", worker_like]) == 1
    assert "is a MiniPaged worker (minipaged.v1.WorkerService), not the metadata service" in capsys.readouterr().err


def test_cli_help_jobs_and_new_options(fake, capsys, monkeypatch):
    _, address = fake
    monkeypatch.setenv("COLUMNS", "200")  # one help line per option
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    out = capsys.readouterr().out
    assert "(default: 32)" in out and "HOST alone means port 50051" in out and "--logprobs [K]" in out
    a = build_parser().parse_args(["generate", "--prompt", "x", "--logprobs"])
    assert a.logprobs == 0
    assert build_parser().parse_args(["generate", "--prompt", "x", "--logprobs", "3"]).logprobs == 3
    assert cli_main(["generate", "--address", address, "--prompt", "ab", "--prompt", "cd", "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().out.split() == ["no", "rs"]
    assert cli_main(["generate", "--address", address, "--prompt", "ab", "--max-new-tokens", "2", "--n", "2",
                     "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["choices"]) == 2
    assert cli_main(["jobs", "--address", address, "--json"]) == 0
    jobs = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert jobs and set(jobs[0]) == {"job_id", "state", "total", "completed", "created"}
    assert cli_main(["delete", "--address", address, jobs[0]["job_id"]]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["job_id"] == jobs[0]["job_id"]
    assert cli_main(["generate", "--address", address, "--prompt", "x", "--top-p", "0"]) == 2   # before any RPC
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
    # a batch prints every choice of every prompt, and refuses --stream rather than ignore it
    assert cli_main(["generate", "--address", address, "--prompt", "ab", "--prompt", "cd", "--max-new-tokens", "2",
                     "--n", "2"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 4
    assert cli_main(["generate", "--address", address, "--prompt", "ab", "--prompt", "cd", "--stream"]) == 2
    assert "--stream takes one --prompt" in capsys.readouterr().err


def _cli(address, *args, **kw):
    import subprocess
    import sys
    # Ctrl-C as a terminal delivers it: a suite started in the background (`make test &`) ignores
    # SIGINT, children inherit that, and Python then never raises KeyboardInterrupt (no preexec_fn:
    # forking a process with gRPC threads is unsafe)
    boot = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "sys.argv[0] = 'client'; runpy.run_module('client', run_name='__main__', alter_sys=True)")
    return subprocess.Popen([sys.executable, "-c", boot, *args, "--address", address], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            **kw)


def test_cli_ctrl_c_and_broken_pipe(fake, tmp_path):
    import signal
    service, address = fake
    p = _cli(address, "generate", "--prompt", "forever", "--stream")
    assert p.stdout.read(1) == b"x"  # streaming has begun
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 130 and b"interrupted" in err and b"Traceback" not in err, err

    job_file = tmp_path / "slow.jsonl"
    job_file.write_text('{"prompt": "slow-job", "max_new_tokens": 1}\n')
    p = _cli(address, "submit", "--file", str(job_file), "--wait", "--no-progress")
    job_id = p.stdout.readline().decode().strip()
    assert job_id.startswith("job-")
    time.sleep(0.3)  # let it enter wait (a signal earlier is handled the same way)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 130 and b"Traceback" not in err, err
    assert f"interrupted; job {job_id} keeps running: python -m client cancel {job_id}".encode() in err

    # `| head`: the reader is gone before we write
    p = _cli(address, "generate", "--prompt", "ab", "--max-new-tokens", "50", "--json")
    p.stdout.close()
    err = p.stderr.read()
    p.wait(timeout=30)
    assert b"Broken pipe" not in err and b"Traceback" not in err and p.returncode == 141, err


def test_a_beam_score_of_zero_is_a_score_not_unset():
    # a near-certain beam (an EOS at p ~ 1) scores exactly 0.0: proto3 presence tells it from "no beam"
    from client.decode import chunk_from_proto, result_from_proto
    ids = wire.pack([7], wire.INT32)
    beam = pb.GenerationResult(token_ids=ids, beam_score=0.0, cumulative_logprob=0.0)
    r = result_from_proto(pb.GenerationResult(choices=[beam]))
    assert r.choices[0].beam_score == 0.0 and r.choices[0].cumulative_logprob == 0.0
    c = chunk_from_proto(pb.GenerateChunk(token_ids=ids, beam_score=0.0, cumulative_logprob=0.0))
    assert c.beam_score == 0.0 and c.cumulative_logprob == 0.0
    plain = chunk_from_proto(pb.GenerateChunk(token_ids=ids))
    assert plain.beam_score is None and plain.cumulative_logprob is None
    assert result_from_proto(pb.GenerationResult(token_ids=ids)).beam_score is None
