"""Scheduler policy in process: token budget, chunked prefill, mixed steps, preemption order,
prefix reuse, and that every step's arrays agree with the block manager (what a worker validates)."""
from __future__ import annotations

import numpy as np

from metadata_service.block_manager import KVBlockManager
from metadata_service.scheduler import Scheduler
from metadata_service.sequence import SamplingParams, Sequence, SeqStatus


def make(num_blocks=64, block_size=4, budget=16, max_seqs=8):
    m = KVBlockManager(num_blocks, block_size)
    return m, Scheduler(m, budget, max_seqs)


def seq(n_prompt, max_new=4, start=1):
    return Sequence(list(range(start, start + n_prompt)), SamplingParams(max_new_tokens=max_new))


def check_batch(m: KVBlockManager, b):
    """The invariants a worker's Step validation enforces, checked on the scheduler's output."""
    qlen = np.diff(b.query_start_loc)
    assert (qlen >= 1).all() and b.query_start_loc[-1] == b.input_ids.size == b.positions.size
    for i, s in enumerate(b.seqs):
        lo, hi = b.query_start_loc[i], b.query_start_loc[i + 1]
        assert list(b.positions[lo:hi]) == list(range(b.seq_lens[i] - qlen[i], b.seq_lens[i]))
        assert list(b.input_ids[lo:hi]) == s.all_token_ids[b.seq_lens[i] - qlen[i]:b.seq_lens[i]]
        for pos, slot in zip(b.positions[lo:hi], b.slot_mapping[lo:hi]):
            blk = b.block_tables[i, pos // m.block_size]
            assert slot == blk * m.block_size + pos % m.block_size
    assert m.invariants_ok()


def run_step(m, sch, token=7):
    """Schedule one step and feed back a token for every sampled sequence; finish at max_new_tokens."""
    b = sch.schedule()
    if b is None:
        return None
    check_batch(m, b)
    for s, d in zip(b.seqs, b.do_sample):
        if d:
            s.append_output(token)
            if len(s.output_token_ids) >= s.params.max_new_tokens:
                sch.remove(s)
    return b


def test_chunked_prefill_respects_the_budget_and_mixes_with_decodes():
    m, sch = make(budget=8)
    a, b = seq(3), seq(20, start=50)
    sch.add(a)
    run_step(m, sch)                              # a: whole 3-token prompt, samples its first token
    sch.add(b)
    step = run_step(m, sch)
    assert [s is a for s in step.seqs] == [True, False]
    assert step.num_tokens == 8                   # 1 decode + a 7-token chunk of b
    assert list(step.do_sample) == [1, 0]         # b is mid-prefill: nothing sampled yet
    while b.num_computed_tokens < 20:
        step = run_step(m, sch)
        assert step.num_tokens <= 8
    assert b.output_token_ids                     # the last chunk sampled


def test_prefix_cache_skips_shared_full_blocks():
    m, sch = make(block_size=4)
    first = seq(13, max_new=1)
    sch.add(first)
    while run_step(m, sch):
        pass
    again = seq(13, max_new=1)                    # same prompt: 3 full blocks cached, 1 token left
    sch.add(again)
    step = run_step(m, sch)
    assert again.num_cached_tokens == 12 and step.num_tokens == 1


def test_preemption_takes_the_most_recently_admitted_and_recomputes():
    m, sch = make(num_blocks=6, block_size=4, budget=64, max_seqs=4)
    old, new = seq(7, max_new=12, start=1), seq(7, max_new=12, start=40)
    sch.add(old)
    sch.add(new)
    run_step(m, sch)
    while old.status is not SeqStatus.FINISHED:
        assert run_step(m, sch) is not None
    assert new.preemptions >= 1 and old.preemptions == 0
    while new.status is not SeqStatus.FINISHED:
        assert run_step(m, sch) is not None
    assert len(new.output_token_ids) == 12
    assert m.num_free_blocks == 6 and m.invariants_ok()


def test_requeue_all_frees_every_block_and_keeps_outputs():
    m, sch = make()
    seqs = [seq(5, max_new=8, start=10 * i) for i in range(3)]
    for s in seqs:
        sch.add(s)
    for _ in range(3):
        run_step(m, sch)
    outs = [list(s.output_token_ids) for s in seqs]
    sch.requeue_all()
    assert m.num_free_blocks == m.num_physical_blocks and not sch.running
    assert [s.num_computed_tokens for s in seqs] == [0, 0, 0]
    assert [list(s.output_token_ids) for s in seqs] == outs
    while any(s.status is not SeqStatus.FINISHED for s in seqs):  # recompute prompt + outputs, go on
        assert run_step(m, sch).num_tokens <= 16
    assert [s.output_token_ids[:3] for s in seqs] == outs and all(len(s.output_token_ids) == 8 for s in seqs)
    assert m.num_free_blocks == m.num_physical_blocks and m.invariants_ok()
