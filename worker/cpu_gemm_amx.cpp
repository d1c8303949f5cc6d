// y = x W^T for large batches (prefill chunks) on CPUs with AMX (worker/cpu_gemm.py), W kept in
// bfloat16, the result the float32 product of x and the checkpoint's exact values.
//
// Why: AMX multiplies bfloat16 tiles at ~7x the rate of AVX-512 float32 FMAs (this project's
// Xeon, 2 threads: 1.9 TFLOP/s vs 0.28 for oneDNN float32 at 256 x 1024 x 6144), but it takes
// bfloat16 inputs, and rounding x to bfloat16 would change the model's numbers. So x is split
// exactly into three bfloat16 parts, x = hi + mid + lo (8 + 8 + 8 significant bits: a float32's
// 24), and y = hi W^T + mid W^T + lo W^T: every product of two bfloat16 values is exact in
// float32, and AMX sums them in float32. The result differs from a float32 GEMM only in rounding
// order (~1e-6 relative), like oneDNN's blocked order does. Three products at AMX speed still
// beat one at FMA speed by ~2x.
//
// Layout: W is packed once at load time in AMX's pair-interleaved ("VNNI") form,
// vnni[p][k/2][j][k%2] = W[16 p + j][k], panels of 16 columns, K padded with zeros to a multiple of
// 32 and the panel count to an even number. Tiles (8 registers of 16 rows x 64 bytes): C0..C3 a
// 32 x 32 block of y (float32), A0/A1 16 rows x 32 k of one part of x, B0/B1 32 k x 16 columns
// of two panels. Rows of x go in chunks whose three parts fit in L2; the panel pairs of a chunk
// are split across threads.
//
// Linux grants AMX state per process on request (arch_prctl ARCH_REQ_XCOMP_PERM); where that
// fails (an older kernel, a VM that hides it) minipaged_amx_available() says 0 and the caller keeps
// its other GEMM.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_math.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr long kArchReqXcompPerm = 0x1023;
constexpr long kXfeatureXtiledata = 18;
constexpr int kKB = 32;   // k per tile step (32 bfloat16 = 64 bytes a row)

using minipaged::round_bf16;
using minipaged::widen;

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Row r of the chunk into parts[3][rows][Kp] (a row at or past mc, and k >= K, are zero padding).
void split_row(const float* x, int64_t ldx, int mc, int rows, int K, int Kp, uint16_t* parts, int r) {
  const int64_t part = int64_t(rows) * Kp;
  uint16_t* hi = parts + int64_t(r) * Kp;
  uint16_t* mid = hi + part;
  uint16_t* lo = mid + part;
  const int n = r < mc ? K : 0;
  const float* xr = x + int64_t(r) * ldx;
  for (int k = 0; k < n; ++k) {
    const float v = xr[k];
    const uint16_t h = round_bf16(v);
    const float r1 = v - widen(h);   // exact: the part hi does not hold
    const uint16_t m = round_bf16(r1);
    hi[k] = h, mid[k] = m, lo[k] = round_bf16(r1 - widen(m));
  }
  for (int k = n; k < Kp; ++k) hi[k] = mid[k] = lo[k] = 0;
}

// One 32 x 32 block of y: rows [mb, mb + 32) of the chunk's parts, panels 2q and 2q + 1.
void block(const uint16_t* parts, int64_t part, int Kp, int mb, const uint16_t* pair, float* out) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t panel = int64_t(Kp) * 16;            // elements of one VNNI panel
  for (int kb = 0; kb < Kp; kb += kKB) {
    _tile_loadd(6, pair + int64_t(kb) * 16, 64);          // 16 k pairs x 16 columns x 2
    _tile_loadd(7, pair + panel + int64_t(kb) * 16, 64);
    for (int s = 0; s < 3; ++s) {
      const uint16_t* a = parts + s * part + int64_t(mb) * Kp + kb;
      _tile_loadd(4, a, Kp * 2);
      _tile_loadd(5, a + int64_t(16) * Kp, Kp * 2);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, out, 32 * 4);                 // out: [32][32] float
  _tile_stored(1, out + 16, 32 * 4);
  _tile_stored(2, out + 16 * 32, 32 * 4);
  _tile_stored(3, out + 16 * 32 + 16, 32 * 4);
}

}  // namespace

namespace minipaged_amx {  // shared with worker/cpu_attn_bf16.cpp
bool permitted() {  // the process may use AMX: asked for once
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}
void configure() {  // every tile 16 rows x 64 bytes; per thread
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  // GCC does not model ldtilecfg as reading all 64 bytes: out of line, it dropped the row and
  // column stores as dead (a #GP); the barrier says the whole struct is read.
  __asm__ __volatile__("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}
}  // namespace minipaged_amx
using minipaged_amx::configure;
using minipaged_amx::permitted;

extern "C" {

int minipaged_amx_available() { return permitted() ? 1 : 0; }

// x [M, K] float32 (row stride ldx), vnni as above (Kp = K rounded up to 32, panels rounded up to
// even), bias [N] or null, y [M, N] float32 (row stride ldy). Returns 0, or 1 (nothing done) when
// the process may not use AMX.
int minipaged_linear_amx_f32(const float* x, int64_t ldx, int M, int K, const uint16_t* vnni, int N,
                             const float* bias, float* y, int64_t ldy, int num_threads) {
  if (!permitted()) return 1;   // an AMX instruction without the grant is SIGILL
  const int Kp = (K + kKB - 1) / kKB * kKB;
  const int pairs = (N + 31) / 32;
  // rows per chunk: its three parts within ~1 MB of L2, a multiple of 32, at least 64
  const int chunk = std::max(32, int((3 << 18) / (6 * int64_t(Kp))) / 32 * 32);
  const int rows_max = std::min(chunk, (M + 31) / 32 * 32);
  std::vector<uint16_t> parts(size_t(3) * rows_max * Kp);
  const int threads = std::max(1, num_threads);
#pragma omp parallel num_threads(threads)
  {
    configure();
    alignas(64) float out[32 * 32];
    for (int m0 = 0; m0 < M; m0 += chunk) {
      const int mc = std::min(chunk, M - m0), rows = (mc + 31) / 32 * 32;
#pragma omp for schedule(static)
      for (int r = 0; r < rows; ++r)
        split_row(x + int64_t(m0) * ldx, ldx, mc, rows, K, Kp, parts.data(), r);
      // (the implicit barrier: every part is written before any block reads it)
      const int64_t part = int64_t(rows) * Kp;
#pragma omp for schedule(static)
      for (int q = 0; q < pairs; ++q) {
        const uint16_t* pair = vnni + int64_t(2 * q) * Kp * 16;
        const int n0 = 32 * q, nc = std::min(32, N - n0);
        for (int mb = 0; mb < rows; mb += 32) {
          block(parts.data(), part, Kp, mb, pair, out);
          const int mr = std::min(32, mc - mb);
          for (int r = 0; r < mr; ++r) {
            float* yr = y + int64_t(m0 + mb + r) * ldy + n0;
            const float* o = out + r * 32;
            if (bias != nullptr)
              for (int j = 0; j < nc; ++j) yr[j] = o[j] + bias[n0 + j];
            else
              std::memcpy(yr, o, sizeof(float) * nc);
          }
        }
      }
    }
    _tile_release();
  }
  return 0;
}

}  // extern "C"

#else  // no AMX: the caller keeps its other GEMM

namespace minipaged_amx {
bool permitted() { return false; }
}

extern "C" {
int minipaged_amx_available() { return 0; }
int minipaged_linear_amx_f32(const float*, int64_t, int, int, const uint16_t*, int, const float*, float*,
                             int64_t, int) { return 1; }
}

#endif
