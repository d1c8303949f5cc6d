// reshape_and_cache.cu -- write K and V of T new tokens into the paged cache.
//   key/value   [T, num_kv_heads, head_dim] (contiguous)
//   key_cache   [num_blocks, num_kv_heads, block_size, head_dim] (HND, contiguous), same for value
//   slot_mapping int64 [T]; slot -> (slot / block_size, slot % block_size); slot < 0 = padding.
// Grid (T), block (128): one CTA per token copies num_kv_heads * head_dim elements of K and of V,
// with 16-byte vectors when head_dim is a multiple of the vector width (the host checks alignment).
#include "common.cu"

namespace mp {

constexpr int CACHE_THREADS = 128;

template <typename T>
__device__ __forceinline__ void reshape_and_cache_impl(
    const T* __restrict__ key, const T* __restrict__ value, T* __restrict__ key_cache,
    T* __restrict__ value_cache, const long long* __restrict__ slot_mapping, int num_kv_heads,
    int head_dim, int block_size, int vectorized) {
    const int t = blockIdx.x;
    const long long slot = slot_mapping[t];
    if (slot < 0) return;
    const long long blk = slot / block_size;
    const int off = static_cast<int>(slot % block_size);
    const int n = num_kv_heads * head_dim;
    const T* ksrc = key + static_cast<long long>(t) * n;
    const T* vsrc = value + static_cast<long long>(t) * n;
    if (vectorized) {
        constexpr int V = Vec<T>::N;
        const int nvec = n / V, vec_per_head = head_dim / V;
        for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
            const int h = i / vec_per_head, d = (i % vec_per_head) * V;
            const long long dst = ((blk * num_kv_heads + h) * block_size + off) * head_dim + d;
            copy16(key_cache + dst, ksrc + i * V);
            copy16(value_cache + dst, vsrc + i * V);
        }
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const int h = i / head_dim, d = i % head_dim;
            const long long dst = ((blk * num_kv_heads + h) * block_size + off) * head_dim + d;
            key_cache[dst] = ksrc[i];
            value_cache[dst] = vsrc[i];
        }
    }
}

}  // namespace mp

#define MP_CACHE_PARAMS(T)                                                                      \
    const T *__restrict__ key, const T *__restrict__ value, T *__restrict__ key_cache,          \
        T *__restrict__ value_cache, const long long *__restrict__ slot_mapping,                \
        int num_kv_heads, int head_dim, int block_size, int vectorized
#define MP_CACHE_ARGS \
    key, value, key_cache, value_cache, slot_mapping, num_kv_heads, head_dim, block_size, vectorized

#define MP_DEFINE_CACHE(NAME, T)                                                          \
    extern "C" __global__ void __launch_bounds__(mp::CACHE_THREADS) NAME(MP_CACHE_PARAMS(T)) { \
        mp::reshape_and_cache_impl<T>(MP_CACHE_ARGS);                                      \
    }                                                                                      \
    SIMT_EMU_ENTRY(NAME, MP_CACHE_PARAMS(T), MP_CACHE_ARGS)

MP_DEFINE_CACHE(reshape_and_cache_f32, float)
MP_DEFINE_CACHE(reshape_and_cache_f16, __half)
MP_DEFINE_CACHE(reshape_and_cache_bf16, __nv_bfloat16)
