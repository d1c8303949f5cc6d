// Paged prefill attention, float32 / float64 products (worker/attention_cpu.py calls it through
// worker/cpu_kernels.py; the torch code stays the reference): register-blocked tiles instead of
// gather + SDPA, whose CPU GEMMs are MKL's slow path on AMD CPUs. The bfloat16 mode's products are
// in worker/cpu_attn_bf16.cpp, entered from here.
#include "cpu_attn_common.h"

namespace {

// The widest vector register: the prefill tiles below keep kRowBlock (kPvRows x 2) vectors of
// accumulators, which must fit in the 16 registers that AVX2 has, next to the operands.
#if defined(__AVX512F__)
constexpr int kVectorBytes = 64;
#else
constexpr int kVectorBytes = 32;
#endif

// Varlen causal prefill: sequence s's q_lens[s] queries are the last q_lens[s] positions of its
// context of seq_lens[s] tokens (a cached prefix may precede them); query row t of the chunk sees
// context positions 0 .. seq_len - q_len + t. A work item is one (sequence, kv head): its K rows
// are gathered once, transposed in groups of kLanes positions, so that scoring a tile of query
// rows (TQ tokens x the G heads of the group) is a small GEMM whose inner loop runs along
// positions with its accumulators in registers; then a per-row causal softmax, then P.V. Two
// passes rather than an online softmax: a tile's scores fit in L2 for any context. A bfloat16
// cache (C = uint16_t) has its V rows widened into one buffer per work item too.
template <typename T, typename C, int kD>
int paged_prefill(const T* query, const C* key_cache, const C* value_cache, int num_blocks,
                  const int32_t* block_tables, int max_blocks, const int32_t* seq_lens,
                  const int32_t* q_starts, const int32_t* q_lens, int S, int num_tokens, int H,
                  int Hkv, int block_size, int head_dim, T scale, T* out, int num_threads) {
  const int D = kD > 0 ? kD : head_dim;
  if (const int bad = check_prefill(block_tables, max_blocks, seq_lens, q_starts, q_lens, S, num_tokens,
                                    block_size, num_blocks))
    return bad;
  constexpr int kLanes = kVectorBytes / sizeof(T);  // positions per GEMM column block: one vector
  constexpr int kRowBlock = 8;             // score rows whose accumulators live in registers
  constexpr int kTileRows = 16;            // query rows (tokens x heads) scored together
  constexpr int kPvRows = 4;               // output rows whose accumulators live in registers
  if (D % kLanes != 0) return -1;          // the caller checks; vectors of d must tile D
  const int G = H / Hkv;
  const int TQ = std::max(1, kTileRows / G);                       // tokens per tile
  const int RP = (TQ * G + kRowBlock - 1) / kRowBlock * kRowBlock;  // rows, padded
  const int64_t head_stride = int64_t(block_size) * D;
  const int64_t block_stride = Hkv * head_stride;
  int max_len = 1;
  for (int s = 0; s < S; ++s) max_len = std::max(max_len, int(seq_lens[s]));
  const int max_pad = (max_len + kLanes - 1) / kLanes * kLanes;

#pragma omp parallel num_threads(std::max(1, std::min(num_threads, S * Hkv)))
  {
    std::vector<T> k_t(size_t(max_pad) * D), q_tile(size_t(RP) * D), o_tile(size_t(RP) * D);
    static_assert(kRowBlock % kPvRows == 0, "RP must be a multiple of kPvRows");
    std::vector<T> scores(size_t(RP) * max_pad), denom(RP);
    std::vector<const T*> v_rows(max_len);
    std::vector<T> v_wide(std::is_same_v<C, T> ? 0 : size_t(max_len) * D);
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < S * Hkv; ++item) {
      const int s = item / Hkv, kvh = item % Hkv;
      const int len = seq_lens[s], qlen = q_lens[s], prefix = len - qlen;
      const int32_t* table = block_tables + int64_t(s) * max_blocks;
      auto row_of = [&](const C* cache, int p) {
        return cache + int64_t(table[p / block_size]) * block_stride + kvh * head_stride +
               int64_t(p % block_size) * D;
      };
      // K transposed per group of kLanes positions: k_t[c][d][i] = k[c * kLanes + i][d]
      const int len_pad = (len + kLanes - 1) / kLanes * kLanes;
      for (int p = 0; p < len_pad; ++p) {
        T* dst = k_t.data() + size_t(p / kLanes) * D * kLanes + p % kLanes;
        if (p < len) {
          const C* k = row_of(key_cache, p);
          for (int d = 0; d < D; ++d) dst[size_t(d) * kLanes] = widen(k[d]);
        } else {
          for (int d = 0; d < D; ++d) dst[size_t(d) * kLanes] = T(0);
        }
      }
      for (int p = 0; p < len; ++p) {
        if constexpr (std::is_same_v<C, T>) {
          v_rows[p] = row_of(value_cache, p);
        } else {
          const C* v = row_of(value_cache, p);
          T* dst = v_wide.data() + size_t(p) * D;
#pragma omp simd
          for (int d = 0; d < D; ++d) dst[d] = widen(v[d]);
          v_rows[p] = dst;
        }
      }

      for (int t0 = 0; t0 < qlen; t0 += TQ) {
        const int nt = std::min(TQ, qlen - t0), R = nt * G;
        const int keys = prefix + t0 + nt;                    // what the tile's last row sees
        const int keys_pad = (keys + kLanes - 1) / kLanes * kLanes;
        // the tile's queries: row r = (token t0 + r / G, head kvh * G + r % G); padding is zero
        std::fill(q_tile.begin(), q_tile.end(), T(0));
        for (int r = 0; r < R; ++r) {
          const T* q = query + (int64_t(q_starts[s] + t0 + r / G) * H + kvh * G + r % G) * D;
          std::copy(q, q + D, q_tile.begin() + size_t(r) * D);
        }
        // 1. scores[r, p] = (q[r] . k[p]) * scale, kLanes positions x kRowBlock rows at a time
        for (int p0 = 0; p0 < keys; p0 += kLanes) {
          const T* kt = k_t.data() + size_t(p0 / kLanes) * D * kLanes;
          for (int r0 = 0; r0 < RP; r0 += kRowBlock) {
            T acc[kRowBlock][kLanes] = {};
            for (int d = 0; d < D; ++d) {
              for (int rr = 0; rr < kRowBlock; ++rr) {
                const T qv = q_tile[size_t(r0 + rr) * D + d];
#pragma omp simd
                for (int i = 0; i < kLanes; ++i) acc[rr][i] += qv * kt[size_t(d) * kLanes + i];
              }
            }
            for (int rr = 0; rr < kRowBlock; ++rr)
              for (int i = 0; i < kLanes; ++i)
                scores[size_t(r0 + rr) * keys_pad + p0 + i] = acc[rr][i] * scale;
          }
        }
        // 2. causal softmax per row: row r sees positions 0 .. prefix + t0 + r / G
        for (int r = 0; r < R; ++r) {
          T* row = scores.data() + size_t(r) * keys_pad;
          const int visible = prefix + t0 + r / G + 1;
          const T mx = row_max(row, visible);
#pragma omp simd
          for (int p = 0; p < visible; ++p) row[p] = exp_nonpositive(row[p] - mx);
          std::fill(row + visible, row + keys_pad, T(0));
          denom[r] = row_sum(row, visible);
        }
        // 3. out[r] = sum_p w[r, p] * v[p]: kPvRows rows x two vectors of d at a time (8
        //    independent FMA chains; 6 loads feed 8 FMAs). A D that is no multiple of two
        //    vectors: one vector of d, two accumulators each (even / odd positions).
        const bool two_vectors = D % (2 * kLanes) == 0;
        for (int r0 = 0; two_vectors && r0 < R; r0 += kPvRows) {
          for (int d0 = 0; d0 < D; d0 += 2 * kLanes) {
            T acc[kPvRows][2][kLanes] = {};
            const T* w = scores.data() + size_t(r0) * keys_pad;
            for (int p = 0; p < keys; ++p) {
              const T* v = v_rows[p] + d0;
              for (int rr = 0; rr < kPvRows; ++rr) {
                const T wp = w[size_t(rr) * keys_pad + p];
#pragma omp simd
                for (int i = 0; i < kLanes; ++i) {
                  acc[rr][0][i] += wp * v[i];
                  acc[rr][1][i] += wp * v[kLanes + i];
                }
              }
            }
            for (int rr = 0; rr < kPvRows; ++rr)
              for (int i = 0; i < 2 * kLanes; ++i)
                o_tile[size_t(r0 + rr) * D + d0 + i] = acc[rr][i / kLanes][i % kLanes];
          }
        }
        for (int r0 = 0; !two_vectors && r0 < R; r0 += kPvRows) {
          for (int d0 = 0; d0 < D; d0 += kLanes) {
            T acc[kPvRows][2][kLanes] = {};
            const T* w = scores.data() + size_t(r0) * keys_pad;
            int p = 0;
            for (; p + 1 < keys; p += 2) {
              const T* v0 = v_rows[p] + d0;
              const T* v1 = v_rows[p + 1] + d0;
              for (int rr = 0; rr < kPvRows; ++rr) {
                const T w0 = w[size_t(rr) * keys_pad + p], w1 = w[size_t(rr) * keys_pad + p + 1];
#pragma omp simd
                for (int i = 0; i < kLanes; ++i) {
                  acc[rr][0][i] += w0 * v0[i];
                  acc[rr][1][i] += w1 * v1[i];
                }
              }
            }
            if (p < keys) {
              const T* v0 = v_rows[p] + d0;
              for (int rr = 0; rr < kPvRows; ++rr) {
                const T w0 = w[size_t(rr) * keys_pad + p];
#pragma omp simd
                for (int i = 0; i < kLanes; ++i) acc[rr][0][i] += w0 * v0[i];
              }
            }
            for (int rr = 0; rr < kPvRows; ++rr)
              for (int i = 0; i < kLanes; ++i)
                o_tile[size_t(r0 + rr) * D + d0 + i] = acc[rr][0][i] + acc[rr][1][i];
          }
        }
        for (int r = 0; r < R; ++r) {
          T* o = out + (int64_t(q_starts[s] + t0 + r / G) * H + kvh * G + r % G) * D;
          for (int d = 0; d < D; ++d) o[d] = o_tile[size_t(r) * D + d] / denom[r];
        }
      }
    }
  }
  return 0;
}

template <typename T, typename C, int kD>
struct Prefill {
  template <typename... A> static int run(A... a) { return paged_prefill<T, C, kD>(a...); }
};

}  // namespace

namespace minipaged_attn_bf16 {  // worker/cpu_attn_bf16.cpp
int engines();
int paged_prefill_bf16(int engine, const float* query, const uint16_t* key_cache, const uint16_t* value_cache,
                       const int32_t* block_tables, int max_blocks, const int32_t* seq_lens, const int32_t* q_starts,
                       const int32_t* q_lens, int S, int H, int Hkv, int block_size, int D, float scale, float* out,
                       int num_threads);
}

// Returns 0, or 1 + the index of a sequence whose seq_len or block ids are out of range.
extern "C" {

int minipaged_paged_prefill_f32(const float* query, const float* key_cache, const float* value_cache,
                                int num_blocks, const int32_t* block_tables, int max_blocks,
                                const int32_t* seq_lens, const int32_t* q_starts, const int32_t* q_lens,
                                int S, int num_tokens, int H, int Hkv, int block_size, int D,
                                double scale, float* out, int num_threads) {
  return dispatch<Prefill, float, float>(D, query, key_cache, value_cache, num_blocks, block_tables, max_blocks,
                                  seq_lens, q_starts, q_lens, S, num_tokens, H, Hkv, block_size, D,
                                  float(scale), out, num_threads);
}

int minipaged_paged_prefill_f64(const double* query, const double* key_cache, const double* value_cache,
                                int num_blocks, const int32_t* block_tables, int max_blocks,
                                const int32_t* seq_lens, const int32_t* q_starts, const int32_t* q_lens,
                                int S, int num_tokens, int H, int Hkv, int block_size, int D,
                                double scale, double* out, int num_threads) {
  return dispatch<Prefill, double, double>(D, query, key_cache, value_cache, num_blocks, block_tables, max_blocks,
                                   seq_lens, q_starts, q_lens, S, num_tokens, H, Hkv, block_size, D,
                                   scale, out, num_threads);
}

int minipaged_paged_prefill_f32_bf16(const float* query, const uint16_t* key_cache,
                                     const uint16_t* value_cache, int num_blocks, const int32_t* block_tables,
                                     int max_blocks, const int32_t* seq_lens, const int32_t* q_starts,
                                     const int32_t* q_lens, int S, int num_tokens, int H, int Hkv,
                                     int block_size, int D, double scale, float* out, int num_threads) {
  return dispatch<Prefill, float, uint16_t>(D, query, key_cache, value_cache, num_blocks, block_tables,
                                            max_blocks, seq_lens, q_starts, q_lens, S, num_tokens, H, Hkv,
                                            block_size, D, float(scale), out, num_threads);
}

// The same in bfloat16 products (worker/cpu_attn_bf16.cpp: q and the softmax weights rounded to
// bfloat16, as a bfloat16 model computes them) on `engine` (2: AMX tiles, 1: AVX512_BF16 pair dot
// products; minipaged_bf16_prefill_engines() says which are here). Returns as above, or -2
// (nothing done) where that engine or this head layout is not available: the caller then runs the
// loop above.
int minipaged_paged_prefill_f32_bf16_rounded(int engine, const float* query, const uint16_t* key_cache,
                                             const uint16_t* value_cache, int num_blocks,
                                             const int32_t* block_tables, int max_blocks, const int32_t* seq_lens,
                                             const int32_t* q_starts, const int32_t* q_lens, int S, int num_tokens,
                                             int H, int Hkv, int block_size, int D, double scale, float* out,
                                             int num_threads) {
  if (const int bad = check_prefill(block_tables, max_blocks, seq_lens, q_starts, q_lens, S, num_tokens,
                                    block_size, num_blocks))
    return bad;
  return minipaged_attn_bf16::paged_prefill_bf16(engine, query, key_cache, value_cache, block_tables, max_blocks,
                                                 seq_lens, q_starts, q_lens, S, H, Hkv, block_size, D, float(scale),
                                                 out, num_threads);
}

int minipaged_bf16_prefill_engines() { return minipaged_attn_bf16::engines(); }

}  // extern "C"
