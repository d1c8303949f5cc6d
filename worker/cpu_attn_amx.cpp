// Varlen causal prefill attention over a bfloat16 K/V cache on AMX tiles: the bfloat16 compute
// mode's prefill (worker/attention_cpu.py), called through cpu_kernels.cpp's
// minipaged_paged_prefill_f32_bf16_amx, which validates the tables first.
//
// Why: the AVX-512 loop (cpu_kernels.cpp paged_prefill) widens every K and V element to float32
// and multiplies in float32, ~35 GFLOP/s per core on this project's Xeon; a long prompt's
// attention is then ~30% of its prefill. AMX multiplies bfloat16 tiles several times faster, and
// the cache already holds bfloat16. The numbers are a bfloat16 model's: q and the softmax weights
// are rounded to bfloat16 (exactly as HF's bfloat16 attention feeds its matmuls), the products
// summed in float32, the softmax itself in float32.
//
// A work item is one (sequence, kv head), as in the AVX-512 loop. Its K is re-laid once into
// AMX's pair-interleaved form along d (kt[p / 16][d / 2][p % 16] = (k[p][d], k[p][d + 1]): the B
// operand of Q K^T), its V along positions (vt[p / 32][d / 16][(p % 32) / 2][d % 16] =
// (v[p][d], v[p + 1][d]): the B operand of P V). A tile is 16 query rows: 16 / G tokens times
// the G query heads that share this kv head. Scores for it are 16 x 16 tiles over D / 32 steps;
// then a per-row causal softmax into bfloat16 weights; then P V, four 16-column tiles of the
// output at a time. Tile registers: 0-3 accumulators, 4-7 operands (all 16 rows x 64 bytes,
// cpu_gemm_amx.cpp configure()).
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__)
#include <immintrin.h>

namespace minipaged_amx {

using minipaged::exp_nonpositive;
using minipaged::round_bf16;
using minipaged::widen;

constexpr int kRows = 16;   // query rows per tile

// Returns 0, or -2 (nothing done) without AMX or for a head layout it does not tile: a group
// size that does not divide 16, or a head dim that is not a multiple of 64.
int paged_prefill_bf16(const float* query, const uint16_t* key_cache, const uint16_t* value_cache,
                       const int32_t* block_tables, int max_blocks, const int32_t* seq_lens, const int32_t* q_starts,
                       const int32_t* q_lens, int S, int H, int Hkv, int block_size, int D, float scale, float* out,
                       int num_threads) {
  if (!permitted() || Hkv < 1 || H % Hkv != 0 || kRows % (H / Hkv) != 0 || D % 64 != 0 || D > 512)
    return -2;
  const int G = H / Hkv, TQ = kRows / G;
  const int64_t head_stride = int64_t(block_size) * D, block_stride = Hkv * head_stride;
  int max_len = 1;
  for (int s = 0; s < S; ++s) max_len = std::max(max_len, int(seq_lens[s]));
  const int max_pad = (max_len + 31) / 32 * 32;
  const int pairs = D / 2, dtiles = D / 16;

#pragma omp parallel num_threads(std::max(1, std::min(num_threads, S * Hkv)))
  {
    configure();
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
      for (int p = 0; p < len32; ++p) {   // K pairs along d; zero past the context
        uint32_t* dst = kt.data() + size_t(p / 16) * pairs * 16 + p % 16;
        if (p < len) {
          const uint32_t* k = reinterpret_cast<const uint32_t*>(row_of(key_cache, p));
          for (int j = 0; j < pairs; ++j) dst[size_t(j) * 16] = k[j];
        } else {
          for (int j = 0; j < pairs; ++j) dst[size_t(j) * 16] = 0;
        }
      }
      for (int p = 0; p < len32; p += 2) {   // V pairs along positions
        const uint16_t* v0 = p < len ? row_of(value_cache, p) : nullptr;
        const uint16_t* v1 = p + 1 < len ? row_of(value_cache, p + 1) : nullptr;
        uint32_t* dst = vt.data() + size_t(p / 32) * dtiles * 256 + (p % 32) / 2 * 16;
        for (int d = 0; d < D; ++d)
          dst[(d / 16) * 256 + d % 16] = uint32_t(v0 ? v0[d] : 0) | uint32_t(v1 ? v1[d] : 0) << 16;
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
        // 1. raw scores q . k, 32 positions (two tiles) at a time
        for (int p0 = 0; p0 < k16; p0 += 32) {
          const bool two = p0 + 16 < k16;
          const uint32_t* b0 = kt.data() + size_t(p0 / 16) * pairs * 16;
          _tile_zero(0);
          _tile_zero(1);
          for (int kb = 0; kb < D; kb += 32) {
            _tile_loadd(4, qt.data() + kb, D * 2);
            _tile_loadd(5, b0 + size_t(kb / 2) * 16, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (two) {
              _tile_loadd(6, b0 + size_t(pairs) * 16 + size_t(kb / 2) * 16, 64);
              _tile_dpbf16ps(1, 4, 6);
            }
          }
          _tile_stored(0, sc.data() + p0, max_pad * 4);
          if (two) _tile_stored(1, sc.data() + p0 + 16, max_pad * 4);
        }
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
        // 3. out = P V, four 16-column tiles of d at a time
        for (int dj = 0; dj < dtiles; dj += 4) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int pc = 0; pc < k32; pc += 32) {
            const uint32_t* b = vt.data() + size_t(pc / 32) * dtiles * 256 + size_t(dj) * 256;
            _tile_loadd(4, pw.data() + pc, max_pad * 2);
            _tile_loadd(5, b, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, b + 256, 64);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(7, b + 512, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, b + 768, 64);
            _tile_dpbf16ps(3, 4, 5);
          }
          _tile_stored(0, ot.data() + dj * 16, D * 4);
          _tile_stored(1, ot.data() + dj * 16 + 16, D * 4);
          _tile_stored(2, ot.data() + dj * 16 + 32, D * 4);
          _tile_stored(3, ot.data() + dj * 16 + 48, D * 4);
        }
        for (int r = 0; r < R; ++r) {
          float* o = out + (int64_t(q_starts[s] + t0 + r / G) * H + kvh * G + r % G) * D;
          const float inv = 1.f / denom[r];
#pragma omp simd
          for (int d = 0; d < D; ++d) o[d] = ot[size_t(r) * D + d] * inv;
        }
      }
    }
    _tile_release();
  }
  return 0;
}

}  // namespace minipaged_amx

#else  // no AMX: the AVX-512 loop serves

namespace minipaged_amx {
int paged_prefill_bf16(const float*, const uint16_t*, const uint16_t*, const int32_t*, int, const int32_t*,
                       const int32_t*, const int32_t*, int, int, int, int, int, float, float*, int) {
  return -2;
}
}  // namespace minipaged_amx

#endif
