// paged_decode.cu -- decode attention over the paged KV cache, split-KV with a reduce.
//
// paged_decode_<dt>_d<D>: grid (B, num_kv_heads, num_splits), block DEC_THREADS (128).
//   One CTA serves one (sequence, kv head) and ALL the G = num_heads / num_kv_heads query heads of
//   its GQA group, so each K/V element of the context is read from memory once per split.
//   Split s covers context positions [s * chunk, min(L, (s + 1) * chunk)), chunk = ceil(L / S)
//   rounded up to a whole tile. The context is walked in tiles of DEC_TILE (32) tokens:
//     1. K and V rows of the tile -> shared memory (16-byte vector loads, fp32 in shared memory),
//        each token's row found through block_tables[b, pos / block_size], pos % block_size;
//        the loads of tile t+1 are issued into registers before tile t is computed;
//     2. scores S[g][j] = scale * q_g . k_j (all threads, G x 32 dot products);
//     3. online softmax: one warp per query head, max and sum over the 32 tokens by warp shuffles,
//        running (max, sum) and the rescale factor alpha kept in shared memory;
//     4. acc[g][d] = alpha_g * acc[g][d] + sum_j p[g][j] * v_j[d] (registers, G*D / 128 per thread).
//   With one split the CTA writes out = acc / sum in the storage type. With several, it writes the
//   partial (max, sum, unnormalized acc) in fp32 to the workspace [B, H, S] / [B, H, S, D], and
//   paged_decode_reduce combines the splits.
// paged_decode_reduce_<dt>_d<D>: grid (B, num_heads), block D: out = sum_s e^(m_s - M) acc_s /
//   sum_s e^(m_s - M) l_s with M = max_s m_s (empty splits carry m = -inf and are skipped).
#include "common.cu"

namespace mp {

constexpr int DEC_THREADS = 128;
constexpr int DEC_TILE = 32;     // tokens per tile (= warp size: lane j owns token j in softmax)
constexpr int MAX_GROUP = 16;    // query heads per kv head
static_assert(DEC_TILE == 32, "the softmax step maps one tile token to one lane");

template <typename T, int D>
__device__ __forceinline__ void paged_decode_impl(
    T* __restrict__ out, float* __restrict__ ws_m, float* __restrict__ ws_l,
    float* __restrict__ ws_acc, const T* __restrict__ q, const T* __restrict__ key_cache,
    const T* __restrict__ value_cache, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, float scale, int num_heads, int num_kv_heads, int block_size,
    int max_blocks, int num_splits) {
    constexpr int V = Vec<T>::N;
    constexpr int DV = D / V;              // vectors per head row
    constexpr int KS = D + 4;              // padded shared row stride (conflict-free float4 reads)
    constexpr int NW = DEC_THREADS / 32;
    constexpr int ACC = MAX_GROUP * D / DEC_THREADS;
    constexpr int NLOAD = (DEC_TILE * DV + DEC_THREADS - 1) / DEC_THREADS;  // vectors per thread
    static_assert(D % V == 0 && D % 4 == 0 && (MAX_GROUP * D) % DEC_THREADS == 0, "head_dim");

    __shared__ __align__(16) float sK[DEC_TILE * KS];
    __shared__ __align__(16) float sV[DEC_TILE * KS];
    __shared__ __align__(16) float sQ[MAX_GROUP * D];
    __shared__ float sP[MAX_GROUP * DEC_TILE];
    __shared__ float sM[MAX_GROUP];
    __shared__ float sL[MAX_GROUP];
    __shared__ float sAlpha[MAX_GROUP];

    const int b = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int G = num_heads / num_kv_heads;
    const int L = seq_lens[b];
    const int per_split = (L + num_splits - 1) / num_splits;
    const int chunk = (per_split + DEC_TILE - 1) / DEC_TILE * DEC_TILE;
    const int start = split * chunk;
    const int end = min(L, start + chunk);
    const int* btab = block_tables + static_cast<long long>(b) * max_blocks;
    const long long head0 = static_cast<long long>(b) * num_heads + static_cast<long long>(kvh) * G;

    for (int i = tid; i < G * DV; i += DEC_THREADS) {
        const int g = i / DV, d = (i % DV) * V;
        load16_to_float(q + (head0 + g) * D + d, &sQ[g * D + d]);
    }
    if (tid < G) {
        sM[tid] = -INFINITY;
        sL[tid] = 0.0f;
    }
    float acc[ACC];
#pragma unroll
    for (int r = 0; r < ACC; ++r) acc[r] = 0.0f;
    __syncthreads();

    // Software pipelining: the raw 16-byte vectors of the NEXT tile are loaded into registers
    // while the current tile is computed, so the global-load latency overlaps the math.
    uint4 rk[NLOAD], rv[NLOAD];
    auto fetch = [&](int t0, int n) {
#pragma unroll
        for (int k = 0; k < NLOAD; ++k) {
            const int i = tid + k * DEC_THREADS;
            if (i < n * DV) {
                const int j = i / DV, d = (i % DV) * V;
                const int pos = t0 + j;
                const long long blk = btab[pos / block_size];
                const long long row = (blk * num_kv_heads + kvh) * block_size + pos % block_size;
                rk[k] = *reinterpret_cast<const uint4*>(key_cache + row * D + d);
                rv[k] = *reinterpret_cast<const uint4*>(value_cache + row * D + d);
            }
        }
    };
    if (start < end) fetch(start, min(DEC_TILE, end - start));

    for (int t0 = start; t0 < end; t0 += DEC_TILE) {
        const int n = min(DEC_TILE, end - t0);
        // 1. the prefetched K/V tile -> shared memory (fp32), then prefetch the next one.
#pragma unroll
        for (int k = 0; k < NLOAD; ++k) {
            const int i = tid + k * DEC_THREADS;
            if (i < n * DV) {
                const int j = i / DV, d = (i % DV) * V;
                unpack16_to_float<T>(rk[k], &sK[j * KS + d]);
                unpack16_to_float<T>(rv[k], &sV[j * KS + d]);
            }
        }
        __syncthreads();
        if (t0 + DEC_TILE < end) fetch(t0 + DEC_TILE, min(DEC_TILE, end - t0 - DEC_TILE));
        // 2. scores.
        for (int i = tid; i < G * DEC_TILE; i += DEC_THREADS) {
            const int g = i / DEC_TILE, j = i % DEC_TILE;
            float s = -INFINITY;
            if (j < n) {
                const float4* qv = reinterpret_cast<const float4*>(&sQ[g * D]);
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
        // 3. online softmax, one warp per query head.
        for (int g = warp; g < G; g += NW)
            online_softmax_row(&sP[g * DEC_TILE + lane], &sM[g], &sL[g], &sAlpha[g], lane == 0);
        __syncthreads();
        // 4. rescale and accumulate P V.
#pragma unroll
        for (int r = 0; r < ACC; ++r) {
            const int idx = tid + r * DEC_THREADS;
            if (idx < G * D) {
                const int g = idx / D, d = idx % D;
                acc[r] = rescale_accumulate(acc[r], sAlpha[g], &sP[g * DEC_TILE], sV, n, KS, d);
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int r = 0; r < ACC; ++r) {
        const int idx = tid + r * DEC_THREADS;
        if (idx < G * D) {
            const int g = idx / D, d = idx % D;
            if (num_splits == 1) {
                const float l = sL[g];
                out[(head0 + g) * D + d] = from_float<T>(l > 0.0f ? acc[r] / l : 0.0f);
            } else {
                const long long w = (head0 + g) * num_splits + split;
                ws_acc[w * D + d] = acc[r];
                if (d == 0) {
                    ws_m[w] = sM[g];
                    ws_l[w] = sL[g];
                }
            }
        }
    }
}

template <typename T, int D>
__device__ __forceinline__ void paged_decode_reduce_impl(
    T* __restrict__ out, const float* __restrict__ ws_m, const float* __restrict__ ws_l,
    const float* __restrict__ ws_acc, int num_heads, int num_splits) {
    const long long bh = static_cast<long long>(blockIdx.x) * num_heads + blockIdx.y;
    const long long w0 = bh * num_splits;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float m = -INFINITY;
        for (int s = 0; s < num_splits; ++s) m = fmaxf(m, ws_m[w0 + s]);
        float l = 0.0f, a = 0.0f;
        for (int s = 0; s < num_splits; ++s) {
            const float ms = ws_m[w0 + s];
            if (ms == -INFINITY) continue;
            const float e = __expf(ms - m);
            l += ws_l[w0 + s] * e;
            a += ws_acc[(w0 + s) * D + d] * e;
        }
        out[bh * D + d] = from_float<T>(l > 0.0f ? a / l : 0.0f);
    }
}

}  // namespace mp

#define MP_DECODE_PARAMS(T)                                                                    \
    T *__restrict__ out, float *__restrict__ ws_m, float *__restrict__ ws_l,                   \
        float *__restrict__ ws_acc, const T *__restrict__ q, const T *__restrict__ key_cache,  \
        const T *__restrict__ value_cache, const int *__restrict__ block_tables,               \
        const int *__restrict__ seq_lens, float scale, int num_heads, int num_kv_heads,        \
        int block_size, int max_blocks, int num_splits
#define MP_DECODE_ARGS                                                                        \
    out, ws_m, ws_l, ws_acc, q, key_cache, value_cache, block_tables, seq_lens, scale,        \
        num_heads, num_kv_heads, block_size, max_blocks, num_splits
#define MP_REDUCE_PARAMS(T)                                                             \
    T *__restrict__ out, const float *__restrict__ ws_m, const float *__restrict__ ws_l, \
        const float *__restrict__ ws_acc, int num_heads, int num_splits
#define MP_REDUCE_ARGS out, ws_m, ws_l, ws_acc, num_heads, num_splits

#define MP_DEFINE_DECODE(SUFFIX, T, D)                                                          \
    extern "C" __global__ void __launch_bounds__(mp::DEC_THREADS)                               \
        paged_decode_##SUFFIX(MP_DECODE_PARAMS(T)) {                                            \
        mp::paged_decode_impl<T, D>(MP_DECODE_ARGS);                                            \
    }                                                                                           \
    extern "C" __global__ void paged_decode_reduce_##SUFFIX(MP_REDUCE_PARAMS(T)) {              \
        mp::paged_decode_reduce_impl<T, D>(MP_REDUCE_ARGS);                                     \
    }                                                                                           \
    SIMT_EMU_ENTRY(paged_decode_##SUFFIX, MP_DECODE_PARAMS(T), MP_DECODE_ARGS)                  \
    SIMT_EMU_ENTRY(paged_decode_reduce_##SUFFIX, MP_REDUCE_PARAMS(T), MP_REDUCE_ARGS)

MP_DEFINE_DECODE(f32_d64, float, 64)
MP_DEFINE_DECODE(f32_d128, float, 128)
MP_DEFINE_DECODE(f16_d64, __half, 64)
MP_DEFINE_DECODE(f16_d128, __half, 128)
MP_DEFINE_DECODE(bf16_d64, __nv_bfloat16, 64)
MP_DEFINE_DECODE(bf16_d128, __nv_bfloat16, 128)
