// y = x W^T with W kept in bfloat16 and everything computed in float32 (worker/cpu_gemm.py).
//
// Why: a Qwen3 checkpoint ships bfloat16 weights; a CPU without bfloat16 instructions computes in
// float32 (worker/dtype_choice.py), and a decode step then reads every weight as 4 bytes although
// its value has only 2 bytes of information. A decode step reads all the weights for a handful of
// rows, so it is bound by those bytes. Here the weights stay 2 bytes in memory and each one is
// widened in a register (a bfloat16 is the top half of a float32: shift left 16 bits), so the
// product is the float32 product of the exact checkpoint values, from half the memory traffic.
//
// Layout: W [N, K] is packed once at load time into panels of 16 output columns,
// packed[p][k][j] = W[16 p + j][k] (zero rows pad N up to a multiple of 16), so one k step of a
// panel is 32 contiguous bytes. The micro-kernel keeps a tile of y in registers (AVX2: 6 rows x 16
// in 12 registers; AVX-512: 16 rows x 16 in 16) and adds x[m, k] * W[16p .. 16p+15, k] for each k
// (broadcast x, FMA), summing over k in order: one FMA chain per output, like a plain dot product. Rows of x are taken in chunks that fit in
// L2 with the panels split across threads inside each chunk, so a panel is read from memory once
// per chunk and x stays in cache.
#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
// GCC 12's AVX-512 headers trip its own -Wmaybe-uninitialized (_mm512_undefined_epi32 inside
// _mm512_cvtepu16_epi32): a false positive about the headers, not this code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

namespace {

constexpr int kNR = 16;  // output columns per panel (two 8-wide registers, or one 16-wide)
// Each tile asks for the weights 64 k steps (2 KB of a panel) ahead. The hardware prefetcher alone
// kept a streamed panel at ~10 GB/s per core, well under what the FMAs consume: 16 x 1024 x 6144
// from memory on this project's AVX-512 EPYC, 2 threads, 294 -> 373 GFLOP/s (cache-resident: 450).
constexpr int kPrefetch = 64 * kNR;

#if defined(__AVX512F__)
// AVX-512: one 16-wide register holds a panel's k step, so a tile of 16 rows is 16 accumulators
// (of 32 registers) and x's values come as embedded broadcasts. Twice the work per instruction of
// the AVX2 tile, and a decode batch of <= 16 rows passes over each panel once. Same arithmetic:
// one FMA chain per output along k, so the same bits as the AVX2 tile.
constexpr int kMR = 16;

inline __m512 widen16(const uint16_t* p) {  // 16 bfloat16 -> 16 float32, exactly
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int MR>
inline void tile(const float* x, int64_t ldx, int K, const uint16_t* panel, float* y, int64_t ldy,
                 int ncols, const float* bias) {
  __m512 acc[MR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const uint16_t* w = panel;
  for (int k = 0; k < K; ++k, w += kNR) {
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch), _MM_HINT_T0);
    const __m512 w0 = widen16(w);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), w0, acc[r]);
  }
  const __mmask16 keep = ncols >= kNR ? __mmask16(0xFFFF) : __mmask16((1u << ncols) - 1);
  const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, _mm512_add_ps(acc[r], b));
}

// Two adjacent panels at once (32 columns, 14 rows: 28 accumulators): each broadcast of x feeds two
// FMAs, so a k step issues 16 loads for 28 FMAs instead of 17 for 16. 16 x 1024 x 6144 on this
// project's Xeon, 2 threads: 200 -> 257 GFLOP/s in cache; 28 such matrices streamed from memory
// 38 -> 31 ms. An odd last panel takes the one-panel tile.
constexpr int kMR2 = 14;

template <int MR>
inline void tile2(const float* x, int64_t ldx, int K, const uint16_t* panel, float* y, int64_t ldy,
                  int ncols, const float* bias) {
  __m512 a0[MR], a1[MR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  const uint16_t* w = panel;
  const uint16_t* v = panel + int64_t(K) * kNR;
  for (int k = 0; k < K; ++k, w += kNR, v += kNR) {
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(v + kPrefetch), _MM_HINT_T0);
    const __m512 w0 = widen16(w), w1 = widen16(v);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      a0[r] = _mm512_fmadd_ps(xb, w0, a0[r]);
      a1[r] = _mm512_fmadd_ps(xb, w1, a1[r]);
    }
  }
  const int n1 = ncols - kNR;   // columns of the second panel (1..16)
  const __mmask16 keep = n1 >= kNR ? __mmask16(0xFFFF) : __mmask16((1u << n1) - 1);
  const __m512 b0 = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias != nullptr ? _mm512_maskz_loadu_ps(keep, bias + kNR) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(y + r * ldy, _mm512_add_ps(a0[r], b0));
    _mm512_mask_storeu_ps(y + r * ldy + kNR, keep, _mm512_add_ps(a1[r], b1));
  }
}

struct Two {
  template <int MR, class... A> static void run(A... a) { tile2<MR>(a...); }
};
template <class Tile, int MR>
inline void tail(const float* x, int64_t ldx, int K, const uint16_t* panel, float* y, int64_t ldy,
                 int ncols, const float* bias, int left);

// Rows split evenly over the fewest tiles of at most 14 (16 rows: 8 + 8, not 14 + 2, whose
// 2-row pass costs nearly as much as a full one: few FMAs per widened weight).
void rows2(const float* x, int64_t ldx, int M, int K, const uint16_t* panel, float* y, int64_t ldy,
           int ncols, const float* bias) {
  const int tiles = (M + kMR2 - 1) / kMR2;
  for (int t = 0, m = 0; t < tiles; ++t) {
    const int mr = M / tiles + (t < M % tiles ? 1 : 0);
    tail<Two, kMR2>(x + m * ldx, ldx, K, panel, y + m * ldy, ldy, ncols, bias, mr);
    m += mr;
  }
}
constexpr bool kPairs = true;

#else
constexpr int kMR = 6;   // rows per micro-tile: 12 accumulators + 2 weights + 1 broadcast <= 16

inline __m256 widen(const uint16_t* p) {  // 8 bfloat16 -> 8 float32, exactly
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <int MR>
inline void tile(const float* x, int64_t ldx, int K, const uint16_t* panel, float* y, int64_t ldy,
                 int ncols, const float* bias) {
  __m256 acc[MR][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const uint16_t* w = panel;
  for (int k = 0; k < K; ++k, w += kNR) {
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch), _MM_HINT_T0);
    const __m256 w0 = widen(w), w1 = widen(w + 8);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
      acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    alignas(32) float out[kNR];
    _mm256_store_ps(out, acc[r][0]);
    _mm256_store_ps(out + 8, acc[r][1]);
    if (bias != nullptr)
      for (int j = 0; j < ncols; ++j) out[j] += bias[j];
    std::memcpy(y + r * ldy, out, sizeof(float) * ncols);
  }
}

constexpr bool kPairs = false;
void rows2(const float*, int64_t, int, int, const uint16_t*, float*, int64_t, int, const float*) {}
#endif

// Whole tiles of kRows rows, then one tile of the rows left (its row count picked at run time
// among the compiled ones). Tile: One (one panel) or, on AVX-512, Two (two adjacent panels).
struct One {
  template <int MR, class... A> static void run(A... a) { tile<MR>(a...); }
};

template <class Tile, int MR>
inline void tail(const float* x, int64_t ldx, int K, const uint16_t* panel, float* y, int64_t ldy,
                 int ncols, const float* bias, int left) {
  if constexpr (MR > 0) {
    if (left == MR) Tile::template run<MR>(x, ldx, K, panel, y, ldy, ncols, bias);
    else tail<Tile, MR - 1>(x, ldx, K, panel, y, ldy, ncols, bias, left);
  }
}

template <class Tile, int kRows>
void over_rows(const float* x, int64_t ldx, int M, int K, const uint16_t* panel, float* y, int64_t ldy,
               int ncols, const float* bias) {
  int m = 0;
  for (; m + kRows <= M; m += kRows)
    Tile::template run<kRows>(x + m * ldx, ldx, K, panel, y + m * ldy, ldy, ncols, bias);
  tail<Tile, kRows - 1>(x + m * ldx, ldx, K, panel, y + m * ldy, ldy, ncols, bias, M - m);
}

void rows(const float* x, int64_t ldx, int M, int K, const uint16_t* panel, float* y, int64_t ldy,
          int ncols, const float* bias) {
  over_rows<One, kMR>(x, ldx, M, K, panel, y, ldy, ncols, bias);
}

}  // namespace

extern "C" {

int minipaged_bf16w_available() { return 1; }
// 1 where the panels beat oneDNN's float32 GEMM at every batch size (the AVX-512 tiles), so the
// float32 copy of a layer can go (worker/cpu_gemm.py all_batches()).
int minipaged_bf16w_all_batches() { return kPairs ? 1 : 0; }

// x [M, K] float32 (row stride ldx), packed [ceil(N/16), K, 16] bfloat16 bits, bias [N] or null,
// y [M, N] float32 (row stride ldy).
void minipaged_linear_bf16w_f32(const float* x, int64_t ldx, int M, int K, const uint16_t* packed,
                                int N, const float* bias, float* y, int64_t ldy, int num_threads) {
  const int panels = (N + kNR - 1) / kNR;
  // rows per chunk: x's chunk stays within ~192 KB of L2 while every panel passes over it
  const int chunk = std::max(kMR, int((192 * 1024) / (int64_t(K) * 4)) / kMR * kMR);
#pragma omp parallel num_threads(std::max(1, num_threads))
  for (int m0 = 0; m0 < M; m0 += chunk) {
    const int mc = std::min(chunk, M - m0);
    if (kPairs) {
#pragma omp for schedule(static)
      for (int q = 0; q < (panels + 1) / 2; ++q) {
        const int p = 2 * q, n0 = p * kNR;
        const float* b = bias != nullptr ? bias + n0 : nullptr;
        if (p + 1 < panels)
          rows2(x + m0 * ldx, ldx, mc, K, packed + int64_t(p) * K * kNR, y + m0 * ldy + n0, ldy,
                std::min(2 * kNR, N - n0), b);
        else
          rows(x + m0 * ldx, ldx, mc, K, packed + int64_t(p) * K * kNR, y + m0 * ldy + n0, ldy,
               std::min(kNR, N - n0), b);
      }
    } else {
#pragma omp for schedule(static)
      for (int p = 0; p < panels; ++p) {
        const int n0 = p * kNR;
        rows(x + m0 * ldx, ldx, mc, K, packed + int64_t(p) * K * kNR, y + m0 * ldy + n0, ldy,
             std::min(kNR, N - n0), bias != nullptr ? bias + n0 : nullptr);
      }
    }
  }
}

}  // extern "C"

#else  // no AVX2 + FMA: the caller keeps float32 weights and its usual GEMM

extern "C" {
int minipaged_bf16w_available() { return 0; }
int minipaged_bf16w_all_batches() { return 0; }
void minipaged_linear_bf16w_f32(const float*, int64_t, int, int, const uint16_t*, int, const float*,
                                float*, int64_t, int) {}
}

#endif
