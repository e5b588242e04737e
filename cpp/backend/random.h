// Counter-based random numbers shared by the CPU and CUDA backends: the same (seed, draw, index)
// gives the same value on both, whatever the batch or the thread that computes it.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define QRT_HD __host__ __device__ __forceinline__
#else
#define QRT_HD inline
#endif

namespace qrt {

QRT_HD uint64_t mix64(uint64_t x) {  // splitmix64 finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

QRT_HD uint64_t hash3(uint64_t seed, uint64_t a, uint64_t b) {
  return mix64(mix64(mix64(seed) ^ a) ^ b);
}

// Uniform in the open interval (0, 1), 24 bits.
QRT_HD float uniform01(uint64_t seed, uint64_t a, uint64_t b) {
  return (float(hash3(seed, a, b) >> 40) + 0.5f) * (1.0f / 16777216.0f);
}

}  // namespace qrt
