"""The one step protocol over real gRPC, two in-process stages of the tiny Qwen3 (layers 0:2 and 2:4):
Steps go down the StepStream, the last stage's replies come back on StepResults, and a step sent
before its predecessor's tokens are known (input -1, `first_gets_tokens`) is embedded on stage 0
with the tokens the last stage sent it on SampledTokenStream. Errors come back up the StepStream;
one for a first_gets_tokens step tells stage 0 that no token is coming."""
from __future__ import annotations

import queue

import grpc
import numpy as np
import pytest

from minipaged import wire
from minipaged.v1 import worker_pb2 as pb
from tests.test_worker_service import BS, NB, PROMPTS, TABLES, Stage, arrays, prefill_then_decode, step_request

SEQ_IDS = np.array([10, 11, 12], dtype=np.int64)


def init_chain(first: Stage, last: Stage, last_blocks: int = NB) -> int:
    epoch = 7_000_001
    last.call("InitCache", pb.InitCacheRequest(num_blocks=last_blocks, block_size=BS, cache_epoch=epoch,
                                               first_stage_address=first.address))
    first.call("InitCache", pb.InitCacheRequest(num_blocks=NB, block_size=BS, cache_epoch=epoch,
                                                next_stage_address=last.address))
    return epoch


def open_streams(first: Stage, last: Stage, epoch: int):
    """(send, results, errors): a StepStream into stage 0 and the last stage's StepResults."""
    results = last.raw.StepResults(pb.StepResultsRequest(cache_epoch=epoch), timeout=60)
    assert next(results).step_id == 0                      # subscribed
    requests: queue.SimpleQueue = queue.SimpleQueue()
    errors = first.raw.StepStream(iter(requests.get, None), timeout=60)
    return requests.put, results, errors


def two_steps(epoch: int) -> tuple[pb.StepRequest, pb.StepRequest]:
    """A prefill of the three prompts, and their first decode with input -1: sent back to back."""
    ids = wire.pack(SEQ_IDS, wire.INT64)
    s1 = step_request(arrays(PROMPTS, [0, 0, 0], TABLES), epoch, step_id=1, sequence_ids=ids,
                      first_gets_tokens=True)
    s2 = step_request(arrays([[-1]] * 3, [len(p) for p in PROMPTS], TABLES), epoch, step_id=2, sequence_ids=ids)
    return s1, s2


@pytest.fixture()
def stages():
    first, last = Stage((0, 2)), Stage((2, 4), num_blocks=NB)
    yield first, last
    first.close()
    last.close()


def test_a_pipeline_embeds_the_tokens_the_last_stage_sent_it(stages):
    whole = Stage()
    want = [wire.unpack(r.sampled_token_ids).tolist() for r in prefill_then_decode(whole.call, whole.init())]
    whole.close()
    first, last = stages
    epoch = init_chain(first, last)
    send, results, errors = open_streams(first, last, epoch)
    for s in two_steps(epoch):
        send(s)                                    # the second before the first's tokens exist
    got = [next(results), next(results)]
    send(None)
    assert [r.step_id for r in got] == [1, 2]
    assert [r.error_code for r in got] == [0, 0]
    assert [wire.unpack(r.sampled_token_ids).tolist() for r in got] == want
    assert [len(r.timings) for r in got] == [2, 2]       # every stage's timing, in the one reply
    assert list(errors) == []                            # nothing else came back up the StepStream
    results.cancel()


def test_an_error_below_stage_0_says_the_tokens_are_not_coming(stages):
    """The last stage holds 8 blocks: the prefill's block 9 is out of its range, so it fails there;
    the decode queued behind it on stage 0 (input -1) fails FAILED_PRECONDITION at once instead of
    waiting for tokens that never come."""
    first, last = stages
    epoch = init_chain(first, last, last_blocks=8)
    send, results, errors = open_streams(first, last, epoch)
    for s in two_steps(epoch):
        send(s)
    got = {r.step_id: r for r in (next(errors), next(errors))}
    send(None)
    assert got[1].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0], got[1].error
    assert "slot" in got[1].error or "block" in got[1].error
    assert got[2].error_code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    # not "did not come back within 30s": stage 0 knew at once
    assert "the step that was to sample it failed" in got[2].error
    results.cancel()
