// Paged decode attention (worker/attention_cpu.py calls it through worker/cpu_kernels.py; the
// torch code stays the reference): one query token per sequence over its cached context.
//
// Decode: the torch formulation gathers every block a batch uses into a contiguous buffer, then
// runs two batched matmuls over it, so K and V cross memory about three times, and a decode step
// of a small model is mostly that traffic. Here each sequence reads its K and V blocks once,
// straight from the cache through its block table, whole blocks at a time (all kv heads: one
// contiguous run), and every query head of a GQA group is served from that read.
#include "cpu_attn_common.h"

namespace {

// A thread's decode reads, in the order its loop makes them (its sequences b, b + nt, ...: each
// one's K blocks, then its V blocks), asked for into L2 kLeadBytes before they are read. Blocks sit
// anywhere in the cache, so the hardware prefetcher cannot see the next one coming; asking for a
// sequence's blocks when it starts is too late for a short context (its first reads wait) and, for a
// long one, a burst that outruns the core's miss buffers (most of it dropped). Asked for at the pace
// of the reads, the next sequence arrives while this one computes.
constexpr int64_t kLeadBytes = 128 << 10;   // 256 KB: the same; 512 KB: slower (an L2 is 1 MB here)

template <typename C>
struct ReadAhead {
  const C* caches[2];              // K, V
  const int32_t* tables;
  const int32_t* lens;
  int max_blocks, B, step, block_size;
  int64_t block_stride;            // elements of one block (all kv heads)
  int b, kv = 0, j = 0;            // the next line to ask for: sequence b, cache kv, block j, at off
  int64_t off = 0, asked = 0;      // asked: bytes asked for so far

  void skip_empty() {
    while (b < B && lens[b] <= 0) b += step;
  }
  void ask_until(int64_t bytes) {
    while (asked < bytes && b < B) {
      __builtin_prefetch(caches[kv] + int64_t(tables[int64_t(b) * max_blocks + j]) * block_stride + off, 0, 2);
      asked += 64;
      if ((off += 64 / sizeof(C)) < block_stride) continue;
      off = 0;
      if (++j < (lens[b] + block_size - 1) / block_size) continue;
      j = 0;
      if (++kv < 2) continue;
      kv = 0;
      b += step;
      skip_empty();
    }
  }
};


// kD > 0: the head dim as a compile-time constant (the dot products unroll; ~25% faster for 64),
// 0: any head dim, at run time. See dispatch() for the instantiated ones. C: the caches' element
// type (T, or uint16_t: bfloat16 K/V read by float32 compute).
template <typename T, typename C, int kD>
int paged_decode(const T* query, const C* key_cache, const C* value_cache, int num_blocks,
                 const int32_t* block_tables, int max_blocks, const int32_t* seq_lens,
                 int B, int H, int Hkv, int block_size, int head_dim, T scale, T* out, int num_threads) {
  const int D = kD > 0 ? kD : head_dim;
  if (const int bad = check_tables(block_tables, max_blocks, seq_lens, B, block_size, num_blocks))
    return bad;
  const int G = H / Hkv;
  const int64_t head_stride = int64_t(block_size) * D;     // one kv head of one block
  const int64_t block_stride = Hkv * head_stride;          // one block, all kv heads
  int max_len = 1;
  for (int b = 0; b < B; ++b) max_len = std::max(max_len, int(seq_lens[b]));

  const int nt = std::max(1, std::min(num_threads, B));
  const int64_t unit_bytes = block_stride * int64_t(sizeof(C)) / H;   // read per (block, head) step
#pragma omp parallel num_threads(nt)
  {
    std::vector<T> scores(size_t(H) * max_len);  // this thread's [H, len] scores, then weights
    std::vector<T> acc(size_t(H) * D);
    // static, 1: thread t takes sequences t, t + nt, ..., so its reads are known ahead
    ReadAhead<C> ahead{{key_cache, value_cache}, block_tables, seq_lens, max_blocks, B, omp_get_num_threads(),
                       block_size, block_stride, omp_get_thread_num()};
    ahead.skip_empty();
    int64_t read = 0;                            // bytes this thread's loop has reached
#pragma omp for schedule(static, 1)
    for (int b = 0; b < B; ++b) {
      const int len = seq_lens[b];
      const T* q = query + int64_t(b) * H * D;
      T* o = out + int64_t(b) * H * D;
      const int32_t* table = block_tables + int64_t(b) * max_blocks;
      if (len <= 0) {  // empty context: zeros, like the torch backend
        std::fill(o, o + int64_t(H) * D, T(0));
        continue;
      }
      // 1. scores[h, p] = (q[h] . k[p]) * scale, block by block
      for (int p0 = 0; p0 < len; p0 += block_size) {
        const C* kb = key_cache + int64_t(table[p0 / block_size]) * block_stride;
        const int n = std::min(block_size, len - p0);
        for (int h = 0; h < H; ++h) {
          ahead.ask_until((read += unit_bytes) + kLeadBytes);
          const T* qh = q + int64_t(h) * D;
          const C* kh = kb + (h / G) * head_stride;
          T* s = scores.data() + size_t(h) * len + p0;
          score_keys<T, C, kD>(qh, kh, n, D, scale, s);
        }
      }
      // 2. weights = exp(s - max) per head, and their sum
      for (int h = 0; h < H; ++h) {
        T* s = scores.data() + size_t(h) * len;
        const T mx = row_max(s, len);
#pragma omp simd
        for (int p = 0; p < len; ++p) s[p] = exp_nonpositive(s[p] - mx);
        acc[size_t(h) * D] = row_sum(s, len);  // parked here until step 3 needs the row
      }
      std::vector<T> denom(H);
      for (int h = 0; h < H; ++h) denom[h] = acc[size_t(h) * D];
      // 3. out[h] = sum_p w[h, p] * v[p] / sum, block by block
      std::fill(acc.begin(), acc.end(), T(0));
      for (int p0 = 0; p0 < len; p0 += block_size) {
        const int j = p0 / block_size;
        const C* vb = value_cache + int64_t(table[j]) * block_stride;
        const int n = std::min(block_size, len - p0);
        for (int h = 0; h < H; ++h) {
          ahead.ask_until((read += unit_bytes) + kLeadBytes);
          const C* vh = vb + (h / G) * head_stride;
          const T* w = scores.data() + size_t(h) * len + p0;
          add_weighted<T, C, kD>(w, vh, n, D, acc.data() + size_t(h) * D);
        }
      }
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d) o[int64_t(h) * D + d] = acc[size_t(h) * D + d] / denom[h];
    }
  }
  return 0;
}

template <typename T, typename C, int kD>
struct Decode {
  template <typename... A> static int run(A... a) { return paged_decode<T, C, kD>(a...); }
};

}  // namespace

// Returns 0, or 1 + the index of a sequence whose seq_len or block ids are out of range.
extern "C" {

// 1 where decode over a bfloat16 cache rounds q to bfloat16 for vdpbf16ps (AVX512_BF16), 0 where
// it widens the cache's values instead (exact float32 products).
int minipaged_decode_rounds_q_bf16() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

int minipaged_paged_decode_f32(const float* query, const float* key_cache, const float* value_cache,
                               int num_blocks, const int32_t* block_tables, int max_blocks,
                               const int32_t* seq_lens, int B, int H, int Hkv, int block_size, int D,
                               double scale, float* out, int num_threads) {
  return dispatch<Decode, float, float>(D, query, key_cache, value_cache, num_blocks, block_tables, max_blocks,
                                 seq_lens, B, H, Hkv, block_size, D, float(scale), out, num_threads);
}

int minipaged_paged_decode_f64(const double* query, const double* key_cache, const double* value_cache,
                               int num_blocks, const int32_t* block_tables, int max_blocks,
                               const int32_t* seq_lens, int B, int H, int Hkv, int block_size, int D,
                               double scale, double* out, int num_threads) {
  return dispatch<Decode, double, double>(D, query, key_cache, value_cache, num_blocks, block_tables, max_blocks,
                                  seq_lens, B, H, Hkv, block_size, D, scale, out, num_threads);
}

// float32 queries over bfloat16 caches (uint16_t bits): the bfloat16 compute mode.
int minipaged_paged_decode_f32_bf16(const float* query, const uint16_t* key_cache, const uint16_t* value_cache,
                                    int num_blocks, const int32_t* block_tables, int max_blocks,
                                    const int32_t* seq_lens, int B, int H, int Hkv, int block_size, int D,
                                    double scale, float* out, int num_threads) {
  return dispatch<Decode, float, uint16_t>(D, query, key_cache, value_cache, num_blocks, block_tables,
                                           max_blocks, seq_lens, B, H, Hkv, block_size, D, float(scale), out,
                                           num_threads);
}

}  // extern "C"
