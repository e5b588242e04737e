// CPU attention microbenchmark: qrt::cpu::attention alone for one causal prefill of one layer (issue 35's model:
// 12 query / 4 KV heads of 64, pages of 16), fp32 or bf16 cache; best of 5, CPU time of the process (fair on a
// shared machine at one thread). Build against a configured build dir, e.g.:
//   ninja -C build/dev qrt_base
//   g++ -O3 -march=native -std=gnu++17 -Icpp tools/attention_cpu_bench.cpp build/dev/libqrt_base.a \
//       -o /tmp/attention_cpu_bench -lpthread
// (an AVX2 build of the kernels: add -mno-avx512f and cpp/backend/cpu/attention.cpp before the library)
// Run: /tmp/attention_cpu_bench [tokens=512] [threads=1] [f32|bf16=f32]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>
#include <vector>

#include "backend/cpu/cpu_kernels.h"
#include "core/dtype.h"
using namespace qrt;

static double cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

int main(int argc, char** argv) {
  const int P = argc > 1 ? std::atoi(argv[1]) : 512, threads = argc > 2 ? std::atoi(argv[2]) : 1;
  const bool bf16 = argc > 3 && std::string(argv[3]) == "bf16";
  const int Hq = 12, Hkv = 4, D = 64, page = 16;
  cpu::ThreadPool pool(threads);
  std::vector<float> q(size_t(P) * Hq * D), out(q.size()), k(size_t(P) * Hkv * D), v(k.size());
  for (size_t i = 0; i < q.size(); ++i) q[i] = float((i * 7919) % 1000) / 1000.f - 0.5f;
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = float((i * 104729) % 1000) / 1000.f - 0.5f;
    v[i] = float((i * 13) % 1000) / 1000.f - 0.5f;
  }
  std::vector<uint16_t> kb(k.size()), vb(v.size());
  for (size_t i = 0; i < k.size(); ++i) kb[i] = f32_to_bf16(k[i]), vb[i] = f32_to_bf16(v[i]);
  std::vector<int32_t> pages(size_t(P / page + 1));
  for (size_t i = 0; i < pages.size(); ++i) pages[i] = int32_t(i);
  int32_t q_start[2] = {0, P}, ctx[1] = {P};
  AttnBatch b;
  b.num_seqs = 1, b.num_tokens = P, b.q_start = q_start, b.ctx_len = ctx, b.page_table = pages.data();
  b.max_pages = int(pages.size()), b.page_size = page, b.max_q_len = P, b.max_ctx_len = P;
  AttnShape s;
  s.q_heads = Hq, s.kv_heads = Hkv, s.head_dim = D, s.scale = 0.125f;
  KvLayer kv;
  kv.k = bf16 ? static_cast<void*>(kb.data()) : k.data();
  kv.v = bf16 ? static_cast<void*>(vb.data()) : v.data();
  kv.dtype = bf16 ? DType::BF16 : DType::F32;
  Tensor qt(q.data(), DType::F32, P, Hq * D), ot(out.data(), DType::F32, P, Hq * D);
  double best = 1e9;
  for (int r = 0; r < 5; ++r) {
    const double t0 = cpu_seconds();
    cpu::attention(qt, kv, b, s, ot, pool);
    best = std::min(best, cpu_seconds() - t0);
  }
  double check = 0;
  for (size_t i = 0; i < out.size(); ++i) check += double(out[i]) * double(i % 13);
  const double flop = 4.0 * Hq * D * (double(P) * (P + 1) / 2);  // q.k and p.v over the causal triangle
  std::printf("attention, %d tokens, %s cache, %d thread(s): %.3f ms CPU, %.1f GFLOP/s (checksum %.6f)\n", P,
              bf16 ? "bf16" : "f32", threads, best * 1e3, flop / best / 1e9, check);
}
