"""Stateful property test of KVBlockManager (Hypothesis RuleBasedStateMachine).

Besides the bookkeeping invariants, a simulated data plane (slot -> token) records what each
append writes and what fork copies, so a wrong prefix hit, a lost copy-on-write or a slot handed to
two live tokens shows up as wrong content. Unknown tokens are written as unique negative values.
"""
import math

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from metadata_service.block_manager import BlockManagerError, KVBlockManager, OutOfBlocksError

IDS = st.integers(0, 7)
ALPHABET = st.integers(0, 2)                     # tiny alphabet: prompts share prefixes often
BASES = [[0, 1, 2, 0, 1, 2, 0, 1], [0, 1, 2, 2, 2, 1, 0, 0], [2, 2, 2, 2, 1, 1, 1, 1]]
PROMPTS = st.one_of(                             # random, or a prefix of a shared base + a tail
    st.lists(ALPHABET, min_size=0, max_size=12),
    st.tuples(st.sampled_from(BASES), st.integers(0, 8), st.lists(ALPHABET, max_size=4))
    .map(lambda t: t[0][:t[1]] + t[2]))


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 3, 4]), num_blocks=st.integers(3, 16))
    def setup(self, block_size, num_blocks):
        self.B, self.N = block_size, num_blocks
        self.m = KVBlockManager(num_blocks, block_size, max_seqs=2)   # small: exercise growth
        self.toks: dict = {}      # sid -> token per position (negative = unknown)
        self.prompt: dict = {}    # sid -> prompt (supplies ids for appends without ids)
        self.nb: dict = {}        # sid -> expected len(block_table)
        self.kv: dict = {}        # slot -> token: the data plane
        self.unknown = 0
        self.out_holds: dict = {}  # prefill end of a move: key -> {slot: token} it must keep
        self.in_moves: dict = {}   # decode end: key -> (prompt, block indexes to move, fresh blocks)
        self.keys = 0

    # ---------------------------------------------------------------- helpers
    def fresh_unknown(self):
        self.unknown -= 1
        return self.unknown

    def attempt(self, fn, expect_fail):
        """Run fn; on a typed error, nothing may have changed. expect_fail: the model's prediction
        (None: either outcome is allowed, but a failure must be OutOfBlocksError)."""
        before = self.m.debug_state()
        try:
            out = fn()
        except BlockManagerError as e:
            assert expect_fail or (expect_fail is None and isinstance(e, OutOfBlocksError)), f"unexpected {e!r}"
            assert self.m.debug_state() == before, "a failed operation changed state"
            return None
        assert not expect_fail, "operation should have failed"
        return out

    def needed(self, sid, n):
        return max(0, math.ceil((len(self.toks[sid]) + n) / self.B) - self.nb[sid])

    def model_tokens(self, sid, n, ids):
        L = len(self.toks[sid])
        if ids is not None:
            return list(ids)
        p = self.prompt.get(sid, [])
        return [p[i] if i < len(p) else self.fresh_unknown() for i in range(L, L + n)]

    def write(self, sid, slots, values):
        assert len(slots) == len(values)
        self.store(slots.tolist(), values)
        self.toks[sid] += values
        self.nb[sid] = max(self.nb[sid], math.ceil(len(self.toks[sid]) / self.B))

    def live(self):
        return sorted(self.toks)

    # The data plane. Here every write lands at once; test_kv_tier.py's machine runs them as the
    # workers do, at a step boundary (flush), after the step's tier saves and loads.
    def store(self, slots, values):
        for s, v in zip(slots, values):
            self.kv[s] = v

    def copy(self, src, dst):
        for o in range(self.B):
            if src * self.B + o in self.kv:
                self.kv[dst * self.B + o] = self.kv[src * self.B + o]

    def flush(self):
        pass

    # ---------------------------------------------------------------- rules
    @rule(sid=IDS, prompt=PROMPTS, extra=st.integers(0, 14))
    def create(self, sid, prompt, extra):
        if sid in self.toks:
            self.attempt(lambda: self.m.create_sequence(sid, prompt), expect_fail=True)
            return
        cached = self.m.prompt_cache_lookup(prompt)
        assert cached % self.B == 0 and cached <= max(0, len(prompt) - 1)
        n = extra
        device = cached - self.m.prompt_tier_lookup(prompt)   # the rest is loaded into fresh blocks,
        need = math.ceil((device + n) / self.B) - device // self.B   # as many as fit (maybe none)
        # Hit blocks that were cached-free leave the free pool: between these bounds, either outcome.
        free = self.m.num_free_blocks
        expect = True if need > free else False if need <= free - device // self.B else None
        res = self.attempt(lambda: self.m.create_and_append(sid, prompt, n), expect)
        if res is None:
            return
        got_cached, slots = res
        assert device <= got_cached <= cached and got_cached % self.B == 0
        cached = got_cached
        self.toks[sid], self.prompt[sid], self.nb[sid] = list(prompt[:cached]), list(prompt), cached // self.B
        self.write(sid, slots, self.model_tokens(sid, n, None))
        self.flush()
        table = list(self.m.sequences[sid].block_table)
        for p in range(cached):                        # the hit blocks hold exactly the prompt
            assert self.kv[table[p // self.B] * self.B + p % self.B] == prompt[p]

    @precondition(lambda self: self.toks)
    @rule(data=st.data(), n=st.integers(0, 9), with_ids=st.booleans())
    def append(self, data, n, with_ids):
        sid = data.draw(st.sampled_from(self.live()))
        ids = data.draw(st.lists(ALPHABET, min_size=n, max_size=n)) if with_ids else None
        slots = self.attempt(lambda: self.m.append_tokens(sid, n, ids), self.needed(sid, n) > self.m.num_free_blocks)
        if slots is not None:
            self.write(sid, slots, self.model_tokens(sid, n, ids))

    @precondition(lambda self: self.toks)
    @rule(data=st.data(), tok=st.one_of(st.none(), ALPHABET))
    def append_one(self, data, tok):
        """The seed's scalar append_token path."""
        sid = data.draw(st.sampled_from(self.live()))
        slot = self.attempt(lambda: self.m.append_token(sid, tok), self.needed(sid, 1) > self.m.num_free_blocks)
        if slot is not None:
            self.write(sid, np.array([slot]), self.model_tokens(sid, 1, None if tok is None else [tok]))

    @precondition(lambda self: self.toks)
    @rule(data=st.data(), with_ids=st.booleans(), multi=st.booleans())
    def batch(self, data, with_ids, multi):
        """multi: append_tokens_batch with varied counts; else a decode step (one token each)."""
        sids = data.draw(st.lists(st.sampled_from(self.live()), min_size=1, unique=True))
        ns = data.draw(st.lists(st.integers(0, 5), min_size=len(sids), max_size=len(sids))) if multi \
            else [1] * len(sids)
        ids = data.draw(st.lists(ALPHABET, min_size=sum(ns), max_size=sum(ns))) if with_ids else None
        need = sum(self.needed(s, n) for s, n in zip(sids, ns))
        fn = (lambda: self.m.append_tokens_batch(sids, ns, ids)) if multi else \
            (lambda: self.m.slot_mapping_for_append(sids, ids))
        slots = self.attempt(fn, need > self.m.num_free_blocks)
        if slots is None:
            return
        assert len(slots) == sum(ns)
        at = 0
        for s, n in zip(sids, ns):
            self.write(s, slots[at:at + n], self.model_tokens(s, n, None if ids is None else ids[at:at + n]))
            at += n

    @precondition(lambda self: self.toks)
    @rule(data=st.data(), child=IDS)
    def fork(self, data, child):
        parent = data.draw(st.sampled_from(self.live()))
        L = len(self.toks[parent])
        partial = L % self.B != 0
        pairs = self.attempt(lambda: self.m.fork(parent, child),
                             child in self.toks or (partial and self.m.num_free_blocks < 1))
        if pairs is None:
            return
        pt, ct = list(self.m.sequences[parent].block_table), list(self.m.sequences[child].block_table)
        assert ct[:L // self.B] == pt[:L // self.B]
        assert pairs == ([(pt[L // self.B], ct[L // self.B])] if partial else [])
        for src, dst in pairs:                         # the data plane's copy
            self.copy(src, dst)
        self.toks[child], self.prompt[child] = list(self.toks[parent]), self.prompt.get(parent, [])
        self.nb[child] = math.ceil(L / self.B)

    @precondition(lambda self: self.toks)
    @rule(data=st.data())
    def allocate_block(self, data):
        sid = data.draw(st.sampled_from(self.live()))
        if self.attempt(lambda: self.m.allocate_block(sid), self.m.num_free_blocks < 1) is not None:
            self.nb[sid] += 1

    @precondition(lambda self: self.toks)
    @rule(data=st.data())
    def release(self, data):
        sid = data.draw(st.sampled_from(self.live()))
        self.m.release_sequence(sid)
        for d in (self.toks, self.prompt, self.nb):
            d.pop(sid, None)
        self.attempt(lambda: self.m.release_sequence(sid), expect_fail=True)   # double release

    @precondition(lambda self: self.toks)
    @rule(data=st.data())
    def preempt_and_recompute(self, data):
        """The scheduler's preemption: free everything, later recompute with the known tokens as the
        prompt (its own blocks are often still cached)."""
        sid = data.draw(st.sampled_from(self.live()))
        known = self.toks[sid]
        known = known[:next((i for i, t in enumerate(known) if t < 0), len(known))]
        self.m.release_sequence(sid)
        for d in (self.toks, self.prompt, self.nb):
            d.pop(sid, None)
        self.create(sid, known, max(0, len(known) - self.m.prompt_cache_lookup(known)))

    # ---------------------------------------------------------------- prefill -> decode moves
    @precondition(lambda self: self.toks)
    @rule(data=st.data())
    def move_out(self, data):
        """The prefill end: hold a sequence's full blocks, then forget the sequence."""
        sid = data.draw(st.sampled_from(self.live()))
        full = len(self.toks[sid]) // self.B
        blocks = list(self.m.sequences[sid].block_table[:full])
        self.keys += 1
        self.m.hold(("out", self.keys), blocks)
        self.out_holds[("out", self.keys)] = {b * self.B + o: self.kv[b * self.B + o]
                                              for b in blocks for o in range(self.B)}
        self.m.release_sequence(sid)
        for d in (self.toks, self.prompt, self.nb):
            d.pop(sid, None)

    @precondition(lambda self: self.out_holds)
    @rule(data=st.data())
    def move_out_done(self, data):
        key = data.draw(st.sampled_from(sorted(self.out_holds)))
        del self.out_holds[key]
        self.m.unhold(key)

    @rule(prompt=PROMPTS)
    def move_in(self, prompt):
        """The decode end: reserve blocks for the prompt's full blocks this pool lacks."""
        self.keys += 1
        key, n = ("in", self.keys), len(prompt) // self.B
        todo, fresh = self.m.reserve_move(key, prompt, n)
        held = self.m.held[key]
        hits = [j for j in range(len(held)) if j not in todo]
        assert len(todo) == len(fresh) and held[len(held) - len(fresh):] == fresh
        for j, b in zip(hits, held):                   # what it found is the prompt's block
            assert [self.kv[b * self.B + o] for o in range(self.B)] == prompt[j * self.B:(j + 1) * self.B]
        self.in_moves[key] = (prompt, todo, fresh)

    @precondition(lambda self: self.in_moves)
    @rule(data=st.data(), ok=st.booleans())
    def move_in_done(self, data, ok):
        key = data.draw(st.sampled_from(sorted(self.in_moves)))
        prompt, todo, fresh = self.in_moves.pop(key)
        if ok:                                         # the move Step wrote the blocks
            B = self.B
            self.store([b * B + o for b in fresh for o in range(B)],
                       [prompt[j * B + o] for j in todo for o in range(B)])
        assert self.m.finish_move(key, ok) == (len(fresh) if ok else 0)
        assert key not in self.m.held

    @rule(sid=IDS)
    def unknown_id(self, sid):
        if sid not in self.toks:
            self.attempt(lambda: self.m.append_token(sid), expect_fail=True)
            self.attempt(lambda: self.m.fork(sid, 99), expect_fail=True)

    @precondition(lambda self: self.toks)
    @rule(data=st.data())
    def out_of_blocks(self, data):
        sid = data.draw(st.sampled_from(self.live()))
        n = (self.N + 1) * self.B                     # more than the whole pool
        before = self.m.debug_state()
        try:
            self.m.append_tokens(sid, n)
            raise AssertionError("appending more than the pool must fail")
        except OutOfBlocksError:
            assert self.m.debug_state() == before

    @rule()
    def reset_prefix_cache(self):
        self.m.reset_prefix_cache()
        assert self.m.stats()["cached_blocks"] == 0

    # ---------------------------------------------------------------- invariants
    @invariant()
    def consistent(self):
        if not hasattr(self, "m"):
            return
        self.flush()                                   # a rule's work is one step
        m, B = self.m, self.B
        assert m.check_invariants() == []
        free = m.pool.free_blocks()
        ref = m.pool.ref_count.tolist()
        referenced = {b for b in range(self.N) if ref[b] > 0}
        assert len(free) == len(set(free)) and not referenced & set(free)
        assert referenced | set(free) == set(range(self.N))
        holders = [0] * self.N
        owner = {}
        for sid in self.live():
            st_ = m.sequences[sid]
            table = list(st_.block_table)
            L = len(self.toks[sid])
            assert st_.sequence_length == L
            assert len(table) == self.nb[sid] >= math.ceil(L / B)
            for b in table:
                holders[b] += 1
            for pos, tok in enumerate(self.toks[sid]):
                blk = table[pos // B]
                slot = blk * B + pos % B
                assert self.kv[slot] == tok, f"sequence {sid} pos {pos}: slot {slot} holds wrong content"
                if slot in owner:                      # shared: read-only, full in both holders
                    assert ref[blk] > 1 and pos // B < L // B and owner[slot][1]
                owner[slot] = (sid, pos // B < L // B)
        for blocks in m.held.values():               # moves in progress hold theirs
            for b in blocks:
                holders[b] += 1
        assert holders == ref
        for kept in self.out_holds.values():          # nothing writes a block a move reads
            assert all(self.kv.get(slot) == tok for slot, tok in kept.items())
        if self.toks:
            lens = m.get_seq_lens_tensor(self.live()).tolist()
            assert lens == [len(self.toks[s]) for s in self.live()]


BlockManagerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_block_manager_stateful = BlockManagerMachine.TestCase
