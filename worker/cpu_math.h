// Helpers shared by the CPU kernel sources (worker/cpu_attn_*.cpp, cpu_fused.cpp, cpu_sampling.cpp,
// cpu_gemm_amx.cpp): the vectorizable exp and the row max of the softmax, and bfloat16 <-> float32.
// Header-only, inline, no state.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace minipaged {

// exp(x) for x <= 0 (softmax weights: score - row max) in a form the compiler vectorizes: libm's
// expf is a call per element, and a long causal prefill computes millions of them. Cephes' expf:
// x = n ln2 + r (ln2 in two parts), a degree-6 polynomial for exp(r), 2^n through the exponent
// bits; relative error ~2e-7 (about 1 ulp). Below -87.3 the weight is 0. float64 (the parity mode)
// keeps std::exp.
inline float exp_nonpositive(float x) {
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (int32_t(n) + 127) << 23;  // 2^n, n >= -126 above the cut-off
  return x < -87.3f ? 0.0f : p * __builtin_bit_cast(float, bits);
}
inline double exp_nonpositive(double x) { return std::exp(x); }

// K/V elements as the compute type: a bfloat16 cache (the bfloat16 compute mode) holds the top
// 16 bits of a float32, so widening is a shift; float and double caches are read as they are.
inline float widen(uint16_t h) { return __builtin_bit_cast(float, uint32_t(h) << 16); }
inline float widen(float x) { return x; }
inline double widen(double x) { return x; }

// Activations of the bfloat16 compute mode cross the GEMMs as bfloat16 (the top 16 bits of a
// float32; widen() above reads them). round_bf16 is torch's float32 -> bfloat16: round to nearest,
// ties to even, NaN as 0x7fc0 (c10's round_to_nearest_even). load/store let one loop read and
// write either type.
inline uint16_t round_bf16(float x) {
  const uint32_t b = __builtin_bit_cast(uint32_t, x);
  if ((b & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return uint16_t((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return widen(p[i]); }
inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(uint16_t* p, int64_t i, float x) { p[i] = round_bf16(x); }

// max of s[0, n) (-inf for n = 0), the softmax's row max. GCC leaves the plain max reduction scalar
// without -ffast-math (one dependent max per element: a fifth of the AMX prefill's time), so
// AVX-512 gets 16 lanes by hand.
inline float max_of(const float* s, int n) {
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int p = 0;
  for (; p + 16 <= n; p += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + p));
  if (p < n) m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, __mmask16((1u << (n - p)) - 1), s + p));
  return _mm512_reduce_max_ps(m);
#else
  float mx = -std::numeric_limits<float>::infinity();
  for (int p = 0; p < n; ++p) mx = s[p] > mx ? s[p] : mx;
  return mx;
#endif
}

}  // namespace minipaged
