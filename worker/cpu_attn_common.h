// What the paged attention loops share (worker/cpu_attn_decode.cpp, cpu_attn_prefill.cpp): the
// tables' checks, a softmax row's max and sum, and one head's dot products against a block's keys
// and weighted sum of its values, in a generic form and in AVX2, AVX-512 and AVX512_BF16 registers;
// and the dispatch that gives the common head dims their own instantiation.
//
// Layout (DESIGN section 4): key_cache / value_cache [num_blocks, Hkv, block_size, D], contiguous;
// context position p of sequence b lives in block block_tables[b, p / block_size] at offset
// p % block_size; query head h reads kv head h / G. query [B, H, D], out [B, H, D], contiguous.
//
// Numerics: scores = (q . k) * scale in the compute type T (float for float32 models, double for
// float64 ones, like the torch backend), a max-subtracted exp, P.V, one division by the sum at the
// end. Plain loops with `omp simd` (no -ffast-math: linking it would switch the whole process to
// flush-to-zero; -fno-trapping-math, which changes no value, lets exp_nonpositive vectorize).
// Parallel with the OpenMP runtime torch already loaded (same libgomp soname), with as many
// threads as torch uses (the caller passes torch.get_num_threads()).
// GCC 12 warns inside its own AVX-512 intrinsics (the _mm512_undefined_ps of _mm512_max_ps and
// the reductions) once they are inlined here: a known false positive.
#pragma once
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <omp.h>
#include <type_traits>
#include <vector>

#include "cpu_math.h"

using namespace minipaged;  // exp_nonpositive, widen, round_bf16, load, store

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

// Every block a sequence reads must exist: returns 1 + the first bad sequence, or 0. (The worker
// validates Steps before they get here; this keeps a wrong direct call an error, not a crash.)
inline int check_tables(const int32_t* block_tables, int max_blocks, const int32_t* seq_lens, int B,
                 int block_size, int num_blocks) {
  for (int b = 0; b < B; ++b) {
    const int len = seq_lens[b];
    if (len < 0 || int64_t(len) > int64_t(max_blocks) * block_size) return b + 1;
    for (int j = 0; j < (len + block_size - 1) / block_size; ++j) {
      const int32_t blk = block_tables[int64_t(b) * max_blocks + j];
      if (blk < 0 || blk >= num_blocks) return b + 1;
    }
  }
  return 0;
}

// The same for a prefill: also every sequence's queries inside the chunk's tokens and its context.
inline int check_prefill(const int32_t* block_tables, int max_blocks, const int32_t* seq_lens, const int32_t* q_starts,
                  const int32_t* q_lens, int S, int num_tokens, int block_size, int num_blocks) {
  if (const int bad = check_tables(block_tables, max_blocks, seq_lens, S, block_size, num_blocks)) return bad;
  for (int s = 0; s < S; ++s)
    if (q_lens[s] < 1 || q_lens[s] > seq_lens[s] || q_starts[s] < 0 ||
        int64_t(q_starts[s]) + q_lens[s] > num_tokens)
      return s + 1;
  return 0;
}


// A softmax row's max (exact in any order, so vectorized) and sum: float32 sums in vector lanes
// (a compiled in-order sum is one add at a time, ~10% of a prefill); float64, the parity mode,
// keeps the in-order sum.
template <typename T>
inline T row_max(const T* s, int n) {
  if constexpr (std::is_same_v<T, float>) return max_of(s, n);
  T mx = -std::numeric_limits<T>::infinity();
  for (int p = 0; p < n; ++p) mx = std::max(mx, s[p]);
  return mx;
}

template <typename T>
inline T row_sum(const T* s, int n) {
  T sum = 0;
  if constexpr (std::is_same_v<T, float>) {
#pragma omp simd reduction(+ : sum)
    for (int p = 0; p < n; ++p) sum += s[p];
  } else {
    for (int p = 0; p < n; ++p) sum += s[p];
  }
  return sum;
}

// One head's scores against n keys of a block, s[i] = (q . k[i]) * scale (k rows D apart), and
// its weighted sum of n value rows, a += sum_i w[i] v[i]. Generic form: four keys at a time (four
// independent FMA chains) and a running sum along d. C is the cache's element type (T, or
// uint16_t for bfloat16); kD only selects a specialization below.
template <typename T, typename C, int kD>
inline void score_keys(const T* q, const C* k, int n, int D, T scale, T* s) {
  int i = 0;
  for (; i + 4 <= n; i += 4) {
    const C *k0 = k + int64_t(i) * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
    T d0 = 0, d1 = 0, d2 = 0, d3 = 0;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
    for (int d = 0; d < D; ++d) {
      d0 += q[d] * widen(k0[d]);
      d1 += q[d] * widen(k1[d]);
      d2 += q[d] * widen(k2[d]);
      d3 += q[d] * widen(k3[d]);
    }
    s[i] = d0 * scale, s[i + 1] = d1 * scale, s[i + 2] = d2 * scale, s[i + 3] = d3 * scale;
  }
  for (; i < n; ++i) {
    const C* kr = k + int64_t(i) * D;
    T dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int d = 0; d < D; ++d) dot += q[d] * widen(kr[d]);
    s[i] = dot * scale;
  }
}

template <typename T, typename C, int kD>
inline void add_weighted(const T* w, const C* v, int n, int D, T* a) {
  for (int i = 0; i < n; ++i) {
    const C* vr = v + int64_t(i) * D;
    const T wi = w[i];
#pragma omp simd
    for (int d = 0; d < D; ++d) a[d] += wi * widen(vr[d]);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// float32 with a head dim of 64 or 128, in AVX2 registers (~3% of a decode step on this project's
// 2-core EPYC, whose decode attention waits on memory; more where K/V is in cache). Scores: eight keys
// at a time, one accumulator vector each along d, then one transpose-add turns the eight vectors
// into eight scores; the generic form pays a horizontal sum per key. Weighted sum: 64 values of d
// in eight accumulator registers across all n rows; the generic form loads and stores a[] for
// every row.
inline __m256 sum8(const __m256* a) {  // lane j = the sum of a[j]'s lanes
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // eight bfloat16 values, widened
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

#if defined(__AVX512F__)
// AVX-512, float32 cache: the same sums in 16-lane registers, half the instructions. Decode
// attention streams K and V from memory but its arithmetic does not hide behind those reads
// (0.6B heads, 16 x ~256 tokens: 0.3 ms a layer in cache, 0.85-1.0 from memory), so it counts.
inline __m256 fold(__m512 a) {  // lanes j and j + 8 added: 16 -> 8
  return _mm256_add_ps(_mm512_castps512_ps256(a),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

template <int kD>
inline int score_keys_f32_512(const float* q, const float* k, int n, float scale, float* s) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    __m512 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_ps();
    const float* kb = k + int64_t(i) * kD;
#pragma GCC unroll 8
    for (int c = 0; c < kD; c += 16) {
      const __m512 qc = _mm512_loadu_ps(q + c);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) acc[j] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(kb + j * kD + c), acc[j]);
    }
    __m256 h[8];
    for (int j = 0; j < 8; ++j) h[j] = fold(acc[j]);
    _mm256_storeu_ps(s + i, _mm256_mul_ps(sum8(h), _mm256_set1_ps(scale)));
  }
  return i;
}

template <int kD>
inline void add_weighted_f32_512(const float* w, const float* v, int n, float* a) {
  constexpr int kVecs = kD / 16;
  __m512 acc[kVecs];
  for (int c = 0; c < kVecs; ++c) acc[c] = _mm512_loadu_ps(a + 16 * c);
  for (int i = 0; i < n; ++i) {
    const __m512 wi = _mm512_set1_ps(w[i]);
    const float* vr = v + int64_t(i) * kD;
#pragma GCC unroll 8
    for (int c = 0; c < kVecs; ++c) acc[c] = _mm512_fmadd_ps(wi, _mm512_loadu_ps(vr + 16 * c), acc[c]);
  }
  for (int c = 0; c < kVecs; ++c) _mm512_storeu_ps(a + 16 * c, acc[c]);
}
#endif

template <typename C, int kD>
inline void score_keys_f32(const float* q, const C* k, int n, float scale, float* s) {
  int i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<C, float>) i = score_keys_f32_512<kD>(q, k, n, scale, s);
#endif
  for (; i + 8 <= n; i += 8) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    const C* kb = k + int64_t(i) * kD;
#pragma GCC unroll 16
    for (int c = 0; c < kD; c += 8) {
      const __m256 qc = _mm256_loadu_ps(q + c);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qc, load8(kb + j * kD + c), acc[j]);
    }
    _mm256_storeu_ps(s + i, _mm256_mul_ps(sum8(acc), _mm256_set1_ps(scale)));
  }
  if (i < n) score_keys<float, C, 0>(q, k + int64_t(i) * kD, n - i, kD, scale, s + i);
}

template <typename C, int kD>
inline void add_weighted_f32(const float* w, const C* v, int n, float* a) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<C, float> && kD == 128) return add_weighted_f32_512<kD>(w, v, n, a);
#endif
  for (int c0 = 0; c0 < kD; c0 += 64) {
    __m256 acc[8];
    for (int c = 0; c < 8; ++c) acc[c] = _mm256_loadu_ps(a + c0 + 8 * c);
    for (int i = 0; i < n; ++i) {
      const __m256 wi = _mm256_set1_ps(w[i]);
      const C* vr = v + int64_t(i) * kD + c0;
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(wi, load8(vr + 8 * c), acc[c]);
    }
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(a + c0 + 8 * c, acc[c]);
  }
}

#define MINIPAGED_F32_SPECIALIZATION(C, D)                                                   \
  template <>                                                                                 \
  inline void score_keys<float, C, D>(const float* q, const C* k, int n, int, float scale,   \
                                      float* s) {                                             \
    score_keys_f32<C, D>(q, k, n, scale, s);                                                  \
  }                                                                                           \
  template <>                                                                                 \
  inline void add_weighted<float, C, D>(const float* w, const C* v, int n, int, float* a) {   \
    add_weighted_f32<C, D>(w, v, n, a);                                                       \
  }
MINIPAGED_F32_SPECIALIZATION(float, 64)
MINIPAGED_F32_SPECIALIZATION(float, 128)
#if !(defined(__AVX512F__) && defined(__AVX512BF16__))
MINIPAGED_F32_SPECIALIZATION(uint16_t, 64)
MINIPAGED_F32_SPECIALIZATION(uint16_t, 128)
#endif
#undef MINIPAGED_F32_SPECIALIZATION
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// float32 queries over a bfloat16 cache (the bfloat16 mode) on AVX512_BF16: the query rounded to
// bfloat16 once per call (as the AMX prefill and a bfloat16 model round it), then each key's
// score is D / 32 pair dot products (vdpbf16ps) straight from the cache, no widening: ~4x fewer
// instructions than the float32 form, which made decode attention compute-bound. The weighted
// sum of V widens 16 values at a time (a shift) into 16-lane accumulators.
template <int kD>
inline void score_keys_bf16(const float* q, const uint16_t* k, int n, float scale, float* s) {
  __m512bh qb[kD / 32];
  for (int c = 0; c < kD / 32; ++c)
    qb[c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 32 * c + 16), _mm512_loadu_ps(q + 32 * c));
  auto key = [&](const uint16_t* kr, int c) { return (__m512bh)_mm512_loadu_si512(kr + 32 * c); };
  int i = 0;
  for (; i + 4 <= n; i += 4) {
    const uint16_t* k0 = k + int64_t(i) * kD;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
#pragma GCC unroll 4
    for (int c = 0; c < kD / 32; ++c) {
      a0 = _mm512_dpbf16_ps(a0, qb[c], key(k0, c));
      a1 = _mm512_dpbf16_ps(a1, qb[c], key(k0 + kD, c));
      a2 = _mm512_dpbf16_ps(a2, qb[c], key(k0 + 2 * kD, c));
      a3 = _mm512_dpbf16_ps(a3, qb[c], key(k0 + 3 * kD, c));
    }
    s[i] = _mm512_reduce_add_ps(a0) * scale, s[i + 1] = _mm512_reduce_add_ps(a1) * scale;
    s[i + 2] = _mm512_reduce_add_ps(a2) * scale, s[i + 3] = _mm512_reduce_add_ps(a3) * scale;
  }
  for (; i < n; ++i) {
    __m512 a = _mm512_setzero_ps();
    for (int c = 0; c < kD / 32; ++c) a = _mm512_dpbf16_ps(a, qb[c], key(k + int64_t(i) * kD, c));
    s[i] = _mm512_reduce_add_ps(a) * scale;
  }
}

template <int kD>
inline void add_weighted_bf16(const float* w, const uint16_t* v, int n, float* a) {
  constexpr int kVecs = kD / 16;
  __m512 acc[kVecs];
  for (int c = 0; c < kVecs; ++c) acc[c] = _mm512_loadu_ps(a + 16 * c);
  for (int i = 0; i < n; ++i) {
    const __m512 wi = _mm512_set1_ps(w[i]);
    const uint16_t* vr = v + int64_t(i) * kD;
#pragma GCC unroll 8
    for (int c = 0; c < kVecs; ++c) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr + 16 * c));
      acc[c] = _mm512_fmadd_ps(wi, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)), acc[c]);
    }
  }
  for (int c = 0; c < kVecs; ++c) _mm512_storeu_ps(a + 16 * c, acc[c]);
}

#define MINIPAGED_BF16_SPECIALIZATION(D)                                                      \
  template <>                                                                                 \
  inline void score_keys<float, uint16_t, D>(const float* q, const uint16_t* k, int n, int,   \
                                             float scale, float* s) {                         \
    score_keys_bf16<D>(q, k, n, scale, s);                                                    \
  }                                                                                           \
  template <>                                                                                 \
  inline void add_weighted<float, uint16_t, D>(const float* w, const uint16_t* v, int n, int, \
                                               float* a) {                                    \
    add_weighted_bf16<D>(w, v, n, a);                                                         \
  }
MINIPAGED_BF16_SPECIALIZATION(64)
MINIPAGED_BF16_SPECIALIZATION(128)
#undef MINIPAGED_BF16_SPECIALIZATION
#endif

// The common head dims get their own instantiation; others run the generic one.
template <template <typename, typename, int> class Kernel, typename T, typename C, typename... Args>
int dispatch(int head_dim, Args... args) {
  switch (head_dim) {
    case 64: return Kernel<T, C, 64>::run(args...);
    case 128: return Kernel<T, C, 128>::run(args...);
    default: return Kernel<T, C, 0>::run(args...);
  }
}

}  // namespace
