// The Qwen3 block's fused elementwise steps (worker/layers.py; worker/cpu_kernels.py builds and
// loads this file): the K/V slot write, QK-norm + RoPE, SwiGLU's silu * up, and the residual add +
// RMSNorm, each one pass instead of several torch ops. float32 math; bfloat16 in or out in the
// bfloat16 mode.
// GCC 12 warns inside its own AVX-512 intrinsics once inlined: a known false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>

#include "cpu_math.h"

using namespace minipaged;  // exp_nonpositive, load, store

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

extern "C" {

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
