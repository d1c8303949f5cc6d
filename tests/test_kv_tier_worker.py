"""A worker's second KV tier (worker/paged_cache.py, worker/validate_cache.py): InitCache sizes it
within --kv-tier-bytes, a Step's saves and loads move K/V exactly (pool block -> slot -> another
block), and a hostile move is INVALID_ARGUMENT with the cache and the tier untouched."""
from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from minipaged import wire
from minipaged.v1 import worker_pb2 as pb
from tests.test_worker_service import BS, NB, PROMPTS, TABLES, Stage, arrays, code_of, step_request

SLOTS = 8


class TierStage(Stage):
    def __init__(self):
        super().__init__()
        per_block = self.runner.kv_bytes_per_block(BS)
        self.servicer.kv_tier_bytes = SLOTS * per_block + per_block // 2   # room for 8 slots, not 9

    def init(self, tier_blocks=SLOTS):
        return self.call("InitCache", pb.InitCacheRequest(num_blocks=NB, block_size=BS,
                                                          tier_blocks=tier_blocks)).cache_epoch

    def tier_checksum(self):
        kc = self.runner.kv_cache
        return sum(float(t.double().abs().sum()) for t in (*kc.tier_key, *kc.tier_value))


@pytest.fixture(scope="module")
def stage():
    s = TierStage()
    yield s
    s.close()


def moves(save=(), load=()):
    """StepRequest fields of tier saves [(block, slot)] and loads [(slot, block)]."""
    sb, ss = ([p[0] for p in save], [p[1] for p in save])
    ls, lb = ([p[0] for p in load], [p[1] for p in load])
    return dict(tier_save_blocks=wire.pack(np.array(sb, np.int32), wire.INT32),
                tier_save_slots=wire.pack(np.array(ss, np.int32), wire.INT32),
                tier_load_slots=wire.pack(np.array(ls, np.int32), wire.INT32),
                tier_load_blocks=wire.pack(np.array(lb, np.int32), wire.INT32))


def test_info_offers_the_tier_and_init_cache_keeps_it_within_its_bytes(stage):
    assert stage.call("Info", pb.InfoRequest()).kv_tier_bytes == stage.servicer.kv_tier_bytes
    code, msg = code_of(lambda: stage.init(SLOTS + 1))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "tier_blocks 9" in msg, msg
    stage.init()
    assert stage.runner.kv_cache.tier_slots == SLOTS


def test_saves_and_loads_move_kv_exactly(stage):
    epoch = stage.init()
    stage.call("Step", step_request(arrays(PROMPTS, [0, 0, 0], TABLES), epoch))
    kc = stage.runner.kv_cache
    want = [c[[0, 1, 9]].clone() for c in (*kc.key_cache, *kc.value_cache)]
    # step 2: save blocks 0, 1, 9 into slots 5, 0, 7 (a step with one new sequence to compute)
    a = arrays([[3, 4]], [0], [[20]])
    stage.call("Step", step_request(a, epoch, step_id=2, **moves(save=[(0, 5), (1, 0), (9, 7)])))
    # step 3: load them into blocks 30, 31, 32 before computing
    stage.call("Step", step_request(arrays([[5]], [0], [[21]]), epoch, step_id=3,
                                    **moves(load=[(5, 30), (0, 31), (7, 32)])))
    got = [c[[30, 31, 32]] for c in (*kc.key_cache, *kc.value_cache)]
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    assert float(want[0].abs().sum()) > 0


_HOSTILE = {
    "save_slot_out_of_range": dict(save=[(0, SLOTS)]),
    "load_slot_negative": dict(load=[(-1, 30)]),
    "save_block_out_of_range": dict(save=[(NB, 0)]),
    "load_block_out_of_range": dict(load=[(0, NB)]),
    "slot_saved_twice": dict(save=[(0, 1), (1, 1)]),
    "block_loaded_twice": dict(load=[(0, 30), (1, 30)]),
}


@pytest.mark.parametrize("name", [*_HOSTILE, "counts_differ", "no_tier"])
def test_hostile_tier_moves_are_rejected_untouched(stage, name):
    epoch = stage.init(0 if name == "no_tier" else SLOTS)
    stage.call("Step", step_request(arrays(PROMPTS, [0, 0, 0], TABLES), epoch))
    if name != "no_tier":
        stage.call("Step", step_request(arrays([[3]], [0], [[20]]), epoch, step_id=2,
                                        **moves(save=[(0, 2), (9, 3)])))
    before, tier_before = stage.checksum(), (stage.tier_checksum() if name != "no_tier" else 0.0)
    if name == "counts_differ":
        over = moves(save=[(0, 1), (1, 2)])
        over["tier_save_slots"] = wire.pack(np.array([1], np.int32), wire.INT32)
    elif name == "no_tier":
        over = moves(save=[(0, 0)])
    else:
        over = moves(**_HOSTILE[name])
    a = arrays([[(x + 17) % 500 for x in p] for p in PROMPTS], [0] * 3, TABLES)
    code, msg = code_of(lambda: stage.call("Step", step_request(a, epoch, step_id=3, **over)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, msg
    assert stage.checksum() == before
    if name != "no_tier":
        assert stage.tier_checksum() == tier_before

