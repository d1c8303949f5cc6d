// Varlen causal prefill attention over a bfloat16 K/V cache in bfloat16 products: the bfloat16
// compute mode's prefill (worker/attention_cpu.py), called through cpu_attn_prefill.cpp's
// minipaged_paged_prefill_f32_bf16_rounded, which validates the tables first. Two engines for the
// same products: AMX tiles (TDPBF16PS) where the CPU has them and Linux grants their state, else
// AVX512_BF16's pair dot products (VDPBF16PS, e.g. Zen 4/5), 16 lanes of one output row at a time.
//
// Why: the AVX-512 loop (cpu_attn_prefill.cpp paged_prefill) widens every K and V element to float32
// and multiplies in float32 (~35 GFLOP/s a core on this project's Xeon, ~110 on a Zen 5); a long
// prompt's attention is then ~30-50% of its prefill. bfloat16 products run several times faster,
// and the cache already holds bfloat16. The numbers are a bfloat16 model's: q and the softmax
// weights are rounded to bfloat16 (exactly as HF's bfloat16 attention feeds its matmuls), the
// products summed in float32, the softmax itself in float32.
//
// A work item is one (sequence, kv head), as in the AVX-512 loop. Its K is re-laid once into the
// pair-interleaved form along d (kt[p / 16][d / 2][p % 16] = (k[p][d], k[p][d + 1]): the B
// operand of Q K^T), its V along positions (vt[p / 32][d / 16][(p % 32) / 2][d % 16] =
// (v[p][d], v[p + 1][d]): the B operand of P V); both engines read these as they are. A tile is
// 16 query rows: 16 / G tokens times the G query heads that share this kv head. Scores for it are
// 16 x 32 blocks over D / 2 pairs; then a per-row causal softmax into bfloat16 weights; then P V,
// 64 columns of the output at a time. AMX tile registers: 0-3 accumulators, 4-7 operands (all 16
// rows x 64 bytes, cpu_gemm_amx.cpp configure()).
// GCC 12 warns inside its own AVX-512 intrinsics (the _mm512_undefined_ps of _mm512_max_ps and
// the reductions) once they are inlined here: a known false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_math.h"

namespace minipaged_amx {
bool permitted();   // cpu_gemm_amx.cpp: the process holds AMX state (arch_prctl)
void configure();
}

// Which engines this build has (the tile loop below needs AVX-512 for its packing either way).
#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define MINIPAGED_PREFILL_AMX 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define MINIPAGED_PREFILL_PAIRS 1
#endif

#if defined(MINIPAGED_PREFILL_AMX) || defined(MINIPAGED_PREFILL_PAIRS)
#include <immintrin.h>

namespace minipaged_attn_bf16 {

using minipaged::exp_nonpositive;
using minipaged::round_bf16;
using minipaged::widen;

constexpr int kRows = 16;   // query rows per tile

#if defined(MINIPAGED_PREFILL_AMX)
struct AmxTiles {
  static void begin() { minipaged_amx::configure(); }
  static void end() { _tile_release(); }
  // sc[r][p0 .. p0 + 32) = q[r] . k[p] for the tile's 16 rows (16 positions when !two)
  static void scores(const uint16_t* qt, int D, const uint32_t* kt, int pairs, bool two, int, float* sc, int ld) {
    _tile_zero(0);
    _tile_zero(1);
    for (int kb = 0; kb < D; kb += 32) {
      _tile_loadd(4, qt + kb, D * 2);
      _tile_loadd(5, kt + size_t(kb / 2) * 16, 64);
      _tile_dpbf16ps(0, 4, 5);
      if (two) {
        _tile_loadd(6, kt + size_t(pairs) * 16 + size_t(kb / 2) * 16, 64);
        _tile_dpbf16ps(1, 4, 6);
      }
    }
    _tile_stored(0, sc, ld * 4);
    if (two) _tile_stored(1, sc + 16, ld * 4);
  }
  // ot[r][dj * 16 .. + 64) = sum_p w[r][p] v[p] over the chunks of 32 positions before k32
  static void pv(const uint16_t* pw, int ld, const uint32_t* vt, int dtiles, int dj, int k32, int, float* ot, int D) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int pc = 0; pc < k32; pc += 32) {
      const uint32_t* b = vt + size_t(pc / 32) * dtiles * 256 + size_t(dj) * 256;
      _tile_loadd(4, pw + pc, ld * 2);
      _tile_loadd(5, b, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, b + 256, 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, b + 512, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, b + 768, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, ot + dj * 16, D * 4);
    _tile_stored(1, ot + dj * 16 + 16, D * 4);
    _tile_stored(2, ot + dj * 16 + 32, D * 4);
    _tile_stored(3, ot + dj * 16 + 48, D * 4);
  }
};
#endif

#if defined(MINIPAGED_PREFILL_PAIRS)
// The same products with VDPBF16PS: a lane of an output row takes one bfloat16 pair (of d for
// scores, of positions for P V) per instruction, the row's pair broadcast to every lane. Rows past
// the tile's R real ones are computed only up to the register block (AMX multiplies all 16; the
// padding is zeros either way).
struct PairDots {
  static void begin() {}
  static void end() {}
  static void scores(const uint16_t* qt, int D, const uint32_t* kt, int pairs, bool two, int R, float* sc, int ld) {
    const uint32_t* q = reinterpret_cast<const uint32_t*>(qt);
    const uint32_t* kt1 = kt + size_t(pairs) * 16;
    for (int r0 = 0; r0 < R; r0 += 8) {       // 8 rows x 2 x 16 positions of accumulators
      __m512 acc[8][2];
      for (auto& a : acc) a[0] = a[1] = _mm512_setzero_ps();
      for (int j = 0; j < pairs; ++j) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(kt + size_t(j) * 16);
        const __m512bh b1 = two ? (__m512bh)_mm512_loadu_si512(kt1 + size_t(j) * 16) : b0;
#pragma GCC unroll 8
        for (int rr = 0; rr < 8; ++rr) {
          const __m512bh a = (__m512bh)_mm512_set1_epi32(int(q[size_t(r0 + rr) * (D / 2) + j]));
          acc[rr][0] = _mm512_dpbf16_ps(acc[rr][0], a, b0);
          if (two) acc[rr][1] = _mm512_dpbf16_ps(acc[rr][1], a, b1);
        }
      }
      for (int rr = 0; rr < 8; ++rr) {
        _mm512_storeu_ps(sc + size_t(r0 + rr) * ld, acc[rr][0]);
        if (two) _mm512_storeu_ps(sc + size_t(r0 + rr) * ld + 16, acc[rr][1]);
      }
    }
  }
  static void pv(const uint16_t* pw, int ld, const uint32_t* vt, int dtiles, int dj, int k32, int R, float* ot, int D) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(pw);
    for (int r0 = 0; r0 < R; r0 += 4) {       // 4 rows x 4 x 16 columns of accumulators
      __m512 acc[4][4];
      for (auto& a : acc) a[0] = a[1] = a[2] = a[3] = _mm512_setzero_ps();
      for (int pc = 0; pc < k32; pc += 32) {
        const uint32_t* b = vt + size_t(pc / 32) * dtiles * 256 + size_t(dj) * 256;
        for (int c = 0; c < 16; ++c) {        // the chunk's 16 position pairs
          const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + c * 16);
          const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + 256 + c * 16);
          const __m512bh b2 = (__m512bh)_mm512_loadu_si512(b + 512 + c * 16);
          const __m512bh b3 = (__m512bh)_mm512_loadu_si512(b + 768 + c * 16);
#pragma GCC unroll 4
          for (int rr = 0; rr < 4; ++rr) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32(int(w[size_t(r0 + rr) * (ld / 2) + pc / 2 + c]));
            acc[rr][0] = _mm512_dpbf16_ps(acc[rr][0], a, b0);
            acc[rr][1] = _mm512_dpbf16_ps(acc[rr][1], a, b1);
            acc[rr][2] = _mm512_dpbf16_ps(acc[rr][2], a, b2);
            acc[rr][3] = _mm512_dpbf16_ps(acc[rr][3], a, b3);
          }
        }
      }
      for (int rr = 0; rr < 4; ++rr)
        for (int t = 0; t < 4; ++t) _mm512_storeu_ps(ot + size_t(r0 + rr) * D + (dj + t) * 16, acc[rr][t]);
    }
  }
};
#endif

// r[x][i] = r[i][x]: a 16 x 16 transpose of 32-bit elements (bfloat16 pairs).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

template <class Engine>
int prefill(const float* query, const uint16_t* key_cache, const uint16_t* value_cache, const int32_t* block_tables,
            int max_blocks, const int32_t* seq_lens, const int32_t* q_starts, const int32_t* q_lens, int S, int H,
            int Hkv, int block_size, int D, float scale, float* out, int num_threads) {
  const int G = H / Hkv, TQ = kRows / G;
  const int64_t head_stride = int64_t(block_size) * D, block_stride = Hkv * head_stride;
  int max_len = 1;
  for (int s = 0; s < S; ++s) max_len = std::max(max_len, int(seq_lens[s]));
  const int max_pad = (max_len + 31) / 32 * 32;
  const int pairs = D / 2, dtiles = D / 16;

#pragma omp parallel num_threads(std::max(1, std::min(num_threads, S * Hkv)))
  {
    Engine::begin();
    std::vector<uint32_t> kt(size_t(max_pad) * pairs), vt(size_t(max_pad) * pairs);
    std::vector<uint16_t> qt(size_t(kRows) * D), pw(size_t(kRows) * max_pad);
    std::vector<float> sc(size_t(kRows) * max_pad), ot(size_t(kRows) * D);
    float denom[kRows];
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < S * Hkv; ++item) {
      const int s = item / Hkv, kvh = item % Hkv;
      const int len = seq_lens[s], qlen = q_lens[s], prefix = len - qlen;
      const int len32 = (len + 31) / 32 * 32;
      const int32_t* table = block_tables + int64_t(s) * max_blocks;
      auto row_of = [&](const uint16_t* cache, int p) {
        return cache + int64_t(table[p / block_size]) * block_stride + kvh * head_stride +
               int64_t(p % block_size) * D;
      };
      for (int p0 = 0; p0 < len32; p0 += 16) {   // K pairs along d, 16 x 16 at a time; zero past the context
        for (int j0 = 0; j0 < pairs; j0 += 16) {
          __m512i r[16];
          for (int i = 0; i < 16; ++i)
            r[i] = p0 + i < len ? _mm512_loadu_si512(reinterpret_cast<const uint32_t*>(row_of(key_cache, p0 + i)) + j0)
                                : _mm512_setzero_si512();
          transpose16(r);
          for (int x = 0; x < 16; ++x) _mm512_storeu_si512(kt.data() + size_t(p0 / 16) * pairs * 16 + (j0 + x) * 16, r[x]);
        }
      }
      for (int p = 0; p < len32; p += 2) {   // V pairs along positions
        const uint16_t* v0 = p < len ? row_of(value_cache, p) : nullptr;
        const uint16_t* v1 = p + 1 < len ? row_of(value_cache, p + 1) : nullptr;
        uint32_t* dst = vt.data() + size_t(p / 32) * dtiles * 256 + (p % 32) / 2 * 16;
        const __m256i zero = _mm256_setzero_si256();
        for (int d = 0; d < D; d += 16) {   // 16 (v0[d], v1[d]) pairs: widen both, v1 to the high half
          const __m256i a = v0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + d)) : zero;
          const __m256i b = v1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + d)) : zero;
          _mm512_storeu_si512(dst + (d / 16) * 256,
                              _mm512_or_si512(_mm512_cvtepu16_epi32(a), _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
        }
      }

      for (int t0 = 0; t0 < qlen; t0 += TQ) {
        const int R = std::min(TQ, qlen - t0) * G;
        const int keys = prefix + t0 + R / G;               // what the tile's last row sees
        const int k16 = (keys + 15) / 16 * 16, k32 = (keys + 31) / 32 * 32;
        // the tile's queries, rounded: row r = (token t0 + r / G, head kvh * G + r % G); zero padding
        for (int r = 0; r < kRows; ++r) {
          uint16_t* dst = qt.data() + size_t(r) * D;
          if (r < R) {
            const float* q = query + (int64_t(q_starts[s] + t0 + r / G) * H + kvh * G + r % G) * D;
            for (int d = 0; d < D; ++d) dst[d] = round_bf16(q[d]);
          } else {
            std::fill(dst, dst + D, uint16_t(0));
          }
        }
        // 1. raw scores q . k, 32 positions at a time
        for (int p0 = 0; p0 < k16; p0 += 32)
          Engine::scores(qt.data(), D, kt.data() + size_t(p0 / 16) * pairs * 16, pairs, p0 + 16 < k16, R,
                         sc.data() + p0, max_pad);
        // 2. causal softmax per row into bfloat16 weights; row r sees positions 0 .. prefix + t0 + r / G
        for (int r = 0; r < kRows; ++r) {
          uint16_t* w = pw.data() + size_t(r) * max_pad;
          const int visible = r < R ? prefix + t0 + r / G + 1 : 0;
          const float* row = sc.data() + size_t(r) * max_pad;
          const float mx = minipaged::max_of(row, visible);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int p = 0; p < visible; ++p) {
            const uint16_t h = round_bf16(exp_nonpositive((row[p] - mx) * scale));
            w[p] = h;
            sum += widen(h);       // the weights P V multiplies: they sum to exactly this
          }
          std::fill(w + visible, w + k32, uint16_t(0));
          denom[r] = sum > 0.f ? sum : 1.f;
        }
        // 3. out = P V, 64 columns of d at a time
        for (int dj = 0; dj < dtiles; dj += 4)
          Engine::pv(pw.data(), max_pad, vt.data(), dtiles, dj, k32, R, ot.data(), D);
        for (int r = 0; r < R; ++r) {
          float* o = out + (int64_t(q_starts[s] + t0 + r / G) * H + kvh * G + r % G) * D;
          const float inv = 1.f / denom[r];
#pragma omp simd
          for (int d = 0; d < D; ++d) o[d] = ot[size_t(r) * D + d] * inv;
        }
      }
    }
    Engine::end();
  }
  return 0;
}

}  // namespace minipaged_attn_bf16
#endif

namespace minipaged_attn_bf16 {

// 1: AVX512_BF16 pair dot products compiled in; 2: AMX tiles compiled in and granted (bits).
int engines() {
  int e = 0;
#if defined(MINIPAGED_PREFILL_PAIRS)
  e |= 1;
#endif
#if defined(MINIPAGED_PREFILL_AMX)
  if (minipaged_amx::permitted()) e |= 2;
#endif
  return e;
}

// Returns 0, or -2 (nothing done) where the engine asked for (2: AMX, 1: pair dot products) is
// not there, or for a head layout the tiles do not cover: a group size that does not divide 16,
// or a head dim that is not a multiple of 64.
int paged_prefill_bf16(int engine, const float* query, const uint16_t* key_cache, const uint16_t* value_cache,
                       const int32_t* block_tables, int max_blocks, const int32_t* seq_lens, const int32_t* q_starts,
                       const int32_t* q_lens, int S, int H, int Hkv, int block_size, int D, float scale, float* out,
                       int num_threads) {
  if (!(engines() & engine) || Hkv < 1 || H % Hkv != 0 || 16 % (H / Hkv) != 0 || D % 64 != 0 || D > 512)
    return -2;
#if defined(MINIPAGED_PREFILL_AMX)
  if (engine == 2)
    return prefill<AmxTiles>(query, key_cache, value_cache, block_tables, max_blocks, seq_lens, q_starts, q_lens,
                             S, H, Hkv, block_size, D, scale, out, num_threads);
#endif
#if defined(MINIPAGED_PREFILL_PAIRS)
  if (engine == 1)
    return prefill<PairDots>(query, key_cache, value_cache, block_tables, max_blocks, seq_lens, q_starts, q_lens,
                             S, H, Hkv, block_size, D, scale, out, num_threads);
#endif
  (void)query, (void)key_cache, (void)value_cache, (void)block_tables, (void)max_blocks, (void)seq_lens;
  (void)q_starts, (void)q_lens, (void)S, (void)block_size, (void)scale, (void)out, (void)num_threads;
  return -2;
}

}  // namespace minipaged_attn_bf16
