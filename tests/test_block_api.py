"""Block API over gRPC, served in-process: replies, status codes, unchanged state after errors,
and 32 concurrent clients."""
import random
import threading
from concurrent import futures

import grpc
import numpy as np
import pytest

from metadata_service.block_api import BlockApi, BlockApiServicer
from metadata_service.block_manager import KVBlockManager
from minipaged import wire
from minipaged.v1 import metadata_pb2 as pb
from minipaged.v1 import metadata_pb2_grpc as pb_grpc

NUM_BLOCKS, BLOCK = 64, 4


@pytest.fixture
def svc():
    api = BlockApi(KVBlockManager(NUM_BLOCKS, BLOCK), threading.Lock())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    pb_grpc.add_MetadataServiceServicer_to_server(BlockApiServicer(api), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield api, pb_grpc.MetadataServiceStub(channel)
    channel.close()
    server.stop(None)


def create(stub, sid, prompt=(), n=0):
    return stub.CreateSequence(pb.CreateSequenceRequest(
        sequence_id=sid, prompt_token_ids=wire.pack(prompt), num_tokens=n))


def append(stub, ids, counts=None, toks=None):
    return stub.AppendTokens(pb.AppendTokensRequest(
        sequence_ids=wire.pack(ids, wire.INT64), num_tokens=b"" if counts is None else wire.pack(counts),
        token_ids=b"" if toks is None else wire.pack(toks)))


def tables(stub, ids):
    r = stub.GetBlockTables(pb.GetBlockTablesRequest(sequence_ids=wire.pack(ids, wire.INT64)))
    return wire.unpack_2d(r.block_tables, len(ids), r.max_blocks), wire.unpack(r.seq_lens)


def test_happy_path(svc):
    api, stub = svc
    p = list(range(10))
    r = create(stub, 1, p, 10)
    assert r.num_cached_tokens == 0 and r.sequence_length == 10
    table = wire.unpack(r.block_table)
    assert wire.unpack(r.slot_mapping).tolist() == [table[i // 4] * 4 + i % 4 for i in range(10)]
    r2 = create(stub, 2, p, 2)                                   # 8 tokens hit, 2 computed
    assert r2.num_cached_tokens == 8 and r2.sequence_length == 10
    assert wire.unpack(r2.block_table)[:2].tolist() == table[:2].tolist()
    slots = wire.unpack(append(stub, [1, 2]).slot_mapping)        # a decode step
    assert len(slots) == 2 and slots[0] == table[2] * 4 + 2
    slots = wire.unpack(append(stub, [1, 2], [3, 0], [7, 7, 7]).slot_mapping)
    assert len(slots) == 3
    t, lens = tables(stub, [2, 1])
    assert lens.tolist() == [11, 14] and t.shape == (2, 4) and t[0, 3] == -1
    f = stub.ForkSequence(pb.ForkSequenceRequest(parent_id=1, child_id=3))
    src, dst = wire.unpack(f.copy_src), wire.unpack(f.copy_dst)
    assert src.tolist() == [t[1, 3]] and len(dst) == 1            # 14 tokens: last block partial
    for sid in (1, 2, 3):
        assert stub.ReleaseSequence(pb.ReleaseSequenceRequest(sequence_id=sid)).freed_blocks >= 1
    assert api.manager.num_free_blocks == NUM_BLOCKS and api.manager.invariants_ok()


def expect(api, code, fn, *in_message):
    before = api.manager.debug_state()
    with pytest.raises(grpc.RpcError) as e:
        fn()
    assert e.value.code() == code, e.value.details()
    for text in in_message:
        assert text in e.value.details()
    assert api.manager.debug_state() == before
    assert api.manager.invariants_ok()
    return e.value.details()


def test_status_codes(svc):
    api, stub = svc
    S = grpc.StatusCode
    create(stub, 1, list(range(6)), 6)
    create(stub, 2, [], 1)
    # unknown ids
    expect(api, S.NOT_FOUND, lambda: append(stub, [1, 77]))
    expect(api, S.NOT_FOUND, lambda: tables(stub, [77]))
    expect(api, S.NOT_FOUND, lambda: stub.ForkSequence(pb.ForkSequenceRequest(parent_id=77, child_id=78)))
    expect(api, S.NOT_FOUND, lambda: stub.ReleaseSequence(pb.ReleaseSequenceRequest(sequence_id=77)))
    # capacity: free and needed counts in the message
    free = api.manager.num_free_blocks
    expect(api, S.RESOURCE_EXHAUSTED, lambda: append(stub, [1], [1000]), f"free {free}", "needed 250")
    expect(api, S.RESOURCE_EXHAUSTED, lambda: create(stub, 3, [], 1000), f"free {free}", "needed 250")
    # malformed
    expect(api, S.INVALID_ARGUMENT, lambda: create(stub, 3, [], -1))
    expect(api, S.INVALID_ARGUMENT, lambda: create(stub, -1))
    expect(api, S.INVALID_ARGUMENT, lambda: create(stub, 2 ** 62))                 # scheduler's id range
    expect(api, S.INVALID_ARGUMENT, lambda: stub.CreateSequence(
        pb.CreateSequenceRequest(sequence_id=3, prompt_token_ids=b"\x01\x02\x03")))
    expect(api, S.INVALID_ARGUMENT, lambda: append(stub, [1], [-1]))
    # a negative token id: nothing here fills it in, the cache would hash a stale slot under it
    expect(api, S.INVALID_ARGUMENT, lambda: append(stub, [1], None, [-1]), "token ids must be >= 0")
    expect(api, S.INVALID_ARGUMENT, lambda: append(stub, [1, 2], [2, 1], [7, -3, 8]), "token_ids[1] = -3")
    expect(api, S.INVALID_ARGUMENT, lambda: create(stub, 3, [5, -1, 6], 3), "prompt_token_ids[1] = -1")
    expect(api, S.INVALID_ARGUMENT, lambda: append(stub, [1, 2], [1]))            # counts for 1 of 2
    expect(api, S.INVALID_ARGUMENT, lambda: append(stub, [1, 2], [1, 1], [5]))     # token count
    expect(api, S.INVALID_ARGUMENT, lambda: append(stub, [1, 1]))                  # duplicate in batch
    expect(api, S.INVALID_ARGUMENT, lambda: append(stub, []))                      # empty batch
    expect(api, S.INVALID_ARGUMENT, lambda: tables(stub, []))
    expect(api, S.INVALID_ARGUMENT, lambda: stub.AppendTokens(
        pb.AppendTokensRequest(sequence_ids=b"\x00" * 7)))                        # not int64s
    expect(api, S.INVALID_ARGUMENT, lambda: stub.GetBlockTables(
        pb.GetBlockTablesRequest(sequence_ids=b"\x00" * 12)))
    expect(api, S.INVALID_ARGUMENT, lambda: stub.ForkSequence(pb.ForkSequenceRequest(parent_id=1, child_id=-5)))
    # duplicates
    expect(api, S.ALREADY_EXISTS, lambda: create(stub, 1))
    expect(api, S.ALREADY_EXISTS, lambda: stub.ForkSequence(pb.ForkSequenceRequest(parent_id=1, child_id=2)))
    # double release
    stub.ReleaseSequence(pb.ReleaseSequenceRequest(sequence_id=2))
    msg = expect(api, S.NOT_FOUND, lambda: stub.ReleaseSequence(pb.ReleaseSequenceRequest(sequence_id=2)))
    assert "already released" in msg


def test_create_with_failing_append_creates_nothing(svc):
    api, stub = svc
    create(stub, 1, list(range(9)), 9)
    stub.ReleaseSequence(pb.ReleaseSequenceRequest(sequence_id=1))   # its 2 full blocks stay cached
    expect(api, grpc.StatusCode.RESOURCE_EXHAUSTED, lambda: create(stub, 2, list(range(9)), 4 * NUM_BLOCKS))
    assert 2 not in api.manager.sequences
    assert create(stub, 2, list(range(9)), 1).num_cached_tokens == 8


def test_concurrent_clients(svc):
    api, stub = svc
    errors = []

    def client(t):
        rnd = random.Random(t)
        try:
            for i in range(6):
                ids = [t * 100 + i * 2, t * 100 + i * 2 + 1]
                prompt = [rnd.randrange(3) for _ in range(rnd.randrange(1, 9))]
                for sid in list(ids):
                    try:
                        create(stub, sid, prompt, len(prompt))
                    except grpc.RpcError as e:                  # a busy pool is a legal answer
                        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                        ids.remove(sid)
                for _ in range(3):
                    if ids:
                        try:
                            append(stub, ids, toks=[rnd.randrange(3) for _ in ids])
                        except grpc.RpcError as e:
                            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                if ids:
                    _, lens = tables(stub, ids)
                    assert (lens > 0).all()
                for sid in ids:
                    stub.ReleaseSequence(pb.ReleaseSequenceRequest(sequence_id=sid))
        except Exception as e:  # surface in the main thread
            errors.append(e)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(32)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:3]
    m = api.manager
    assert m.num_free_blocks == NUM_BLOCKS and m.stats()["live_sequences"] == 0
    assert m.stats()["used_blocks"] == 0 and m.invariants_ok()
    assert m.stats()["prefix_cache_hits"] > 0


def test_stats_count_block_api_sequences_once_and_its_counters_for_good():
    """Before any chain, Stats shows the block API's pool; its sequences count once, and its
    prefix-cache counts stay in the counters after a chain's pool replaces it (a counter never goes
    down)."""
    from types import SimpleNamespace

    from metadata_service.api import MetadataServicer
    from metadata_service.engine import Engine
    engine = Engine(block_size=4, default_num_blocks=64)
    servicer = MetadataServicer.__new__(MetadataServicer)          # only what Stats reads
    servicer.engine, servicer.block_api = engine, BlockApi(engine.default_manager, threading.Lock())
    servicer.max_waiting = 4096
    for sid in (1, 2):
        engine.default_manager.create_and_append(sid, np.arange(1, 10, dtype=np.int32), 9)
    st = servicer.Stats(None, None)
    assert st.live_sequences == 2 and (st.prefix_cache_queries, st.prefix_cache_hits) == (4, 2)
    for sid in (1, 2):
        engine.default_manager.release_sequence(sid)
    chain = SimpleNamespace(manager=KVBlockManager(32, 4))         # a chain's pool of another size
    servicer._size_block_api_pool(chain)
    assert engine.default_manager is servicer.block_api.manager and engine.default_manager.num_physical_blocks == 32
    st = servicer.Stats(None, None)
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (4, 2)
