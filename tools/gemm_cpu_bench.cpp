// CPU GEMM microbenchmark: qrt::cpu::gemm alone (the CPU backend's linear) over the products of one decode
// step of the CPU bench model (12 layers of q|k|v 1280x768, o 768x768, gate|up 4096x768, down 768x2048, then
// the tied LM head 32768x768; distinct bf16 weights per layer, 201 MB, so nothing stays in cache), for a few
// row counts, on the backend's thread pool. Build against a configured build dir, e.g.:
//   ninja -C build/dev qrt_base
//   g++ -O3 -march=native -std=c++17 -Icpp tools/gemm_cpu_bench.cpp build/dev/libqrt_base.a \
//       -o /tmp/gemm_cpu_bench -lpthread -ldl && /tmp/gemm_cpu_bench [threads]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cpu/cpu_kernels.h"
#include "backend/cpu/thread_pool.h"
#include "core/dtype.h"
using namespace qrt;

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  cpu::ThreadPool pool(threads);
  struct Shape { int n, k; };
  std::vector<Shape> step;
  for (int l = 0; l < 12; ++l) step.insert(step.end(), {{1280, 768}, {768, 768}, {4096, 768}, {768, 2048}});
  step.push_back({32768, 768});
  std::mt19937 rng(0);
  std::vector<std::vector<uint16_t>> ws;
  double bytes = 0;
  for (const Shape& s : step) {
    std::vector<uint16_t> w(size_t(s.n) * s.k);
    for (auto& v : w) v = uint16_t(0x3c00 + (rng() & 0xff));  // small bf16 values
    bytes += double(w.size()) * 2;
    ws.push_back(std::move(w));
  }
  std::printf("threads %d, one step: %zu products, %.1f MB of bf16 weights\n", threads, step.size(), bytes / 1e6);
  for (int M : {1, 2, 4, 8, 16}) {
    std::vector<float> x(size_t(M) * 2048, 0.01f), out(size_t(M) * 32768);
    auto run = [&] {
      for (size_t i = 0; i < step.size(); ++i) {
        Tensor xt(x.data(), DType::F32, M, step[i].k), ot(out.data(), DType::F32, M, step[i].n);
        Tensor wt(ws[i].data(), DType::BF16, step[i].n, step[i].k);
        cpu::gemm(xt, wt, nullptr, ot, pool, false);
      }
    };
    run();
    double best = 1e9;
    for (int r = 0; r < 7; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      run();
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::printf("M %2d: %7.3f ms per step, %5.1f GB/s of weights, %6.1f GFLOP/s\n", M, best * 1e3,
                bytes / best / 1e9, bytes * M / best / 1e9);
  }
}
