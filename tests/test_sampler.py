"""The sampler: greedy, seeded sampling independent of batch companions, top-k/top-p, logprobs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.sampler import sample, uniform_for

V = 50


def params(n, temperature=1.0, top_p=1.0, top_k=0, seed=0, offset=0):
    full = lambda v, dt: np.full(n, v, dtype=dt)  # noqa: E731
    return (full(temperature, np.float32), full(top_p, np.float32), full(top_k, np.int32),
            full(seed, np.int64), full(offset, np.int32))


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = torch.randn(6, V)
    logits[0, 3] = logits[0, 7] = logits[0].max() + 1
    ids, lp = sample(logits, *params(6, temperature=0.0), return_logprobs=False)
    assert ids.dtype == np.int32 and lp is None
    assert ids.tolist() == logits.argmax(-1).tolist() and ids[0] == 3


def test_seeded_sampling_is_reproducible_and_independent_of_companions():
    g = torch.Generator().manual_seed(0)
    row = torch.randn(V, generator=g)
    alone = [sample(row[None], *params(1, 0.9, 0.95, 20, seed=42, offset=o))[0][0] for o in range(30)]
    again = [sample(row[None], *params(1, 0.9, 0.95, 20, seed=42, offset=o))[0][0] for o in range(30)]
    assert alone == again
    assert len(set(alone)) > 1                      # offsets move the stream on
    # Same row at another batch position, among other rows with other parameters.
    others = torch.randn(4, V, generator=g)
    for o in range(30):
        batch = torch.cat([others[:2], row[None], others[2:]])
        t, p, k, s, off = params(5, 0.9, 0.95, 20, seed=42, offset=o)
        t[[0, 3]] = 0.0
        s[[1, 4]] = [7, 8]
        ids, _ = sample(batch, t, p, k, s, off)
        assert ids[2] == alone[o]
    # A different seed gives a different stream.
    other_seed = [sample(row[None], *params(1, 0.9, 0.95, 20, seed=43, offset=o))[0][0] for o in range(30)]
    assert other_seed != alone


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(8, V) * 3
    greedy = logits.argmax(-1).numpy()
    for o in range(5):
        ids_k, _ = sample(logits, *params(8, 1.5, 1.0, 1, seed=o, offset=o))
        ids_p, _ = sample(logits, *params(8, 1.5, 1e-6, 0, seed=o, offset=o))
        assert (ids_k == greedy).all() and (ids_p == greedy).all()


def test_top_k_restricts_support_and_distribution_follows_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    n = 4000
    seeds = np.arange(n, dtype=np.int64)
    ids, _ = sample(logits.expand(n, -1), np.ones(n, np.float32), np.ones(n, np.float32),
                    np.full(n, 3, np.int32), seeds, np.zeros(n, np.int32))
    assert set(ids.tolist()) <= {0, 1, 2}
    freq = np.bincount(ids, minlength=5)[:3] / n
    expect = torch.softmax(logits[0, :3], -1).numpy()
    assert np.abs(freq - expect).max() < 0.03


def test_top_p_keeps_smallest_prefix_reaching_p():
    # probs 0.5, 0.3, 0.2: top_p 0.6 keeps the first two (0.5 < 0.6), never the third.
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    n = 2000
    ids, _ = sample(logits.expand(n, -1), np.ones(n, np.float32), np.full(n, 0.6, np.float32),
                    np.zeros(n, np.int32), np.arange(n, dtype=np.int64), np.zeros(n, np.int32))
    assert set(ids.tolist()) == {0, 1}


def test_logprobs_are_raw_log_softmax_at_the_chosen_id():
    logits = torch.randn(5, V, dtype=torch.float64)
    t, p, k, s, o = params(5, 0.7, 0.9, 10, seed=3)
    t[0] = 0.0
    ids, lp = sample(logits, t, p, k, s, o, return_logprobs=True)
    assert lp.dtype == np.float32
    exp = torch.log_softmax(logits, -1)[torch.arange(5), torch.as_tensor(ids).long()].numpy()
    np.testing.assert_allclose(lp, exp, rtol=1e-6)


def test_uniform_is_in_unit_interval_and_pure():
    u = uniform_for(np.arange(-500, 500), np.arange(1000) % 7)
    assert (u >= 0).all() and (u < 1).all()
    assert np.array_equal(u, uniform_for(np.arange(-500, 500), np.arange(1000) % 7))
    assert abs(u.mean() - 0.5) < 0.05


def reference_draw(row: torch.Tensor, t: float, p: float, k: int, u: float) -> int:
    """The sampler's definition, the slow way: a stable sort of the whole row, the kept set, then
    the inverse CDF over the kept tokens in id order (float64)."""
    V = row.numel()
    vals, order = torch.sort(row.double(), descending=True, stable=True)
    w = torch.exp((vals - vals[0]) / t)
    if 0 < k < V:
        w[vals < vals[k - 1]] = 0        # every token tied with the k-th stays (transformers, vLLM)
    c = w.cumsum(0)
    keep = (c - w) < p * c[-1]
    keep[0] = True
    kept = torch.zeros(V, dtype=torch.float64)
    kept[order] = w * keep
    cdf = kept.cumsum(0)
    return int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True)[0])


@pytest.mark.parametrize("head", [4096, 8])   # 8: most top-p rows prove nothing and sort their row
def test_every_path_draws_what_the_definition_says(monkeypatch, head):
    """Token for token against reference_draw over float64 rows of 3,000 ids: top-k (with ties at
    its boundary: values rounded as bfloat16 logits are), top-p with and without top-k, every token
    kept, -inf masked ids; rows of every kind in one batch, and with a small head (the full-sort
    path) the same tokens."""
    import worker.sampler as sampler_mod
    monkeypatch.setattr(sampler_mod, "HEAD", head)
    g = torch.Generator().manual_seed(5)
    V, R = 3000, 12
    logits = (torch.randn(R, V, generator=g, dtype=torch.float64) * 2).bfloat16().double()  # many ties
    logits[1, ::3] = float("-inf")
    logits[2, 5:] = float("-inf")                                     # 5 finite ids, top_k 20
    t = np.array([0.7, 1.0, 0.9, 1.3, 0.5, 1.0, 0.8, 1.0, 2.0, 0.6, 1.0, 0.3], dtype=np.float32)
    p = np.array([1.0, 0.9, 1.0, 0.95, 1.0, 0.5, 0.99, 1.0, 0.9, 0.95, 0.2, 1.0], dtype=np.float32)
    k = np.array([20, 0, 20, 0, 1, 0, 40, 0, 0, 20, 7, 3], dtype=np.int32)
    for offset in range(12):
        seeds = np.arange(R, dtype=np.int64) * 7 + 1
        offs = np.full(R, offset, dtype=np.int32)
        ids, _ = sample(logits, t, p, k, seeds, offs)
        u = uniform_for(seeds, offs)
        want = [reference_draw(logits[r], float(t[r]), float(p[r]), int(k[r]), float(u[r])) for r in range(R)]
        assert ids.tolist() == want
        assert all(np.isfinite(logits[r, ids[r]].item()) for r in range(R))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_k_keeps_every_token_tied_at_its_boundary(dtype):
    """As transformers' TopKLogitsWarper and vLLM's threshold: top_k 2 of four tied best keeps all
    four, equally often; top_k 1 of two tied keeps both."""
    logits = torch.zeros(1, 10, dtype=dtype)
    logits[0, [2, 5, 7, 9]] = 1.0
    logits[0, 4] = 0.5
    n = 2000
    for k, want in ((2, {2, 5, 7, 9}), (1, {2, 5, 7, 9}), (5, {2, 4, 5, 7, 9})):
        ids, _ = sample(logits.expand(n, -1), np.ones(n, np.float32), np.ones(n, np.float32),
                        np.full(n, k, np.int32), np.arange(n, dtype=np.int64), np.zeros(n, np.int32))
        assert set(ids.tolist()) == want
        if k == 2:
            assert np.abs(np.bincount(ids, minlength=10)[[2, 5, 7, 9]] / n - 0.25).max() < 0.04
    wide = torch.zeros(1, 5000, dtype=dtype)       # ties past the head of candidates: the sorted path
    wide[0, 1000:1100] = 1.0
    ids, _ = sample(wide.expand(n, -1), np.ones(n, np.float32), np.ones(n, np.float32),
                    np.full(n, 3, np.int32), np.arange(n, dtype=np.int64), np.zeros(n, np.int32))
    assert set(ids.tolist()) <= set(range(1000, 1100)) and len(set(ids.tolist())) > 90


def test_a_float32_row_keeping_every_token_follows_softmax():
    """The whole-vocabulary path (chunk, then id; no sort) over a row longer than one chunk."""
    g = torch.Generator().manual_seed(1)
    row = torch.randn(1, 5000, generator=g) * 4
    n = 20000
    ids, _ = sample(row.expand(n, -1), np.full(n, 1.0, np.float32), np.ones(n, np.float32),
                    np.zeros(n, np.int32), np.arange(n, dtype=np.int64), np.zeros(n, np.int32))
    probs = torch.softmax(row[0].double(), -1).numpy()
    top = np.argsort(-probs)[:5]
    freq = np.bincount(ids, minlength=5000)
    assert np.abs(freq[top] / n - probs[top]).max() < 0.01


def test_a_nucleus_past_the_head_is_found_by_bins_as_a_sort_finds_it():
    """Flat rows (a random-weight model's) whose top-p nucleus holds most of 30,000 ids: the binned
    search, several ids to a bin, draws the tokens of the full-sort definition."""
    g = torch.Generator().manual_seed(9)
    R, V = 4, 30000
    logits = (torch.randn(R, V, generator=g, dtype=torch.float64) * 0.3).bfloat16().double()
    t = np.array([0.7, 1.0, 1.5, 0.9], dtype=np.float32)
    p = np.array([0.8, 0.95, 0.5, 0.99], dtype=np.float32)
    for offset in range(6):
        seeds, offs = np.arange(R, dtype=np.int64) + 100, np.full(R, offset, dtype=np.int32)
        ids, _ = sample(logits, t, p, np.zeros(R, np.int32), seeds, offs)
        u = uniform_for(seeds, offs)
        assert ids.tolist() == [reference_draw(logits[r], float(t[r]), float(p[r]), 0, float(u[r]))
                                for r in range(R)]


def kernels_or_skip():
    """worker.cpu_kernels, or skip the test where the library cannot be built here."""
    from worker import cpu_kernels
    if not cpu_kernels.fused_ok(torch.zeros(1)):
        pytest.skip("the CPU kernels are not built here")
    return cpu_kernels


def _three_ways(monkeypatch, logits, t, p, k, seeds, offset):
    """The tokens of the compiled paths, of the torch / numpy paths (the kernels switched off), and of
    reference_draw, for one step at `offset`."""
    import worker.sampler as sampler_mod
    R = logits.shape[0]
    seeds, offs = np.asarray(seeds, dtype=np.int64), np.full(R, offset, dtype=np.int32)
    compiled, _ = sample(logits, t, p, k, seeds, offs)
    with monkeypatch.context() as m:
        m.setattr(sampler_mod.cpu_kernels, "fused_ok", lambda x: False)
        plain, _ = sample(logits, t, p, k, seeds, offs)
    u = uniform_for(seeds, offs)
    want = [reference_draw(logits[r], float(t[r]), float(p[r]), int(k[r]), float(u[r])) for r in range(R)]
    return compiled.tolist(), plain.tolist(), want


def test_compiled_whole_row_draw_is_the_torch_paths_and_the_definitions(monkeypatch):
    """float32 rows that keep every token draw through worker/cpu_sampling.cpp (row_weights, then
    pick_whole): the same tokens as the torch / numpy path and as reference_draw, including rows
    with -inf masked ids and low temperatures over a wide spread (arguments of exp far below its
    normal range, which count as weight 0)."""
    kernels_or_skip()
    g = torch.Generator().manual_seed(11)
    R, V = 16, 5000
    scale = torch.tensor([1.0, 4.0, 12.0, 30.0] * 4)[:, None]
    logits = torch.randn(R, V, generator=g) * scale
    logits[3, ::2] = float("-inf")
    logits[7, 10:] = float("-inf")
    t = np.array([1.0, 0.6, 0.3, 0.1] * 4, dtype=np.float32)
    for offset in range(8):
        compiled, plain, want = _three_ways(monkeypatch, logits, t, np.ones(R, np.float32),
                                            np.zeros(R, np.int32), np.arange(R) * 3 + 2, offset)
        assert compiled == plain == want
        assert all(np.isfinite(logits[r, compiled[r]].item()) for r in range(R))


def test_compiled_nucleus_past_the_head_is_the_numpy_bins_and_the_definitions(monkeypatch):
    """float32 flat rows whose top-p nucleus holds most of 30,000 ids, found by the compiled search
    (worker/cpu_sampling.cpp nucleus_weights): the tokens of the numpy bins and of reference_draw,
    with bfloat16-rounded values (ties across the cut), -inf masked ids, a row with one finite id,
    and one whose values are all equal."""
    kernels_or_skip()
    g = torch.Generator().manual_seed(13)
    R, V = 8, 30000
    logits = (torch.randn(R, V, generator=g) * 0.3).bfloat16().float()
    logits[2, ::3] = float("-inf")
    logits[5, 1:] = float("-inf")
    logits[5, 0] = 3.0
    logits[6] = 0.25
    logits[4] = float("-inf")              # p z (~900) under the head's size, its nucleus past it:
    logits[4, :4000] = -1.4 + 0.01 * torch.randn(4000, generator=g)   # the head is tried first
    logits[4, 7] = 0.0
    t = np.array([0.7, 1.0, 1.5, 0.9, 1.0, 1.0, 1.0, 0.6], dtype=np.float32)
    p = np.array([0.8, 0.95, 0.5, 0.99, 0.9, 0.9, 0.7, 0.999], dtype=np.float32)
    for offset in range(6):
        compiled, plain, want = _three_ways(monkeypatch, logits, t, p, np.zeros(R, np.int32),
                                            np.arange(R) * 11 + 5, offset)
        assert compiled == plain == want
        assert all(np.isfinite(logits[r, compiled[r]].item()) for r in range(R))


def test_compiled_paths_on_a_small_vocabulary_keep_top_p(monkeypatch):
    """A vocabulary no larger than the head (the tiny model's 512): the row is sorted, and top-p
    alone still keeps its nucleus (its total mass summed) on contiguous float32 rows, next to top-k."""
    kernels_or_skip()
    g = torch.Generator().manual_seed(17)
    R, V = 6, 512
    logits = torch.randn(R, V, generator=g)
    t = np.array([1.0, 0.7, 1.3, 1.0, 0.9, 2.0], dtype=np.float32)
    p = np.array([0.9, 0.5, 0.99, 1.0, 0.8, 0.3], dtype=np.float32)
    k = np.array([0, 0, 0, 40, 10, 0], dtype=np.int32)
    picked = set()
    for offset in range(8):
        compiled, plain, want = _three_ways(monkeypatch, logits, t, p, k, np.arange(R) * 3 + 1, offset)
        assert compiled == plain == want
        picked.add(compiled[0])
    assert len(picked) > 1                      # not the row's argmax every time


def test_compiled_min_p_masks_what_the_torch_form_masks(monkeypatch):
    from worker import logits_processors
    kernels_or_skip()
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 3000, generator=g) * 3
    min_p = np.array([0.05, 0.0, 0.5, 1.0, 0.2, 0.01], dtype=np.float32)
    t = np.array([1.0, 1.0, 0.7, 1.0, 0.0, 2.0], dtype=np.float32)
    a, b = logits.clone(), logits.clone()
    logits_processors.apply_min_p(a, min_p, t)
    with monkeypatch.context() as m:
        m.setattr(logits_processors.cpu_kernels, "fused_ok", lambda x: False)
        logits_processors.apply_min_p(b, min_p, t)
    assert torch.equal(a, b)
    assert torch.equal(a[1], logits[1]) and torch.equal(a[4], logits[4])   # min_p 0, greedy: untouched


def test_compiled_head_is_the_stable_sorts_first_m_and_draws_the_same_tokens(monkeypatch):
    """worker/cpu_sampling.cpp head_stable: the first m of a stable descending sort (ties to the
    lower id) of bfloat16-rounded float32 rows (many ties) with -inf ids; the sampler's top-k /
    top-p draws through it equal the torch path's (topk, then re-sorted by id and value)."""
    cpu_kernels = kernels_or_skip()
    g = torch.Generator().manual_seed(21)
    R, V = 10, 6000
    logits = (torch.randn(R, V, generator=g) * 2).bfloat16().float()
    logits[2, ::2] = float("-inf")
    logits[5, 30:] = float("-inf")                                 # fewer finite ids than the head
    for m in (1, 20, 84, 300):
        vals, ids = cpu_kernels.head_stable(logits, m)
        svals, sids = torch.sort(logits, dim=-1, descending=True, stable=True)
        assert torch.equal(ids, sids[:, :m]) and torch.equal(vals, svals[:, :m])
    t = np.array([0.6, 1.0, 0.8, 1.2, 0.7, 1.0, 0.5, 0.9, 1.0, 0.6], dtype=np.float32)
    p = np.array([0.95, 1.0, 0.9, 0.8, 1.0, 0.95, 0.5, 1.0, 0.9, 0.99], dtype=np.float32)
    k = np.array([20, 40, 0, 0, 5, 20, 0, 1, 50, 20], dtype=np.int32)
    for offset in range(6):
        compiled, plain, want = _three_ways(monkeypatch, logits, t, p, k, np.arange(R) * 5 + 3, offset)
        assert compiled == plain == want
