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

// One 16-byte load of Vec<T>::N elements (p must be 16-byte aligned), converted to fp32 in out.
template <typename T>
__device__ __forceinline__ void load16_to_float(const T* __restrict__ p, float* __restrict__ out) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < Vec<T>::N; ++i) out[i] = to_float(e[i]);
}

// The Vec<T>::N elements held in a 16-byte register vector, converted to fp32 in out.
template <typename T>
__device__ __forceinline__ void unpack16_to_float(const uint4& raw, float* __restrict__ out) {
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < Vec<T>::N; ++i) out[i] = to_float(e[i]);
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

}  // namespace mp

#endif  // MINIPAGED_KERNELS_COMMON_CU
