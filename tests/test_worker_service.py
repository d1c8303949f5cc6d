"""The WorkerService over real gRPC (in-process servers on loopback) with the real ModelRunner on the
embedded `tiny` Qwen3: Info, InitCache, Step (parity with the runner, validation, epochs), pipeline
stages, copy-on-write copies carried by a Step, token auth, registration and the command line."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from minipaged import wire
from minipaged.v1 import metadata_pb2 as mpb
from minipaged.v1 import metadata_pb2_grpc as mpb_grpc
from minipaged.v1 import worker_pb2 as pb
from minipaged.v1 import worker_pb2_grpc as pb_grpc
from worker.__main__ import build_parser, resolve_args
from worker.model_runner import ModelRunner
from worker.registration import Registration
from worker.server import WorkerServicer, build_server

BS, NB, M = 4, 64, 8  # block size, blocks, max blocks per sequence
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [40, 41, 42], [100, 7, 200, 9, 9, 9, 9, 9, 300, 11]]
TOKEN = "s3cret"


class Stage:
    """A worker stage served in-process: servicer + grpc server + stub."""

    def __init__(self, layers=(0, 4), token="", num_blocks=NB):
        self.runner = ModelRunner("tiny", *layers, "float32", "cpu")
        self.servicer = WorkerServicer(self.runner, model_name="tiny", fixed_num_blocks=num_blocks)
        self.server, port, _ = build_server(self.servicer, "127.0.0.1", 0, token)
        self.address = self.servicer.address = f"127.0.0.1:{port}"
        self.channel = grpc.insecure_channel(self.address)
        meta = (("authorization", f"Bearer {token}"),) if token else ()
        raw = pb_grpc.WorkerServiceStub(self.channel)
        self.call = lambda m, req: getattr(raw, m)(req, metadata=meta, timeout=30)
        self.raw = raw

    def init(self, next_stage="", next_token="", epoch=0):
        return self.call("InitCache", pb.InitCacheRequest(num_blocks=NB, block_size=BS, next_stage_address=next_stage,
                                                          next_stage_token=next_token, cache_epoch=epoch)).cache_epoch

    def checksum(self):
        return self.runner.kv_cache.checksum()

    def close(self):
        self.channel.close()
        self.server.stop(None)
        self.servicer.close()


@pytest.fixture(scope="module")
def single():
    s = Stage()
    yield s
    s.close()


@pytest.fixture(scope="module")
def chain():
    last = Stage((2, 4), token=TOKEN)
    first = Stage((0, 2))
    yield first, last
    first.close()
    last.close()


def arrays(new_tokens, ctx_before, tables):
    """The packed-batch arrays for sequences b appending new_tokens[b] after ctx_before[b] tokens."""
    qlen = np.array([len(t) for t in new_tokens])
    seq_lens = np.array(ctx_before) + qlen
    positions = np.concatenate([np.arange(c, c + q) for c, q in zip(ctx_before, qlen)])
    seq = np.repeat(np.arange(len(qlen)), qlen)
    bt = np.full((len(qlen), M), -1, np.int32)
    for b, row in enumerate(tables):
        bt[b, :len(row)] = row
    slots = bt[seq, positions // BS] * BS + positions % BS
    B = len(qlen)
    return dict(input_ids=np.concatenate(new_tokens), positions=positions, slot_mapping=slots,
                query_start_loc=np.concatenate([[0], np.cumsum(qlen)]), seq_lens=seq_lens, block_tables=bt,
                do_sample=np.ones(B, np.uint8), temperature=np.zeros(B, np.float32), top_p=np.ones(B, np.float32),
                top_k=np.zeros(B, np.int32), seeds=np.arange(B, dtype=np.int64), sample_offsets=np.zeros(B, np.int32))


def step_request(a, epoch, **over) -> pb.StepRequest:
    dt = {"input_ids": wire.INT32, "positions": wire.INT32, "slot_mapping": wire.INT32, "query_start_loc": wire.INT32,
          "seq_lens": wire.INT32, "block_tables": wire.INT32, "do_sample": wire.UINT8, "temperature": wire.FLOAT32,
          "top_p": wire.FLOAT32, "top_k": wire.INT32, "seeds": wire.INT64, "sample_offsets": wire.INT32}
    fields = {k: wire.pack(v, dt[k]) for k, v in a.items()}
    fields.update(cache_epoch=epoch, max_blocks_per_seq=M, step_id=1)
    fields.update(over)
    return pb.StepRequest(**fields)


TABLES = [[0, 1, 2], [5], [9, 3, 7, 8]]  # room for prefill + a few decode tokens each


def prefill_then_decode(call, epoch, **over):
    """Prefill the three prompts, then one decode step with the sampled tokens. Returns both replies."""
    r1 = call("Step", step_request(arrays(PROMPTS, [0, 0, 0], TABLES), epoch, **over))
    tok = wire.unpack(r1.sampled_token_ids)
    r2 = call("Step", step_request(arrays([[int(t)] for t in tok], [len(p) for p in PROMPTS], TABLES), epoch, **over))
    return r1, r2


def direct_tokens():
    """Same two steps run on a ModelRunner directly (the parity reference)."""
    r = ModelRunner("tiny", 0, 4, "float32", "cpu")
    r.init_cache(NB, BS)
    out, tok = [], None
    for i in range(2):
        a = arrays(PROMPTS if i == 0 else [[int(t)] for t in tok], [0] * 3 if i == 0 else [len(p) for p in PROMPTS], TABLES)
        h = r.execute(r.make_batch(a["input_ids"], a["positions"], a["slot_mapping"], a["query_start_loc"],
                                   a["seq_lens"], a["block_tables"]))
        tok, _, _, _ = r.sample(h, a["query_start_loc"], a["do_sample"], a["temperature"], a["top_p"], a["top_k"],
                             a["seeds"], a["sample_offsets"], False)
        out.append(np.asarray(tok).tolist())
    return out


def code_of(fn):
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), e.value.details()


def test_info_and_health(single):
    info = single.call("Info", pb.InfoRequest())
    assert (info.model_name, info.num_layers, info.layer_start, info.layer_end) == ("tiny", 4, 0, 4)
    assert (info.hidden_size, info.vocab_size, info.num_attention_heads, info.num_kv_heads, info.head_dim) == \
        (256, 512, 8, 4, 64)
    assert (info.dtype, info.device, info.backend, info.dtype_bytes) == ("float32", "cpu", "torch", 4)
    assert info.max_position_embeddings == 4096 and wire.unpack(info.eos_token_ids).tolist() == [256]
    assert info.fixed_num_blocks == NB and info.kv_cache_bytes == 0
    assert info.model_fingerprint == single.runner.fingerprint and info.address == single.address
    h = health_pb2_grpc.HealthStub(single.channel).Check(health_pb2.HealthCheckRequest(service=""))
    assert h.status == health_pb2.HealthCheckResponse.SERVING
    services = ProtoReflectionDescriptorDatabase(single.channel).get_services()
    assert {"minipaged.v1.WorkerService", "grpc.health.v1.Health"} <= set(services)


def test_hidden_states_wire_roundtrip(single):
    """Stage to stage, hidden states travel as raw bytes in their own dtype (bfloat16 included)."""
    h = torch.randn(5, 256).to(torch.bfloat16)
    fwd, beside = single.servicer._forward_request(pb.StepRequest(input_ids=b"\0" * 20, step_id=3), h)
    assert beside is None  # no data link configured: the bytes travel inside the message
    assert fwd.hidden_dtype == "bfloat16" and not fwd.input_ids and fwd.step_id == 3
    back = torch.frombuffer(bytearray(fwd.hidden_states), dtype=torch.bfloat16).view(5, 256)
    assert torch.equal(back, h)


def test_step_before_init_then_epochs(single):
    code, msg = code_of(lambda: single.call("Step", step_request(arrays(PROMPTS, [0] * 3, TABLES), 0)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "InitCache" in msg
    code, msg = code_of(lambda: single.call("InitCache", pb.InitCacheRequest(num_blocks=NB + 1, block_size=BS)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and str(NB) in msg
    e1, e2 = single.init(), single.init()
    assert e1 != e2 and 0 not in (e1, e2)  # re-init is allowed and gets a fresh epoch
    info = single.call("Info", pb.InfoRequest())
    assert (info.cache_epoch, info.num_blocks, info.block_size) == (e2, NB, BS)
    code, msg = code_of(lambda: single.call("Step", step_request(arrays(PROMPTS, [0] * 3, TABLES), e1)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and str(e1) in msg and str(e2) in msg


def test_step_matches_model_runner(single):
    epoch = single.init()
    r1, r2 = prefill_then_decode(single.call, epoch)
    got = [wire.unpack(r.sampled_token_ids).tolist() for r in (r1, r2)]
    assert got == direct_tokens()
    assert r2.cache_epoch == epoch and [(t.layer_start, t.layer_end) for t in r2.timings] == [(0, 4)]
    assert single.call("Health", pb.WorkerHealthRequest()).steps_served >= 2


def _mutations():
    """(name, request override or array mutation) for the hostile-request table."""
    def arr(**kw):
        return ("arrays", kw)

    def raw(**kw):
        return ("raw", kw)
    return {
        "qsl_not_from_0": arr(query_start_loc=[1, 7, 10, 20]),
        "qsl_not_ending_at_T": arr(query_start_loc=[0, 7, 10, 19]),
        "qsl_zero_length": arr(query_start_loc=[0, 7, 7, 20]),
        "no_sequences": arr(query_start_loc=[0]),
        "input_ids_bad_bytes": raw(input_ids=b"\x01\x02\x03"),
        "input_ids_short": ("drop", "input_ids"),
        "input_ids_vocab": ("set", ("input_ids", 3, 512)),
        "position_out_of_range": ("set", ("positions", 0, 4096)),
        "positions_swapped": ("swap", "positions"),
        "slot_out_of_range": ("set", ("slot_mapping", 2, NB * BS)),
        "slot_other_block": ("set", ("slot_mapping", 8, 0)),
        "block_id_out_of_range": ("table", (0, 5, NB)),
        "block_hole_in_used_part": ("table", (2, 1, -1)),
        "seq_len_exceeds_max_blocks": ("narrow", 2),
        "seq_lens_short": ("set", ("seq_lens", 1, 2)),
        "temperature_negative": ("set", ("temperature", 0, -1.0)),
        "top_p_above_1": ("set", ("top_p", 1, 1.5)),
        "top_k_negative": ("set", ("top_k", 2, -3)),
        "do_sample_wrong_length": ("drop", "do_sample"),
        "grammar_bitmask_short": raw(grammar_rows=wire.pack([0]), grammar_bitmask=b"\0" * 8),
        "grammar_rows_out_of_range": raw(grammar_rows=wire.pack([3]), grammar_bitmask=b"\xff" * 64),
        "grammar_row_twice": raw(grammar_rows=wire.pack([1, 1]), grammar_bitmask=b"\xff" * 128),
        "min_p_above_1": raw(min_p=np.asarray([0.0, 1.5, 0.1], dtype=np.float32).tobytes()),
        "min_p_nan": raw(min_p=np.asarray([0.0, np.nan, 0.1], dtype=np.float32).tobytes()),
        "min_p_wrong_length": raw(min_p=np.zeros(2, dtype=np.float32).tobytes()),
    }


@pytest.mark.parametrize("name", list(_mutations()))
def test_invalid_step_rejected_cache_untouched(single, name):
    epoch = single.init()
    prefill_then_decode(single.call, epoch)  # some content, so a stray write would show
    before = single.checksum()
    # Other tokens than the prefill's: a stray write of this request would change the checksum.
    a = arrays([[(x + 17) % 500 for x in p] for p in PROMPTS], [0] * 3, TABLES)
    a["block_tables"] = a["block_tables"].copy()
    kind, what = _mutations()[name]
    over = {}
    if kind == "arrays":
        a.update({k: np.array(v) for k, v in what.items()})
    elif kind == "raw":
        over = what
    elif kind == "drop":
        a[what] = a[what][:-1]
    elif kind == "set":
        field, i, v = what
        a[field] = a[field].copy()
        a[field][i] = v
    elif kind == "swap":
        a[what] = a[what].copy()
        a[what][[0, 1]] = a[what][[1, 0]]
    elif kind == "narrow":
        a["block_tables"] = np.ascontiguousarray(a["block_tables"][:, :what])
        over = {"max_blocks_per_seq": what}
    elif kind == "table":
        b, j, v = what
        a["block_tables"][b, j] = v
    code, msg = code_of(lambda: single.call("Step", step_request(a, epoch, **over)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, msg
    assert single.checksum() == before


def test_two_stages_match_one(single, chain):
    first, last = chain
    epoch1 = single.init()
    one = prefill_then_decode(single.call, epoch1, return_logits=True)
    last.init()
    epoch = first.init(next_stage=last.address, next_token=TOKEN)
    two = prefill_then_decode(first.call, epoch, return_logits=True)
    for a, b in zip(one, two):
        assert wire.unpack(a.sampled_token_ids).tolist() == wire.unpack(b.sampled_token_ids).tolist()
        np.testing.assert_allclose(wire.unpack(b.logits, wire.FLOAT64), wire.unpack(a.logits, wire.FLOAT64),
                                   rtol=1e-5, atol=1e-5)
    assert two[1].cache_epoch == epoch and [(t.layer_start, t.layer_end) for t in two[1].timings] == [(0, 2), (2, 4)]
    # A later stage validates hidden states too.
    bad = step_request(arrays(PROMPTS, [0] * 3, TABLES), last.servicer.epoch, hidden_states=b"\0" * 12,
                       hidden_dtype="float32")
    assert code_of(lambda: last.call("Step", bad))[0] == grpc.StatusCode.INVALID_ARGUMENT
    # The next stage re-initialised (its content is gone): the chain refuses instead of reading stale K/V.
    last.init()
    code, msg = code_of(lambda: first.call("Step", step_request(arrays([[5]], [len(PROMPTS[0])], TABLES[:1]), epoch)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and last.address in msg
    # And a next stage that is down is UNAVAILABLE, named.
    epoch = first.init(next_stage="127.0.0.1:1")
    code, msg = code_of(lambda: first.call("Step", step_request(arrays(PROMPTS, [0] * 3, TABLES), epoch)))
    assert code == grpc.StatusCode.UNAVAILABLE and "127.0.0.1:1" in msg


def test_step_copies_reach_every_stage(chain):
    """Copy-on-write the way the metadata service forks: the Step carries copy_src/copy_dst, every
    stage copies before it writes. A child sharing the parent's full block and owning a copy of its
    partial last block decodes exactly as the parent does, on both stages."""
    first, last = chain
    # The metadata service's way: one chain-wide epoch, last stage initialised first.
    assert last.init(epoch=12345) == 12345
    epoch = first.init(next_stage=last.address, next_token=TOKEN, epoch=12345)
    assert epoch == 12345
    prompt, parent, child = PROMPTS[0], [0, 1], [0, 20]   # 7 tokens: block 0 full, block 1 holds 3
    r = first.call("Step", step_request(arrays([prompt], [0], [parent]), epoch))
    tok = int(wire.unpack(r.sampled_token_ids)[0])
    before = {id(s): s.checksum() for s in chain}
    fork = step_request(arrays([[tok], [tok]], [len(prompt)] * 2, [parent, child]), epoch, step_id=2,
                        return_logits=True, copy_src=wire.pack([1]), copy_dst=wire.pack([20]))
    reply = first.call("Step", fork)
    ids = wire.unpack(reply.sampled_token_ids).tolist()
    logits = wire.unpack(reply.logits, wire.FLOAT64).reshape(2, -1)
    assert ids[0] == ids[1]
    np.testing.assert_allclose(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    for stage in chain:
        assert stage.checksum() != before[id(stage)]
        for k in stage.runner.kv_cache.key_cache + stage.runner.kv_cache.value_cache:
            # block 20 = block 1's three copied positions + the child's token, written as the parent's
            assert torch.equal(k[20], k[1]) and k[1].abs().sum() > 0
    # Bad copies are refused by the whole chain before any stage touches its cache.
    for src, dst in ([0], [NB]), ([NB], [1]), ([0, 1], [30, 30]), ([0, 1], [30]):
        sums = [s.checksum() for s in chain]
        code, msg = code_of(lambda: first.call("Step", step_request(
            arrays([[tok]], [len(prompt)], [parent]), epoch, step_id=3, copy_src=wire.pack(src),
            copy_dst=wire.pack(dst))))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "copy_" in msg, msg
        assert [s.checksum() for s in chain] == sums


def test_token_auth(chain):
    _, last = chain  # serves with --worker-token
    assert code_of(lambda: last.raw.Info(pb.InfoRequest(), timeout=10))[0] == grpc.StatusCode.UNAUTHENTICATED
    wrong = (("authorization", "Bearer nope"),)
    assert code_of(lambda: last.raw.Info(pb.InfoRequest(), metadata=wrong, timeout=10))[0] == \
        grpc.StatusCode.UNAUTHENTICATED
    assert last.call("Info", pb.InfoRequest()).layer_start == 2
    h = health_pb2_grpc.HealthStub(last.channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert h.status == health_pb2.HealthCheckResponse.SERVING  # health stays open


class FakeMetadata(mpb_grpc.MetadataServiceServicer):
    def __init__(self):
        self.registered, self.heartbeats, self.known = [], 0, True

    def RegisterWorker(self, request, context):
        self.registered.append(request.info.address)
        self.known = True
        return mpb.RegisterWorkerReply(worker_id=f"w{len(self.registered)}", heartbeat_interval_ms=50)

    def Heartbeat(self, request, context):
        self.heartbeats += 1
        return mpb.HeartbeatReply(known=self.known)


def wait_for(cond, timeout=10.0):
    end = time.time() + timeout
    while time.time() < end and not cond():
        time.sleep(0.02)
    return cond()


def test_registration_retries_and_reregisters():
    import socket
    with socket.socket() as s:  # a port nobody serves yet: the worker must keep retrying
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    reg = Registration(f"127.0.0.1:{port}", lambda: pb.WorkerInfo(address="w:1"), lambda: 7,
                       backoff_s=0.05, max_backoff_s=0.2).start()
    time.sleep(0.3)
    fake = FakeMetadata()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    mpb_grpc.add_MetadataServiceServicer_to_server(fake, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        assert wait_for(lambda: fake.registered == ["w:1"] and fake.heartbeats >= 2)
        fake.known = False  # the service forgot us (restart): the worker registers again
        assert wait_for(lambda: len(fake.registered) >= 2)
        assert reg.worker_id.startswith("w")
    finally:
        reg.stop()
        server.stop(None)


def test_cli_flags():
    a = resolve_args(["--metadata", "meta:50051", "--port", "50061", "--model", "tiny", "--layers", "0:2",
                      "--host", "0.0.0.0", "--advertise-address", "worker0:50061", "--num-blocks", "128",
                      "--worker-token", "t", "--heartbeat-ms", "500"])
    assert (a.layer_start, a.layer_end, a.dtype, a.backend, a.num_blocks) == (0, 2, "float32", "torch", 128)
    a = resolve_args(["--model", "tiny", "--device", "cuda", "--kv-memory-fraction", "0.8"])
    assert (a.layer_start, a.layer_end, a.dtype, a.backend) == (0, 4, "bfloat16", "pycuda")
    a = resolve_args(["--model", "tiny", "--dtype", "float64", "--kv-cache-bytes", "1048576", "--backend", "torch"])
    assert a.dtype == "float64" and a.kv_cache_bytes == 1 << 20
    for bad in (["--layers", "0:9"], ["--layers", "2:2"], ["--layers", "x"], ["--num-blocks", "4",
                "--kv-memory-fraction", "0.5"], ["--dtype", "int8"], ["--model", "/nonexistent"]):
        with pytest.raises(SystemExit):
            resolve_args(["--model", "tiny", *bad] if "--model" not in bad else bad)
    # no --metadata: the service's default address, as the client and gateway use (issue 21)
    env = os.environ.pop("MINIPAGED_ADDRESS", None)
    try:
        assert build_parser().parse_args([]).metadata == "127.0.0.1:50051"
        assert resolve_args(["--standalone"]).metadata == "" == resolve_args(["--metadata", ""]).metadata
        os.environ["MINIPAGED_ADDRESS"] = "meta:50099"
        assert build_parser().parse_args([]).metadata == "meta:50099"
    finally:
        os.environ.pop("MINIPAGED_ADDRESS", None)
        if env is not None:
            os.environ["MINIPAGED_ADDRESS"] = env


def test_process_serves_registers_and_stops_on_sigterm():
    """`python -m worker` as a process: serves on a free port, registers, exits 0 on SIGTERM."""
    fake = FakeMetadata()
    meta = grpc.server(futures.ThreadPoolExecutor(2))
    mpb_grpc.add_MetadataServiceServicer_to_server(fake, meta)
    meta_port = meta.add_insecure_port("127.0.0.1:0")
    meta.start()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.Popen([sys.executable, "-m", "worker", "--port", "0", "--model", "tiny", "--layers", "2:4",
                          "--kv-cache-bytes", str(8 << 20), "--metadata", f"127.0.0.1:{meta_port}"],
                         cwd=root, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while "listening on" not in line:
            line = p.stderr.readline()
            assert line, "worker exited before listening"
        address = line.split("listening on")[1].strip()
        threading.Thread(target=p.stderr.read, daemon=True).start()  # keep draining the log
        with grpc.insecure_channel(address) as ch:
            info = pb_grpc.WorkerServiceStub(ch).Info(pb.InfoRequest(), timeout=30)
        assert (info.layer_start, info.kv_cache_bytes, info.address) == (2, 8 << 20, address)
        assert wait_for(lambda: fake.registered == [address], timeout=30)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            p.kill()
        meta.stop(None)


def test_grammar_bitmask_keeps_only_allowed_tokens(single):
    """Structured outputs on the last stage: a constrained row samples among the tokens its bitmask
    allows (here exactly one, greedy and sampled alike); an unconstrained row is untouched."""
    epoch = single.init()
    free = wire.unpack(single.call("Step", step_request(arrays(PROMPTS, [0, 0, 0], TABLES), epoch)).sampled_token_ids)
    epoch = single.init()
    words = np.zeros((2, 512 // 32), np.int32)
    words[0, 77 // 32] = 1 << (77 % 32)
    words[1, 300 // 32] = 1 << (300 % 32)
    a = arrays(PROMPTS, [0, 0, 0], TABLES)
    a["temperature"] = np.array([0.0, 0.0, 1.0], np.float32)
    r = single.call("Step", step_request(a, epoch, grammar_rows=wire.pack([0, 2]), grammar_bitmask=words.tobytes()))
    got = wire.unpack(r.sampled_token_ids).tolist()
    assert got[0] == 77 and got[2] == 300 and got[1] == int(free[1])
