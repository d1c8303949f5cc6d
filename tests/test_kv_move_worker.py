"""Prefill -> decode K/V moves on the data plane (worker/kv_move.py): a Step with no rows makes a
stage read blocks from the source stage of its layer range over that stage's data link, exactly;
a source that is gone, restarted or refuses is UNAVAILABLE, and a hostile move INVALID_ARGUMENT,
both with the reading stage's cache untouched. On a step stream a move's read runs beside the
steps sent after it."""
from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
import torch

from minipaged import wire
from minipaged.v1 import worker_pb2 as pb
from tests.test_worker_service import NB, PROMPTS, TABLES, Stage, arrays, code_of, step_request
from worker.data_link import DataServer
from worker.step_stream import StepPipe


@pytest.fixture(scope="module")
def pair():
    src, dst = Stage(), Stage()
    src.servicer.data_server = DataServer(src.servicer, "127.0.0.1", 0, "")
    src.epoch = src.init()
    src.call("Step", step_request(arrays(PROMPTS, [0, 0, 0], TABLES), src.epoch))   # fills blocks 0, 1, 9, ...
    yield src, dst
    src.close()
    dst.close()


def move(src, dst_epoch, pairs, layers=(0, 4), epoch=None, step_id=7, **over) -> pb.StepRequest:
    req = pb.StepRequest(step_id=step_id, cache_epoch=dst_epoch,
                         kv_pull_src_blocks=wire.pack(np.array([p[0] for p in pairs], np.int32), wire.INT32),
                         kv_pull_dst_blocks=wire.pack(np.array([p[1] for p in pairs], np.int32), wire.INT32), **over)
    req.kv_sources.add(layer_start=layers[0], layer_end=layers[1], data_address=f"127.0.0.1:{src.servicer.data_server.port}",
                       cache_epoch=src.epoch if epoch is None else epoch)
    return req


def blocks(stage, ids):
    kc = stage.runner.kv_cache
    return [c[ids].clone() for c in (*kc.key_cache, *kc.value_cache)]


def test_a_move_copies_the_source_blocks_exactly(pair):
    src, dst = pair
    epoch = dst.init()
    reply = dst.call("Step", move(src, epoch, [(0, 30), (1, 31), (9, 32)]))
    assert reply.step_id == 7 and not reply.sampled_token_ids and reply.timings
    for want, got in zip(blocks(src, [0, 1, 9]), blocks(dst, [30, 31, 32])):
        assert torch.equal(want, got)
    assert float(blocks(dst, [30])[0].abs().sum()) > 0


def test_a_source_of_another_epoch_is_unavailable_and_nothing_is_written(pair):
    src, dst = pair
    epoch = dst.init()
    before = dst.checksum()
    code, msg = code_of(lambda: dst.call("Step", move(src, epoch, [(0, 30)], epoch=src.epoch + 1)))
    assert code == grpc.StatusCode.UNAVAILABLE and "K/V move" in msg, msg
    assert dst.checksum() == before


def test_a_source_that_is_not_listening_is_unavailable(pair):
    src, dst = pair
    epoch = dst.init()
    req = move(src, epoch, [(0, 30)])
    req.kv_sources[0].data_address = "127.0.0.1:1"
    code, _ = code_of(lambda: dst.call("Step", req))
    assert code == grpc.StatusCode.UNAVAILABLE


def test_the_source_refuses_blocks_outside_its_cache(pair):
    src, dst = pair
    epoch = dst.init()
    before = dst.checksum()
    code, msg = code_of(lambda: dst.call("Step", move(src, epoch, [(NB, 30)])))
    assert code == grpc.StatusCode.UNAVAILABLE and "out of range" in msg, msg
    assert dst.checksum() == before


_HOSTILE = {
    "dst_out_of_range": dict(pairs=[(0, NB)]),
    "dst_twice": dict(pairs=[(0, 30), (1, 30)]),
    "src_negative": dict(pairs=[(-1, 30)]),
    "no_source_for_my_layers": dict(pairs=[(0, 30)], layers=(0, 2)),
    "rows_beside_a_move": dict(pairs=[(0, 30)], query_start_loc=wire.pack(np.array([0, 1], np.int32), wire.INT32)),
}


@pytest.mark.parametrize("case", sorted(_HOSTILE))
def test_a_hostile_move_is_invalid_and_touches_nothing(pair, case):
    src, dst = pair
    epoch = dst.init()
    before = dst.checksum()
    code, msg = code_of(lambda: dst.call("Step", move(src, epoch, **_HOSTILE[case])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, msg
    assert dst.checksum() == before


def test_a_step_sent_after_a_slow_move_is_answered_first(pair, monkeypatch):
    # the source takes a second to read: the step behind the move in the stream does not wait for it
    src, dst = pair
    epoch = dst.init()
    read = src.runner.kv_cache.read_blocks
    monkeypatch.setattr(src.runner.kv_cache, "read_blocks", lambda ids: (time.sleep(1.0), read(ids))[1])
    results = dst.servicer.subscribe_results()
    steps = [move(src, epoch, [(0, 30), (1, 31), (9, 32)], step_id=7),
             step_request(arrays(PROMPTS, [0, 0, 0], TABLES), epoch, step_id=8)]
    StepPipe(dst.servicer).pump(iter(steps))
    first, second = results.get(timeout=30)[0], results.get(timeout=30)[0]
    assert (first.step_id, second.step_id) == (8, 7)
    assert first.sampled_token_ids and not first.error_code and not second.error_code
    for want, got in zip(blocks(src, [0, 1, 9]), blocks(dst, [30, 31, 32])):
        assert torch.equal(want, got)


def test_a_data_link_peer_that_never_says_hello_is_closed(pair, monkeypatch):
    """Probe K: connections that never sent their hello were kept forever (3,000 held 3,000 threads
    and descriptors); a peer now has HELLO_TIMEOUT_S for it, and the worker goes on serving."""
    import socket
    import worker.data_link as data_link
    monkeypatch.setattr(data_link, "HELLO_TIMEOUT_S", 0.5)
    src, _ = pair
    idle = [socket.create_connection(("127.0.0.1", src.servicer.data_server.port), timeout=30) for _ in range(3)]
    for s in idle:
        assert s.recv(1) == b""          # the worker closed it (a recv past 30 s would raise instead)
        s.close()
    assert src.call("Health", pb.WorkerHealthRequest()).cache_epoch == src.epoch   # serving, its cache as it was
