"""The metadata plane's side of a prefill -> decode move (metadata_service/kv_moves.py), alone: a move
whose reply does not come back within --step-timeout plus the workers' read timeout fails the decode
chain (its stages might still write the reserved blocks, so they cannot go to anyone else)."""
from __future__ import annotations

import time
from types import SimpleNamespace

from metadata_service.kv_moves import KvMoves, Move
from minipaged.constants import KV_MOVE_TIMEOUT_S


class _Chain(KvMoves):
    def __init__(self, step_timeout_s: float):
        self.cfg = SimpleNamespace(step_timeout_s=step_timeout_s)
        self.moving, self.last_move_at, self.missed_deadline, self.lost = {}, 0.0, False, None

    def _lose(self, why: str) -> None:
        self.lost = why


def _move(age_s: float) -> Move:
    return Move(seq=None, src=None, src_blocks=[1, 2], sent_at=time.monotonic() - age_s)


def test_a_move_within_its_deadline_is_left_alone():
    c = _Chain(8.0)
    c.moving[5] = _move(8.0 + KV_MOVE_TIMEOUT_S - 5)
    c._check_move_deadline()
    assert c.lost is None and not c.missed_deadline


def test_a_move_past_its_deadline_fails_the_chain():
    c = _Chain(8.0)
    c.moving[5] = _move(8.0 + KV_MOVE_TIMEOUT_S + 1)
    c.moving[6] = _move(0.0)
    c._check_move_deadline()
    assert c.missed_deadline and "K/V move step 5" in c.lost


def test_the_last_move_reply_restarts_the_clock():
    # a stage pulls one move at a time: the second waits behind the first, not on a hung device
    c = _Chain(8.0)
    c.moving[6] = _move(8.0 + KV_MOVE_TIMEOUT_S + 1)
    c.last_move_at = time.monotonic() - 1.0
    c._check_move_deadline()
    assert c.lost is None


def test_a_request_larger_than_every_decode_pool_decodes_where_it_prefilled():
    """Moved only to a decode chain whose pool can hold it: one that never could would keep it
    waiting for room forever (found by probing: a 36-token prompt + 6 new over a 10-block pool)."""
    from metadata_service.sequence_routing import SequenceRouting

    def chain(cid, role, blocks):
        stage = SimpleNamespace(info=SimpleNamespace(layer_start=0, layer_end=3, data_port=9000 + cid),
                                address=f"127.0.0.1:{8000 + cid}")
        return SimpleNamespace(chain_id=cid, alive=True, role=role, stages=[stage],
                               manager=SimpleNamespace(pool=SimpleNamespace(num_blocks=blocks)))
    src, small, big = chain(1, "prefill", 64), chain(2, "decode", 10), chain(3, "decode", 40)
    engine = SimpleNamespace(chains={1: src, 2: small})
    assert SequenceRouting.decode_chains_for(engine, src, 10) == [small]
    assert SequenceRouting.decode_chains_for(engine, src, 11) == []      # stays on the prefill chain
    engine.chains[3] = big
    assert SequenceRouting.decode_chains_for(engine, src, 11) == [big]


def test_decode_chains_of_another_layer_split_are_named_in_the_log_once(caplog):
    """A move pairs stages of equal layer ranges: decode chains split otherwise never take a request.
    Nothing fails, so the service says it (once per prefill chain) rather than stay silent."""
    from metadata_service.sequence_routing import SequenceRouting

    def chain(cid, role, splits):
        stages = [SimpleNamespace(info=SimpleNamespace(layer_start=a, layer_end=b, data_port=9000 + cid),
                                  address=f"127.0.0.1:{8000 + cid}") for a, b in splits]
        return SimpleNamespace(chain_id=cid, alive=True, role=role, stages=stages,
                               manager=SimpleNamespace(pool=SimpleNamespace(num_blocks=64)))

    class Engine(SequenceRouting):
        pass
    engine = Engine()
    engine.chains = {1: chain(1, "prefill", [(0, 4)]), 2: chain(2, "decode", [(0, 2), (2, 4)])}
    with caplog.at_level("WARNING", logger="metadata_service.engine"):
        assert engine.decode_chains_for(engine.chains[1]) == []
        assert engine.decode_chains_for(engine.chains[1]) == []
    [record] = [r for r in caplog.records if "decode where they prefilled" in r.getMessage()]
    assert "layer split [(0, 4)]" in record.getMessage() and "(2, 4)" in record.getMessage()
