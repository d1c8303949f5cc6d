// CPU kernels (worker/cpu_kernels.py builds and loads this file): the torch backend's paged
// attention, decode and prefill, each as one compiled loop over the cache (worker/attention_cpu.py;
// the torch code stays the reference), and two fused elementwise steps of the Qwen3 block
// (qk_norm_rope, silu_mul, add_rmsnorm; worker/layers.py).
//
// Decode: the torch formulation gathers every block a batch uses into a contiguous buffer, then
// runs two batched matmuls over it, so K and V cross memory about three times, and a decode step
// of a small model is mostly that traffic. Here each sequence reads its K and V blocks once,
// straight from the cache through its block table, whole blocks at a time (all kv heads: one
// contiguous run), and every query head of a GQA group is served from that read.
// Prefill: see paged_prefill below (register-blocked tiles instead of gather + SDPA, whose CPU
// GEMMs are MKL's slow path on AMD CPUs).
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

// The widest vector register: the prefill tiles below keep kRowBlock (kPvRows x 2) vectors of
// accumulators, which must fit in the 16 registers that AVX2 has, next to the operands.
#if defined(__AVX512F__)
constexpr int kVectorBytes = 64;
#else
constexpr int kVectorBytes = 32;
#endif

// A thread's decode reads, in the order its loop makes them (its sequences b, b + nt, ...: each
// one's K blocks, then its V blocks), asked for into L2 kLeadBytes before they are read. Blocks sit
// anywhere in the cache, so the hardware prefetcher cannot see the next one coming; asking for a
// sequence's blocks when it starts is too late for a short context (its first reads wait) and, for a
// long one, a burst that outruns the core's miss buffers (most of it dropped). Asked for at the pace
// of the reads, the next sequence arrives while this one computes.
constexpr int64_t kLeadBytes = 128 << 10;   // 256 KB: the same; 512 KB: slower (an L2 is 1 MB here)

template <typename C>
struct ReadAhead {
  const C* caches[2];              // K, V
  const int32_t* tables;
  const int32_t* lens;
  int max_blocks, B, step, block_size;
  int64_t block_stride;            // elements of one block (all kv heads)
  int b, kv = 0, j = 0;            // the next line to ask for: sequence b, cache kv, block j, at off
  int64_t off = 0, asked = 0;      // asked: bytes asked for so far

  void skip_empty() {
    while (b < B && lens[b] <= 0) b += step;
  }
  void ask_until(int64_t bytes) {
    while (asked < bytes && b < B) {
      __builtin_prefetch(caches[kv] + int64_t(tables[int64_t(b) * max_blocks + j]) * block_stride + off, 0, 2);
      asked += 64;
      if ((off += 64 / sizeof(C)) < block_stride) continue;
      off = 0;
      if (++j < (lens[b] + block_size - 1) / block_size) continue;
      j = 0;
      if (++kv < 2) continue;
      kv = 0;
      b += step;
      skip_empty();
    }
  }
};

// Every block a sequence reads must exist: returns 1 + the first bad sequence, or 0. (The worker
// validates Steps before they get here; this keeps a wrong direct call an error, not a crash.)
int check_tables(const int32_t* block_tables, int max_blocks, const int32_t* seq_lens, int B,
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
int check_prefill(const int32_t* block_tables, int max_blocks, const int32_t* seq_lens, const int32_t* q_starts,
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

// kD > 0: the head dim as a compile-time constant (the dot products unroll; ~25% faster for 64),
// 0: any head dim, at run time. See dispatch() for the instantiated ones. C: the caches' element
// type (T, or uint16_t: bfloat16 K/V read by float32 compute).
template <typename T, typename C, int kD>
int paged_decode(const T* query, const C* key_cache, const C* value_cache, int num_blocks,
                 const int32_t* block_tables, int max_blocks, const int32_t* seq_lens,
                 int B, int H, int Hkv, int block_size, int head_dim, T scale, T* out, int num_threads) {
  const int D = kD > 0 ? kD : head_dim;
  if (const int bad = check_tables(block_tables, max_blocks, seq_lens, B, block_size, num_blocks))
    return bad;
  const int G = H / Hkv;
  const int64_t head_stride = int64_t(block_size) * D;     // one kv head of one block
  const int64_t block_stride = Hkv * head_stride;          // one block, all kv heads
  int max_len = 1;
  for (int b = 0; b < B; ++b) max_len = std::max(max_len, int(seq_lens[b]));

  const int nt = std::max(1, std::min(num_threads, B));
  const int64_t unit_bytes = block_stride * int64_t(sizeof(C)) / H;   // read per (block, head) step
#pragma omp parallel num_threads(nt)
  {
    std::vector<T> scores(size_t(H) * max_len);  // this thread's [H, len] scores, then weights
    std::vector<T> acc(size_t(H) * D);
    // static, 1: thread t takes sequences t, t + nt, ..., so its reads are known ahead
    ReadAhead<C> ahead{{key_cache, value_cache}, block_tables, seq_lens, max_blocks, B, omp_get_num_threads(),
                       block_size, block_stride, omp_get_thread_num()};
    ahead.skip_empty();
    int64_t read = 0;                            // bytes this thread's loop has reached
#pragma omp for schedule(static, 1)
    for (int b = 0; b < B; ++b) {
      const int len = seq_lens[b];
      const T* q = query + int64_t(b) * H * D;
      T* o = out + int64_t(b) * H * D;
      const int32_t* table = block_tables + int64_t(b) * max_blocks;
      if (len <= 0) {  // empty context: zeros, like the torch backend
        std::fill(o, o + int64_t(H) * D, T(0));
        continue;
      }
      // 1. scores[h, p] = (q[h] . k[p]) * scale, block by block
      for (int p0 = 0; p0 < len; p0 += block_size) {
        const C* kb = key_cache + int64_t(table[p0 / block_size]) * block_stride;
        const int n = std::min(block_size, len - p0);
        for (int h = 0; h < H; ++h) {
          ahead.ask_until((read += unit_bytes) + kLeadBytes);
          const T* qh = q + int64_t(h) * D;
          const C* kh = kb + (h / G) * head_stride;
          T* s = scores.data() + size_t(h) * len + p0;
          score_keys<T, C, kD>(qh, kh, n, D, scale, s);
        }
      }
      // 2. weights = exp(s - max) per head, and their sum
      for (int h = 0; h < H; ++h) {
        T* s = scores.data() + size_t(h) * len;
        const T mx = row_max(s, len);
#pragma omp simd
        for (int p = 0; p < len; ++p) s[p] = exp_nonpositive(s[p] - mx);
        acc[size_t(h) * D] = row_sum(s, len);  // parked here until step 3 needs the row
      }
      std::vector<T> denom(H);
      for (int h = 0; h < H; ++h) denom[h] = acc[size_t(h) * D];
      // 3. out[h] = sum_p w[h, p] * v[p] / sum, block by block
      std::fill(acc.begin(), acc.end(), T(0));
      for (int p0 = 0; p0 < len; p0 += block_size) {
        const int j = p0 / block_size;
        const C* vb = value_cache + int64_t(table[j]) * block_stride;
        const int n = std::min(block_size, len - p0);
        for (int h = 0; h < H; ++h) {
          ahead.ask_until((read += unit_bytes) + kLeadBytes);
          const C* vh = vb + (h / G) * head_stride;
          const T* w = scores.data() + size_t(h) * len + p0;
          add_weighted<T, C, kD>(w, vh, n, D, acc.data() + size_t(h) * D);
        }
      }
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d) o[int64_t(h) * D + d] = acc[size_t(h) * D + d] / denom[h];
    }
  }
  return 0;
}

// Varlen causal prefill: sequence s's q_lens[s] queries are the last q_lens[s] positions of its
// context of seq_lens[s] tokens (a cached prefix may precede them); query row t of the chunk sees
// context positions 0 .. seq_len - q_len + t. A work item is one (sequence, kv head): its K rows
// are gathered once, transposed in groups of kLanes positions, so that scoring a tile of query
// rows (TQ tokens x the G heads of the group) is a small GEMM whose inner loop runs along
// positions with its accumulators in registers; then a per-row causal softmax, then P.V. Two
// passes rather than an online softmax: a tile's scores fit in L2 for any context. A bfloat16
// cache (C = uint16_t) has its V rows widened into one buffer per work item too.
template <typename T, typename C, int kD>
int paged_prefill(const T* query, const C* key_cache, const C* value_cache, int num_blocks,
                  const int32_t* block_tables, int max_blocks, const int32_t* seq_lens,
                  const int32_t* q_starts, const int32_t* q_lens, int S, int num_tokens, int H,
                  int Hkv, int block_size, int head_dim, T scale, T* out, int num_threads) {
  const int D = kD > 0 ? kD : head_dim;
  if (const int bad = check_prefill(block_tables, max_blocks, seq_lens, q_starts, q_lens, S, num_tokens,
                                    block_size, num_blocks))
    return bad;
  constexpr int kLanes = kVectorBytes / sizeof(T);  // positions per GEMM column block: one vector
  constexpr int kRowBlock = 8;             // score rows whose accumulators live in registers
  constexpr int kTileRows = 16;            // query rows (tokens x heads) scored together
  constexpr int kPvRows = 4;               // output rows whose accumulators live in registers
  if (D % kLanes != 0) return -1;          // the caller checks; vectors of d must tile D
  const int G = H / Hkv;
  const int TQ = std::max(1, kTileRows / G);                       // tokens per tile
  const int RP = (TQ * G + kRowBlock - 1) / kRowBlock * kRowBlock;  // rows, padded
  const int64_t head_stride = int64_t(block_size) * D;
  const int64_t block_stride = Hkv * head_stride;
  int max_len = 1;
  for (int s = 0; s < S; ++s) max_len = std::max(max_len, int(seq_lens[s]));
  const int max_pad = (max_len + kLanes - 1) / kLanes * kLanes;

#pragma omp parallel num_threads(std::max(1, std::min(num_threads, S * Hkv)))
  {
    std::vector<T> k_t(size_t(max_pad) * D), q_tile(size_t(RP) * D), o_tile(size_t(RP) * D);
    static_assert(kRowBlock % kPvRows == 0, "RP must be a multiple of kPvRows");
    std::vector<T> scores(size_t(RP) * max_pad), denom(RP);
    std::vector<const T*> v_rows(max_len);
    std::vector<T> v_wide(std::is_same_v<C, T> ? 0 : size_t(max_len) * D);
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < S * Hkv; ++item) {
      const int s = item / Hkv, kvh = item % Hkv;
      const int len = seq_lens[s], qlen = q_lens[s], prefix = len - qlen;
      const int32_t* table = block_tables + int64_t(s) * max_blocks;
      auto row_of = [&](const C* cache, int p) {
        return cache + int64_t(table[p / block_size]) * block_stride + kvh * head_stride +
               int64_t(p % block_size) * D;
      };
      // K transposed per group of kLanes positions: k_t[c][d][i] = k[c * kLanes + i][d]
      const int len_pad = (len + kLanes - 1) / kLanes * kLanes;
      for (int p = 0; p < len_pad; ++p) {
        T* dst = k_t.data() + size_t(p / kLanes) * D * kLanes + p % kLanes;
        if (p < len) {
          const C* k = row_of(key_cache, p);
          for (int d = 0; d < D; ++d) dst[size_t(d) * kLanes] = widen(k[d]);
        } else {
          for (int d = 0; d < D; ++d) dst[size_t(d) * kLanes] = T(0);
        }
      }
      for (int p = 0; p < len; ++p) {
        if constexpr (std::is_same_v<C, T>) {
          v_rows[p] = row_of(value_cache, p);
        } else {
          const C* v = row_of(value_cache, p);
          T* dst = v_wide.data() + size_t(p) * D;
#pragma omp simd
          for (int d = 0; d < D; ++d) dst[d] = widen(v[d]);
          v_rows[p] = dst;
        }
      }

      for (int t0 = 0; t0 < qlen; t0 += TQ) {
        const int nt = std::min(TQ, qlen - t0), R = nt * G;
        const int keys = prefix + t0 + nt;                    // what the tile's last row sees
        const int keys_pad = (keys + kLanes - 1) / kLanes * kLanes;
        // the tile's queries: row r = (token t0 + r / G, head kvh * G + r % G); padding is zero
        std::fill(q_tile.begin(), q_tile.end(), T(0));
        for (int r = 0; r < R; ++r) {
          const T* q = query + (int64_t(q_starts[s] + t0 + r / G) * H + kvh * G + r % G) * D;
          std::copy(q, q + D, q_tile.begin() + size_t(r) * D);
        }
        // 1. scores[r, p] = (q[r] . k[p]) * scale, kLanes positions x kRowBlock rows at a time
        for (int p0 = 0; p0 < keys; p0 += kLanes) {
          const T* kt = k_t.data() + size_t(p0 / kLanes) * D * kLanes;
          for (int r0 = 0; r0 < RP; r0 += kRowBlock) {
            T acc[kRowBlock][kLanes] = {};
            for (int d = 0; d < D; ++d) {
              for (int rr = 0; rr < kRowBlock; ++rr) {
                const T qv = q_tile[size_t(r0 + rr) * D + d];
#pragma omp simd
                for (int i = 0; i < kLanes; ++i) acc[rr][i] += qv * kt[size_t(d) * kLanes + i];
              }
            }
            for (int rr = 0; rr < kRowBlock; ++rr)
              for (int i = 0; i < kLanes; ++i)
                scores[size_t(r0 + rr) * keys_pad + p0 + i] = acc[rr][i] * scale;
          }
        }
        // 2. causal softmax per row: row r sees positions 0 .. prefix + t0 + r / G
        for (int r = 0; r < R; ++r) {
          T* row = scores.data() + size_t(r) * keys_pad;
          const int visible = prefix + t0 + r / G + 1;
          const T mx = row_max(row, visible);
#pragma omp simd
          for (int p = 0; p < visible; ++p) row[p] = exp_nonpositive(row[p] - mx);
          std::fill(row + visible, row + keys_pad, T(0));
          denom[r] = row_sum(row, visible);
        }
        // 3. out[r] = sum_p w[r, p] * v[p]: kPvRows rows x two vectors of d at a time (8
        //    independent FMA chains; 6 loads feed 8 FMAs). A D that is no multiple of two
        //    vectors: one vector of d, two accumulators each (even / odd positions).
        const bool two_vectors = D % (2 * kLanes) == 0;
        for (int r0 = 0; two_vectors && r0 < R; r0 += kPvRows) {
          for (int d0 = 0; d0 < D; d0 += 2 * kLanes) {
            T acc[kPvRows][2][kLanes] = {};
            const T* w = scores.data() + size_t(r0) * keys_pad;
            for (int p = 0; p < keys; ++p) {
              const T* v = v_rows[p] + d0;
              for (int rr = 0; rr < kPvRows; ++rr) {
                const T wp = w[size_t(rr) * keys_pad + p];
#pragma omp simd
                for (int i = 0; i < kLanes; ++i) {
                  acc[rr][0][i] += wp * v[i];
                  acc[rr][1][i] += wp * v[kLanes + i];
                }
              }
            }
            for (int rr = 0; rr < kPvRows; ++rr)
              for (int i = 0; i < 2 * kLanes; ++i)
                o_tile[size_t(r0 + rr) * D + d0 + i] = acc[rr][i / kLanes][i % kLanes];
          }
        }
        for (int r0 = 0; !two_vectors && r0 < R; r0 += kPvRows) {
          for (int d0 = 0; d0 < D; d0 += kLanes) {
            T acc[kPvRows][2][kLanes] = {};
            const T* w = scores.data() + size_t(r0) * keys_pad;
            int p = 0;
            for (; p + 1 < keys; p += 2) {
              const T* v0 = v_rows[p] + d0;
              const T* v1 = v_rows[p + 1] + d0;
              for (int rr = 0; rr < kPvRows; ++rr) {
                const T w0 = w[size_t(rr) * keys_pad + p], w1 = w[size_t(rr) * keys_pad + p + 1];
#pragma omp simd
                for (int i = 0; i < kLanes; ++i) {
                  acc[rr][0][i] += w0 * v0[i];
                  acc[rr][1][i] += w1 * v1[i];
                }
              }
            }
            if (p < keys) {
              const T* v0 = v_rows[p] + d0;
              for (int rr = 0; rr < kPvRows; ++rr) {
                const T w0 = w[size_t(rr) * keys_pad + p];
#pragma omp simd
                for (int i = 0; i < kLanes; ++i) acc[rr][0][i] += w0 * v0[i];
              }
            }
            for (int rr = 0; rr < kPvRows; ++rr)
              for (int i = 0; i < kLanes; ++i)
                o_tile[size_t(r0 + rr) * D + d0 + i] = acc[rr][0][i] + acc[rr][1][i];
          }
        }
        for (int r = 0; r < R; ++r) {
          T* o = out + (int64_t(q_starts[s] + t0 + r / G) * H + kvh * G + r % G) * D;
          for (int d = 0; d < D; ++d) o[d] = o_tile[size_t(r) * D + d] / denom[r];
        }
      }
    }
  }
  return 0;
}

}  // namespace

// QK-norm then RoPE, the steps between the qkv projection and attention (HF's Qwen3Attention):
// for each token and head, x = the head's D values of qkv; x = x / sqrt(mean(x^2) + eps) * w (w:
// q_norm or k_norm weight); then out = x * cos + rotate_half(x) * sin, rotate_half(x) =
// (-x[D/2:], x[:D/2]). One pass over q and k instead of ~22 torch ops, each a full read and write.
// In: float32 qkv, or bfloat16 (the bfloat16 mode: then k is written as bfloat16, the cache's
// type, and q stays float32 for the attention loops). The math is float32 either way.
template <typename In, typename KOut>
void qk_norm_rope(const In* qkv, int64_t row_stride, int T, int H, int Hkv, int D,
                  const float* q_weight, const float* k_weight, float eps, const float* cos,
                  const float* sin, float* q_out, KOut* k_out, int num_threads) {
  const int half = D / 2;
#pragma omp parallel for num_threads(std::max(1, num_threads)) schedule(static)
  for (int t = 0; t < T; ++t) {
    const float* c = cos + int64_t(t) * D;
    const float* s = sin + int64_t(t) * D;
    for (int h = 0; h < H + Hkv; ++h) {
      const In* xin = qkv + int64_t(t) * row_stride + int64_t(h) * D;   // q heads, then k heads
      const float* w = h < H ? q_weight : k_weight;
      float x[512], y[512];                           // D <= 512 (checked by the caller)
#pragma omp simd
      for (int d = 0; d < D; ++d) x[d] = load(xin, d);
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int d = 0; d < D; ++d) ss += x[d] * x[d];
      const float rstd = 1.f / std::sqrt(ss / float(D) + eps);
#pragma omp simd
      for (int d = 0; d < D; ++d) y[d] = x[d] * rstd * w[d];
      if (h < H) {
        float* o = q_out + (int64_t(t) * H + h) * D;
#pragma omp simd
        for (int d = 0; d < half; ++d) {
          o[d] = y[d] * c[d] - y[d + half] * s[d];
          o[d + half] = y[d + half] * c[d + half] + y[d] * s[d + half];
        }
      } else {
        KOut* o = k_out + (int64_t(t) * Hkv + h - H) * D;
#pragma omp simd
        for (int d = 0; d < half; ++d) {
          store(o, d, y[d] * c[d] - y[d + half] * s[d]);
          store(o, d + half, y[d + half] * c[d + half] + y[d] * s[d + half]);
        }
      }
    }
  }
}

// SwiGLU's middle: out = silu(gate) * up, silu(g) = g / (1 + exp(-g)), written with exp of a
// non-positive argument only (the vectorized exp above): g >= 0: g / (1 + e), g < 0: g e / (1 + e),
// e = exp(-|g|). float32, or bfloat16 in and out (the bfloat16 mode; float32 math).
template <typename X>
void silu_mul(const X* gate_up, int64_t row_stride, int T, int I, X* out, int num_threads) {
#pragma omp parallel for num_threads(std::max(1, num_threads)) schedule(static)
  for (int t = 0; t < T; ++t) {
    const X* g = gate_up + int64_t(t) * row_stride;
    const X* u = g + I;
    X* o = out + int64_t(t) * I;
#pragma omp simd
    for (int i = 0; i < I; ++i) {
      const float gi = load(g, i);
      const float e = exp_nonpositive(-std::fabs(gi));
      const float silu = (gi >= 0.f ? gi : gi * e) / (1.f + e);
      store(o, i, silu * load(u, i));
    }
  }
}

// The residual step and RMSNorm, one pass per row of the float32 residual stream: h += y (y: a
// sublayer's output, float32 or bfloat16, or none), then out = h / sqrt(mean(h^2) + eps) * w, the
// next GEMM's input (float32, or rounded to bfloat16 in the bfloat16 mode). HF's Qwen3RMSNorm in
// float32, with the statistic summed in vector lanes; instead of ~8 torch ops, each a full read and
// write of the activations (and in the bfloat16 mode a float32 copy of every GEMM output).
template <typename Y, typename Out>
void add_rmsnorm(float* h, const Y* y, int T, int n, const float* w, float eps, Out* out, int num_threads) {
#pragma omp parallel for num_threads(std::max(1, num_threads)) schedule(static)
  for (int t = 0; t < T; ++t) {
    float* r = h + int64_t(t) * n;
    if (y != nullptr) {
      const Y* yr = y + int64_t(t) * n;
#pragma omp simd
      for (int i = 0; i < n; ++i) r[i] += load(yr, i);
    }
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < n; ++i) ss += r[i] * r[i];
    const float rstd = 1.f / std::sqrt(ss / float(n) + eps);
    Out* o = out + int64_t(t) * n;
#pragma omp simd
    for (int i = 0; i < n; ++i) store(o, i, r[i] * rstd * w[i]);
  }
}

namespace minipaged_attn_bf16 {  // worker/cpu_attn_bf16.cpp
int engines();
int paged_prefill_bf16(int engine, const float* query, const uint16_t* key_cache, const uint16_t* value_cache,
                       const int32_t* block_tables, int max_blocks, const int32_t* seq_lens, const int32_t* q_starts,
                       const int32_t* q_lens, int S, int H, int Hkv, int block_size, int D, float scale, float* out,
                       int num_threads);
}

// The common head dims get their own instantiation; others run the generic one.
template <template <typename, typename, int> class Kernel, typename T, typename C, typename... Args>
int dispatch(int head_dim, Args... args) {
  switch (head_dim) {
    case 64: return Kernel<T, C, 64>::run(args...);
    case 128: return Kernel<T, C, 128>::run(args...);
    default: return Kernel<T, C, 0>::run(args...);
  }
}
template <typename T, typename C, int kD>
struct Decode {
  template <typename... A> static int run(A... a) { return paged_decode<T, C, kD>(a...); }
};
template <typename T, typename C, int kD>
struct Prefill {
  template <typename... A> static int run(A... a) { return paged_prefill<T, C, kD>(a...); }
};

// Returns 0, or 1 + the index of a sequence whose seq_len or block ids are out of range.
extern "C" {

// 1 where decode over a bfloat16 cache rounds q to bfloat16 for vdpbf16ps (AVX512_BF16), 0 where
// it widens the cache's values instead (exact float32 products).
int minipaged_decode_rounds_q_bf16() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

// K/V write (reshape_and_cache): token t's Hkv heads (D elements each, contiguous, rows `stride`
// elements apart) go to slot s = slots[t] of the [num_blocks, Hkv, bs, D] caches: block s / bs,
// offset s % bs; s < 0 is padding. One call per layer instead of ~10 torch ops computing row
// indices for index_copy_. Returns 0, or 1 + the first token whose slot is past the cache.
int minipaged_write_kv(const char* key, int64_t key_stride, const char* value, int64_t value_stride,
                       const int64_t* slots, int T, char* key_cache, char* value_cache,
                       int64_t num_blocks, int Hkv, int bs, int D, int elem) {
  const int64_t row = int64_t(D) * elem;
  for (int t = 0; t < T; ++t) {
    const int64_t s = slots[t];
    if (s < 0) continue;
    if (s >= num_blocks * bs) return t + 1;
    const int64_t base = ((s / bs) * Hkv * bs + s % bs) * row;  // head 0 of this slot
    for (int h = 0; h < Hkv; ++h) {
      std::memcpy(key_cache + base + int64_t(h) * bs * row, key + (t * key_stride + int64_t(h) * D) * elem, row);
      std::memcpy(value_cache + base + int64_t(h) * bs * row, value + (t * value_stride + int64_t(h) * D) * elem, row);
    }
  }
  return 0;
}

int minipaged_paged_decode_f32(const float* query, const float* key_cache, const float* value_cache,
                               int num_blocks, const int32_t* block_tables, int max_blocks,
                               const int32_t* seq_lens, int B, int H, int Hkv, int block_size, int D,
                               double scale, float* out, int num_threads) {
  return dispatch<Decode, float, float>(D, query, key_cache, value_cache, num_blocks, block_tables, max_blocks,
                                 seq_lens, B, H, Hkv, block_size, D, float(scale), out, num_threads);
}

int minipaged_paged_decode_f64(const double* query, const double* key_cache, const double* value_cache,
                               int num_blocks, const int32_t* block_tables, int max_blocks,
                               const int32_t* seq_lens, int B, int H, int Hkv, int block_size, int D,
                               double scale, double* out, int num_threads) {
  return dispatch<Decode, double, double>(D, query, key_cache, value_cache, num_blocks, block_tables, max_blocks,
                                  seq_lens, B, H, Hkv, block_size, D, scale, out, num_threads);
}

int minipaged_paged_prefill_f32(const float* query, const float* key_cache, const float* value_cache,
                                int num_blocks, const int32_t* block_tables, int max_blocks,
                                const int32_t* seq_lens, const int32_t* q_starts, const int32_t* q_lens,
                                int S, int num_tokens, int H, int Hkv, int block_size, int D,
                                double scale, float* out, int num_threads) {
  return dispatch<Prefill, float, float>(D, query, key_cache, value_cache, num_blocks, block_tables, max_blocks,
                                  seq_lens, q_starts, q_lens, S, num_tokens, H, Hkv, block_size, D,
                                  float(scale), out, num_threads);
}

int minipaged_paged_prefill_f64(const double* query, const double* key_cache, const double* value_cache,
                                int num_blocks, const int32_t* block_tables, int max_blocks,
                                const int32_t* seq_lens, const int32_t* q_starts, const int32_t* q_lens,
                                int S, int num_tokens, int H, int Hkv, int block_size, int D,
                                double scale, double* out, int num_threads) {
  return dispatch<Prefill, double, double>(D, query, key_cache, value_cache, num_blocks, block_tables, max_blocks,
                                   seq_lens, q_starts, q_lens, S, num_tokens, H, Hkv, block_size, D,
                                   scale, out, num_threads);
}

// float32 queries over bfloat16 caches (uint16_t bits): the bfloat16 compute mode.
int minipaged_paged_decode_f32_bf16(const float* query, const uint16_t* key_cache, const uint16_t* value_cache,
                                    int num_blocks, const int32_t* block_tables, int max_blocks,
                                    const int32_t* seq_lens, int B, int H, int Hkv, int block_size, int D,
                                    double scale, float* out, int num_threads) {
  return dispatch<Decode, float, uint16_t>(D, query, key_cache, value_cache, num_blocks, block_tables,
                                           max_blocks, seq_lens, B, H, Hkv, block_size, D, float(scale), out,
                                           num_threads);
}

int minipaged_paged_prefill_f32_bf16(const float* query, const uint16_t* key_cache,
                                     const uint16_t* value_cache, int num_blocks, const int32_t* block_tables,
                                     int max_blocks, const int32_t* seq_lens, const int32_t* q_starts,
                                     const int32_t* q_lens, int S, int num_tokens, int H, int Hkv,
                                     int block_size, int D, double scale, float* out, int num_threads) {
  return dispatch<Prefill, float, uint16_t>(D, query, key_cache, value_cache, num_blocks, block_tables,
                                            max_blocks, seq_lens, q_starts, q_lens, S, num_tokens, H, Hkv,
                                            block_size, D, float(scale), out, num_threads);
}

// The same in bfloat16 products (worker/cpu_attn_bf16.cpp: q and the softmax weights rounded to
// bfloat16, as a bfloat16 model computes them) on `engine` (2: AMX tiles, 1: AVX512_BF16 pair dot
// products; minipaged_bf16_prefill_engines() says which are here). Returns as above, or -2
// (nothing done) where that engine or this head layout is not available: the caller then runs the
// loop above.
int minipaged_paged_prefill_f32_bf16_rounded(int engine, const float* query, const uint16_t* key_cache,
                                             const uint16_t* value_cache, int num_blocks,
                                             const int32_t* block_tables, int max_blocks, const int32_t* seq_lens,
                                             const int32_t* q_starts, const int32_t* q_lens, int S, int num_tokens,
                                             int H, int Hkv, int block_size, int D, double scale, float* out,
                                             int num_threads) {
  if (const int bad = check_prefill(block_tables, max_blocks, seq_lens, q_starts, q_lens, S, num_tokens,
                                    block_size, num_blocks))
    return bad;
  return minipaged_attn_bf16::paged_prefill_bf16(engine, query, key_cache, value_cache, block_tables, max_blocks,
                                                 seq_lens, q_starts, q_lens, S, H, Hkv, block_size, D, float(scale),
                                                 out, num_threads);
}

int minipaged_bf16_prefill_engines() { return minipaged_attn_bf16::engines(); }

void minipaged_qk_norm_rope_f32(const float* qkv, int row_stride, int T, int H, int Hkv, int D,
                                const float* q_weight, const float* k_weight, float eps,
                                const float* cos, const float* sin, float* q_out, float* k_out,
                                int num_threads) {
  qk_norm_rope(qkv, row_stride, T, H, Hkv, D, q_weight, k_weight, eps, cos, sin, q_out, k_out,
               num_threads);
}

// bfloat16 qkv in, float32 q and bfloat16 k out (the bfloat16 mode).
void minipaged_qk_norm_rope_bf16(const uint16_t* qkv, int row_stride, int T, int H, int Hkv, int D,
                                 const float* q_weight, const float* k_weight, float eps,
                                 const float* cos, const float* sin, float* q_out, uint16_t* k_out,
                                 int num_threads) {
  qk_norm_rope(qkv, row_stride, T, H, Hkv, D, q_weight, k_weight, eps, cos, sin, q_out, k_out,
               num_threads);
}

void minipaged_silu_mul_f32(const float* gate_up, int row_stride, int T, int I, float* out,
                            int num_threads) {
  silu_mul(gate_up, row_stride, T, I, out, num_threads);
}

void minipaged_silu_mul_bf16(const uint16_t* gate_up, int row_stride, int T, int I, uint16_t* out,
                             int num_threads) {
  silu_mul(gate_up, row_stride, T, I, out, num_threads);
}

void minipaged_add_rmsnorm_bf16(float* h, const uint16_t* y, int T, int n, const float* w, float eps,
                                uint16_t* out, int num_threads) {
  add_rmsnorm(h, y, T, n, w, eps, out, num_threads);
}

// float32 in and out (the float32 layers; DecoderLayer.forward).
void minipaged_add_rmsnorm_f32(float* h, const float* y, int T, int n, const float* w, float eps, float* out,
                               int num_threads) {
  add_rmsnorm(h, y, T, n, w, eps, out, num_threads);
}

}  // extern "C"
