// Causal paged attention on the CPU, fp32. One task per (query row, KV head): the query heads of a
// GQA group share each K/V row load. Results do not depend on the batch (each task is independent).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
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
  float lanes[16];
  std::memcpy(lanes, &acc, 64);
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) lanes[j] += lanes[j + w];
  float s = lanes[0];
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

void attention(const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& s,
               Tensor& out, ThreadPool& pool) {
  QRT_CHECK(q.dtype == DType::F32 && cache.dtype == DType::F32, "cpu attention: float32 only");
  const int D = s.head_dim, Hkv = s.kv_heads, group = s.q_heads / s.kv_heads;
  const int64_t kv_cols = int64_t(Hkv) * D;
  const float* kc = static_cast<const float*>(cache.k);
  const float* vc = static_cast<const float*>(cache.v);
  std::vector<int> row_seq(b.num_tokens);
  for (int si = 0; si < b.num_seqs; ++si)
    for (int r = b.q_start[si]; r < b.q_start[si + 1]; ++r) row_seq[r] = si;
  // A task is a query row and a run of KV heads: whole rows when there are enough of them (each
  // cache row is then read once, contiguously), single KV heads otherwise.
  const int heads_per_task = b.num_tokens >= 2 * pool.size() ? Hkv : 1;
  const int tasks_per_row = Hkv / heads_per_task;
  const int64_t tasks = int64_t(b.num_tokens) * tasks_per_row;
  const bool par = tasks > 1 && int64_t(b.max_ctx_len) * b.num_tokens * s.q_heads > 4096;
  std::atomic<int64_t> next{0};  // tasks taken one at a time by the next free thread
  pool.run(par, [&](int, int) {
    const int hq = heads_per_task * group;  // query heads of one task
    std::vector<float> scores(size_t(std::max(1, b.max_ctx_len)) * hq);
    std::vector<float> acc(size_t(D) * hq), inv(hq);
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      const int r = int(t / tasks_per_row), kh0 = int(t % tasks_per_row) * heads_per_task;
      const int si = row_seq[r];
      const int q_len = b.q_start[si + 1] - b.q_start[si];
      const int n = b.ctx_len[si] - q_len + (r - b.q_start[si]) + 1;  // positions [0, pos]
      const int32_t* pages = b.page_table + int64_t(si) * b.max_pages;
      const float* qr = q.ptr<float>() + int64_t(r) * q.stride + int64_t(kh0) * group * D;
      for (int p = 0; p < n; ++p) {
        const int64_t row = int64_t(pages[p / b.page_size]) * b.page_size + p % b.page_size;
        const float* kr = kc + row * kv_cols + int64_t(kh0) * D;
        for (int h = 0; h < hq; ++h) scores[size_t(h) * n + p] = dot(qr + h * D, kr + (h / group) * D, D) * s.scale;
      }
      for (int h = 0; h < hq; ++h) {
        float* sc = scores.data() + size_t(h) * n;
        float mx = -INFINITY;
        for (int p = 0; p < n; ++p) mx = std::max(mx, sc[p]);
        inv[h] = 1.f / exp_shift_sum(sc, n, mx);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int p = 0; p < n; ++p) {
        const int64_t row = int64_t(pages[p / b.page_size]) * b.page_size + p % b.page_size;
        const float* vr = vc + row * kv_cols + int64_t(kh0) * D;
        for (int h = 0; h < hq; ++h) {
          const float w = scores[size_t(h) * n + p];
          float* __restrict__ a = acc.data() + size_t(h) * D;
          const float* __restrict__ v = vr + (h / group) * D;
          for (int i = 0; i < D; ++i) a[i] += w * v[i];
        }
      }
      float* orow = out.ptr<float>() + int64_t(r) * out.stride + int64_t(kh0) * group * D;
      for (int h = 0; h < hq; ++h)
        for (int i = 0; i < D; ++i) orow[h * D + i] = acc[size_t(h) * D + i] * inv[h];
    }
  });
}

}  // namespace qrt::cpu
