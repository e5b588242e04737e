// Prefill attention alone, with the runtime's own kernels (attention.cu compiled in): the mma.sync tile kernel
// against the wgmma kernel in several shapes, on paged caches with shuffled pages. For each case it prints
// each kernel's time, TFLOP/s (causal: 4 * D * query heads * keys seen, summed over the rows) and the largest
// difference from the tile kernel's output (both bf16, fp32 accumulation).
//   nvcc -O3 -arch=sm_90a -std=c++17 -DQRT_HAVE_SM90A -Icpp tools/attn_prefill_study.cu cpp/core/dtype.cpp \
//        -o /tmp/prefill_study
//   /tmp/prefill_study [--heads Hq Hkv D] [SEQSxQLEN[+PREFIX] ...]   (default Qwen3-8B's 32 8 128, a sweep)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/attention.cu"
#include "study_common.cuh"

namespace qrt::cuda {
bool chained_launch_supported() { return false; }
}  // namespace qrt::cuda

using namespace qrt;
using namespace qrt::cuda;

namespace study {

struct Case {
  int seqs, q_len, prefix;
};

using Launch = void (*)(const Tensor&, const KvLayer&, const AttnBatch&, const AttnShape&, Tensor&, cudaStream_t);
struct Kernel {
  const char* name;
  Launch run;
};

template <int D> std::vector<Kernel> kernels() {
  using B = __nv_bfloat16;
  return {{"tile 4x2", launch_tile<B, D, 4, 2>},
          {"overlap 64x3 s4", launch_wgmma<B, D, 64, 3, 4, kPipeOverlap>},
          {"producer 64x2 s4", launch_wgmma<B, D, 64, 2, 4, kPipeProducer>},
          {"producer 64x3 s4", launch_wgmma<B, D, 64, 3, 4, kPipeProducer>},
          {"producer 128x2 s3", launch_wgmma<B, D, 128, 2, 3, kPipeProducer>},
          {"pingpong 64x2 s4", launch_wgmma<B, D, 64, 2, 4, kPipePingPong>},
          {"pingpong 64x3 s4", launch_wgmma<B, D, 64, 3, 4, kPipePingPong>},
          {"pingpong 128x2 s3", launch_wgmma<B, D, 128, 2, 3, kPipePingPong>}};
}

void run_case(const Case& c, int Hq, int Hkv, int D, cudaStream_t st) {
  const int page = 16;
  // Sequence i: q_len tokens after a prefix; the first sequence has the full length, the others shorter
  // (a ragged batch).
  std::vector<int> qlen(c.seqs), ctx(c.seqs);
  for (int i = 0; i < c.seqs; ++i) {
    qlen[i] = i == 0 ? c.q_len : std::max(1, c.q_len - 37 * i);
    ctx[i] = c.prefix + qlen[i];
  }
  int max_pages = 0, total_pages = 0, tokens = 0, max_q = 0, max_ctx = 0;
  for (int i = 0; i < c.seqs; ++i) {
    max_pages = std::max(max_pages, (ctx[i] + page - 1) / page);
    total_pages += (ctx[i] + page - 1) / page;
    tokens += qlen[i];
    max_q = std::max(max_q, qlen[i]);
    max_ctx = std::max(max_ctx, ctx[i]);
  }
  std::vector<int32_t> perm(total_pages);
  for (int i = 0; i < total_pages; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), std::mt19937(7));
  std::vector<int32_t> table(size_t(c.seqs) * max_pages, 0), q_start(c.seqs + 1, 0);
  double flops = 0;
  for (int i = 0, used = 0; i < c.seqs; ++i) {
    const int np = (ctx[i] + page - 1) / page;
    for (int p = 0; p < np; ++p) table[size_t(i) * max_pages + p] = perm[used++];
    q_start[i + 1] = q_start[i] + qlen[i];
    for (int t = 0; t < qlen[i]; ++t) flops += 4.0 * D * Hq * (c.prefix + t + 1);
  }
  const int64_t cols = int64_t(Hkv) * D, rows = int64_t(total_pages) * page;
  __nv_bfloat16 *kc = dev<__nv_bfloat16>(size_t(rows * cols)), *vc = dev<__nv_bfloat16>(size_t(rows * cols));
  fill(kc, size_t(rows * cols), 1);
  fill(vc, size_t(rows * cols), 2);
  Tensor q(dev<__nv_bfloat16>(size_t(tokens) * Hq * D), DType::BF16, tokens, int64_t(Hq) * D);
  fill(q.ptr<__nv_bfloat16>(), size_t(tokens) * Hq * D, 3, 0.5f);
  AttnBatch b;
  b.num_seqs = c.seqs;
  b.num_tokens = tokens;
  b.q_start = upload(q_start);
  b.ctx_len = upload(ctx);
  b.page_table = upload(table);
  b.max_pages = max_pages;
  b.page_size = page;
  b.max_q_len = max_q;
  b.max_ctx_len = max_ctx;
  const AttnShape sh{Hq, Hkv, D, 1.0f / std::sqrt(float(D))};
  const KvLayer cache{kc, vc, DType::BF16};
  const size_t n_out = size_t(tokens) * Hq * D;
  std::vector<__nv_bfloat16> ref(n_out), got(n_out);
  const auto ks = D == 64 ? kernels<64>() : kernels<128>();
  for (size_t k = 0; k < ks.size(); ++k) {
    Tensor out(dev<__nv_bfloat16>(n_out), DType::BF16, tokens, int64_t(Hq) * D);
    ck(cudaMemset(out.data, 0xff, n_out * 2), "memset");  // NaN: rows left unwritten show
    ks[k].run(q, cache, b, sh, out, st);
    ck(cudaStreamSynchronize(st), ks[k].name);
    ck(cudaMemcpy((k == 0 ? ref : got).data(), out.data, n_out * 2, cudaMemcpyDeviceToHost), "download");
    double diff = 0, peak = 0;
    if (k > 0)
      for (size_t i = 0; i < n_out; ++i) {
        const double r = __bfloat162float(ref[i]), g = __bfloat162float(got[i]);
        diff = std::isfinite(g) ? std::max(diff, std::fabs(r - g)) : INFINITY;
        peak = std::max(peak, std::fabs(r));
      }
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    const int reps = std::max(3, int(2e12 / flops));
    for (int i = 0; i < 2; ++i) ks[k].run(q, cache, b, sh, out, st);
    cudaEventRecord(e0, st);
    for (int i = 0; i < reps; ++i) ks[k].run(q, cache, b, sh, out, st);
    cudaEventRecord(e1, st);
    ck(cudaEventSynchronize(e1), "run");
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    const double us = ms * 1e3 / reps;
    std::printf("%4dx%-6d+%-6d %-16s %10.1f us %7.1f TFLOP/s   max diff %.3g (of %.3g)\n", c.seqs, c.q_len, c.prefix,
                ks[k].name, us, flops / (us * 1e-6) / 1e12, diff, peak);
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    cudaFree(out.data);
  }
  cudaFree(kc), cudaFree(vc), cudaFree(q.data);
  cudaFree(const_cast<int32_t*>(b.q_start)), cudaFree(const_cast<int32_t*>(b.ctx_len));
  cudaFree(const_cast<int32_t*>(b.page_table));
}

}  // namespace study

using namespace study;

int main(int argc, char** argv) {
  int Hq = 32, Hkv = 8, D = 128;
  std::vector<Case> cases;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--heads" && i + 3 < argc) {
      Hq = std::atoi(argv[++i]), Hkv = std::atoi(argv[++i]), D = std::atoi(argv[++i]);
    } else {
      const auto x = a.find('x'), plus = a.find('+');
      cases.push_back({std::atoi(a.substr(0, x).c_str()), std::atoi(a.substr(x + 1, plus - x - 1).c_str()),
                       plus == std::string::npos ? 0 : std::atoi(a.substr(plus + 1).c_str())});
    }
  }
  if (cases.empty()) cases = {{1, 1024, 0}, {1, 8192, 0}, {1, 32768, 0}, {4, 2048, 0}, {1, 2048, 6144}, {3, 517, 93}};
  if (D != 64 && D != 128) {
    std::printf("head_dim %d: the wgmma kernel takes 64 or 128\n", D);
    return 1;
  }
  cudaStream_t st;
  cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  std::printf("heads %d/%d x %d\n", Hq, Hkv, D);
  for (const Case& c : cases) run_case(c, Hq, Hkv, D, st);
  return 0;
}
