"""Hypothesis fuzzing of every RPC of both services with random and hostile values.

Metadata service: a real LocalCluster (subprocesses on loopback) driven through raw gRPC stubs.
Worker: an in-process WorkerServicer over the real `tiny` ModelRunner, so the K/V cache checksum can
be compared before and after every rejected Step (copy-on-write copies included) / InitCache.

Every call must end with a clear status (OK for valid-but-odd input, else one of ALLOWED) and a
non-empty message; no process dies; no block leaks; a rejected Step never touches the cache.

The `test_bug_*` tests at the end pin down real bugs found by this fuzzing (they fail until the
service is fixed; see their docstrings).

Run with -s to see the summary line: "fuzz: N cases, statuses: {...}".
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from collections import Counter, defaultdict

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client import LocalCluster
from client.sdk import build_submit_request
from minipaged import wire
from minipaged.v1 import metadata_pb2 as mpb
from minipaged.v1 import metadata_pb2_grpc as mpb_grpc
from minipaged.v1 import worker_pb2 as pb
from minipaged.v1 import worker_pb2_grpc as pb_grpc
from worker.model_runner import ModelRunner
from worker.server import WorkerServicer, build_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SC = grpc.StatusCode
OK = SC.OK
ALLOWED = {OK, SC.INVALID_ARGUMENT, SC.RESOURCE_EXHAUSTED, SC.NOT_FOUND, SC.FAILED_PRECONDITION,
           SC.ALREADY_EXISTS, SC.PERMISSION_DENIED}
POOL_BLOCKS, POOL_BS = 64, 16          # the cluster's pool
NB, BS, M = 64, 16, 8                  # the in-process worker's cache, max blocks per sequence in Steps
MAX_WAITING = 64
I32_MIN, I32_MAX, I64_MIN, I64_MAX = -2**31, 2**31 - 1, -2**63, 2**63 - 1



def fuzz(n: int) -> settings:
    """Derandomized (the same cases every run, so CI is reproducible), no deadline."""
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large, HealthCheck.filter_too_much])

HIST: Counter = Counter()                       # status name -> calls
PER_RPC: dict[str, Counter] = defaultdict(Counter)


def outcome(rpc: str, fn, allowed=ALLOWED):
    """Run one call; record and check its status. Returns (code, reply or None, details)."""
    try:
        reply, code, details = fn(), OK, ""
    except grpc.RpcError as e:
        reply, code, details = None, e.code(), e.details() or ""
    HIST[code.name] += 1
    PER_RPC[rpc][code.name] += 1
    assert code in allowed, f"{rpc} answered {code.name}: {details!r}"
    if code != OK:
        assert details.strip(), f"{rpc} answered {code.name} with an empty message"
    return code, reply, details


# ================================================================== fixtures

@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster(model="tiny", workers=1, dtype="float32", block_size=POOL_BS, num_blocks=POOL_BLOCKS,
                     extra_service_args=["--max-waiting", str(MAX_WAITING)])
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def meta(cluster):
    ch = grpc.insecure_channel(cluster.address)
    yield mpb_grpc.MetadataServiceStub(ch)
    ch.close()


class Stage:
    """A standalone worker served in-process (as in test_worker_service.py), cache initialised."""

    def __init__(self):
        self.runner = ModelRunner("tiny", 0, 4, "float32", "cpu")
        self.servicer = WorkerServicer(self.runner, model_name="tiny", fixed_num_blocks=NB)
        self.server, port, _ = build_server(self.servicer, "127.0.0.1", 0, "")
        self.address = self.servicer.address = f"127.0.0.1:{port}"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.WorkerServiceStub(self.channel)
        self.epoch = self.init()

    def init(self) -> int:
        self.epoch = self.stub.InitCache(pb.InitCacheRequest(num_blocks=NB, block_size=BS), timeout=30).cache_epoch
        return self.epoch

    def checksum(self) -> float:
        return self.runner.kv_cache.checksum()

    def close(self):
        self.channel.close()
        self.server.stop(None)
        self.servicer.close()


@pytest.fixture(scope="module")
def stage():
    s = Stage()
    yield s
    s.close()


def alive(cluster):
    dead = [i for i, p in enumerate(cluster.processes) if p.poll() is not None]
    assert not dead, f"processes {dead} died\n" + cluster.logs()


# ================================================================== value strategies

INT32 = st.one_of(st.sampled_from([I32_MIN, -2, -1, 0, 1, 2, 63, 64, 1024, 4095, 4096, 4097, I32_MAX]),
                  st.integers(I32_MIN, I32_MAX))
INT64 = st.one_of(st.sampled_from([I64_MIN, -1, 0, 1, 2**62, I64_MAX]), st.integers(I64_MIN, I64_MAX))
F32 = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.0, -1.0, 1e-45, 0.5, 1.0, 1.0000001,
                                 2.0, 1e38, -1e38]), st.floats(width=32))
ODD_CHARS = ["\x00", "\u202e", "\ufeff", "a\u0301", "\U0010ffff", "🙂🙂🙂", "日本語", "\r\n\t", "\ufffd", "\u2028"]
TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)   # any valid unicode
PROMPT = st.one_of(st.just(""), TEXT, st.sampled_from(ODD_CHARS),
                   st.sampled_from([1000, 1100, 5000]).map(lambda n: "x" * n))         # > pool / > max_model_len


def packed(values, dtype=wire.INT32) -> bytes:
    return wire.pack(np.asarray(values, dtype=np.int64).astype(dtype), dtype)


IDS_BYTES = st.one_of(st.just(b""), st.binary(max_size=33),
                      st.lists(st.integers(-3, 600), max_size=20).map(packed),
                      st.lists(st.sampled_from([I32_MIN, -1, 255, 256, 511, 512, I32_MAX]), max_size=4).map(packed),
                      st.sampled_from([1000, 4200]).map(lambda n: packed(np.arange(n) % 256)))
STOP = st.one_of(st.lists(TEXT, max_size=3), st.just([""]), st.just(["s"] * 17), st.just(["y" * 300]))


VALID_GEN = dict(
    prompt=st.one_of(TEXT.filter(bool), st.sampled_from(ODD_CHARS)),
    prompt_token_ids=st.one_of(st.just(b""), st.lists(st.integers(0, 511), min_size=1, max_size=20).map(packed)),
    max_new_tokens=st.integers(1, 4), temperature=st.sampled_from([0.0, 0.7, 1.0, 1e-45, 1e38]),
    top_p=st.sampled_from([1.0, 0.9, 0.0, 1e-45]), top_k=st.sampled_from([0, 1, 50, 512, I32_MAX]),
    seed=st.one_of(st.none(), INT64), stop=st.lists(TEXT, max_size=3),
    stop_token_ids=st.one_of(st.just(b""), st.lists(st.integers(0, 511), max_size=3).map(packed)),
    ignore_eos=st.booleans(), return_logprobs=st.booleans(), min_p=st.sampled_from([0.0, 0.05, 1.0]))
HOSTILE_GEN = dict(
    prompt=PROMPT, prompt_token_ids=IDS_BYTES, max_new_tokens=INT32, temperature=F32, top_p=F32, top_k=INT32,
    seed=INT64, stop=STOP, stop_token_ids=IDS_BYTES, ignore_eos=st.booleans(), return_logprobs=st.booleans(),
    min_p=F32)


@st.composite
def generate_requests(draw):
    """Mostly-valid requests with 0-3 hostile fields (so both acceptance and each check get hit)."""
    hostile = draw(st.sets(st.sampled_from(sorted(HOSTILE_GEN)), max_size=3))
    kw = {k: draw((HOSTILE_GEN if k in hostile else VALID_GEN)[k]) for k in sorted(VALID_GEN)}
    if kw["seed"] is None:
        del kw["seed"]
    if "prompt" in hostile and "prompt_token_ids" not in hostile:
        kw["prompt_token_ids"] = b""                     # else the ids win and the hostile prompt is unused
    return mpb.GenerateRequest(**kw)


def run_generate(meta, req, max_chunks=3):
    """Stream; stop (cancel) after max_chunks chunks. Returns the chunks."""
    call = meta.Generate(req, timeout=60)
    chunks = []
    try:
        for c in call:
            chunks.append(c)
            if c.finish_reason or len(chunks) >= max_chunks:
                break
    finally:
        call.cancel()
    return chunks


def wait_idle(meta, timeout=30.0):
    end = time.monotonic() + timeout
    while True:
        st_ = meta.Stats(mpb.StatsRequest(), timeout=10)
        if st_.running == 0 and st_.waiting == 0 or time.monotonic() > end:
            return st_
        time.sleep(0.05)


# ================================================================== metadata service

@fuzz(250)
@given(req=generate_requests())
def test_fuzz_generate(cluster, meta, req):
    code, chunks, _ = outcome("Generate", lambda: run_generate(meta, req))
    alive(cluster)
    if code == OK:
        assert chunks, "an accepted Generate must stream at least one chunk"
        for c in chunks:
            assert c.finish_reason in ("", "length", "stop")
            n = len(wire.unpack(c.token_ids))
            if req.return_logprobs:
                assert len(wire.unpack(c.logprobs, wire.FLOAT32)) == n


@fuzz(12)
@given(prompt=st.one_of(TEXT.filter(bool), st.sampled_from(ODD_CHARS)), n=st.integers(1, 6),
       extra=st.integers(1, 20), alphabet=st.sampled_from(["z", "日", "🙂", "\x00", "ab"]),
       temperature=st.sampled_from([0.0, 0.7, 1e-45, 1e38]), seed=INT64)
def test_fuzz_stop_never_matches(meta, prompt, n, extra, alphabet, temperature, seed):
    """A stop string longer than any text n tokens can decode to never matches: finish 'length'."""
    stop = (alphabet * (n + extra))[: n + extra]
    req = mpb.GenerateRequest(prompt=prompt, max_new_tokens=n, stop=[stop], ignore_eos=True,
                              temperature=temperature, seed=seed)
    code, chunks, _ = outcome("Generate", lambda: run_generate(meta, req, max_chunks=10 ** 6))
    assert code == OK
    toks = [t for c in chunks for t in wire.unpack(c.token_ids).tolist()]
    assert chunks[-1].finish_reason == "length" and len(toks) == n
    assert chunks[-1].usage.completion_tokens == n


@fuzz(40)
@given(reqs=st.one_of(st.lists(generate_requests(), max_size=3),
                      st.just([mpb.GenerateRequest(prompt="hi", max_new_tokens=1)] * (MAX_WAITING + 1))))
def test_fuzz_submit_job(meta, reqs):
    code, reply, _ = outcome("SubmitJob", lambda: meta.SubmitJob(mpb.SubmitJobRequest(requests=reqs), timeout=30))
    if not reqs or len(reqs) > MAX_WAITING:
        assert code in (SC.INVALID_ARGUMENT, SC.RESOURCE_EXHAUSTED)
    if code != OK:
        return
    jid = reply.job_id
    _, job, _ = outcome("CancelJob", lambda: meta.CancelJob(mpb.JobRequest(job_id=jid), timeout=30))
    assert job.job_id == jid and job.total == len(reqs) and job.state in ("cancelled", "done")
    code, msgs, _ = outcome("WatchJob", lambda: list(meta.WatchJob(mpb.JobRequest(job_id=jid), timeout=30)))
    assert code == OK and msgs and msgs[-1].state in ("cancelled", "done")
    code, job, _ = outcome("GetJob", lambda: meta.GetJob(mpb.JobRequest(job_id=jid), timeout=30))
    assert code == OK and job.state in ("cancelled", "done")


@fuzz(40)
@given(job_id=st.one_of(TEXT, st.sampled_from(ODD_CHARS), st.just("0" * 32), st.just("x" * 2000),
                        st.just("' OR 1=1 --")))
def test_fuzz_unknown_job_ids(meta, job_id):
    r = mpb.JobRequest(job_id=job_id)
    for rpc, fn in (("GetJob", lambda: meta.GetJob(r, timeout=10)),
                    ("CancelJob", lambda: meta.CancelJob(r, timeout=10)),
                    ("WatchJob", lambda: list(meta.WatchJob(r, timeout=10)))):
        code, _, _ = outcome(rpc, fn)
        assert code == SC.NOT_FOUND, f"{rpc}({job_id!r:.40}) -> {code.name}"


# ---- block API: random programs of create/append/fork/release/tables over a small id space

SID = st.one_of(st.sampled_from([1, 2, 3, 4]), st.sampled_from([0, -1, 2**62 - 1, 2**62, I64_MAX, I64_MIN]), INT64)
KNOWN = st.sampled_from([1, 2, 3, 4])
SIDS_BYTES = st.one_of(st.lists(KNOWN, min_size=1, max_size=4, unique=True).map(lambda v: packed(v, wire.INT64)),
                       st.lists(SID, max_size=4).map(lambda v: packed(v, wire.INT64)), st.binary(max_size=20))
COUNTS = st.one_of(st.just(b""), st.lists(st.integers(0, 20), min_size=1, max_size=4).map(packed),
                   st.lists(st.one_of(st.integers(-2, 20), INT32), max_size=4).map(packed), st.binary(max_size=9))


@st.composite
def valid_append(draw):
    """Mostly-valid AppendTokens over ids 1-2 (live when an earlier op created them)."""
    ids = draw(st.lists(st.sampled_from([1, 2]), min_size=1, max_size=2, unique=True))
    counts = draw(st.one_of(st.none(), st.lists(st.one_of(st.integers(0, 20), st.just(2000)),
                                                min_size=len(ids), max_size=len(ids))))
    n = len(ids) if counts is None else sum(counts)
    toks = packed(draw(st.lists(st.integers(0, 511), min_size=n, max_size=n))) if draw(st.booleans()) else b""
    return ("append", packed(ids, wire.INT64), b"" if counts is None else packed(counts), toks)


OPS = st.one_of(
    st.tuples(st.just("create"), st.sampled_from([1, 2]), st.lists(st.integers(0, 3), max_size=40).map(packed),
              st.integers(0, 40)),
    valid_append(),
    st.tuples(st.just("tables"), st.lists(st.sampled_from([1, 2]), min_size=1, max_size=2).map(
        lambda v: packed(v, wire.INT64))),
    st.tuples(st.just("fork"), st.sampled_from([1, 2]), st.sampled_from([2, 3, 4])),
    st.tuples(st.just("create"), st.one_of(KNOWN, SID), IDS_BYTES, st.one_of(st.integers(0, 40), INT32)),
    st.tuples(st.just("create"), KNOWN, st.lists(st.integers(0, 3), max_size=40).map(packed), st.integers(0, 40)),
    st.tuples(st.just("append"), SIDS_BYTES, COUNTS, st.one_of(st.just(b""), IDS_BYTES)),
    st.tuples(st.just("fork"), st.one_of(KNOWN, SID), st.one_of(KNOWN, SID)),
    st.tuples(st.just("release"), st.one_of(KNOWN, SID)),
    st.tuples(st.just("tables"), SIDS_BYTES),
)


@fuzz(120)
@given(ops=st.lists(OPS, min_size=1, max_size=10), n1=st.integers(0, 40),
       p2=st.lists(st.integers(0, 3), max_size=40).map(packed), n2=st.integers(0, 40))
def test_fuzz_block_api(meta, ops, n1, p2, n2):
    """A random program; it starts by creating sequences 1 and 2 so later ops often hit live ids."""
    ops = [("create", 1, b"", n1), ("create", 2, p2, n2)] + ops
    live: set[int] = set()
    try:
        for op in ops:
            kind = op[0]
            if kind == "create":
                _, sid, prompt, n = op
                code, r, _ = outcome("CreateSequence", lambda: meta.CreateSequence(
                    mpb.CreateSequenceRequest(sequence_id=sid, prompt_token_ids=prompt, num_tokens=n), timeout=10))
                if code == OK:
                    live.add(sid)
                    table = wire.unpack(r.block_table)
                    assert r.sequence_length == len(wire.unpack(r.slot_mapping)) + r.num_cached_tokens
                    assert ((table >= 0) & (table < POOL_BLOCKS)).all()
            elif kind == "append":
                _, ids, counts, toks = op
                code, r, _ = outcome("AppendTokens", lambda: meta.AppendTokens(
                    mpb.AppendTokensRequest(sequence_ids=ids, num_tokens=counts, token_ids=toks), timeout=10))
                if code == OK:
                    slots = wire.unpack(r.slot_mapping)
                    assert ((slots >= 0) & (slots < POOL_BLOCKS * POOL_BS)).all()
            elif kind == "fork":
                _, parent, child = op
                code, r, _ = outcome("ForkSequence", lambda: meta.ForkSequence(
                    mpb.ForkSequenceRequest(parent_id=parent, child_id=child), timeout=10))
                if code == OK:
                    live.add(child)
                    assert len(wire.unpack(r.copy_src)) == len(wire.unpack(r.copy_dst))
            elif kind == "release":
                code, r, _ = outcome("ReleaseSequence", lambda: meta.ReleaseSequence(
                    mpb.ReleaseSequenceRequest(sequence_id=op[1]), timeout=10))
                if code == OK:
                    live.discard(op[1])
            else:
                code, r, _ = outcome("GetBlockTables", lambda: meta.GetBlockTables(
                    mpb.GetBlockTablesRequest(sequence_ids=op[1]), timeout=10))
                if code == OK:
                    n = len(wire.unpack(op[1], wire.INT64))
                    assert len(wire.unpack(r.seq_lens)) == n
                    assert len(wire.unpack(r.block_tables)) == n * r.max_blocks
    finally:
        for sid in sorted(live):
            code, _, _ = outcome("ReleaseSequence", lambda: meta.ReleaseSequence(
                mpb.ReleaseSequenceRequest(sequence_id=sid), timeout=10))
            assert code == OK
    assert meta.Stats(mpb.StatsRequest(), timeout=10).invariants_ok


@fuzz(30)
@given(address=st.one_of(st.just(""), TEXT, st.just("127.0.0.1:1")), fp=TEXT,
       layers=st.tuples(INT32, INT32, INT32), worker_id=st.one_of(TEXT, st.just("")),
       epoch=INT64, fixed=INT32, kv=INT64)
def test_fuzz_register_and_heartbeat(meta, real_worker, address, fp, layers, worker_id, epoch, fixed, kv):
    """Registrations that must be refused: bad layer ranges, or a model fingerprint that differs from
    the registered worker's (never the real worker's address: that would legitimately replace it)."""
    if address == real_worker.address:
        address += "x"
    start, end, total = layers
    info = pb.WorkerInfo(address=address, model_name="fuzz", model_fingerprint="fuzz-" + fp, num_layers=total,
                         layer_start=start, layer_end=end, fixed_num_blocks=fixed, kv_cache_bytes=kv,
                         cache_epoch=epoch)
    code, _, _ = outcome("RegisterWorker", lambda: meta.RegisterWorker(
        mpb.RegisterWorkerRequest(info=info), timeout=10))
    # a malformed WorkerInfo is INVALID_ARGUMENT; a well-formed one of another model, FAILED_PRECONDITION
    assert code in (SC.INVALID_ARGUMENT, SC.FAILED_PRECONDITION)
    code, r, _ = outcome("Heartbeat", lambda: meta.Heartbeat(
        mpb.HeartbeatRequest(worker_id=worker_id, cache_epoch=epoch), timeout=10))
    assert code == OK and not r.known
    assert meta.Stats(mpb.StatsRequest(), timeout=10).ready


@pytest.fixture(scope="module")
def real_worker(cluster):
    cmd = cluster.processes[1].args
    with grpc.insecure_channel(f"127.0.0.1:{cmd[cmd.index('--port') + 1]}") as ch:
        return pb_grpc.WorkerServiceStub(ch).Info(pb.InfoRequest(), timeout=10)


# ================================================================== worker: Step / InitCache

DTYPES = {"sequence_ids": wire.INT64, "input_ids": wire.INT32, "positions": wire.INT32,
          "slot_mapping": wire.INT32, "query_start_loc": wire.INT32, "seq_lens": wire.INT32,
          "block_tables": wire.INT32, "do_sample": wire.UINT8, "temperature": wire.FLOAT32,
          "top_p": wire.FLOAT32, "top_k": wire.INT32, "seeds": wire.INT64, "sample_offsets": wire.INT32}
PER_SEQ = ["sequence_ids", "seq_lens", "do_sample", "temperature", "top_p", "top_k", "seeds", "sample_offsets"]


@st.composite
def valid_steps(draw):
    """A self-consistent Step: B sequences, distinct blocks, queries = the last qlen positions."""
    B = draw(st.integers(1, 3))
    pool = draw(st.permutations(range(NB)))
    ctx = [draw(st.integers(0, 40)) for _ in range(B)]
    qlen = [draw(st.integers(1, 8)) for _ in range(B)]
    seq_lens = np.array(ctx) + np.array(qlen)
    bt = np.full((B, M), -1, np.int64)
    used = 0
    for b in range(B):
        n = -(-int(seq_lens[b]) // BS)
        bt[b, :n] = pool[used:used + n]
        used += n
    positions = np.concatenate([np.arange(c, c + q) for c, q in zip(ctx, qlen)])
    seq = np.repeat(np.arange(B), qlen)
    slots = bt[seq, positions // BS] * BS + positions % BS
    pad = draw(st.lists(st.booleans(), min_size=len(slots), max_size=len(slots)))
    slots = np.where(pad, -1, slots) if draw(st.booleans()) else slots
    a = dict(sequence_ids=np.arange(B) + 100, input_ids=draw(st.lists(st.integers(0, 511), min_size=len(slots),
                                                                      max_size=len(slots))),
             positions=positions, slot_mapping=slots, query_start_loc=np.concatenate([[0], np.cumsum(qlen)]),
             seq_lens=seq_lens, block_tables=bt, do_sample=draw(st.lists(st.integers(0, 1), min_size=B, max_size=B)),
             temperature=draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=B, max_size=B)),
             top_p=draw(st.lists(st.sampled_from([0.0, 0.9, 1.0]), min_size=B, max_size=B)),
             top_k=draw(st.lists(st.sampled_from([0, 1, 5, 10 ** 6]), min_size=B, max_size=B)),
             seeds=draw(st.lists(INT64, min_size=B, max_size=B)),
             sample_offsets=draw(st.lists(st.integers(0, 100), min_size=B, max_size=B)))
    fields = {k: wire.pack(np.asarray(v, dtype=np.float64 if DTYPES[k].kind == "f" else np.int64).astype(DTYPES[k]),
                           DTYPES[k]) for k, v in a.items()}
    return fields, dict(max_blocks_per_seq=M, return_logprobs=draw(st.booleans()),
                        return_logits=draw(st.booleans()), step_id=draw(INT64))


BYTE_FIELDS = st.sampled_from(sorted(DTYPES))
MUTATION = st.one_of(
    st.tuples(st.just("trunc"), BYTE_FIELDS, st.integers(1, 3)),
    st.tuples(st.just("extend"), BYTE_FIELDS, st.binary(min_size=1, max_size=9)),
    st.tuples(st.just("replace"), BYTE_FIELDS, st.binary(max_size=24)),
    st.tuples(st.just("empty"), BYTE_FIELDS),
    st.tuples(st.just("set"), BYTE_FIELDS, st.integers(0, 50), st.one_of(INT32, INT64), F32),
    st.tuples(st.just("drop_last"), st.sampled_from(PER_SEQ + ["query_start_loc", "block_tables"])),
    st.tuples(st.just("swap"), st.sampled_from(["positions", "query_start_loc", "slot_mapping", "block_tables"])),
    st.tuples(st.just("epoch"), INT64),
    st.tuples(st.just("max_blocks"), INT32),
    st.tuples(st.just("hidden"), st.binary(max_size=16), st.sampled_from(["", "float32", "int8", "bfloat16"])),
)


def mutate(fields: dict, scalars: dict, mut) -> None:
    kind = mut[0]
    if kind in ("trunc", "extend", "replace", "empty", "set", "drop_last", "swap"):
        name = mut[1]
        data = fields[name]
        dt = DTYPES[name]
        if kind == "trunc":
            fields[name] = data[:max(0, len(data) - mut[2])]
        elif kind == "extend":
            fields[name] = data + mut[2]
        elif kind == "replace":
            fields[name] = mut[2]
        elif kind == "empty":
            fields[name] = b""
        elif len(data) % dt.itemsize == 0 and data:
            arr = np.frombuffer(data, dt).copy()
            if kind == "set":
                ival, fval = mut[3], mut[4]
                if name == "query_start_loc":     # kept small: the int32-wrap case is test_bug_qsl_int32_wrap
                    ival = ival % 211 - 10
                arr[mut[2] % arr.size] = fval if dt.kind == "f" else np.array(ival).astype(dt)
            elif kind == "drop_last":
                arr = arr[:-1]
            elif arr.size > 1:
                arr[[0, -1]] = arr[[-1, 0]]
            fields[name] = arr.tobytes()
    elif kind == "epoch":
        scalars["cache_epoch"] = mut[1]
    elif kind == "max_blocks":
        scalars["max_blocks_per_seq"] = mut[1]
    elif kind == "hidden":
        scalars["hidden_states"], scalars["hidden_dtype"] = mut[1], mut[2]


@fuzz(500)
@given(step=valid_steps(), muts=st.lists(MUTATION, max_size=3))
def test_fuzz_step(stage, step, muts):
    fields, scalars = dict(step[0]), dict(step[1], cache_epoch=stage.epoch)
    for m in muts:
        mutate(fields, scalars, m)
    req = pb.StepRequest(**fields, **scalars)
    before = stage.checksum()
    code, reply, details = outcome("Step", lambda: stage.stub.Step(req, timeout=60),
                                   allowed={OK, SC.INVALID_ARGUMENT, SC.FAILED_PRECONDITION})
    if not muts:
        assert code == OK, details
    if code == OK:
        B = len(np.frombuffer(fields["query_start_loc"], wire.INT32)) - 1
        S = int(np.frombuffer(fields["do_sample"], wire.UINT8).sum())
        assert len(wire.unpack(reply.sampled_token_ids)) == S and reply.cache_epoch == stage.epoch and B >= 1
        if scalars["return_logits"] and S:
            assert len(wire.unpack(reply.logits, wire.FLOAT64)) == S * 512
    else:
        assert stage.checksum() == before, f"a rejected Step ({code.name}: {details}) changed the cache"
        if code == SC.FAILED_PRECONDITION:
            assert "epoch" in details


BLOCK_IDS = st.one_of(st.lists(st.integers(0, NB - 1), max_size=5, unique=True).map(packed),
                      st.lists(st.one_of(st.integers(-3, NB + 3), INT32), max_size=5).map(packed),
                      st.binary(max_size=13))


@fuzz(150)
@given(step=valid_steps(), src=BLOCK_IDS, dst=BLOCK_IDS)
def test_fuzz_step_copies(stage, step, src, dst):
    """A valid Step carrying random copy-on-write pairs: it runs when the pairs are well formed (same
    count, ids in range, distinct destinations), else INVALID_ARGUMENT with the cache untouched."""
    fields, scalars = dict(step[0]), dict(step[1], cache_epoch=stage.epoch)
    req = pb.StepRequest(**fields, **scalars, copy_src=src, copy_dst=dst)
    well_formed = len(src) % 4 == 0 and len(src) == len(dst)
    if well_formed and src:
        s, d = np.frombuffer(src, wire.INT32), np.frombuffer(dst, wire.INT32)
        well_formed = (((s >= 0) & (s < NB)).all() and ((d >= 0) & (d < NB)).all()
                       and np.unique(d).size == d.size)
    before = stage.checksum()
    code, _, details = outcome("Step", lambda: stage.stub.Step(req, timeout=60),
                               allowed={OK, SC.INVALID_ARGUMENT})
    assert (code == OK) == well_formed, details
    if code != OK:
        assert "copy_" in details, details
        assert stage.checksum() == before, f"a rejected Step ({details}) changed the cache"


@fuzz(40)
@given(nb=st.one_of(st.integers(I32_MIN, 0), st.integers(NB + 1, I32_MAX), st.sampled_from([I32_MIN, 0, NB + 1])),
       bs=INT32, addr=TEXT, epoch=INT64, valid_nb=st.booleans())
def test_fuzz_init_cache_invalid(stage, nb, bs, addr, epoch, valid_nb):
    """Only invalid sizes (a valid InitCache re-initialises: see the next test). A valid num_blocks
    is combined only with block_size <= 0 here: a huge block_size is test_bug_init_cache_huge_block_size."""
    if valid_nb:
        nb, bs = NB, min(bs, 0)
    before, epoch_before = stage.checksum(), stage.epoch
    code, _, _ = outcome("InitCache", lambda: stage.stub.InitCache(pb.InitCacheRequest(
        num_blocks=nb, block_size=bs, next_stage_address=addr, cache_epoch=epoch), timeout=30))
    assert code in (SC.INVALID_ARGUMENT, SC.RESOURCE_EXHAUSTED)
    h = stage.stub.Health(pb.WorkerHealthRequest(), timeout=10)
    assert h.ready and h.cache_epoch == epoch_before and stage.checksum() == before


def test_reinit_deliberately_then_rebaseline(stage):
    old = stage.epoch
    code, r, _ = outcome("InitCache", lambda: stage.stub.InitCache(
        pb.InitCacheRequest(num_blocks=NB, block_size=BS), timeout=30))
    assert code == OK and r.cache_epoch not in (0, old)
    stage.epoch = r.cache_epoch
    assert stage.checksum() == 0.0                                   # a fresh, zeroed cache
    fields, scalars = _simple_step()
    code, _, details = outcome("Step", lambda: stage.stub.Step(pb.StepRequest(**fields, **scalars, cache_epoch=old),
                                                                timeout=30))
    assert code == SC.FAILED_PRECONDITION and str(old) in details and stage.checksum() == 0.0
    for rpc, fn in (("Info", lambda: stage.stub.Info(pb.InfoRequest(), timeout=10)),
                    ("Health", lambda: stage.stub.Health(pb.WorkerHealthRequest(), timeout=10))):
        assert outcome(rpc, fn)[0] == OK


def _simple_step():
    """One sequence, 3 prompt tokens in block 5."""
    f = dict(input_ids=packed([1, 2, 3]), positions=packed([0, 1, 2]), slot_mapping=packed([80, 81, 82]),
             query_start_loc=packed([0, 3]), seq_lens=packed([3]), block_tables=packed([5] + [-1] * (M - 1)),
             do_sample=bytes([1]), temperature=wire.pack([0.0], wire.FLOAT32), top_p=wire.pack([1.0], wire.FLOAT32),
             top_k=packed([0]), seeds=packed([0], wire.INT64), sample_offsets=packed([0]))
    return f, dict(max_blocks_per_seq=M, step_id=1)


# ================================================================== invalid UTF-8 on the wire

def _raw_call(cluster, method: str, payload: bytes, stream: bool):
    ch = grpc.insecure_channel(cluster.address)
    try:
        path = f"/minipaged.v1.MetadataService/{method}"
        if stream:
            return list(ch.unary_stream(path)(payload, timeout=10))    # no serializer: raw bytes
        return ch.unary_unary(path)(payload, timeout=10)
    finally:
        ch.close()


def test_raw_bytes_messages(cluster, meta):
    """Hand-built wire messages: garbage, truncated varints, unknown fields (valid UTF-8 only: the
    invalid-UTF-8 case is test_bug_invalid_utf8_string_field)."""
    ok_prompt = mpb.GenerateRequest(prompt="hi", max_new_tokens=1).SerializeToString()
    for payload in (b"", b"\x08", b"\xff" * 5, ok_prompt + b"\xf8\x07\x01", b"\x12\x05ab"):
        code, _, details = outcome("Generate(raw)", lambda: _raw_call(cluster, "Generate", payload, True),
                                   allowed=ALLOWED | {SC.INTERNAL})
        if code == SC.INTERNAL:  # undecodable bytes: grpcio itself answers before any handler runs
            assert "deserializing" in details
    alive(cluster)


# ================================================================== leak / liveness check (run after the fuzz)

def test_zz_no_leak_and_alive(cluster, meta, stage):
    alive(cluster)
    st_ = wait_idle(meta)
    end = time.monotonic() + 20
    while (st_.free_blocks != st_.num_blocks or st_.live_sequences) and time.monotonic() < end:
        time.sleep(0.1)
        st_ = meta.Stats(mpb.StatsRequest(), timeout=10)
    assert (st_.running, st_.waiting, st_.live_sequences) == (0, 0, 0)
    assert st_.free_blocks == st_.num_blocks == POOL_BLOCKS and st_.used_blocks == 0 and st_.invariants_ok
    assert st_.ready
    # the service still serves a normal request after all of it
    r = cluster.client.generate(prompt="after the storm", max_new_tokens=4, ignore_eos=True)
    assert r.finish_reason == "length" and len(r.token_ids) == 4
    # the admission counter did not leak: a job of exactly --max-waiting requests is still admitted
    job = [{"prompt_token_ids": [7, i % 256], "max_new_tokens": 1} for i in range(MAX_WAITING)]
    code, reply, details = outcome("SubmitJob", lambda: meta.SubmitJob(
        build_submit_request(job), timeout=30))
    assert code == OK, f"--max-waiting slots leaked: {details}"
    results = cluster.client.wait(reply.job_id, timeout=120)
    assert len(results) == MAX_WAITING and all(x.finish_reason in ("length", "stop") for x in results)
    st_ = wait_idle(meta)
    assert st_.free_blocks == st_.num_blocks and st_.invariants_ok
    assert stage.stub.Health(pb.WorkerHealthRequest(), timeout=10).ready
    total = sum(HIST.values())
    print(f"\nfuzz: {total} cases, statuses: {dict(HIST)}")
    for rpc in sorted(PER_RPC):
        print(f"  {rpc:16s} {dict(PER_RPC[rpc])}")
    assert total >= 500


# ================================================================== bugs found (fail until fixed)

def test_bug_invalid_utf8_string_field(cluster):
    """BUG: a proto3 `string` field holding invalid UTF-8 (possible from any non-Python client) is
    answered INTERNAL "Exception deserializing request!" by grpcio before the handler runs; the
    contract wants INVALID_ARGUMENT (a bad request, never retried)."""
    bad_prompt = b"\x0a\x03\xff\xfeA" + b"\x18\x02"          # prompt = ff fe 41, max_new_tokens = 2
    bad_job = b"\x0a\x02\xc3\x28"                              # job_id = c3 28 (invalid 2-byte sequence)
    codes = []
    for method, payload, stream in (("Generate", bad_prompt, True), ("GetJob", bad_job, False)):
        try:
            _raw_call(cluster, method, payload, stream)
            codes.append(OK)
        except grpc.RpcError as e:
            codes.append(e.code())
    alive(cluster)
    assert codes == [SC.INVALID_ARGUMENT, SC.INVALID_ARGUMENT], codes


def test_bug_init_cache_huge_block_size(stage):
    """BUG (worker/server.py InitCache): block_size has no upper bound and only torch.OutOfMemoryError
    is caught. num_blocks=1, block_size=2**31-1 passes the checks, the old cache is dropped and epoch
    set to 0 first, then torch.zeros fails with RuntimeError -> status UNKNOWN and the worker is left
    without a cache (Health.ready false) although the request was invalid."""
    before, epoch = stage.checksum(), stage.epoch
    try:
        code, details = OK, ""
        stage.stub.InitCache(pb.InitCacheRequest(num_blocks=1, block_size=I32_MAX), timeout=30)
    except grpc.RpcError as e:
        code, details = e.code(), e.details()
    h = stage.stub.Health(pb.WorkerHealthRequest(), timeout=10)
    still = (h.ready, h.cache_epoch)
    if not h.ready:
        stage.init()                                               # leave a working worker behind
    assert code in (SC.INVALID_ARGUMENT, SC.RESOURCE_EXHAUSTED), f"{code.name}: {details}"
    assert still == (True, epoch) and stage.checksum() == before


def test_bug_long_id_echoed_in_error_message(meta):
    """BUG (metadata_service/api.py `_job` and `CancelJob`: f"unknown job id {job_id!r}"; same pattern in
    workers.py WorkerRegistry.register: f"bad registration: address={info.address!r} ..."): the message
    echoes client input of any length. gRPC carries the message in the grpc-message trailer; past the
    8 KiB soft limit the client randomly, past the hard limit always, gets RESOURCE_EXHAUSTED "Stream
    removed (received metadata size exceeds ... limit)" instead of NOT_FOUND / INVALID_ARGUMENT."""
    long = "x" * 20000
    got = []
    for rpc, fn in (("GetJob", lambda: meta.GetJob(mpb.JobRequest(job_id=long), timeout=10)),
                    ("CancelJob", lambda: meta.CancelJob(mpb.JobRequest(job_id=long), timeout=10)),
                    ("RegisterWorker", lambda: meta.RegisterWorker(mpb.RegisterWorkerRequest(
                        info=pb.WorkerInfo(address=long, layer_start=0, layer_end=0, num_layers=4)), timeout=10))):
        try:
            fn()
            got.append((rpc, "OK"))
        except grpc.RpcError as e:
            got.append((rpc, e.code().name))
    assert got == [("GetJob", "NOT_FOUND"), ("CancelJob", "NOT_FOUND"), ("RegisterWorker", "INVALID_ARGUMENT")]


QSL_WRAP = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))   # a 34 GB allocation must fail, not thrash
sys.path.insert(0, sys.argv[1])
import numpy as np
from minipaged import wire
from minipaged.v1 import worker_pb2 as pb
from worker.validation import StepLimits, StepValidationError, validate_step
T = 3
i32 = lambda v: wire.pack(np.array(v, dtype=np.int64).astype(np.int32))
req = pb.StepRequest(input_ids=i32([1, 2, 3]), positions=i32([0, 1, 2]), slot_mapping=i32([-1, -1, -1]),
                     query_start_loc=i32([0, 2**31 - 1, -2, T]), seq_lens=i32([2**31 - 1, 2**31 - 1, T + 2]),
                     block_tables=i32([-1] * 3), max_blocks_per_seq=1)
try:
    validate_step(req, StepLimits(512, 256, 4096, 64, 16, True))
    print("ACCEPTED")
except StepValidationError as e:
    print("REJECTED", e)
except BaseException as e:
    print("CRASH", type(e).__name__, e)
"""


def test_bug_qsl_int32_wrap():
    """BUG (worker/validation.py `qlen = np.diff(qsl)`): the diff is taken in int32 and wraps.
    query_start_loc = [0, 2**31-1, -2, 3] gives qlen = [2**31-1, 2**31-1, 5]: every check on qlen
    passes, then np.repeat(np.arange(B), qlen) tries to build a 2**32-element (34 GB) array: a
    MemoryError (status UNKNOWN) -- or, on a host with that much RAM, a 34 GB spike per request.
    Run in a subprocess with RLIMIT_AS so the probe cannot hurt the machine."""
    out = subprocess.run([sys.executable, "-c", QSL_WRAP, ROOT], capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("REJECTED"), out.stdout + out.stderr
