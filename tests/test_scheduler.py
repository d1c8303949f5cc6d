"""Scheduler policy in process: token budget, chunked prefill, mixed steps, preemption order,
prefix reuse, and that every step's arrays agree with the block manager (what a worker validates),
with block tables sent as deltas and rebuilt by the worker's own SequenceStore."""
from __future__ import annotations

import numpy as np

from metadata_service.block_manager import KVBlockManager
from metadata_service.scheduler import Scheduler
from metadata_service.sequence import SamplingParams, Sequence, SeqStatus
from worker.step_state import SequenceStore

WORKER = {}  # scheduler -> the SequenceStore a worker would keep for it


def make(num_blocks=64, block_size=4, budget=16, max_seqs=8, **kw):
    m = KVBlockManager(num_blocks, block_size)
    sch = Scheduler(m, budget, max_seqs, **kw)
    WORKER[id(sch)] = SequenceStore()
    return m, sch


def worker_tables(sch, b):
    """What the worker rebuilds from the step's delta (and what it forgets first)."""
    store = WORKER[id(sch)]
    store.release(sch.released)
    sch.released = []
    ids = [s.seq_id for s in b.seqs]
    if b.block_tables is not None:
        return b.block_tables
    tables = store.preview_tables(ids, b.table_base, b.new_block_counts, b.new_blocks)
    store.commit_tables(ids, tables, b.table_base, b.new_block_counts)
    return tables


def seq(n_prompt, max_new=4, start=1):
    return Sequence(list(range(start, start + n_prompt)), SamplingParams(max_new_tokens=max_new))


def check_batch(m: KVBlockManager, b):
    """The invariants a worker's Step validation enforces, checked on the scheduler's output."""
    qlen = np.diff(b.query_start_loc)
    assert (qlen >= 1).all() and b.query_start_loc[-1] == b.input_ids.size == b.positions.size
    tables = worker_tables(sch_of(m), b)
    truth = m.get_block_table_tensor([s.seq_id for s in b.seqs])
    for i, s in enumerate(b.seqs):
        n = int(m.sequences[s.seq_id].sequence_length + m.block_size - 1) // m.block_size
        assert tables[i, :n].tolist() == truth[i, :n].tolist()
        lo, hi = b.query_start_loc[i], b.query_start_loc[i + 1]
        assert list(b.positions[lo:hi]) == list(range(b.seq_lens[i] - qlen[i], b.seq_lens[i]))
        want = s.all_token_ids[b.seq_lens[i] - qlen[i]:b.seq_lens[i]]
        got = list(b.input_ids[lo:hi])
        if got[-1] == -1:  # async scheduling: the token still being sampled
            assert s in b.deferred and len(want) == len(got) - 1
            got = got[:-1]
        assert got == want
        for pos, slot in zip(b.positions[lo:hi], b.slot_mapping[lo:hi]):
            blk = tables[i, pos // m.block_size]
            assert slot == blk * m.block_size + pos % m.block_size
    assert m.invariants_ok()


SCHEDULERS = {}


def sch_of(m):
    return SCHEDULERS[id(m)]


def run_step(m, sch, token=7):
    """Schedule one step and feed back a token for every sampled sequence; finish at max_new_tokens."""
    SCHEDULERS[id(m)] = sch
    b = sch.schedule()
    if b is None:
        return None
    check_batch(m, b)
    apply(sch, b, token)
    return b


def apply(sch, b, token=7):
    sch.step_done(b)
    for s, g, d in zip(b.seqs, b.gens, b.do_sample):
        if d and s.gen == g and s.status is not SeqStatus.FINISHED:
            s.output_token_ids.append(token)   # as the chain applies a sampled token
            s.num_tokens += 1
            if s.deferred:
                sch.manager.fill_tokens([s.seq_id], [token])
                s.deferred = False
            if len(s.output_token_ids) >= s.params.max_new_tokens:
                sch.remove(s)


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


def test_async_scheduling_reads_the_pending_token_and_drops_at_most_one():
    """Step k+1 is scheduled before step k's tokens exist: its decodes read input -1. A step that
    samples a sequence's last token (max_new) has no step after it: that token is never fed back,
    and admission counts no K/V slot for it."""
    m, sch = make(budget=64, overlap=True)
    SCHEDULERS[id(m)] = sch
    a, b = seq(5, max_new=3), seq(9, max_new=6, start=30)
    sch.add(a)
    sch.add(b)
    k = sch.schedule()                    # both prefills, each samples
    check_batch(m, k)
    k1 = sch.schedule()                   # scheduled before k is applied: two placeholders
    check_batch(m, k1)
    assert k1.input_ids.tolist() == [-1, -1] and set(k1.deferred) == {a, b}
    assert sch.schedule() is None         # at most one token in flight unseen per sequence
    apply(sch, k, token=11)
    inflight = [k1]
    while inflight or sch.has_work():
        nxt = sch.schedule()
        if nxt is not None:
            check_batch(m, nxt)
            assert all(s.num_tokens - s.num_prompt_tokens < s.params.max_new_tokens for s in nxt.seqs)
            inflight.append(nxt)
        assert inflight, "work left, but nothing in flight and nothing scheduled"
        apply(sch, inflight.pop(0), token=11)
    assert len(a.output_token_ids) == 3 and len(b.output_token_ids) == 6
    assert m.num_free_blocks == m.num_physical_blocks and m.invariants_ok()


def test_micro_batches_are_disjoint():
    m, sch = make(budget=64, micro_batches=3)
    SCHEDULERS[id(m)] = sch
    seqs = [seq(6, max_new=5, start=10 * i) for i in range(7)]
    for s in seqs:
        sch.add(s)
    inflight = []
    for slot in range(3):
        b = sch.schedule(slot)
        check_batch(m, b)
        inflight.append(b)
    members = [set(map(id, b.seqs)) for b in inflight]
    assert not (members[0] & members[1]) and not (members[1] & members[2]) and not (members[0] & members[2])
    assert sum(len(b.seqs) for b in inflight) == 7
    while inflight:                        # round-robin: each slot's next step after its reply
        b = inflight.pop(0)
        apply(sch, b)
        nxt = sch.schedule(b.slot)
        if nxt is not None:
            assert not any(s.inflight > 1 for s in nxt.seqs)
            check_batch(m, nxt)
            inflight.append(nxt)
    assert all(len(s.output_token_ids) == 5 for s in seqs)
    assert m.num_free_blocks == m.num_physical_blocks and m.invariants_ok()


def test_delta_tables_do_not_grow_with_context():
    """A decode step sends only new blocks: the same few bytes at 2k and at 32k tokens of context."""
    sizes = {}
    for ctx in (2048, 32768):
        m, sch = make(num_blocks=64 * ctx // 16 + 64, block_size=16, budget=1 << 16, max_seqs=64)
        SCHEDULERS[id(m)] = sch
        seqs = [seq(ctx, max_new=40, start=1) for _ in range(4)]
        for s in seqs:
            sch.add(s)
        while any(s.num_computed_tokens < ctx for s in seqs):
            run_step(m, sch)
        decode = [run_step(m, sch) for _ in range(32)]
        sizes[ctx] = sum(b.new_blocks.nbytes + b.table_base.nbytes + b.new_block_counts.nbytes for b in decode)
    assert sizes[2048] == sizes[32768]


def test_sequences_that_wait_for_their_token_are_staggered_over_the_two_steps_in_flight():
    """Grammar-constrained sequences never decode on a placeholder (their bitmask needs the token);
    when they would all wait for one reply, half go now and half in the step right after, so the
    overlap holds. Penalized ones run ahead like any other (the last stage completes their history)."""
    m, sch = make(budget=64, overlap=True)
    SCHEDULERS[id(m)] = sch
    seqs = [Sequence(list(range(1 + 10 * i, 6 + 10 * i)), SamplingParams(max_new_tokens=6, grammar=object()))
            for i in range(4)]
    free = seq(4, max_new=6, start=60)
    penalized = Sequence(list(range(70, 75)), SamplingParams(max_new_tokens=6, repetition_penalty=1.3))
    for s in seqs + [free, penalized]:
        sch.add(s)
    k = sch.schedule()                            # every prefill, each samples
    check_batch(m, k)
    ahead = sch.schedule()
    check_batch(m, ahead)
    assert ahead.seqs == [free, penalized]        # only the unconstrained ones run ahead on -1
    free = [free, penalized]
    apply(sch, k)
    a = sch.schedule()                            # none of theirs in flight: half of them go now
    check_batch(m, a)
    assert [s for s in a.seqs if s not in free] == seqs[:2]
    apply(sch, ahead)
    b = sch.schedule()                            # ... and the other half in the very next step
    check_batch(m, b)
    assert [s for s in b.seqs if s not in free] == seqs[2:]
    halves = [set(seqs[:2]), set(seqs[2:])]
    inflight = [a, b]
    while inflight:                               # from then on each half keeps to its own steps
        apply(sch, inflight.pop(0))
        nxt = sch.schedule()
        if nxt is not None:
            check_batch(m, nxt)
            mine = set(nxt.seqs) - set(free)
            assert mine <= halves[0] or mine <= halves[1]
            inflight.append(nxt)
    assert all(len(s.output_token_ids) == 6 for s in seqs)


def test_a_short_micro_batch_preempts_the_newest_sequence_of_any_micro_batch():
    # Two micro-batches, one sequence each, a pool that holds only one of them to the end. The
    # newest is preempted whichever micro-batch runs short (first come, first served): a victim
    # chosen within the short micro-batch would preempt the oldest, and two micro-batches would
    # take turns preempting each other's work. An empty micro-batch preempts nothing.
    m, sch = make(num_blocks=6, block_size=4, budget=64, max_seqs=4, micro_batches=2)
    SCHEDULERS[id(m)] = sch
    old, new = seq(7, max_new=14, start=1), seq(7, max_new=14, start=40)
    sch.add(old)
    sch.add(new)
    inflight, steps = [], 0
    while sch.has_work():
        for slot in (0, 1):                    # each micro-batch with nothing in flight sends a step
            if not any(x.slot == slot for x in inflight) and (nxt := sch.schedule(slot)) is not None:
                check_batch(m, nxt)            # the worker takes it (and its releases) as it is sent
                inflight.append(nxt)
        if steps == 0:
            assert {s.slot for b in inflight for s in b.seqs} == {0, 1}
        steps += 1
        assert steps < 200 and inflight, "no progress"
        apply(sch, inflight.pop(0))
    assert old.preemptions == 0 and 1 <= new.preemptions <= 2
    assert len(old.output_token_ids) == len(new.output_token_ids) == 14
    assert m.num_free_blocks == 6 and m.invariants_ok()


def test_a_preempted_forks_pending_copy_is_dropped_with_its_blocks():
    """A beam fork queues a copy-on-write into the child's fresh block; if the group is preempted
    in the same reply (a later fork found no block), that block goes back and may be a copy's
    destination again before the next step: the stale copy must go with it (found by probing:
    24 concurrent beam searches on 48 blocks sent a step with one destination twice)."""
    m, sch = make(num_blocks=16, block_size=4, budget=64, max_seqs=4)
    p = seq(6, max_new=8)
    sch.add(p)
    run_step(m, sch)                              # 6 prompt tokens: the last block is partial
    c = Sequence(p.prompt_token_ids, p.params)
    c.output_token_ids, c.num_tokens = list(p.output_token_ids), p.num_tokens
    sch.copies += m.fork(p.seq_id, c.seq_id)
    [(src, dst)] = sch.copies
    c.num_computed_tokens = p.num_computed_tokens
    sch._admit_running(c, p.slot)
    sch.preempt_beams([c])
    assert sch.copies == [] and dst in m.pool.free_blocks() and m.invariants_ok()
