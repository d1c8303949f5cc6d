// paged_prefill.cu -- varlen causal prefill attention over the paged KV cache.
//
// paged_prefill_<dt>_d<D>: grid (B, ceil(max_query_len / q_tile), num_kv_heads), block 128.
//   query [T, H, D] is packed: sequence b owns rows query_start_loc[b] .. query_start_loc[b+1]);
//   its qlen queries are the LAST qlen positions of its context of L = seq_lens[b] tokens (whose
//   K/V, the cached prefix and these new tokens, are already in the cache). Query i of the sequence
//   sits at absolute position p_i = L - qlen + i and attends to context positions 0..p_i.
//   One CTA serves q_tile consecutive queries of one sequence for all G query heads of one kv head:
//   PF_ROWS (32) rows r = i * G + g, q_tile = PF_ROWS / G (the host computes it), so each K/V tile
//   is loaded once for the whole group. Keys are walked in tiles of PF_TILE (16) tokens from 0 to
//   the last query's position, with the same four steps as decode (K/V to shared memory, scores,
//   online softmax with half-warp shuffles: lanes 0-15 one row, 16-31 the next, then P V).
#include "common.cu"

namespace mp {

constexpr int PF_THREADS = 128;
constexpr int PF_ROWS = 32;
constexpr int PF_TILE = 16;
static_assert(PF_TILE == 16, "the softmax step maps a tile to a half warp");

template <typename T, int D>
__device__ __forceinline__ void paged_prefill_impl(
    T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ key_cache,
    const T* __restrict__ value_cache, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc, float scale,
    int num_heads, int num_kv_heads, int block_size, int max_blocks, int q_tile) {
    constexpr int V = Vec<T>::N;
    constexpr int DV = D / V;
    constexpr int KS = D + 4;
    constexpr int NW = PF_THREADS / 32;
    constexpr int ACC = PF_ROWS * D / PF_THREADS;
    static_assert(D % V == 0 && D % 4 == 0 && (PF_ROWS * D) % PF_THREADS == 0, "head_dim");

    __shared__ __align__(16) float sK[PF_TILE * KS];
    __shared__ __align__(16) float sV[PF_TILE * KS];
    __shared__ __align__(16) float sQ[PF_ROWS * D];
    __shared__ float sP[PF_ROWS * PF_TILE];
    __shared__ float sM[PF_ROWS];
    __shared__ float sL[PF_ROWS];
    __shared__ float sAlpha[PF_ROWS];

    const int b = blockIdx.x, kvh = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int G = num_heads / num_kv_heads;
    const int q_begin = query_start_loc[b];
    const int qlen = query_start_loc[b + 1] - q_begin;
    const int L = seq_lens[b];
    const int ctx0 = L - qlen;                 // absolute position of query 0
    const int qi0 = blockIdx.y * q_tile;
    if (qi0 >= qlen) return;                   // uniform over the CTA: no barrier is skipped
    const int nq = min(q_tile, qlen - qi0);
    const int R = nq * G;                      // live rows
    const int kend = ctx0 + qi0 + nq;          // keys [0, kend) are visible to some row
    const int* btab = block_tables + static_cast<long long>(b) * max_blocks;

    for (int i = tid; i < R * DV; i += PF_THREADS) {
        const int r = i / DV, d = (i % DV) * V;
        const int qi = qi0 + r / G, g = r % G;
        const long long row = static_cast<long long>(q_begin + qi) * num_heads + kvh * G + g;
        load16_to_float(q + row * D + d, &sQ[r * D + d]);
    }
    if (tid < PF_ROWS) {
        sM[tid] = -INFINITY;
        sL[tid] = 0.0f;
    }
    float acc[ACC];
#pragma unroll
    for (int k = 0; k < ACC; ++k) acc[k] = 0.0f;
    __syncthreads();

    for (int t0 = 0; t0 < kend; t0 += PF_TILE) {
        const int n = min(PF_TILE, kend - t0);
        for (int i = tid; i < n * DV; i += PF_THREADS) {
            const int j = i / DV, d = (i % DV) * V;
            const int pos = t0 + j;
            const long long blk = btab[pos / block_size];
            const long long row = (blk * num_kv_heads + kvh) * block_size + pos % block_size;
            load16_to_float(key_cache + row * D + d, &sK[j * KS + d]);
            load16_to_float(value_cache + row * D + d, &sV[j * KS + d]);
        }
        __syncthreads();
        for (int i = tid; i < PF_ROWS * PF_TILE; i += PF_THREADS) {
            const int r = i / PF_TILE, j = i % PF_TILE;
            float s = -INFINITY;
            if (r < R && j < n && t0 + j <= ctx0 + qi0 + r / G) {
                const float4* qv = reinterpret_cast<const float4*>(&sQ[r * D]);
                const float4* kv = reinterpret_cast<const float4*>(&sK[j * KS]);
                float dot = 0.0f;
#pragma unroll 8
                for (int d = 0; d < D / 4; ++d) {
                    const float4 a = qv[d], c = kv[d];
                    dot += a.x * c.x + a.y * c.y + a.z * c.z + a.w * c.w;
                }
                s = dot * scale;
            }
            sP[i] = s;
        }
        __syncthreads();
        // Online softmax: warp w takes row pairs w, w + NW, ...; a half warp per row.
        for (int rp = warp; rp < PF_ROWS / 2; rp += NW) {
            const int r = rp * 2 + (lane >> 4), j = lane & 15;
            online_softmax_row(&sP[r * PF_TILE + j], &sM[r], &sL[r], &sAlpha[r], j == 0, 16);
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < ACC; ++k) {
            const int idx = tid + k * PF_THREADS;
            const int r = idx / D, d = idx % D;
            if (r < R)
                acc[k] = rescale_accumulate(acc[k], sAlpha[r], &sP[r * PF_TILE], sV, n, KS, d);
        }
        __syncthreads();
    }

#pragma unroll
    for (int k = 0; k < ACC; ++k) {
        const int idx = tid + k * PF_THREADS;
        const int r = idx / D, d = idx % D;
        if (r < R) {
            const int qi = qi0 + r / G, g = r % G;
            const long long row = static_cast<long long>(q_begin + qi) * num_heads + kvh * G + g;
            const float l = sL[r];
            out[row * D + d] = from_float<T>(l > 0.0f ? acc[k] / l : 0.0f);
        }
    }
}

}  // namespace mp

#define MP_PREFILL_PARAMS(T)                                                                  \
    T *__restrict__ out, const T *__restrict__ q, const T *__restrict__ key_cache,            \
        const T *__restrict__ value_cache, const int *__restrict__ block_tables,              \
        const int *__restrict__ seq_lens, const int *__restrict__ query_start_loc,            \
        float scale, int num_heads, int num_kv_heads, int block_size, int max_blocks,         \
        int q_tile
#define MP_PREFILL_ARGS                                                                       \
    out, q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, num_heads, \
        num_kv_heads, block_size, max_blocks, q_tile

#define MP_DEFINE_PREFILL(SUFFIX, T, D)                                                   \
    extern "C" __global__ void __launch_bounds__(mp::PF_THREADS)                          \
        paged_prefill_##SUFFIX(MP_PREFILL_PARAMS(T)) {                                    \
        mp::paged_prefill_impl<T, D>(MP_PREFILL_ARGS);                                    \
    }                                                                                     \
    SIMT_EMU_ENTRY(paged_prefill_##SUFFIX, MP_PREFILL_PARAMS(T), MP_PREFILL_ARGS)

MP_DEFINE_PREFILL(f32_d64, float, 64)
MP_DEFINE_PREFILL(f32_d128, float, 128)
MP_DEFINE_PREFILL(f16_d64, __half, 64)
MP_DEFINE_PREFILL(f16_d128, __half, 128)
MP_DEFINE_PREFILL(bf16_d64, __nv_bfloat16, 64)
MP_DEFINE_PREFILL(bf16_d128, __nv_bfloat16, 128)
