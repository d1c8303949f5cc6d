"""Token sampling: greedy, temperature, top-k, top-p, seeded per request.

Randomness is counter-based: row r's uniform number is a hash (splitmix64) of its request's
(seed, offset), where offset is the index of the token being sampled. So a request with a seed
gets the same tokens whatever else is in the batch, wherever it sits, on any device, without a
per-row generator loop. The uniform picks a token by inverse CDF over the kept tokens in id order.
The kept set comes from a head of candidates (on the CPU one compiled scan, worker/cpu_sampling.cpp
head_stable; elsewhere torch.topk); top-p alone from binning its row (float32 on the CPU: always, a
compiled search; elsewhere where the nucleus runs past the head); a row is sorted only where its
top-k edge ties run past the head on a GPU or in float64 (bench/sampling_rules.py: [64, 151,936]
rows, ~360 ms for a sort, 2-3 ms with top-k, ~12 ms for top-p alone).
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from minipaged.rng import splitmix64
from worker import cpu_kernels


def uniform_for(seeds, offsets) -> np.ndarray:
    """float64 in [0, 1), a pure function of (seed, offset)."""
    seeds = np.asarray(seeds, dtype=np.int64).astype(np.uint64)
    offsets = np.asarray(offsets, dtype=np.int64).astype(np.uint64)
    z = splitmix64(splitmix64(seeds) ^ offsets)
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _as(values, dtype, device) -> torch.Tensor:
    return torch.as_tensor(np.array(values, dtype=dtype, copy=True).reshape(-1), device=device)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (int64), ties to the lowest id. On the CPU numpy's one SIMD pass is 3-6x
    torch's reduction ([64, 151936] float32 on 2 cores: 0.9 vs 2.6 ms, ~2% of a Qwen3-0.6B decode
    step); both return the first of equal maxima."""
    if logits.device.type == "cpu":
        return torch.from_numpy(np.argmax(logits.numpy(), axis=-1).astype(np.int64, copy=False))
    return logits.argmax(dim=-1)


_scratch = threading.local()   # each thread's buffers of the last shapes: see scratch_like


def scratch_like(x: torch.Tensor, name: str) -> torch.Tensor:
    """A buffer of x's shape and dtype, kept per thread and name for the next step (CPU; on a GPU
    a new tensor: its caching allocator already reuses). On the CPU a fresh [64, 151,936] float32
    tensor is a new mapping whose first touch costs ~8 ms of page faults on 2 cores, more than a
    log_softmax over it. Valid until this thread's next call with the same name."""
    if x.device.type != "cpu":
        return torch.empty_like(x)
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    buf = bufs.get(name)
    if buf is None or buf.shape != x.shape or buf.dtype != x.dtype:
        buf = bufs[name] = torch.empty_like(x)
    return buf


def log_softmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the vocabulary in float32 (float64 for float64 logits), into a scratch
    buffer (valid until this thread's next call)."""
    x = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    return torch.log_softmax(x, -1, out=scratch_like(x, "log_softmax"))


def sample(logits: torch.Tensor, temperature, top_p, top_k, seeds, offsets,
           return_logprobs: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """logits [S, V] -> (token ids int32 [S], logprobs float32 [S] or None).

    temperature <= 0: argmax (ties -> lowest id). Otherwise weights exp((logit - max) / T), keep the
    top_k (0 = all) heaviest and every token tied with the k-th, then the smallest prefix of those whose mass reaches top_p (at least
    one token), then draw (see _draw). The logprob is log_softmax of the raw (temperature 1,
    unfiltered) logits at the token."""
    S, V = logits.shape
    dev = logits.device
    cdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.to(cdt)
    temp = _as(temperature, np.float64, dev)
    stochastic = temp > 0
    if S and bool(stochastic.all()):   # (no copy of the rows: ~12 ms at [64, 151,936] float32)
        ids = _draw(logits, temp, _as(top_p, np.float64, dev), _as(top_k, np.int64, dev),
                    np.asarray(seeds), np.asarray(offsets))
    else:
        ids = argmax_rows(logits)
        if S and bool(stochastic.any()):
            rows = stochastic.nonzero().squeeze(1)
            ids[rows] = _draw(logits[rows], temp[rows], _as(top_p, np.float64, dev)[rows],
                              _as(top_k, np.int64, dev)[rows],
                              np.asarray(seeds)[rows.cpu().numpy()], np.asarray(offsets)[rows.cpu().numpy()])
    logprobs = None
    if return_logprobs:
        lp = log_softmax_rows(logits).gather(1, ids[:, None]).squeeze(1)
        logprobs = lp.to(torch.float32).cpu().numpy()
    return ids.to(torch.int32).cpu().numpy(), logprobs


# Candidates per row for top-p without top-k where the bins are not compiled (float64, a GPU): a
# nucleus that fits in them is found without sorting the vocabulary (a sort of [64, 151,936] takes
# ~360 ms on 2 cores, a topk of 1,024 ~15 ms).
HEAD = 1024
CHUNK = 1024      # a whole-vocabulary draw finds its chunk of ids first, then the id inside it


def _draw(logits, temp, top_p, top_k, seeds, offsets) -> torch.Tensor:
    """Stochastic rows -> token ids. A token's weight is exp((logit - max) / T); the kept set is
    the top_k (0 = all) heaviest and every token tied with the k-th (transformers' and vLLM's
    threshold), then the smallest prefix of those whose mass reaches top_p (ties to the lower id; at
    least one token); the uniform picks by inverse CDF over the kept
    tokens in id order. Rows that keep every token draw over the vocabulary without a sort; the
    others find their kept set in a head of candidates (_head), or, past the head, by binning
    the row (top-p) or sorting it. Every path keeps the same set and draws the same way."""
    R, V = logits.shape
    dev = logits.device
    u = torch.as_tensor(uniform_for(seeds, offsets), device=dev)
    k = torch.where((top_k > 0) & (top_k < V), top_k, 0)
    p = top_p.clamp(max=1.0)
    whole = (k == 0) & (p >= 1.0)
    if bool(whole.all()):
        return _pick_whole(_row_weights(logits, temp), u)
    out = torch.empty(R, dtype=torch.int64, device=dev)
    if bool(whole.any()):
        rows = whole.nonzero().squeeze(1)
        out[rows] = _pick_whole(_row_weights(logits[rows], temp[rows]), u[rows])
        rest = (~whole).nonzero().squeeze(1)
        out[rest] = _draw_filtered(logits[rest], temp[rest], p[rest], k[rest], u[rest])
        return out
    return _draw_filtered(logits, temp, p, k, u)


# Below this exponent exp() leaves the normal range of the dtype: its result is a subnormal or 0,
# and torch's vectorized exp on the CPU takes a slow path for it (measured on [64, 151,936]
# float32: 2.8 ms for in-range values, 14 ms for -inf, 35 ms for -200, 86 ms where results are
# subnormal). Masked logits (-inf: grammars, min_tokens, min_p) and low temperatures over a trained
# model's spread land there; such weights count as 0 (< 1.2e-38 of the row's heaviest, which is 1).
EXP_FLOOR = {torch.float32: -87.3, torch.float64: -708.0}   # (the sampler computes in these two)


def _row_weights(x, temp, buffer: str = "weights") -> torch.Tensor:
    """exp((x - row max) / T) in x's dtype, 0 below EXP_FLOOR, in a scratch buffer (valid until its
    next use). float32 rows on the CPU: one compiled pass (worker/cpu_sampling.cpp row_weights)."""
    out = scratch_like(x, buffer)
    if cpu_kernels.fused_ok(x) and x.dim() == 2 and x.is_contiguous() and out.is_contiguous():
        return cpu_kernels.row_weights(x, temp, out)
    w = torch.sub(x, x.max(-1, keepdim=True).values, out=out)
    w.div_(temp.to(w.dtype)[:, None])
    floor = EXP_FLOOR[w.dtype]
    if bool(w.amin() >= floor):         # (one read of the rows: the common case stays one exp)
        return w.exp_()
    low = w < floor
    return w.clamp_(min=floor).exp_().masked_fill_(low, 0.0)


def _row_totals(w) -> torch.Tensor:
    """Each row's sum of weights in float64 (numpy's pairwise sum of each row on its own)."""
    if w.device.type == "cpu":
        return torch.from_numpy(np.sum(w.numpy(), axis=-1, dtype=np.float64))
    return w.to(torch.float64).sum(-1)


def _pick_whole(w, u) -> torch.Tensor:
    """Inverse CDF over a whole row of weights w [R, V] in id order: the chunk of CHUNK ids, then
    the id (float64 sums of the float weights). A token of weight 0 is never picked, even by u = 0."""
    R, V = w.shape
    if w.device.type != "cpu":
        cdf = w.to(torch.float64).cumsum(-1)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=V - 1)
        return pick.squeeze(1)
    if cpu_kernels.fused_ok(w) and w.is_contiguous():      # float32 rows: the compiled pass
        return cpu_kernels.pick_whole(w, u, CHUNK)
    W, uu = w.numpy(), u.numpy()
    starts = np.arange(0, V, CHUNK)
    ccdf = np.cumsum(np.add.reduceat(W, starts, axis=1, dtype=np.float64), axis=1)
    target = uu * ccdf[:, -1]
    c = np.minimum((ccdf <= target[:, None]).sum(1), starts.size - 1)     # first chunk whose cdf > target
    below = np.where(c > 0, ccdf[np.arange(R), np.maximum(c - 1, 0)], 0.0)
    cols = np.minimum(starts[c][:, None] + np.arange(CHUNK)[None, :], V - 1)
    seg = np.where(starts[c][:, None] + np.arange(CHUNK)[None, :] < V, W[np.arange(R)[:, None], cols], 0)
    inner = np.cumsum(seg, axis=1, dtype=np.float64)
    j = (inner <= (target - below)[:, None]).sum(1)
    last = CHUNK - 1 - np.argmax(seg[:, ::-1] > 0, axis=1)                 # rounding never lands past it
    return torch.from_numpy(starts[c] + np.minimum(j, last))


def _draw_filtered(x, temp, p, k, u) -> torch.Tensor:
    R, V = x.shape
    dev = x.device
    # Top-p alone on the CPU skips the head where the bins are cheaper: float32 rows always (the
    # compiled search, a few passes of a row, finds any nucleus for less than a head of ~1,000 costs,
    # and sums the row itself), others where the mass p z exceeds m (no weight exceeds 1, so the
    # head cannot hold the nucleus).
    m = int(k.max()) + 64 if bool((k > 0).all()) else max(HEAD, int(k.max()) + 64)
    compiled = dev.type == "cpu" and cpu_kernels.fused_ok(x) and x.is_contiguous() and m < V
    z_all = torch.zeros(R, dtype=torch.float64, device=dev)   # top-p over the whole row: its total mass
    if not compiled and bool((k == 0).any()):
        rows = (k == 0).nonzero().squeeze(1)
        z_all[rows] = _row_totals(_row_weights(x if rows.numel() == R else x[rows], temp[rows]))
    if m >= V:   # a small vocabulary: the head would be the whole row, so sort the row
        vals, ids = torch.sort(x, dim=-1, descending=True, stable=True)
        return _finish(vals, ids, temp, p, k, u, z_all, torch.full((R,), V, device=dev), True)[0]
    if dev.type == "cpu":
        far = (k == 0) & ((p * z_all > m) | compiled)
    else:
        far = torch.zeros(R, dtype=torch.bool, device=dev)
    tok = torch.empty(R, dtype=torch.int64, device=dev)
    late = far.clone()
    if not bool(far.all()):
        near = (~far).nonzero().squeeze(1)
        xs = x if near.numel() == R else x[near]
        vals, ids, exact = _head(xs, m)
        tok[near], fits = _finish(vals, ids, temp[near], p[near], k[near], u[near], z_all[near], exact, False)
        late[near] = ~fits
        if not bool(late.any()):
            return tok
    # The kept set reaches past the head: a nucleus (top-p alone) by binning its row on the CPU,
    # anything else (a GPU, or top-k whose edge ties run past the head) by a sort of the row.
    if dev.type == "cpu":
        bins = late & (k == 0)
        if bool(bins.any()):
            tok[bins] = _nucleus(x, bins.nonzero().squeeze(1), temp, p, z_all, u, compiled)
        late &= ~bins
    if bool(late.any()):
        rows = late.nonzero().squeeze(1)
        svals, sids = torch.sort(x[rows], dim=-1, descending=True, stable=True)
        tok[rows], _ = _finish(svals, sids, temp[rows], p[rows], k[rows], u[rows], z_all[rows],
                               torch.full((rows.numel(),), V, device=dev), True)
    return tok


def _nucleus(x, rows, temp, p, z_all, u, compiled: bool) -> torch.Tensor:
    """The tokens of top-p rows `rows` of x whose nucleus lies past the head (CPU): by the compiled
    search (worker/cpu_sampling.cpp nucleus_weights) where `compiled`, else by _nucleus_by_bins."""
    if compiled:
        out = scratch_like(x, "nucleus")[:rows.numel()]
        return _pick_whole(cpu_kernels.nucleus_weights(x, rows, temp[rows], p[rows], out), u[rows])
    return torch.tensor([_nucleus_by_bins(x[r], float(temp[r]), float(p[r]), float(z_all[r]), u[r:r + 1])
                         for r in rows.tolist()], dtype=torch.int64)


def _head(x, m: int):
    """(values, ids, exact): each row's m best candidates in stable descending order (value
    descending, ties to the lower id), the first `exact` of them certainly those of a stable sort
    of the row. float32 rows on the CPU: one compiled scan, exact everywhere."""
    R = x.shape[0]
    if cpu_kernels.fused_ok(x) and x.is_contiguous():
        vals, ids = cpu_kernels.head_stable(x, m)
        return vals, ids, torch.full((R,), m, dtype=torch.int64)
    vals, ids = torch.topk(x, m + 1, dim=-1)
    # The head's first m are those of a stable sort, up to ties at its last value (topk takes any
    # of them): whole when the (m+1)-th is lower (or they are -inf, weightless), else exact only
    # above that value.
    exact = torch.full((R,), m, dtype=torch.int64, device=x.device)
    tied = (vals[:, m] == vals[:, m - 1]) & ~torch.isinf(vals[:, m - 1])
    if bool(tied.any()):    # every value above the tie is in the head: count there, not over the row
        rows = tied.nonzero().squeeze(1)  # (bfloat16 logits tie often: a row pass here cost ~8% of a step)
        exact[rows] = (vals[rows, :m] > vals[rows, m - 1:m]).sum(-1)
    vals, ids = vals[:, :m], ids[:, :m]
    by_id = torch.argsort(ids, dim=-1)                  # ties in id order: by id, then a stable sort by value
    vals, ids = vals.gather(1, by_id), ids.gather(1, by_id)
    by_val = torch.sort(vals, dim=-1, descending=True, stable=True).indices
    return vals.gather(1, by_val), ids.gather(1, by_val), exact


NUCLEUS_BINS = 4096


def _nucleus_by_bins(x, t: float, p: float, z: float, u) -> int:
    """A top-p draw whose nucleus is large, without sorting the row: the logits go into bins by
    value, every bin above the one where the mass from the top reaches p * z is kept whole, and
    only that bin's ids are sorted (value descending, ties by id) to find where the nucleus ends;
    then the inverse CDF over the kept ids, in id order. O(vocabulary): a few ms a row where its
    sort took ~6. (The mass above the cut is summed per bin rather than token by token in sorted
    order: the two roundings could disagree only within ~1e-15 of a token's boundary.)"""
    w = _row_weights(x[None], torch.tensor([t], dtype=torch.float64), "row weights")[0].numpy()
    xs = x.numpy()
    finite = np.isfinite(xs)
    lo, hi = float(xs[finite].min()), float(xs[finite].max())
    scale = (NUCLEUS_BINS - 1) / (hi - lo) if hi > lo else 0.0
    b = np.where(finite, ((np.where(finite, xs, lo) - lo) * scale).astype(np.int64), 0)
    mass = np.bincount(b, weights=w, minlength=NUCLEUS_BINS)
    above = np.cumsum(mass[::-1])[::-1] - mass            # mass of every higher bin
    cut = int(np.flatnonzero(above < p * z).min())        # the lowest bin whose mass above is < p z
    members = np.flatnonzero(b == cut)
    if not members.size:       # (only where p * z rounds above the bins' own total: keep every token)
        return int(_pick_whole(torch.from_numpy(w[None].astype(np.float64)), u)[0])
    order = members[np.lexsort((members, -xs[members]))]  # value descending, ties by id
    before = above[cut] + np.cumsum(w[order]) - w[order]
    kept = order[before < p * z]
    weights = np.where(b > cut, w, 0.0)
    weights[kept] = w[kept]
    if not weights.any():                                 # at least one token: the heaviest
        weights[order[0]] = w[order[0]]
    return int(_pick_whole(torch.from_numpy(weights[None]), u)[0])


def _finish(vals, ids, temp, p, k, u, z_all, exact, whole_row: bool):
    """Candidates [R, C] (value descending, ties by id; the first `exact` of each row are those of
    a stable sort of the row) -> (tokens, whether each row's kept set lies within those, as it must
    for its token to count). `whole_row`: the candidates are the whole sorted row."""
    R, C = vals.shape
    w = _weights(vals, vals[:, :1], temp)
    # top-k keeps every token whose logit ties the k-th one, as transformers and vLLM do (a threshold)
    edge = vals.gather(1, (torch.clamp(k, 1, C) - 1)[:, None])
    cut = (k[:, None] > 0) & (vals < edge)
    w = w.masked_fill(cut, 0.0)
    kept = C - cut.sum(-1)                               # the top-k set's size, its ties included
    c = w.cumsum(-1)
    z = torch.where(k > 0, c.gather(1, (kept - 1)[:, None]).squeeze(1), z_all)
    keep = (c - w) < p[:, None] * z[:, None]             # mass strictly above it < top_p
    keep[:, 0] = True
    reach = c.gather(1, (torch.clamp(exact, 1, C) - 1)[:, None]).squeeze(1)
    # a top-k set fits when a lower value follows its ties within the exact candidates (or the k-th
    # value is -inf: every finite one is above it, and -inf weighs nothing)
    k_fits = (kept < exact) | ((k <= exact) & torch.isinf(edge.squeeze(1))) | whole_row
    fits = torch.where(k > 0, k_fits, (reach >= p * z) | whole_row)
    w = w * keep
    if whole_row:   # back to id order by a scatter, not a second sort of the row
        return _pick_whole(torch.zeros_like(w).scatter_(1, ids, w), u), fits
    return _pick(w, ids, u), fits


def _weights(vals, vmax, temp) -> torch.Tensor:
    return torch.exp((vals.to(torch.float64) - vmax.to(torch.float64)) / temp[:, None])


def _pick(w, ids, u) -> torch.Tensor:
    """Inverse CDF over weights w [R, C] of candidate ids [R, C], in id order (_pick_whole over the
    candidates put in id order)."""
    order = torch.argsort(ids, dim=-1)
    w, ids = w.gather(1, order), ids.gather(1, order)
    return ids.gather(1, _pick_whole(w, u).to(ids.device)[:, None]).squeeze(1)
