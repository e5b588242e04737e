// CPU GEMM microbenchmark: qrt::cpu::gemm alone (the CPU backend's linear) over the products of one step of
// issue 35's model (10 layers of q|k|v 1280x768, o 768x768, gate|up 4096x768, down 768x2048, distinct weights
// per layer so that nothing stays in cache; decode row counts (<= 16) add the tied LM head 32000x768), for a
// few row counts, on the backend's thread pool; best of --reps runs. Build against a configured build dir:
//   ninja -C build/dev qrt_base
//   g++ -O3 -march=native -std=gnu++17 -Icpp tools/gemm_cpu_bench.cpp build/dev/libqrt_base.a \
//       -o /tmp/gemm_cpu_bench -lpthread -ldl
// and an AVX2 + FMA build of the kernels on an AVX-512 machine (gemm.cpp compiled in, before the library):
//   g++ -O3 -march=native -mno-avx512f -std=gnu++17 -Icpp tools/gemm_cpu_bench.cpp cpp/backend/cpu/gemm.cpp \
//       build/dev/libqrt_base.a -o /tmp/gemm_cpu_bench_avx2 -lpthread -ldl
// Run: /tmp/gemm_cpu_bench [threads=2] [f32|bf16|f16=bf16] [rows=1,8,512] [reps=5]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_kernels.h"
#include "backend/cpu/thread_pool.h"
#include "core/dtype.h"
using namespace qrt;

static double cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const std::string dt = argc > 2 ? argv[2] : "bf16";
  const std::string rows = argc > 3 ? argv[3] : "1,8,512";
  const int reps = argc > 4 ? std::atoi(argv[4]) : 5;
  const DType wdt = dt == "f32" ? DType::F32 : dt == "f16" ? DType::F16 : DType::BF16;
  const size_t esz = dtype_size(wdt);
  cpu::ThreadPool pool(threads);
  struct Shape { int n, k; };
  std::vector<Shape> step;
  for (int l = 0; l < 10; ++l) step.insert(step.end(), {{1280, 768}, {768, 768}, {4096, 768}, {768, 2048}});
  const Shape head{32000, 768};
  step.push_back(head);
  std::mt19937 rng(0);
  std::uniform_real_distribution<float> u(-0.05f, 0.05f);
  std::vector<std::vector<char>> ws;
  double layer_bytes = 0;
  for (const Shape& s : step) {
    const size_t n = size_t(s.n) * s.k;
    std::vector<char> w(n * esz);
    for (size_t i = 0; i < n; ++i) {
      const float v = u(rng);
      if (wdt == DType::F32) std::memcpy(&w[i * 4], &v, 4);
      else {
        const uint16_t h = wdt == DType::BF16 ? f32_to_bf16(v) : f32_to_f16(v);
        std::memcpy(&w[i * 2], &h, 2);
      }
    }
    if (&s != &step.back()) layer_bytes += double(w.size());
    ws.push_back(std::move(w));
  }
  const double head_bytes = double(head.n) * head.k * esz;
  std::printf("threads %d, %s weights: layers %.1f MB, LM head %.1f MB\n", threads, dt.c_str(), layer_bytes / 1e6,
              head_bytes / 1e6);
  for (size_t p = 0; p < rows.size();) {
    const size_t q = std::min(rows.find(',', p), rows.size());
    const int M = std::atoi(rows.substr(p, q - p).c_str());
    p = q + 1;
    const bool with_head = M <= 16;  // prefill computes the LM head for its last row only
    const size_t products = step.size() - (with_head ? 0 : 1);
    std::vector<float> x_mem(size_t(M) * 2048 + 16), out(size_t(M) * 32000);
    float* x = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(x_mem.data()) + 63) & ~uintptr_t(63));
    for (size_t i = 0; i < size_t(M) * 2048; ++i) x[i] = u(rng);  // 64-byte aligned, as the backend's buffers
    auto run = [&] {
      for (size_t i = 0; i < products; ++i) {
        Tensor xt(x, DType::F32, M, step[i].k), ot(out.data(), DType::F32, M, step[i].n);
        Tensor wt(ws[i].data(), wdt, step[i].n, step[i].k);
        cpu::gemm(xt, wt, nullptr, ot, pool, false);
      }
    };
    run();
    double best = 1e9, best_cpu = 1e9;  // wall time; CPU time of the process (fair on a shared machine at 1 thread)
    for (int r = 0; r < reps; ++r) {
      const double c0 = cpu_seconds();
      const auto t0 = std::chrono::steady_clock::now();
      run();
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      best_cpu = std::min(best_cpu, cpu_seconds() - c0);
    }
    const double bytes = layer_bytes + (with_head ? head_bytes : 0.0);
    const double flop = 2.0 * bytes / esz * M;
    std::printf("M %4d: %8.3f ms per step, %5.1f GB/s of weights, %6.1f GFLOP/s; CPU time %8.3f ms, %6.1f GFLOP/s\n",
                M, best * 1e3, bytes / best / 1e9, flop / best / 1e9, best_cpu * 1e3, flop / best_cpu / 1e9);
  }
}
