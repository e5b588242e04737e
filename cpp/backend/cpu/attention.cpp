// Causal paged attention on the CPU, fp32. One task per (query row, KV head): the query heads of a
// GQA group share each K/V row load. Results do not depend on the batch (each task is independent).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "backend/cpu/cpu_kernels.h"
#include "core/error.h"

namespace qrt::cpu {
namespace {

typedef float v16f __attribute__((vector_size(64)));

inline float dot(const float* a, const float* b, int n) {
  v16f acc{};
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    v16f x, y;
    std::memcpy(&x, a + i, 64);
    std::memcpy(&y, b + i, 64);
    acc += x * y;
  }
  float lanes[16];
  std::memcpy(lanes, &acc, 64);
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) lanes[j] += lanes[j + w];
  float s = lanes[0];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

void attention(const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& s,
               Tensor& out, int threads) {
  QRT_CHECK(q.dtype == DType::F32 && cache.dtype == DType::F32, "cpu attention: float32 only");
  const int D = s.head_dim, Hkv = s.kv_heads, group = s.q_heads / s.kv_heads;
  const int64_t kv_cols = int64_t(Hkv) * D;
  const float* kc = static_cast<const float*>(cache.k);
  const float* vc = static_cast<const float*>(cache.v);
  std::vector<int> row_seq(b.num_tokens);
  for (int si = 0; si < b.num_seqs; ++si)
    for (int r = b.q_start[si]; r < b.q_start[si + 1]; ++r) row_seq[r] = si;
  const int64_t tasks = int64_t(b.num_tokens) * Hkv;
  const bool par = tasks > 1 && int64_t(b.max_ctx_len) * tasks * group > 4096;
#pragma omp parallel num_threads(threads) if (par)
  {
    std::vector<float> scores(size_t(std::max(1, b.max_ctx_len)) * group);
    std::vector<float> acc(size_t(D) * group);
#pragma omp for schedule(dynamic, 2)
    for (int64_t t = 0; t < tasks; ++t) {
      const int r = int(t / Hkv), kh = int(t % Hkv);
      const int si = row_seq[r];
      const int q_len = b.q_start[si + 1] - b.q_start[si];
      const int pos = b.ctx_len[si] - q_len + (r - b.q_start[si]);
      const int n = pos + 1;
      const int32_t* pages = b.page_table + int64_t(si) * b.max_pages;
      const float* qr = q.ptr<float>() + int64_t(r) * q.stride + int64_t(kh) * group * D;
      for (int p = 0; p < n; ++p) {
        const int64_t row = int64_t(pages[p / b.page_size]) * b.page_size + p % b.page_size;
        const float* kr = kc + row * kv_cols + int64_t(kh) * D;
        for (int g = 0; g < group; ++g) scores[size_t(g) * n + p] = dot(qr + g * D, kr, D) * s.scale;
      }
      std::vector<float> inv(group);
      for (int g = 0; g < group; ++g) {
        float* sc = scores.data() + size_t(g) * n;
        float mx = -INFINITY;
        for (int p = 0; p < n; ++p) mx = std::max(mx, sc[p]);
        float sum = 0.f;
        for (int p = 0; p < n; ++p) {
          sc[p] = std::exp(sc[p] - mx);
          sum += sc[p];
        }
        inv[g] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int p = 0; p < n; ++p) {
        const int64_t row = int64_t(pages[p / b.page_size]) * b.page_size + p % b.page_size;
        const float* vr = vc + row * kv_cols + int64_t(kh) * D;
        for (int g = 0; g < group; ++g) {
          const float w = scores[size_t(g) * n + p];
          float* a = acc.data() + size_t(g) * D;
          for (int i = 0; i < D; ++i) a[i] += w * vr[i];
        }
      }
      for (int g = 0; g < group; ++g) {
        float* orow = out.ptr<float>() + int64_t(r) * out.stride + int64_t(kh * group + g) * D;
        for (int i = 0; i < D; ++i) orow[i] = acc[size_t(g) * D + i] * inv[g];
      }
    }
  }
}

}  // namespace qrt::cpu
