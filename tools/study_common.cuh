// Helpers the attention studies share (tools/attn_*_study.cu): error checks, device buffers, random bf16.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace study {

// Exits with the CUDA error's text (a study has nothing to recover).
inline void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::printf("%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// p[i] = a hash of (i, seed) as a value in [-amp, amp).
__global__ void fill_kernel(__nv_bfloat16* p, size_t n, uint32_t seed, float amp) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    p[i] = __float2bfloat16((float(h & 0xffff) / 65536.f - 0.5f) * 2.f * amp);
  }
}
inline void fill(__nv_bfloat16* p, size_t n, uint32_t seed, float amp = 1.f) {
  fill_kernel<<<1024, 256>>>(p, n, seed, amp);
  ck(cudaGetLastError(), "fill");
}

template <typename X> X* dev(size_t n) {
  void* p = nullptr;
  ck(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(X)), "cudaMalloc");
  return static_cast<X*>(p);
}
template <typename X> X* upload(const std::vector<X>& v) {
  X* p = dev<X>(v.size());
  ck(cudaMemcpy(p, v.data(), v.size() * sizeof(X), cudaMemcpyHostToDevice), "upload");
  return p;
}

}  // namespace study
