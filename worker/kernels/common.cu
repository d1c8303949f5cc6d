// common.cu -- helpers shared by the attention kernels (included by every other .cu file).
// Storage types: float, __half, __nv_bfloat16; all arithmetic is fp32.
// Under nvcc the CUDA headers supply the 16-bit types; in the CPU emulation build simt_cpu.h does.
#ifndef MINIPAGED_KERNELS_COMMON_CU
#define MINIPAGED_KERNELS_COMMON_CU

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define SIMT_EMU_ENTRY(NAME, PARAMS, ARGS)
#endif

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

namespace mp {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16(x);
}

// Elements of T in one 16-byte vector load.
template <typename T> struct Vec { static constexpr int N = 16 / static_cast<int>(sizeof(T)); };

// The Vec<T>::N elements held in a 16-byte register vector, converted to fp32 in out.
template <typename T>
__device__ __forceinline__ void unpack16_to_float(const uint4& raw, float* __restrict__ out) {
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < Vec<T>::N; ++i) out[i] = to_float(e[i]);
}

// bf16 -> fp32 is exact: the 16 bits are the top half of the float. A shift and a mask per 32-bit
// word instead of per-element extraction: fewer live temporaries (the generic path made ptxas
// spill 4 bytes in paged_decode_bf16_d64 on sm_90, where it aims at 64 registers).
template <>
__device__ __forceinline__ void unpack16_to_float<__nv_bfloat16>(const uint4& raw,
                                                                 float* __restrict__ out) {
    const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {                       // little endian: element 2i is the low half
        out[2 * i] = __uint_as_float(w[i] << 16);
        out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

// One 16-byte load of Vec<T>::N elements (p must be 16-byte aligned), converted to fp32 in out.
template <typename T>
__device__ __forceinline__ void load16_to_float(const T* __restrict__ p, float* __restrict__ out) {
    unpack16_to_float<T>(*reinterpret_cast<const uint4*>(p), out);
}

// One 16-byte store of Vec<T>::N elements (copy, no conversion); both pointers 16-byte aligned.
template <typename T>
__device__ __forceinline__ void copy16(T* __restrict__ dst, const T* __restrict__ src) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}

__device__ __forceinline__ float warp_max(float v, int width = 32) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        if (o < width) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o, width));
    return v;
}

__device__ __forceinline__ float warp_sum(float v, int width = 32) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        if (o < width) v += __shfl_xor_sync(0xffffffffu, v, o, width);
    return v;
}

// exp(s - m) with -inf handled: a masked score contributes 0, and an all-masked row stays at 0.
__device__ __forceinline__ float safe_exp(float s, float m) {
    return (s == -INFINITY) ? 0.0f : __expf(s - m);
}

// One online-softmax step for one row of a score tile, shared by decode and prefill. `width` lanes
// (a warp, or a half warp) hold the row's scores, one each at *p. The score is replaced by
// exp(s - m_new); the row's running max *m and sum *l absorb the tile; *alpha is what the row's
// accumulator must be scaled by before this tile's P V is added. `leader` is the row's first lane.
__device__ __forceinline__ void online_softmax_row(float* p, float* m, float* l, float* alpha,
                                                   bool leader, int width = 32) {
    const float s = *p;
    const float m_old = *m;
    const float m_new = fmaxf(m_old, warp_max(s, width));
    const float e = safe_exp(s, m_new);
    const float l_tile = warp_sum(e, width);
    *p = e;
    __syncwarp();   // every lane has read m_old before it is overwritten
    if (leader) {
        const float a = safe_exp(m_old, m_new);
        *alpha = a;
        *l = *l * a + l_tile;
        *m = m_new;
    }
}

// acc * alpha + sum_j p[j] * V[j][d]: one output element's share of a tile, V staged in shared
// memory with row stride ks.
__device__ __forceinline__ float rescale_accumulate(float acc, float alpha, const float* p,
                                                    const float* v, int n, int ks, int d) {
    float a = acc * alpha;
    for (int j = 0; j < n; ++j) a += p[j] * v[j * ks + d];
    return a;
}

}  // namespace mp

#endif  // MINIPAGED_KERNELS_COMMON_CU
