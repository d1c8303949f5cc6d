"""The batch lookups of the step path (minipaged/id_index.py) and a worker's remembered tables
(worker/step_state.py): vectorized, and the same answers as the per-id dict they index."""
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
