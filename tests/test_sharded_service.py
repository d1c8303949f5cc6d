"""The sharded metadata service (`--shards N`): one address, N shard services, each a whole
metadata service in a process of its own. Unit checks of how jobs are split and merged and where
workers go; end to end, float64 tokens equal transformers' through the front, job ids, watch,
list, cancel, delete, Stats and pool snapshots merged, and a refused job leaves no part behind."""
from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import grpc
import pytest

from client import LocalCluster
from client.errors import InvalidArgument, NotFound
from metadata_service.front import CHAIN_ID_STRIDE
from metadata_service.front_jobs import merge_jobs, merged_state, new_job_id, parse_job_id, split
from metadata_service.shards import ShardSet, shard_argv
from minipaged.v1 import metadata_pb2, metadata_pb2_grpc
from tests.test_e2e import VOCAB, ckpt, oracle, prompts, settle  # noqa: F401 (fixtures)


def test_split_follows_the_weights_and_keeps_every_request():
    assert split(10, [2, 2]) == [5, 5]
    assert split(7, [1, 0, 2]) == [2, 0, 5]
    assert split(3, [1, 1, 1, 1]) == [1, 1, 1, 0]
    for total in range(1, 30):
        assert sum(split(total, [3, 1, 2])) == total


def test_a_job_id_says_how_the_job_was_split():
    jid = new_job_id([4, 0, 3])
    assert parse_job_id(jid, 3) == [4, 0, 3]
    assert parse_job_id(jid, 2) is None and parse_job_id("0123abcd", 3) is None
    assert parse_job_id("abc_0_0", 2) is None          # no request anywhere: no job


def test_parts_merge_into_one_job_in_request_order():
    def part(state, total, done, created):
        return metadata_pb2.Job(state=state, total=total, completed=len(done), created=created,
                                results=[metadata_pb2.GenerationResult(index=i) for i in done])
    job = merge_jobs("j", [(0, part("done", 2, [1, 0], 5.0)), (2, part("running", 3, [2], 4.0))], [2, 0, 3])
    assert [r.index for r in job.results] == [0, 1, 4]
    assert (job.state, job.total, job.completed, job.created) == ("running", 5, 3, 4.0)
    assert merged_state(["done", "done"]) == "done" and merged_state(["queued", "queued"]) == "queued"
    assert merged_state(["done", "cancelled"]) == "cancelled" and merged_state(["done", "queued"]) == "running"


def test_shards_get_the_front_flags_they_need_and_no_others():
    argv = ["--shards", "2", "--port=9", "--host", "0.0.0.0", "--db", "x.db", "--token", "t", "--block-size", "4"]
    assert shard_argv(argv) == ["--token", "t", "--block-size", "4"]


def test_stages_of_a_chain_meet_in_one_shard_and_whole_workers_spread():
    shards = ShardSet.__new__(ShardSet)
    shards.stubs, shards.lock = [None] * 3, __import__("threading").Lock()
    shards.by_address, shards.by_group = {}, {}
    shards.stats, shards._placed = [None] * 3, [0] * 3

    def info(address, start, end, group="", role="both"):
        return SimpleNamespace(address=address, layer_start=start, layer_end=end, num_layers=4,
                               replica_group=group, role=role)
    whole = [shards.shard_for_worker(info(f"w{i}", 0, 4)) for i in range(3)]
    assert sorted(whole) == [0, 1, 2]
    stages = {shards.shard_for_worker(info(f"s{i}", 2 * (i % 2), 2 * (i % 2) + 2)) for i in range(4)}
    assert len(stages) == 1
    named = {shards.shard_for_worker(info(f"g{i}", 2 * i, 2 * i + 2, group="g")) for i in range(2)}
    assert len(named) == 1
    roles = {shards.shard_for_worker(info(f"p{r}", 0, 4, role=r)) for r in ("prefill", "decode")}
    assert roles == stages   # prefill and decode workers of the default group: one shard, K/V moves stay in it
    assert shards.shard_for_worker(info("w1", 0, 4)) == whole[1]   # registering again: the same shard
    # the shards' own Stats count workers: one whose worker left takes the next one (found by
    # probing: counts of every address ever placed sent it to a busy shard, the empty one's work waited)
    shards.stats = [SimpleNamespace(num_workers=n) for n in (3, 0, 4)]
    shards._placed = [0, 0, 0]
    assert shards.shard_for_worker(info("new", 0, 4)) == 1


@pytest.fixture(scope="module")
def sharded(ckpt):
    with LocalCluster(model=ckpt, replicas=2, dtype="float64", block_size=4,
                      extra_service_args=["--shards", "2"]) as c:
        yield c


@pytest.mark.slow
def test_a_job_split_over_two_shards_gives_transformers_tokens(sharded, oracle):
    c = sharded.client
    st = c.stats()
    assert st.ready and st.num_chains == 2
    assert sorted(ch["chain_id"] // CHAIN_ID_STRIDE for ch in st.chains) == [0, 1]   # one chain per shard
    batch = prompts(12, 1, 30, seed=41)
    job = c.submit([{"prompt_token_ids": p, "max_new_tokens": 6} for p in batch])
    assert sum(parse_job_id(job, 2)) == 12 and all(parse_job_id(job, 2))
    results = c.wait(job, timeout=300)
    assert [r.index for r in results] == list(range(12))
    for p, r in zip(batch, results):
        assert r.token_ids == oracle(p, 6), f"prompt {p}"
    got = c.get_job(job)
    assert got.state == "done" and got.total == 12 and [r.index for r in got.results] == list(range(12))
    listed = [j for j in c.list_jobs() if j.job_id == job]
    assert len(listed) == 1 and listed[0].total == 12 and listed[0].completed == 12
    assert c.cancel(job).state == "done"          # finished: nothing to cancel
    c.delete_job(job)
    with pytest.raises(NotFound):
        c.get_job(job)
    st = settle(c)
    assert st.generated_tokens >= 72 and all(ch["invariants_ok"] for ch in st.chains)
    snap = c.pool_snapshot()
    assert sorted(ch.chain_id // CHAIN_ID_STRIDE for ch in snap.chains) == [0, 1]


@pytest.mark.slow
def test_generate_streams_through_the_front(sharded, oracle):
    p = prompts(1, 5, 20, seed=43)[0]
    r = sharded.client.generate(prompt_token_ids=p, max_new_tokens=7)
    assert r.token_ids == oracle(p, 7)


@pytest.mark.slow
def test_a_conversations_next_turn_goes_to_the_shard_that_holds_its_history(sharded, oracle):
    """Without affinity half of these next turns would land on the other shard and recompute."""
    c = sharded.client
    firsts = prompts(6, 40, 48, seed=44)
    turns = [p + c.generate(prompt_token_ids=p, max_new_tokens=6).token_ids for p in firsts]
    for history in turns:
        prompt = history + [3, 4, 5, 6]
        r = c.generate(prompt_token_ids=prompt, max_new_tokens=5)
        assert r.token_ids == oracle(prompt, 5)
        assert r.usage.cached_tokens >= len(history) - 4, (len(history), r.usage)


def test_text_prompts_hash_by_their_bytes():
    from metadata_service.front_routing import prompt_blocks
    a = prompt_blocks(metadata_pb2.GenerateRequest(prompt="x" * 200), 16)
    b = prompt_blocks(metadata_pb2.GenerateRequest(prompt="x" * 130 + "y" * 70), 16)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    ids = metadata_pb2.GenerateRequest(prompt_token_ids=bytes(4 * 33))
    assert len(prompt_blocks(ids, 16)) == 2


@pytest.mark.slow
def test_a_refused_job_leaves_no_part_in_any_shard(sharded):
    c = sharded.client
    before = {j.job_id for j in c.list_jobs(limit=1000)}
    bad = [{"prompt_token_ids": [2, 3, 4], "max_new_tokens": 4} for _ in range(9)]
    bad.append({"prompt_token_ids": [2, VOCAB + 5], "max_new_tokens": 4})   # the last part's shard refuses it
    with pytest.raises(InvalidArgument, match="prompt token ids must be in"):
        c.submit(bad)
    assert {j.job_id for j in c.list_jobs(limit=1000)} == before
    settle(c)
    stub = metadata_pb2_grpc.MetadataServiceStub(grpc.insecure_channel(sharded.address))
    with pytest.raises(grpc.RpcError) as e:   # ids are the front's to pick
        stub.SubmitJob(metadata_pb2.SubmitJobRequest(requests=[metadata_pb2.GenerateRequest(
            prompt_token_ids=b"\x02\x00\x00\x00", max_new_tokens=2)], job_id="mine"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(NotFound):
        c.get_job("not-a-sharded-id")
    for unknown in ("abc_0_0", "_0_0"):       # well formed, but a job has a request somewhere
        with pytest.raises(NotFound):
            c.get_job(unknown)
        with pytest.raises(NotFound):
            c.cancel(unknown)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.WatchJob(metadata_pb2.JobRequest(job_id=unknown)))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:   # the limit is checked with a state filter too
        stub.ListJobs(metadata_pb2.ListJobsRequest(limit=-1, state="done"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.slow
def test_a_chosen_job_id_on_one_service_must_be_well_formed_and_unused(ckpt):
    with LocalCluster(model=ckpt, dtype="float64") as cl:
        stub = metadata_pb2_grpc.MetadataServiceStub(grpc.insecure_channel(cl.address))
        req = [metadata_pb2.GenerateRequest(prompt_token_ids=b"\x02\x00\x00\x00", max_new_tokens=2)]
        assert stub.SubmitJob(metadata_pb2.SubmitJobRequest(requests=req, job_id="abc_1")).job_id == "abc_1"
        for job_id, code in (("abc_1", grpc.StatusCode.ALREADY_EXISTS), ("a b", grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(grpc.RpcError) as e:
                stub.SubmitJob(metadata_pb2.SubmitJobRequest(requests=req, job_id=job_id))
            assert e.value.code() == code
        cl.client.wait("abc_1", timeout=60)
        assert [j.job_id for j in cl.client.list_jobs()] == ["abc_1"]
        settle(cl.client)


@pytest.mark.slow
def test_the_block_api_is_shard_zeros(sharded):
    stub = metadata_pb2_grpc.MetadataServiceStub(grpc.insecure_channel(sharded.address))
    got = stub.CreateSequence(metadata_pb2.CreateSequenceRequest(sequence_id=77, num_tokens=9))
    assert got.sequence_id == 77 and got.sequence_length == 9
    st = sharded.client.stats()     # with chains up the pool figures are theirs: the block API's own
    assert st.block_api_used_blocks == 3 and st.block_api_blocks >= 3 and st.num_chains == 2
    assert stub.ReleaseSequence(metadata_pb2.ReleaseSequenceRequest(sequence_id=77)).freed_blocks == 3
    assert sharded.client.stats().block_api_used_blocks == 0
    settle(sharded.client)


@pytest.mark.slow
def test_jobs_survive_a_restart_of_a_sharded_service(ckpt, oracle):
    """Each shard keeps its part in its own store (--db PATH.shardK); the job id needs no table."""
    with LocalCluster(model=ckpt, replicas=2, dtype="float64", extra_service_args=["--shards", "2"]) as c:
        batch = prompts(10, 1, 30, seed=45)
        job = c.client.submit([{"prompt_token_ids": p, "max_new_tokens": 24} for p in batch])
        c.restart_service()
        results = c.client.wait(job, timeout=300)
        assert [r.token_ids for r in results] == [oracle(p, 24) for p in batch]
        settle(c.client)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


@pytest.mark.slow
def test_a_shard_killed_mid_job_starts_again_and_its_part_resumes(ckpt, oracle):
    with LocalCluster(model=ckpt, replicas=2, dtype="float64", extra_service_args=["--shards", "2"]) as c:
        batch = prompts(10, 1, 30, seed=47)
        job = c.client.submit([{"prompt_token_ids": p, "max_new_tokens": 24} for p in batch])
        shards = _children(c.processes[0].pid)
        assert len(shards) == 2
        os.kill(shards[1], signal.SIGKILL)
        results = c.client.wait(job, timeout=300)
        assert [r.token_ids for r in results] == [oracle(p, 24) for p in batch]
        end = time.monotonic() + 60
        while c.client.stats().num_chains < 2:   # its worker registered again, with the new shard
            assert time.monotonic() < end
            time.sleep(0.2)
        assert _children(c.processes[0].pid)[0] == shards[0]
        settle(c.client)


@pytest.mark.slow
def test_with_a_client_token_the_front_still_sees_its_shards(ckpt):
    """The front's own Stats calls carry the token: readiness and the job split depend on them."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from client import Client
    from client.errors import Unauthenticated
    with LocalCluster(model=ckpt, replicas=2, dtype="float64", token="t0k3n",
                      extra_service_args=["--shards", "2"]) as c:
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(c.address))
        end = time.monotonic() + 10
        while health.Check(health_pb2.HealthCheckRequest(service="minipaged.v1.MetadataService")).status \
                != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < end
            time.sleep(0.2)
        job = c.client.submit([{"prompt_token_ids": [2, 3, 4], "max_new_tokens": 3}] * 8)
        assert parse_job_id(job, 2) == [4, 4]
        assert len(c.client.wait(job, timeout=120)) == 8
        with pytest.raises(Unauthenticated):
            Client(c.address).stats()


@pytest.mark.slow
def test_a_front_killed_9_takes_its_shards_with_it_and_a_new_one_resumes(ckpt, oracle):
    with LocalCluster(model=ckpt, replicas=2, dtype="float64", extra_service_args=["--shards", "2"]) as c:
        batch = prompts(8, 1, 30, seed=49)
        job = c.client.submit([{"prompt_token_ids": p, "max_new_tokens": 24} for p in batch])
        front = c.processes[0]
        shards = _children(front.pid)
        front.send_signal(signal.SIGKILL)
        front.wait()
        end = time.monotonic() + 20
        while any(os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"
                  for pid in shards):
            assert time.monotonic() < end, "a shard outlived its front"
            time.sleep(0.1)
        c.restart_service()
        results = c.client.wait(job, timeout=300)
        assert [r.token_ids for r in results] == [oracle(p, 24) for p in batch]
        settle(c.client)


@pytest.mark.slow
def test_a_client_of_a_front_waiting_for_the_first_worker_is_told_so():
    """A shard parks a Generate or a SubmitJob until a worker registers and says so in its
    headers: the front passes that on, so the SDK warns instead of waiting in silence."""
    from tests.test_housekeeping import told_waiting
    told_waiting("--shards", 2)


def test_shards_metrics_merge_into_one_family_per_name_labelled_by_shard():
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from metadata_service.front_metrics import merge_families
    text = ('# HELP vllm:generation_tokens_total Tokens generated\n# TYPE vllm:generation_tokens_total counter\n'
            'vllm:generation_tokens_total{model_name="m"} %d\n')
    fams = merge_families({0: text % 5, 1: None, 2: text % 7})
    registry = SimpleNamespace(collect=lambda: fams)
    out = {(s.name, s.labels.get("shard")): s.value
           for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    assert out[("vllm:generation_tokens_total", "0")] == 5 and out[("vllm:generation_tokens_total", "2")] == 7
    assert ("vllm:generation_tokens_total", "1") not in out
    assert [out[("minipaged:shard_up", k)] for k in "012"] == [1, 0, 1]


def test_a_finished_stream_leaves_its_shards_load_at_once():
    # a burst of short streams must not pile up on one shard's figure until the next poll and push a
    # conversation's next turn away from the shard that holds its history
    from metadata_service.front_routing import ShardRouter
    r = ShardRouter(2)
    stats = [SimpleNamespace(ready=True, block_size=16, num_blocks=1024, tier_blocks=0, num_chains=1,
                             used_blocks=0)] * 2
    history = metadata_pb2.GenerateRequest(prompt_token_ids=bytes(4 * 64), max_new_tokens=16)
    home, blocks = r.choose(history, stats)
    assert blocks == 3 + 1
    for i in range(6):                           # others' streams, each finished before the next turn
        k, b = r.choose(metadata_pb2.GenerateRequest(prompt_token_ids=bytes([i + 1]) * 64, max_new_tokens=16), stats)
        r.finished(k, b)
    r.finished(home, blocks)
    assert r.routed == [0.0, 0.0]
    assert r.choose(history, stats)[0] == home


def test_a_part_forgotten_by_a_restarted_shard_is_data_loss_not_an_unknown_job():
    """A shard restarted without --db forgets its part: GetJob said "unknown job id" for an id it
    had just issued, and ListJobs showed a smaller total (found by probing)."""
    from metadata_service.front_jobs import FrontJobRpcs
    from minipaged.v1 import metadata_pb2

    class Gone(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.NOT_FOUND

        def details(self):
            return "unknown job id"

    class Aborted(Exception):
        pass

    class Context:
        def abort(self, code, details):
            raise Aborted(code, details)

    job_id = "abc_2_2"
    part = metadata_pb2.Job(job_id=job_id, state="done", total=2, completed=2, created=1.0)
    front = FrontJobRpcs()
    front.shards = [None, None]
    front._each = lambda calls, method, context: {0: part, 1: Gone()} if method != "ListJobs" else \
        {0: metadata_pb2.JobList(jobs=[part]), 1: metadata_pb2.JobList()}
    with pytest.raises(Aborted) as e:
        front.GetJob(metadata_pb2.JobRequest(job_id=job_id), Context())
    assert e.value.args[0] == grpc.StatusCode.DATA_LOSS and "part on shard 1 (2 requests) is gone" in e.value.args[1]
    front.DeleteJob(metadata_pb2.JobRequest(job_id=job_id), Context())          # the parts left go
    [listed] = front.ListJobs(metadata_pb2.ListJobsRequest(), Context()).jobs
    assert (listed.total, listed.completed) == (4, 2)


def test_two_workers_of_different_models_registering_at_once_are_not_both_taken():
    """The shards' Stats are polled every 0.5 s: a second model's worker registering before they
    showed the first got in, and the front served two models (found by probing)."""
    from metadata_service.front import FrontServicer
    from minipaged.v1 import metadata_pb2, worker_pb2

    class Refused(Exception):
        pass

    class Context:
        def abort(self, code, details):
            raise Refused(code, details)

    shards = SimpleNamespace(stats=[None, None], shard_for_worker=lambda info: int(info.address[-1]) % 2)
    front = FrontServicer(shards)
    front._forward = lambda k, method, request, context: metadata_pb2.RegisterWorkerReply(worker_id="w")

    def register(address, fp):
        info = worker_pb2.WorkerInfo(address=address, model_name=fp, model_fingerprint=fp)
        return front.RegisterWorker(metadata_pb2.RegisterWorkerRequest(info=info), Context())
    assert register("h:1", "aaaa").worker_id == "1/w"
    with pytest.raises(Refused, match="model mismatch"):
        register("h:2", "bbbb")
    assert register("h:4", "aaaa").worker_id == "0/w"
