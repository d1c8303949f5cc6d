// The sampler's passes over whole rows of logits (worker/sampler.py; worker/cpu_kernels.py builds
// and loads this file with the other kernels): weights, the draw over a row, min_p, the head of
// candidates for top-k, a top-p nucleus, and the grammar bitmask of structured outputs. float32
// rows of the vocabulary, one row per sampled sequence, rows in parallel (OpenMP, torch's thread
// count). Each
// keeps the set and the draw that worker/sampler.py defines (its torch / numpy forms are the
// reference the tests compare with).
// GCC 12 warns inside its own AVX-512 intrinsics (max_of's _mm512_max_ps) once inlined: a known
// false positive, as in cpu_attn_common.h.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_math.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using minipaged::exp_nonpositive;
using minipaged::max_of;

inline void weights_of_row(const float* xr, int V, float t, float* o) {
  const float m = max_of(xr, V);
#pragma omp simd
  for (int i = 0; i < V; ++i) {
    const float z = (xr[i] - m) / t;
    o[i] = exp_nonpositive(z > -88.f ? z : -88.f);   // (-inf and below: 0, without an int overflow)
  }
}

// Sampling weights, one row per sampled sequence (worker/sampler.py _row_weights): out = exp((x -
// max x) / T), float32, 0 where the argument is below -87.3 (masked -inf logits, and tokens below
// 1.2e-38 of the row's heaviest). One read for the max, one fused pass: torch's exp takes a slow
// path for arguments past float32's normal range (5x for -inf, 30x where results are subnormal).
void row_weights(const float* x, int R, int V, const float* temp, float* out, int num_threads) {
#pragma omp parallel for num_threads(std::max(1, num_threads)) schedule(static)
  for (int r = 0; r < R; ++r) weights_of_row(x + int64_t(r) * V, V, temp[r], out + int64_t(r) * V);
}

// The draw over a whole row (worker/sampler.py _pick_whole): the inverse CDF of weights w [R, V]
// in id order at u [R] in [0, 1): the chunk of `chunk` ids whose float64 running sum first exceeds
// u x total, then the id inside it; a weight of 0 is never picked (the pick stops at the chunk's
// last positive weight). One read of the row plus one chunk, where numpy took ~12 ms for 64 rows
// of 151,936 ids (float64 copies of every chunk).
void pick_whole(const float* w, int R, int V, const double* u, int chunk, int64_t* out, int num_threads) {
  const int nchunks = (V + chunk - 1) / chunk;
#pragma omp parallel for num_threads(std::max(1, num_threads)) schedule(static)
  for (int r = 0; r < R; ++r) {
    const float* wr = w + int64_t(r) * V;
    std::vector<double> cdf(nchunks);
    double run = 0.0;
    for (int c = 0; c < nchunks; ++c) {
      const int a = c * chunk, b = std::min(V, a + chunk);
      double s = 0.0;
#pragma omp simd reduction(+ : s)
      for (int i = a; i < b; ++i) s += double(wr[i]);
      run += s;
      cdf[c] = run;
    }
    const double target = u[r] * run;
    int c = 0;
    while (c < nchunks - 1 && cdf[c] <= target) ++c;            // the first chunk whose cdf > target
    while (c > 0 && cdf[c] == (c ? cdf[c - 1] : 0.0)) --c;      // (rounding past the mass: back to a heavy chunk)
    double left = target - (c > 0 ? cdf[c - 1] : 0.0);
    const int a = c * chunk, b = std::min(V, a + chunk);
    int pick = a, last = a;
    double inner = 0.0;
    bool found = false;
    for (int i = a; i < b; ++i) {
      if (wr[i] > 0.f) last = i;
      inner += double(wr[i]);
      if (!found && inner > left) { pick = i; found = true; }
    }
    out[r] = found ? std::min(pick, last) : last;
  }
}

// min_p in place (worker/logits_processors.py apply_min_p): row r of x [R, V] keeps the logits >=
// its max + drop[r] (drop = temperature x ln(min_p), <= 0), -inf elsewhere. One read for the max
// and one pass, where torch's amax, compare and masked_fill took three.
void min_p_mask(float* x, int R, int V, const float* drop, int num_threads) {
  const float ninf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for num_threads(std::max(1, num_threads)) schedule(static)
  for (int r = 0; r < R; ++r) {
    float* xr = x + int64_t(r) * V;
    const float cut = max_of(xr, V) + drop[r];
#pragma omp simd
    for (int i = 0; i < V; ++i) xr[i] = xr[i] < cut ? ninf : xr[i];
  }
}

// The first m of each row's stable descending order (value descending, ties to the lower id): the
// sampler's head of candidates for top-k / top-p (worker/sampler.py _draw_filtered), exact at its
// edge, where torch.topk takes any of the tied values (bfloat16 logits tie often) and the head then
// had to be re-sorted by id and value. One scan of the row against the worst kept value (16 at a
// time with AVX-512), a heap of m; the heap changes ~m ln(V / m) times on a row in random order.
void head_stable(const float* x, int R, int V, int m, float* vals, int64_t* ids, int num_threads) {
  using Entry = std::pair<float, int>;
  // a before b in the stable descending order; the heap's top is then the worst kept entry
  auto better = [](const Entry& a, const Entry& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  if (m <= 0 || m > V) return;       // (callers ask for 1 <= m <= V)
#pragma omp parallel for num_threads(std::max(1, num_threads)) schedule(static)
  for (int r = 0; r < R; ++r) {
    const float* xr = x + int64_t(r) * V;
    std::vector<Entry> heap;
    heap.reserve(m);
    int i = 0;
    for (; i < V && int(heap.size()) < m; ++i) {
      const float v = xr[i];           // NaN (a broken model) as -inf: the order must stay strict
      heap.emplace_back(v == v ? v : -std::numeric_limits<float>::infinity(), i);
      std::push_heap(heap.begin(), heap.end(), better);
    }
    float tau = heap.front().first;   // a later id enters only with a value above the worst kept
    auto offer = [&](int j) {
      if (xr[j] > tau) {
        std::pop_heap(heap.begin(), heap.end(), better);
        heap.back() = Entry(xr[j], j);
        std::push_heap(heap.begin(), heap.end(), better);
        tau = heap.front().first;
      }
    };
#if defined(__AVX512F__)
    for (; i + 16 <= V; i += 16) {
      __mmask16 mk = _mm512_cmp_ps_mask(_mm512_loadu_ps(xr + i), _mm512_set1_ps(tau), _CMP_GT_OQ);
      while (mk) {                     // in id order: ties keep the lower id
        offer(i + __builtin_ctz(mk));
        mk &= mk - 1;
      }
    }
#endif
    for (; i < V; ++i) offer(i);
    std::sort(heap.begin(), heap.end(), better);
    for (int j = 0; j < m; ++j) {
      vals[int64_t(r) * m + j] = heap[j].first;
      ids[int64_t(r) * m + j] = heap[j].second;
    }
  }
}

// Top-p alone whose nucleus reaches past the sampler's head of candidates (a flat row: a random-weight
// model's, or a high temperature), for rows[0, n) of x [R, V]: w [n, V] gets each row's weights
// (as row_weights) with every token outside its nucleus set to 0, ready for pick_whole. The nucleus
// is the smallest prefix of the stable descending order (value descending, ties to the lower id)
// whose mass reaches p[j] z (z: the row's total weight), at least one token. Without a sort: the
// finite logits go into kBins bins by value, the bins above the one where the mass from the top
// reaches p z are kept whole, and only that bin's ids are sorted. worker/sampler.py
// _nucleus_by_bins is the same search in numpy (~1.5 ms a row of 151,936; this: a few passes). The
// mass above the cut bin is summed per bin, not token by token in sorted order: the two roundings
// could disagree only within ~1e-15 of a token's boundary.
constexpr int kBins = 4096;

void nucleus_weights(const float* x, int V, const int64_t* rows, int n, const float* temp, const double* p,
                     float* w, int num_threads) {
  constexpr float kInf = std::numeric_limits<float>::infinity(), kMax = std::numeric_limits<float>::max();
#pragma omp parallel num_threads(std::max(1, num_threads))
  {
    std::vector<uint16_t> bins(V);
    std::vector<double> mass(4 * kBins);              // 4 interleaved sums: no chain of adds to one bin
    std::vector<std::pair<float, int>> members;
#pragma omp for schedule(dynamic, 1)
    for (int j = 0; j < n; ++j) {
      const float* xr = x + rows[j] * V;
      float* wr = w + int64_t(j) * V;
      weights_of_row(xr, V, temp[j], wr);
      float lo = kInf, hi = -kInf;
      double total = 0.0;                               // z: the row's mass
#pragma omp simd reduction(min : lo) reduction(max : hi) reduction(+ : total)
      for (int i = 0; i < V; ++i) {
        const bool finite = std::fabs(xr[i]) <= kMax;
        lo = std::min(lo, finite ? xr[i] : kInf);
        hi = std::max(hi, finite ? xr[i] : -kInf);
        total += double(wr[i]);
      }
      if (!(lo <= hi)) continue;                        // (no finite logit: nothing to cut)
      // bins by value, monotone (float rounding is), the non-finite in bin 0 (their weight is 0)
      const float scale = hi > lo ? float(kBins - 1) / (hi - lo) : 0.f;
#pragma omp simd
      for (int i = 0; i < V; ++i) {
        const bool finite = std::fabs(xr[i]) <= kMax;
        bins[i] = uint16_t(std::min(int(((finite ? xr[i] : lo) - lo) * scale), kBins - 1));
      }
      std::fill(mass.begin(), mass.end(), 0.0);
      for (int i = 0; i < V; ++i) mass[(i & 3) * kBins + bins[i]] += double(wr[i]);
      const double target = p[j] * total;
      auto bin_mass = [&](int b) { return (mass[b] + mass[kBins + b]) + (mass[2 * kBins + b] + mass[3 * kBins + b]); };
      double above = 0.0;                               // the mass of the bins above `cut`
      int cut = kBins - 1;
      while (cut > 0 && above + bin_mass(cut) < target) above += bin_mass(cut--);
      members.clear();
      for (int i = 0; i < V; ++i)
        if (bins[i] == cut && std::fabs(xr[i]) <= kMax) members.emplace_back(xr[i], i);
      if (members.empty()) continue;                    // (p z past the bins' own total: keep every token)
      std::sort(members.begin(), members.end(), [](const auto& a, const auto& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
      });
      size_t kept = 0;                                  // the prefix of the cut bin whose mass before is < p z
      for (double before = above; kept < members.size() && before < target; ++kept) before += wr[members[kept].second];
      kept = std::max<size_t>(kept, 1);                // at least one token (p z <= 0 keeps none above)
      // (the row's heaviest token is in the cut bin's kept prefix or above it: some weight stays)
      const float last_v = members[kept - 1].first;
      const int last_i = members[kept - 1].second, c = cut;
#pragma omp simd
      for (int i = 0; i < V; ++i) {
        const bool keep = bins[i] > c || (bins[i] == c && (xr[i] > last_v || (xr[i] == last_v && i <= last_i)));
        wr[i] = keep ? wr[i] : 0.f;
      }
    }
  }
}

// Structured outputs (worker/grammar_mask.py apply): in row rows[g] of x [*, V], -inf wherever bit
// j of word w of words[g] [G, W] is 0 (token 32 w + j not allowed by the grammar; xgrammar's
// layout). A masked store of -inf per 16 tokens, allowed ones untouched: one pass over the row,
// where xgrammar's CPU kernel took ~17 ms for 64 rows of 151,936 on 2 cores.
void grammar_mask(float* x, int V, const int64_t* rows, int G, const int32_t* words, int W, int num_threads) {
  const float ninf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for num_threads(std::max(1, num_threads)) schedule(static)
  for (int g = 0; g < G; ++g) {
    float* xr = x + rows[g] * V;
    const uint32_t* wr = reinterpret_cast<const uint32_t*>(words) + int64_t(g) * W;
    int i = 0;
#if defined(__AVX512F__)
    const __m512 inf16 = _mm512_set1_ps(ninf);
    for (; i + 32 <= V; i += 32) {
      const uint32_t bad = ~wr[i / 32];
      if (bad == 0) continue;
      _mm512_mask_storeu_ps(xr + i, __mmask16(bad & 0xffffu), inf16);
      _mm512_mask_storeu_ps(xr + i + 16, __mmask16(bad >> 16), inf16);
    }
#endif
    for (; i < V; ++i)
      if (!((wr[i / 32] >> (i % 32)) & 1u)) xr[i] = ninf;
  }
}

}  // namespace

extern "C" {

void minipaged_pick_whole_f32(const float* w, int R, int V, const double* u, int chunk, int64_t* out,
                              int num_threads) {
  pick_whole(w, R, V, u, chunk, out, num_threads);
}

void minipaged_head_stable_f32(const float* x, int R, int V, int m, float* vals, int64_t* ids, int num_threads) {
  head_stable(x, R, V, m, vals, ids, num_threads);
}

void minipaged_min_p_f32(float* x, int R, int V, const float* drop, int num_threads) {
  min_p_mask(x, R, V, drop, num_threads);
}

void minipaged_row_weights_f32(const float* x, int R, int V, const float* temp, float* out, int num_threads) {
  row_weights(x, R, V, temp, out, num_threads);
}

void minipaged_grammar_mask_f32(float* x, int V, const int64_t* rows, int G, const int32_t* words, int W,
                                int num_threads) {
  grammar_mask(x, V, rows, G, words, W, num_threads);
}

void minipaged_nucleus_weights_f32(const float* x, int V, const int64_t* rows, int n, const float* temp,
                                   const double* p, float* w, int num_threads) {
  nucleus_weights(x, V, rows, n, temp, p, w, num_threads);
}

}  // extern "C"
