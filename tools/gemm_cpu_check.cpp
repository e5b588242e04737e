// CPU GEMM check for builds of the kernels other than this machine's (the test suite covers the native one): every
// row of x @ w^T for 40 rows equals the row computed alone, bit for bit, at row counts that take each tile family
// (few rows, 5-15, 16-23 with 16-bit blocks widened, 24+ packed outer products), for fp32, bf16 and fp16 weights
// and K with and without a tail. Build, e.g. the AVX2 + FMA kernels on an AVX-512 machine:
//   g++ -O3 -march=haswell -std=gnu++17 -Icpp tools/gemm_cpu_check.cpp cpp/backend/cpu/gemm.cpp \
//       build/cpu/libqrt_base.a -o /tmp/gemm_cpu_check -lpthread -ldl && /tmp/gemm_cpu_check
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <random>
#include <vector>
#include "backend/cpu/cpu_kernels.h"
#include "backend/cpu/thread_pool.h"
using namespace qrt;
int main() {
  cpu::ThreadPool pool(2);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1, 1);
  int bad = 0;
  for (DType wdt : {DType::F32, DType::BF16, DType::F16})
    for (auto [K, N] :
         std::vector<std::pair<int, int>>{{768, 50}, {100, 37}, {2048, 19}, {5, 7}, {257, 33}, {64, 100}}) {
      int M = 40;
      std::vector<float> x(M * K), wf(N * K);
      for (auto& v : x) v = u(rng);
      for (auto& v : wf) v = u(rng);
      size_t esz = dtype_size(wdt);
      std::vector<char> w(N * K * esz);
      for (int i = 0; i < N * K; ++i) {
        if (wdt == DType::F32) std::memcpy(&w[i * 4], &wf[i], 4);
        else {
          const uint16_t h = wdt == DType::BF16 ? f32_to_bf16(wf[i]) : f32_to_f16(wf[i]);
          std::memcpy(&w[i * 2], &h, 2);
        }
      }
      Tensor wt(w.data(), wdt, N, K);
      std::vector<float> bias(N), init(M * N);
      for (auto& v : bias) v = u(rng);
      for (auto& v : init) v = u(rng);
      Tensor bt(bias.data(), DType::F32, 1, N);
      for (int variant = 0; variant < 3; ++variant) {  // plain; with a bias; accumulating into out
        const Tensor* b = variant == 1 ? &bt : nullptr;
        const bool acc = variant == 2;
        std::vector<float> alone(init), all(init);
        for (int i = 0; i < M; ++i) {
          Tensor xt(x.data() + i * K, DType::F32, 1, K), ot(alone.data() + i * N, DType::F32, 1, N);
          cpu::gemm(xt, wt, b, ot, pool, acc);
        }
        for (int n : {2, 3, 7, 8, 13, 16, 17, 24, 31, 40}) {
          std::copy(init.begin(), init.end(), all.begin());
          Tensor xt(x.data(), DType::F32, n, K), ot(all.data(), DType::F32, n, N);
          cpu::gemm(xt, wt, b, ot, pool, acc);
          if (std::memcmp(all.data(), alone.data(), size_t(n) * N * 4)) {
            ++bad;
            std::printf("differ: dt %d K %d N %d rows %d variant %d\n", int(wdt), K, N, n, variant);
          }
        }
      }
    }
  std::printf("%s\n", bad ? "FAIL" : "ok");
  return bad != 0;
}
