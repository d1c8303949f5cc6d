// Paged decode attention for the CPU: the torch backend's decode, fused into one pass over K/V.
//
// Why: the torch formulation gathers every block a batch uses into a contiguous buffer, then runs
// two batched matmuls over it, so K and V cross memory about three times, and a decode step of a
// small model is mostly that traffic. Here each sequence reads its K and V blocks once, straight
// from the cache through its block table, whole blocks at a time (all kv heads: one contiguous
// run), and every query head of a GQA group is served from that read.
//
// Layout (DESIGN section 4): key_cache / value_cache [num_blocks, Hkv, block_size, D], contiguous;
// context position p of sequence b lives in block block_tables[b, p / block_size] at offset
// p % block_size; query head h reads kv head h / G. query [B, H, D], out [B, H, D], contiguous.
//
// Numerics: scores = (q . k) * scale in the compute type T (float for float32 models, double for
// float64 ones, like the torch backend), a max-subtracted exp, P.V, one division by the sum at the
// end. Plain loops with `omp simd` (no -ffast-math: linking it would switch the whole process to
// flush-to-zero). Parallel over sequences with the OpenMP runtime torch already loaded (same
// libgomp soname), with as many threads as torch uses (the caller passes torch.get_num_threads()).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

// Blocks sit anywhere in the cache, so the hardware prefetcher cannot see the next one coming;
// asking for it a couple of blocks ahead hides most of the memory latency (~25% faster here).
constexpr int kPrefetchBlocks = 2;

template <typename T>
inline void prefetch(const T* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 64 / sizeof(T)) __builtin_prefetch(p + i, 0, 3);
}

// Every block a sequence reads must exist: returns 1 + the first bad sequence, or 0. (The worker
// validates Steps before they get here; this keeps a wrong direct call an error, not a crash.)
int check_tables(const int32_t* block_tables, int max_blocks, const int32_t* seq_lens, int B,
                 int block_size, int num_blocks) {
  for (int b = 0; b < B; ++b) {
    const int len = seq_lens[b];
    if (len < 0 || int64_t(len) > int64_t(max_blocks) * block_size) return b + 1;
    for (int j = 0; j < (len + block_size - 1) / block_size; ++j) {
      const int32_t blk = block_tables[int64_t(b) * max_blocks + j];
      if (blk < 0 || blk >= num_blocks) return b + 1;
    }
  }
  return 0;
}

template <typename T>
int paged_decode(const T* query, const T* key_cache, const T* value_cache, int num_blocks,
                 const int32_t* block_tables, int max_blocks, const int32_t* seq_lens,
                 int B, int H, int Hkv, int block_size, int D, T scale, T* out, int num_threads) {
  if (const int bad = check_tables(block_tables, max_blocks, seq_lens, B, block_size, num_blocks))
    return bad;
  const int G = H / Hkv;
  const int64_t head_stride = int64_t(block_size) * D;     // one kv head of one block
  const int64_t block_stride = Hkv * head_stride;          // one block, all kv heads
  int max_len = 1;
  for (int b = 0; b < B; ++b) max_len = std::max(max_len, int(seq_lens[b]));

#pragma omp parallel num_threads(std::max(1, std::min(num_threads, B)))
  {
    std::vector<T> scores(size_t(H) * max_len);  // this thread's [H, len] scores, then weights
    std::vector<T> acc(size_t(H) * D);
#pragma omp for schedule(dynamic, 1)
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
      const int num_blocks_used = (len + block_size - 1) / block_size;
      for (int j = 0; j < std::min(kPrefetchBlocks, num_blocks_used); ++j)
        prefetch(key_cache + int64_t(table[j]) * block_stride, block_stride);
      for (int p0 = 0; p0 < len; p0 += block_size) {
        const int j = p0 / block_size;
        const T* kb = key_cache + int64_t(table[j]) * block_stride;
        const int n = std::min(block_size, len - p0);
        const int ahead = j + kPrefetchBlocks;  // K ahead, then the first V blocks
        if (ahead < num_blocks_used)
          prefetch(key_cache + int64_t(table[ahead]) * block_stride, block_stride);
        else if (ahead - num_blocks_used < num_blocks_used)
          prefetch(value_cache + int64_t(table[ahead - num_blocks_used]) * block_stride, block_stride);
        for (int h = 0; h < H; ++h) {
          const T* qh = q + int64_t(h) * D;
          const T* kh = kb + (h / G) * head_stride;
          T* s = scores.data() + size_t(h) * len + p0;
          for (int i = 0; i < n; ++i) {
            const T* k = kh + int64_t(i) * D;
            T dot = 0;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < D; ++d) dot += qh[d] * k[d];
            s[i] = dot * scale;
          }
        }
      }
      // 2. weights = exp(s - max) per head, and their sum
      for (int h = 0; h < H; ++h) {
        T* s = scores.data() + size_t(h) * len;
        T mx = -std::numeric_limits<T>::infinity();
        for (int p = 0; p < len; ++p) mx = std::max(mx, s[p]);
        T sum = 0;
        for (int p = 0; p < len; ++p) {
          s[p] = std::exp(s[p] - mx);
          sum += s[p];
        }
        acc[size_t(h) * D] = sum;  // parked here until step 3 needs the row
      }
      std::vector<T> denom(H);
      for (int h = 0; h < H; ++h) denom[h] = acc[size_t(h) * D];
      // 3. out[h] = sum_p w[h, p] * v[p] / sum, block by block
      std::fill(acc.begin(), acc.end(), T(0));
      for (int p0 = 0; p0 < len; p0 += block_size) {
        const int j = p0 / block_size;
        const T* vb = value_cache + int64_t(table[j]) * block_stride;
        const int n = std::min(block_size, len - p0);
        if (j + kPrefetchBlocks < num_blocks_used)
          prefetch(value_cache + int64_t(table[j + kPrefetchBlocks]) * block_stride, block_stride);
        for (int h = 0; h < H; ++h) {
          const T* vh = vb + (h / G) * head_stride;
          const T* w = scores.data() + size_t(h) * len + p0;
          T* a = acc.data() + size_t(h) * D;
          for (int i = 0; i < n; ++i) {
            const T* v = vh + int64_t(i) * D;
            const T wi = w[i];
#pragma omp simd
            for (int d = 0; d < D; ++d) a[d] += wi * v[d];
          }
        }
      }
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d) o[int64_t(h) * D + d] = acc[size_t(h) * D + d] / denom[h];
    }
  }
  return 0;
}

}  // namespace

// Returns 0, or 1 + the index of a sequence whose seq_len or block ids are out of range.
extern "C" {

int minipaged_paged_decode_f32(const float* query, const float* key_cache, const float* value_cache,
                               int num_blocks, const int32_t* block_tables, int max_blocks,
                               const int32_t* seq_lens, int B, int H, int Hkv, int block_size, int D,
                               double scale, float* out, int num_threads) {
  return paged_decode<float>(query, key_cache, value_cache, num_blocks, block_tables, max_blocks,
                             seq_lens, B, H, Hkv, block_size, D, float(scale), out, num_threads);
}

int minipaged_paged_decode_f64(const double* query, const double* key_cache, const double* value_cache,
                               int num_blocks, const int32_t* block_tables, int max_blocks,
                               const int32_t* seq_lens, int B, int H, int Hkv, int block_size, int D,
                               double scale, double* out, int num_threads) {
  return paged_decode<double>(query, key_cache, value_cache, num_blocks, block_tables, max_blocks,
                              seq_lens, B, H, Hkv, block_size, D, scale, out, num_threads);
}

}  // extern "C"
