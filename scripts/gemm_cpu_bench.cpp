// CPU GEMM microbenchmark: qrt::cpu::gemm alone (the CPU backend's linear) on decode and prefill shapes,
// bf16 and fp32 weights, two threads. Build against a configured build dir, e.g.:
//   cmake -S . -B build/dev -G Ninja && ninja -C build/dev qrt_base
//   g++ -O3 -march=native -fopenmp -std=c++17 -Icpp scripts/gemm_cpu_bench.cpp build/dev/libqrt_base.a \
//       -o /tmp/gemm_cpu_bench -ldl -lpthread && /tmp/gemm_cpu_bench
#include <chrono>
#include <cstring>
#include <cstdio>
#include <vector>
#include <random>
#include "backend/cpu/cpu_kernels.h"
#include "core/dtype.h"
using namespace qrt;
int main() {
  int shapes[][3] = {{1,2048,768},{1,6144,768},{1,32768,768},{8,2048,768},{64,2048,768}};
  std::mt19937 rng(0); std::normal_distribution<float> nd;
  for (auto& s : shapes) {
    int M=s[0],N=s[1],K=s[2];
    std::vector<float> x(M*K), out(M*N); std::vector<uint16_t> wb(size_t(N)*K); std::vector<float> wf(size_t(N)*K);
    for (auto& v: x) v=nd(rng);
    for (size_t i=0;i<wf.size();++i){ wf[i]=nd(rng)*0.02f; uint32_t u; memcpy(&u,&wf[i],4); wb[i]=u>>16; }
    Tensor xt(x.data(), DType::F32, M, K), ot(out.data(), DType::F32, M, N);
    for (int t=0;t<2;++t) {
      Tensor wt = t==0 ? Tensor(wb.data(), DType::BF16, N, K) : Tensor(wf.data(), DType::F32, N, K);
      cpu::gemm(xt, wt, nullptr, ot, 2);
      auto t0=std::chrono::steady_clock::now(); int n=0; double el=0;
      do { cpu::gemm(xt, wt, nullptr, ot, 2); ++n; el=std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count(); } while (el<0.3);
      el/=n;
      printf("%3d %6d %5d %s %8.3f ms %6.1f GB/s %6.1f GFLOP/s\n",M,N,K,t==0?"bf16":"f32 ",el*1e3,double(N)*K*(t==0?2:4)/el/1e9,2.0*M*N*K/el/1e9);
    }
  }
}
