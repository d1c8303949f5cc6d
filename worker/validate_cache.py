"""Step checks of where the step reads and writes K/V: block tables (full or a delta over the
stage's SequenceStore), slot_mapping, and the copy-on-write pairs. One bad id here would silently
overwrite another sequence's K/V, so every id is checked against the cache and the tables."""
from __future__ import annotations

import numpy as np

from minipaged import wire
from worker.validate_common import StepLimits, check_range, fail


def block_tables(req, lim: StepLimits, B: int, seq_ids, seq_lens, store):
    """Block tables (full, or a delta over what the store holds): ids in range, and every block
    the context uses is present. Returns (tables [B, M], (base, counts) or None)."""
    table_delta = None
    if req.delta_tables:
        base = wire.unpack(req.table_base, wire.INT32, name="table_base", count=B)
        counts = wire.unpack(req.new_block_counts, wire.INT32, name="new_block_counts", count=B)
        if (base < 0).any() or (counts < 0).any():
            fail("table_base and new_block_counts must be >= 0")
        new_blocks = wire.unpack(req.new_blocks, wire.INT32, name="new_blocks", count=int(counts.sum()))
        check_range("new_blocks", new_blocks, 0, lim.num_blocks)
        tables = store.preview_tables(seq_ids, base, counts, new_blocks)
        table_delta = (base, counts)
        # a row's first base + count blocks are ids checked when they came (here or by an earlier
        # step), and -1 after: the per-row count is the whole hole check, no pass over the table
        valid_blocks = base.astype(np.int64) + counts
    else:
        M = req.max_blocks_per_seq
        if M < 1:
            fail(f"max_blocks_per_seq = {M} must be >= 1")
        tables = wire.unpack_2d(req.block_tables, B, M, wire.INT32, name="block_tables")
        check_range("block_tables", tables, -1, lim.num_blocks)
    M = tables.shape[1]
    used = (seq_lens.astype(np.int64) + lim.block_size - 1) // lim.block_size
    if (used > M).any():
        b = int(np.argmax(used > M))
        fail(f"seq_lens[{b}] = {seq_lens[b]} needs {used[b]} blocks of {lim.block_size}, "
             f"more than max_blocks_per_seq = {M}")
    if table_delta is not None:
        short = used > valid_blocks
        hole = (int(np.argmax(short)), int(valid_blocks[np.argmax(short)])) if short.any() else None
    else:
        holes = (np.arange(M)[None, :] < used[:, None]) & (tables < 0)
        hole = tuple(int(x) for x in np.argwhere(holes)[0]) if holes.any() else None
    if hole is not None:
        b, j = hole
        fail(f"block_tables[{b}, {j}] = -1 inside the used part ({used[b]} blocks for seq_len {seq_lens[b]})")
    return tables, table_delta


def slot_mapping(req, lim: StepLimits, T: int, positions, tables, seq_of_token) -> np.ndarray:
    """Slots in range, and each written slot where the tables say its position lives."""
    slots = wire.unpack(req.slot_mapping, wire.INT32, name="slot_mapping", count=T)
    check_range("slot_mapping", slots, -1, lim.num_blocks * lim.block_size)
    pos64 = positions.astype(np.int64)
    want = tables[seq_of_token, pos64 // lim.block_size].astype(np.int64) * lim.block_size + pos64 % lim.block_size
    wrong = (slots != -1) & (slots != want)
    if wrong.any():
        t = int(np.argmax(wrong))
        fail(f"slot_mapping[{t}] = {slots[t]} but position {positions[t]} of sequence "
             f"{int(seq_of_token[t])} maps to slot {want[t]} through its block table")
    return slots


def tier_moves(req, lim: StepLimits):
    """The second KV tier's saves (pool block -> slot) and loads (slot -> pool block), or None."""
    if not (req.tier_save_blocks or req.tier_save_slots or req.tier_load_slots or req.tier_load_blocks):
        return None
    if not lim.tier_blocks:
        fail("tier moves in a step, but this stage has no KV tier (InitCache tier_blocks = 0)")
    sb = wire.unpack(req.tier_save_blocks, wire.INT32, name="tier_save_blocks")
    ss = wire.unpack(req.tier_save_slots, wire.INT32, name="tier_save_slots", count=sb.size)
    ls = wire.unpack(req.tier_load_slots, wire.INT32, name="tier_load_slots")
    lb = wire.unpack(req.tier_load_blocks, wire.INT32, name="tier_load_blocks", count=ls.size)
    check_range("tier_save_blocks", sb, 0, lim.num_blocks)
    check_range("tier_load_blocks", lb, 0, lim.num_blocks)
    check_range("tier_save_slots", ss, 0, lim.tier_blocks)
    check_range("tier_load_slots", ls, 0, lim.tier_blocks)
    if np.unique(ss).size != ss.size or np.unique(lb).size != lb.size:
        fail("tier moves: a slot saved twice or a block loaded twice in one step")
    return sb, ss, ls, lb


def copies(req, lim: StepLimits):
    """Copy-on-write block pairs to run before the step (forks)."""
    copy_src = copy_dst = None
    if req.copy_src or req.copy_dst:
        copy_src = wire.unpack(req.copy_src, wire.INT32, name="copy_src")
        copy_dst = wire.unpack(req.copy_dst, wire.INT32, name="copy_dst", count=copy_src.size)
        check_range("copy_src", copy_src, 0, lim.num_blocks)
        check_range("copy_dst", copy_dst, 0, lim.num_blocks)
        if np.unique(copy_dst).size != copy_dst.size:
            fail("copy_dst: duplicate destination blocks")
    return copy_src, copy_dst
