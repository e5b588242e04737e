// Causal paged attention on the CPU, one (query row, head) pair per task, fp32.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/cpu_kernels.h"
#include "core/error.h"

namespace qrt::cpu {

void attention(const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& s,
               Tensor& out, int threads) {
  QRT_CHECK(q.dtype == DType::F32 && cache.dtype == DType::F32, "cpu attention: float32 only");
  const int D = s.head_dim, Hq = s.q_heads, Hkv = s.kv_heads, group = Hq / Hkv;
  const int64_t kv_cols = int64_t(Hkv) * D;
  const float* kc = static_cast<const float*>(cache.k);
  const float* vc = static_cast<const float*>(cache.v);
  // Flatten (row, head) pairs; a row's sequence is found from q_start.
  std::vector<int> row_seq(b.num_tokens);
  for (int si = 0; si < b.num_seqs; ++si)
    for (int r = b.q_start[si]; r < b.q_start[si + 1]; ++r) row_seq[r] = si;
  const int64_t tasks = int64_t(b.num_tokens) * Hq;
  const bool par = tasks > 1 && int64_t(b.max_ctx_len) * tasks > 4096;
#pragma omp parallel num_threads(threads) if (par)
  {
    std::vector<float> scores(std::max(1, b.max_ctx_len));
    std::vector<float> acc(D);
#pragma omp for schedule(dynamic, 4)
    for (int64_t t = 0; t < tasks; ++t) {
      const int r = int(t / Hq), h = int(t % Hq), kh = h / group;
      const int si = row_seq[r];
      const int q_len = b.q_start[si + 1] - b.q_start[si];
      const int pos = b.ctx_len[si] - q_len + (r - b.q_start[si]);
      const int32_t* pages = b.page_table + int64_t(si) * b.max_pages;
      const float* qr = q.ptr<float>() + int64_t(r) * q.stride + int64_t(h) * D;
      float mx = -INFINITY;
      for (int p = 0; p <= pos; ++p) {
        const int64_t row = int64_t(pages[p / b.page_size]) * b.page_size + p % b.page_size;
        const float* kr = kc + row * kv_cols + int64_t(kh) * D;
        float d = 0.f;
        for (int i = 0; i < D; ++i) d += qr[i] * kr[i];
        d *= s.scale;
        scores[p] = d;
        mx = std::max(mx, d);
      }
      float sum = 0.f;
      for (int p = 0; p <= pos; ++p) {
        scores[p] = std::exp(scores[p] - mx);
        sum += scores[p];
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int p = 0; p <= pos; ++p) {
        const int64_t row = int64_t(pages[p / b.page_size]) * b.page_size + p % b.page_size;
        const float* vr = vc + row * kv_cols + int64_t(kh) * D;
        const float w = scores[p];
        for (int i = 0; i < D; ++i) acc[i] += w * vr[i];
      }
      float* orow = out.ptr<float>() + int64_t(r) * out.stride + int64_t(h) * D;
      const float inv = 1.f / sum;
      for (int i = 0; i < D; ++i) orow[i] = acc[i] * inv;
    }
  }
}

}  // namespace qrt::cpu
