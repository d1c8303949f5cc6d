"""The batch lookups of the step path (minipaged/id_index.py) and a worker's remembered tables
(worker/step_state.py): vectorized, and the same answers as the per-id dict they index."""
import threading
import time

import numpy as np
import pytest

from metadata_service.block_manager import InvalidArgumentError, KVBlockManager, UnknownSequenceError
from minipaged.id_index import IdIndex, has_duplicates
from worker.step_state import SequenceStore, StepPrecondition


def test_index_agrees_with_its_dict_through_changes():
    rng = np.random.default_rng(0)
    row_of, index = {}, None
    index = IdIndex(row_of)
    for _ in range(50):
        for sid in rng.integers(0, 1 << 62, 5).tolist():
            row_of[sid] = len(row_of)
        for sid in list(row_of)[:2]:
            del row_of[sid]
        index.changed()
        probe = np.array(list(row_of) + rng.integers(0, 1 << 62, 5).tolist(), dtype=np.int64)
        want = np.array([row_of.get(int(s), -1) for s in probe])
        assert (index.lookup(probe) == want).all()
    assert (IdIndex({}).lookup(np.array([1, 2], dtype=np.int64)) == -1).all()
    assert has_duplicates(np.array([3, 1, 3])) and not has_duplicates(np.array([3, 1, 2]))


def test_block_manager_array_ids_take_the_same_checks_as_lists():
    m = KVBlockManager(64, 4)
    for sid in (5, 9):
        m.create_sequence(sid, [1, 2, 3])
    ids = np.array([9, 5], dtype=np.int64)
    before = m.get_seq_lens_tensor([9, 5]).tolist()
    slots = m.slot_mapping_for_append(ids, np.array([7, 8])).tolist()
    assert slots == [m.slot_for_position(9, before[0]), m.slot_for_position(5, before[1])]
    assert m.get_seq_lens_tensor(ids).tolist() == [before[0] + 1, before[1] + 1]
    with pytest.raises(InvalidArgumentError):
        m.slot_mapping_for_append(np.array([5, 5], dtype=np.int64))
    m.release_sequence(9)
    with pytest.raises(UnknownSequenceError):
        m.get_seq_lens_tensor(ids)


def test_store_preview_gathers_extends_and_truncates_rows():
    st = SequenceStore()
    ids = np.array([11, 12], dtype=np.int64)
    t = st.preview_tables(ids, np.zeros(2, np.int32), np.array([2, 3], np.int32), np.arange(5, dtype=np.int32))
    assert t.tolist() == [[0, 1, -1], [2, 3, 4]]
    st.commit_tables(ids, t, np.zeros(2, np.int32), np.array([2, 3], np.int32))
    # row 0 keeps its 2 blocks and gains one, row 1 is cut back to 1 block (a re-formed table) and gains one
    t2 = st.preview_tables(ids, np.array([2, 1], np.int32), np.array([1, 1], np.int32), np.array([7, 8], np.int32))
    assert t2.tolist() == [[0, 1, 7], [2, 8, -1]]
    with pytest.raises(StepPrecondition):
        st.preview_tables(ids, np.array([3, 0], np.int32), np.zeros(2, np.int32), np.zeros(0, np.int32))
    st.release([11])
    assert st.rows(ids, create=False).tolist()[0] == -1
    assert len(set(st.rows(np.array([11, 13, 13], dtype=np.int64), create=True).tolist())) == 2


def _runner(overlap: bool):
    from metadata_service.chain import ChainConfig, ChainRunner
    from metadata_service.scheduler import Scheduler

    class Engine:
        eos_ids = {3}
        finished: list = []

        def finish(self, seq, reason, **kw):
            self.finished.append((seq.seq_id, reason))

        def stream_tokens(self, *a, **k):
            pass

    m = KVBlockManager(512, 4)
    r = ChainRunner.__new__(ChainRunner)
    r.cfg, r.epoch, r.next_step_id, r.wire_bytes, r.tokens_to_first = ChainConfig(), 1, 1, 0, False
    r.engine, r.manager, r.generated_tokens = Engine(), m, 0
    r.engine.finished = []
    r.scheduler = Scheduler(m, 1 << 20, 64, overlap=overlap)
    return r


@pytest.mark.parametrize("overlap", [False, True])
def test_plain_decode_steps_match_the_general_path(overlap):
    """Two identical chains, one applying plain decode steps through apply.apply_plain, the
    other through the general per-sequence path: the same tokens, finishes and sample offsets (the
    steady path derives them from seq_len - prompt length)."""
    from metadata_service.sequence import SamplingParams, Sequence
    from minipaged.v1 import worker_pb2
    from minipaged.wire import pack
    rng = np.random.default_rng(1)
    prompts = [rng.integers(4, 50, int(n)).tolist() for n in rng.integers(1, 12, 24)]
    limits = rng.integers(1, 20, 24).tolist()
    chains = [_runner(overlap), _runner(overlap)]
    for r in chains:
        for i, (p, k) in enumerate(zip(prompts, limits)):
            r.scheduler.add(Sequence(list(p), SamplingParams(max_new_tokens=k, ignore_eos=i % 3 == 0), seq_id=i))
    plain_steps, deferred_rows = 0, 0
    queues = ([], [])
    for _ in range(120):
        for use_plain, r, q in zip((True, False), chains, queues):
            b = r.scheduler.schedule() if r.scheduler.has_work() and len(q) < (2 if overlap else 1) else None
            if b is not None:
                if b.num_tokens == len(b.seqs):   # decodes: offsets are len(output) (+1 when the input is -1)
                    want = [len(s.output_token_ids) + (s in b.deferred) for s in b.seqs]
                    assert b.sample_offsets.tolist() == want
                    deferred_rows += len(b.deferred)
                q.append(b)
            if q and (b is None or len(q) == 2 or not overlap):
                b = q.pop(0)
                toks = np.random.default_rng(b.seq_ids.tolist() + [b.num_tokens]).integers(0, 8, int(b.do_sample.sum()))
                toks = toks.astype(np.int32)                          # EOS is 3
                if use_plain and b.plain:
                    plain_steps += 1
                    r._apply_plain(b, toks)
                else:
                    r.scheduler.step_done(b)
                    r._apply(b, worker_pb2.StepReply(sampled_token_ids=pack(toks)))
    assert not any(queues)
    assert deferred_rows > 0 if overlap else deferred_rows == 0
    assert plain_steps > 5
    a, b = chains
    assert sorted(a.engine.finished) == sorted(b.engine.finished) and len(a.engine.finished) == 24
    assert a.generated_tokens == b.generated_tokens
    assert a.manager.num_free_blocks == b.manager.num_free_blocks


@pytest.mark.parametrize("plain", [True, False])
def test_a_reply_for_a_row_rebound_to_another_sequence_is_ignored(plain):
    """A sequence leaves while its step is in flight and a new one takes its Progress row: the old
    reply must not give the newcomer a token (the row's owner id says whose step it was)."""
    from metadata_service.sequence import SamplingParams, Sequence
    from minipaged.v1 import worker_pb2
    from minipaged.wire import pack
    r = _runner(overlap=False)
    sch = r.scheduler
    old = Sequence([5, 6, 7], SamplingParams(max_new_tokens=8, ignore_eos=True), seq_id=1)
    sch.add(old)
    sch.step_done(first := sch.schedule())                 # the prefill
    r._apply(first, worker_pb2.StepReply(sampled_token_ids=pack([9])))
    b = sch.schedule()                                      # old's decode, in flight
    row = old._row
    sch.remove(old)                                         # it ends meanwhile (an abort)
    new = Sequence([5, 6], SamplingParams(max_new_tokens=8, ignore_eos=True), seq_id=2)
    sch.add(new)
    sch.schedule()                                          # new admitted: it takes the freed row
    assert new._row == row
    before = (list(new.output_token_ids), new.num_tokens, new.inflight)
    if plain:
        assert b.plain
        r._apply_plain(b, np.array([4], dtype=np.int32))
    else:
        sch.step_done(b)
        r._apply(b, worker_pb2.StepReply(sampled_token_ids=pack([4])))
    assert (list(new.output_token_ids), new.num_tokens, new.inflight) == before
    assert old.output_token_ids == [9] and r.generated_tokens == 1


def test_a_token_of_a_released_run_never_lands_on_the_sequence_that_came_back():
    # Stage 0 forwarded a step sampling sequence 5; the sequence was preempted (released) and came
    # back under the same id with a new step in flight before the old step's token arrived. The
    # old token belongs to the old run: it must neither become the input -1 of the new run nor
    # count as the new step's token.
    store = SequenceStore()
    old = store.note_forwarded([5, 6])
    store.release([5])
    new = store.note_forwarded([5])
    store.record_forwarded(old, np.array([11, 12]))
    assert store.last_token[store.rows([6], create=False)].tolist() == [12]
    with pytest.raises(StepPrecondition, match="did not come back"):
        store.resolve_placeholders([5], timeout_s=0.01)        # still waiting for the new step
    store.record_forwarded(new, np.array([21]))
    assert store.resolve_placeholders([5, 6], timeout_s=0.01).tolist() == [21, 12]
    store.release([6])
    store.record_forwarded(old, None)                          # a late failure of the old step
    assert store.resolve_placeholders([5], timeout_s=0.01).tolist() == [21]


def test_stage_0_checks_a_step_before_it_waits_for_its_tokens():
    # With async scheduling stage 0 holds a step whose input -1 is still being sampled downstream.
    # Every other check runs first: a bad step fails at once (not after the wait), and the wait
    # for the token is the last thing between the tokens' arrival and the compute.
    from minipaged import wire
    from minipaged.v1 import worker_pb2 as pb
    from worker.validation import StepLimits, StepValidationError, validate_step

    i32 = lambda v: wire.pack(np.array(v, dtype=np.int32))  # noqa: E731
    store = SequenceStore()
    ticket = store.note_forwarded([5])
    req = pb.StepRequest(sequence_ids=wire.pack(np.array([5]), wire.INT64), input_ids=i32([-1]),
                         positions=i32([3]), slot_mapping=i32([3]), query_start_loc=i32([0, 1]),
                         seq_lens=i32([4]), block_tables=i32([0]), max_blocks_per_seq=1,
                         do_sample=wire.pack(np.array([1]), wire.UINT8), temperature=wire.pack(np.zeros(1), wire.FLOAT32),
                         top_p=wire.pack(np.ones(1), wire.FLOAT32), top_k=i32([0]),
                         seeds=wire.pack(np.zeros(1), wire.INT64), sample_offsets=i32([0]))
    lim = StepLimits(512, 256, 4096, 64, 16, True)
    bad = pb.StepRequest()
    bad.CopyFrom(req)
    bad.slot_mapping = i32([70])                      # not the slot of position 3 in block 0
    t0 = time.monotonic()
    with pytest.raises(StepValidationError, match="slot_mapping"):
        validate_step(bad, lim, store, placeholder_timeout_s=5.0)
    assert time.monotonic() - t0 < 2.0                # refused without waiting for the token
    threading.Timer(0.05, lambda: store.record_forwarded(ticket, np.array([42]))).start()
    assert validate_step(req, lim, store, placeholder_timeout_s=5.0).input_ids.tolist() == [42]
