// Causal paged attention on the CPU, fp32. A task is a query row and a run of KV heads. Results do not depend
// on the batch (each task is independent). With AVX-512 (head_dim a multiple of 16, <= 256), each query head
// takes its scores 16 keys at a time (one lane sum per block of keys, not per key) and its weighted sum of V
// rows in registers, reading its KV head's rows once per query head (from cache after the first): on the CPU
// bench model attention went from 11.1% to 8.4% of a batch-8 decode step (perf). Otherwise the query heads of
// a GQA group share each K/V row load. The cache holds fp32, or bf16 / fp16 rows (16-bit weights: the KV
// dtype of a bf16 model, half the bytes a step reads), converted to fp32 as they are read.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__AVX2__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "backend/cpu/cpu_kernels.h"
#include "core/error.h"

namespace qrt::cpu {
namespace {

inline float dot(const float* a, const float* b, int n) {
  v16f acc{};
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    v16f x, y;
    std::memcpy(&x, a + i, 64);
    std::memcpy(&y, b + i, 64);
    acc += x * y;
  }
#if defined(__AVX512F__)
  float s = _mm512_reduce_add_ps(reinterpret_cast<__m512>(acc));
#else
  float s = lane_sum(acc);
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// The cache's element types: K/V rows of fp32, bf16 or fp16 (both 16-bit kinds stored as uint16_t).
struct F32Rows {
  using E = float;
};
struct Bf16Rows {
  using E = uint16_t;
};
struct F16Rows {
  using E = uint16_t;
};
// n elements as fp32: the row itself, or converted into buf (8 at a time with AVX2 / F16C).
inline const float* as_f32(F32Rows, const float* p, int, float*) { return p; }
inline const float* as_f32(Bf16Rows, const uint16_t* p, int n, float* buf) {
  int i = 0;
#if defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)));
    _mm256_storeu_ps(buf + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
#endif
  for (; i < n; ++i) buf[i] = bf16_to_f32(p[i]);
  return buf;
}
inline const float* as_f32(F16Rows, const uint16_t* p, int n, float* buf) {
  int i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
#endif
  for (; i < n; ++i) buf[i] = f16_to_f32(p[i]);
  return buf;
}

#if defined(__AVX512F__)
inline __m512 load16(F32Rows, const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(Bf16Rows, const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline __m512 load16(F16Rows, const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// scores[p] = scale * q . k(p) for p < n (D a multiple of 16, at most 256), keys in blocks of 16: each key's
// 16-lane products summed by sum_lanes16 (a key past n in a block repeats the block's first; its score is
// dropped). key(p) points at k(p)'s D elements of kind R.
template <typename R, typename KeyRow>
void block_scores(R kind, const float* q, int D, int n, float scale, KeyRow key, float* scores) {
  __m512 qv[16];
  for (int c = 0; c < D / 16; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  for (int p0 = 0; p0 < n; p0 += 16) {
    __m512 v[16];
    for (int j = 0; j < 16; ++j) {
      const auto* k = key(p0 + j < n ? p0 + j : p0);
      __m512 a = _mm512_mul_ps(qv[0], load16(kind, k));
      for (int c = 1; c < D / 16; ++c) a = _mm512_fmadd_ps(qv[c], load16(kind, k + 16 * c), a);
      v[j] = a;
    }
    const __m512 s = _mm512_mul_ps(sum_lanes16(v), _mm512_set1_ps(scale));
    const int m = std::min(16, n - p0);
    _mm512_mask_storeu_ps(scores + p0, __mmask16((1u << m) - 1), s);
  }
}

// out[0, D) = sum over p < n of w[p] * v(p), accumulated in p order in registers (D a multiple of 16, <= 256);
// val(p) points at v(p)'s D elements of kind R.
template <typename R, typename ValRow>
void weighted_sum_in_registers(R kind, const float* w, int D, int n, ValRow val, float* out) {
  __m512 acc[16];
  for (int c = 0; c < D / 16; ++c) acc[c] = _mm512_setzero_ps();
  for (int p = 0; p < n; ++p) {
    const auto* v = val(p);
    const __m512 wp = _mm512_set1_ps(w[p]);
    for (int c = 0; c < D / 16; ++c) acc[c] = _mm512_fmadd_ps(wp, load16(kind, v + 16 * c), acc[c]);
  }
  for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(out + 16 * c, acc[c]);
}
#endif

template <typename R>
void attention_rows(R kind, const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& s,
                    Tensor& out, ThreadPool& pool) {
  using E = typename R::E;
  const int D = s.head_dim, Hkv = s.kv_heads, group = s.q_heads / s.kv_heads;
  const int64_t kv_cols = int64_t(Hkv) * D;
  const E* kc = static_cast<const E*>(cache.k);
  const E* vc = static_cast<const E*>(cache.v);
  std::vector<int> row_seq(b.num_tokens);
  for (int si = 0; si < b.num_seqs; ++si)
    for (int r = b.q_start[si]; r < b.q_start[si + 1]; ++r) row_seq[r] = si;
  // A task is a query row and a run of KV heads: whole rows when there are enough of them (each
  // cache row is then taken by one task), single KV heads otherwise.
  const int heads_per_task = b.num_tokens >= 2 * pool.size() ? Hkv : 1;
  const int tasks_per_row = Hkv / heads_per_task;
  const int64_t tasks = int64_t(b.num_tokens) * tasks_per_row;
  const bool par = tasks > 1 && int64_t(b.max_ctx_len) * b.num_tokens * s.q_heads > 4096;
  std::atomic<int64_t> next{0};  // tasks taken one at a time by the next free thread
  // AVX-512 and head_dim a multiple of 16 up to 256: scores 16 keys at a time, weighted sums in registers.
#if defined(__AVX512F__)
  const bool avx512_path = D % 16 == 0 && D <= 256;
#else
  const bool avx512_path = false;
#endif
  pool.run(par, [&](int, int) {
    const int hq = heads_per_task * group;  // query heads of one task
    std::vector<float> scores(size_t(std::max(1, b.max_ctx_len)) * hq);
    std::vector<float> acc(size_t(D) * hq), inv(hq), row(size_t(D) * heads_per_task);
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      const int r = int(t / tasks_per_row), kh0 = int(t % tasks_per_row) * heads_per_task;
      const int si = row_seq[r];
      const int q_len = b.q_start[si + 1] - b.q_start[si];
      const int n = b.ctx_len[si] - q_len + (r - b.q_start[si]) + 1;  // positions [0, pos]
      const int32_t* pages = b.page_table + int64_t(si) * b.max_pages;
      const float* qr = q.ptr<float>() + int64_t(r) * q.stride + int64_t(kh0) * group * D;
      auto cache_row = [&](int p) { return int64_t(pages[p / b.page_size]) * b.page_size + p % b.page_size; };
      if (avx512_path) {
#if defined(__AVX512F__)
        for (int h = 0; h < hq; ++h) {
          const int64_t off = int64_t(kh0 + h / group) * D;
          block_scores(kind, qr + h * D, D, n, s.scale, [&](int p) { return kc + cache_row(p) * kv_cols + off; },
                       scores.data() + size_t(h) * n);
        }
#endif
      } else {
        for (int p = 0; p < n; ++p) {
          const float* kr = as_f32(kind, kc + cache_row(p) * kv_cols + int64_t(kh0) * D, int(row.size()), row.data());
          for (int h = 0; h < hq; ++h) scores[size_t(h) * n + p] = dot(qr + h * D, kr + (h / group) * D, D) * s.scale;
        }
      }
      for (int h = 0; h < hq; ++h) {
        float* sc = scores.data() + size_t(h) * n;
        float mx = -INFINITY;
        for (int p = 0; p < n; ++p) mx = std::max(mx, sc[p]);
        inv[h] = 1.f / exp_shift_sum(sc, n, mx);
      }
      if (avx512_path) {
#if defined(__AVX512F__)
        for (int h = 0; h < hq; ++h) {
          const int64_t off = int64_t(kh0 + h / group) * D;
          weighted_sum_in_registers(kind, scores.data() + size_t(h) * n, D, n,
                                    [&](int p) { return vc + cache_row(p) * kv_cols + off; },
                                    acc.data() + size_t(h) * D);
        }
#endif
      } else {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int p = 0; p < n; ++p) {
          const float* vr = as_f32(kind, vc + cache_row(p) * kv_cols + int64_t(kh0) * D, int(row.size()), row.data());
          for (int h = 0; h < hq; ++h) {
            const float w = scores[size_t(h) * n + p];
            float* __restrict__ a = acc.data() + size_t(h) * D;
            const float* __restrict__ v = vr + (h / group) * D;
            for (int i = 0; i < D; ++i) a[i] += w * v[i];
          }
        }
      }
      float* orow = out.ptr<float>() + int64_t(r) * out.stride + int64_t(kh0) * group * D;
      for (int h = 0; h < hq; ++h)
        for (int i = 0; i < D; ++i) orow[h * D + i] = acc[size_t(h) * D + i] * inv[h];
    }
  });
}

}  // namespace

void attention(const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& s,
               Tensor& out, ThreadPool& pool) {
  QRT_CHECK(q.dtype == DType::F32, "cpu attention: float32 queries only");
  switch (cache.dtype) {
    case DType::F32: attention_rows(F32Rows{}, q, cache, b, s, out, pool); break;
    case DType::BF16: attention_rows(Bf16Rows{}, q, cache, b, s, out, pool); break;
    case DType::F16: attention_rows(F16Rows{}, q, cache, b, s, out, pool); break;
    default: QRT_CHECK(false, "cpu attention: KV cache of ", dtype_name(cache.dtype), " (float32, bfloat16 or float16)");
  }
}

}  // namespace qrt::cpu
