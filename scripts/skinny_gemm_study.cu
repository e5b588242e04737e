// Standalone study of few-row linears (decode at batch 2..16) on Qwen3-8B's 144 step shapes (36 layers of
// q|k|v 6144x4096, o 4096x4096, gate|up 24576x4096, down 4096x12288; distinct weights per layer so nothing
// stays in L2). Each variant runs the 144 products of a step as one CUDA graph; the figure is weight bytes /
// graph time. Variants:
//   lt        cuBLASLt, its first heuristic algorithm (split-K reduce kernels included), as the runtime calls it
//   read16    the weight stream alone in the tensor-core fragment pattern (8 rows x 64 bytes per load)
//   readrow   the weight stream alone in the one-row GEMV pattern (512 contiguous bytes per load)
//   direct    tensor cores, fragments loaded straight from memory (session 8's form)
//   async     tensor cores, weights staged in shared memory by cp.async (whole 128-byte lines per row),
//             fragments by ldmatrix, each warp its own eighth of K
//   coop      tensor cores, the block's warps stream one tile's rows front to back together (512-byte
//             copies), each warp multiplies its k-steps of every stage
// `/tmp/skinny skinny` times cuBLASLt against the K-split skinny GEMM of skinny_gemm_ksplit.cuh at
// M = 16, 32, 64, alternated, after checking the latter's products.
// `/tmp/skinny lt-algos` instead times, per shape and M in {32, 64, 128}, every algorithm cuBLASLt's heuristic
// offers (up to 12) and the first one forced to split-K 2/3/4, over the 36 layers' distinct weights, with
// each algorithm's tile, split-K, stages and waves.
//   nvcc -O3 -arch=sm_90 -std=c++17 scripts/skinny_gemm_study.cu -lcublasLt -o /tmp/skinny && /tmp/skinny
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "skinny_gemm_ksplit.cuh"

#define CK(x)                                                                \
  do {                                                                       \
    cudaError_t e_ = (x);                                                    \
    if (e_ != cudaSuccess) {                                                 \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                          \
    }                                                                        \
  } while (0)
#define LK(x)                                                         \
  do {                                                                \
    cublasStatus_t s_ = (x);                                          \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                \
      std::printf("%s:%d cublasLt status %d\n", __FILE__, __LINE__, int(s_)); \
      std::exit(1);                                                   \
    }                                                                 \
  } while (0)

using bf16 = __nv_bfloat16;

__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_release() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void cp16(void* smem, const void* g) {
  const uint32_t s = uint32_t(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(g));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
__device__ __forceinline__ void ldsm4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, const void* p) {
  const uint32_t s = uint32_t(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(s));
}

constexpr int kThreads = 256, kWarps = 8;

// ---- read16: every warp of a persistent grid streams tiles of 16 rows x its eighth of K, lane (g, t)
// reading 16 bytes at 8t of 32-element chunks of rows g and g + 8 (U chunks in flight).
template <int U, int BPS>
__global__ void __launch_bounds__(kThreads, BPS) read16(const bf16* w, int N, int K, float* sink) {
  pdl_release();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int chunks = K / 32, cb = chunks * warp / kWarps, ce = chunks * (warp + 1) / kWarps;
  uint32_t acc = 0;
  for (int i = blockIdx.x; i < N / 16; i += gridDim.x) {
    const bf16* r0 = w + size_t(i * 16 + g) * K + 8 * t;
    const bf16* r1 = r0 + size_t(8) * K;
    for (int c = cb; c < ce; c += U) {
      uint4 v[U][2];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (c + u < ce) v[u][0] = ld_stream(r0 + 32 * (c + u)), v[u][1] = ld_stream(r1 + 32 * (c + u));
        else v[u][0] = v[u][1] = make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int u = 0; u < U; ++u) acc ^= v[u][0].x ^ v[u][1].y ^ v[u][0].z ^ v[u][1].w;
    }
  }
  if (acc == 0x12345u) *sink = float(acc);
}

// ---- readrow: two warps per row, each half of it, U pieces of 16 bytes per lane in flight.
template <int U, int BPS>
__global__ void __launch_bounds__(kThreads, BPS) readrow(const bf16* w, int N, int K, float* sink) {
  pdl_release();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int pieces = K / 8, half = pieces / 2;
  uint32_t acc = 0;
  for (int grp = blockIdx.x; grp < N / 4; grp += gridDim.x) {
    const uint4* r = reinterpret_cast<const uint4*>(w + size_t(grp * 4 + warp / 2) * K) + (warp & 1) * half;
    for (int c = lane; c < half; c += 32 * U) {
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = c + 32 * u < half ? ld_stream(r + c + 32 * u) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].w;
    }
  }
  if (acc == 0x12345u) *sink = float(acc);
}

// ---- direct: a block's 8 warps on tiles of 16 weight rows, warp w an eighth of K; the mma's 8 columns are
// x rows (NT n-tiles); A and B share a permutation of k so that a lane's 16 bytes are two k-steps.
template <int NT, int U, int BPS>
__global__ void __launch_bounds__(kThreads, BPS)
    direct(const bf16* __restrict__ x, int M, const bf16* __restrict__ w, bf16* __restrict__ out, int N, int K) {
  constexpr int COLS = 8 * NT;
  __shared__ float part[kWarps][16][COLS];
  pdl_release();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int chunks = K / 32, cb = chunks * warp / kWarps, ce = chunks * (warp + 1) / kWarps;
  const int tiles = N / 16;
  auto rows = [&](int i, const bf16* (&p)[2]) {
    p[0] = w + size_t(i * 16 + g) * K + 8 * t;
    p[1] = p[0] + size_t(8) * K;
  };
  auto load = [&](const bf16* const (&p)[2], int c0, uint4 (&d)[U][2]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const bool ok = c0 + u < ce;
      d[u][0] = ok ? ld_stream(p[0] + 32 * (c0 + u)) : make_uint4(0, 0, 0, 0);
      d[u][1] = ok ? ld_stream(p[1] + 32 * (c0 + u)) : make_uint4(0, 0, 0, 0);
    }
  };
  int i = blockIdx.x;
  const bf16* wr[2];
  rows(i < tiles ? i : 0, wr);
  uint4 wv[U][2];
  load(wr, cb, wv);
  pdl_wait();
  const uint4* xr[NT];
  bool xok[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    xok[j] = g + 8 * j < M;
    xr[j] = reinterpret_cast<const uint4*>(x + size_t(xok[j] ? g + 8 * j : 0) * K) + t;
  }
  for (; i < tiles; i += gridDim.x) {
    float acc[NT][4] = {};
    const int in = i + gridDim.x;
    for (int c0 = cb; c0 < ce; c0 += U) {
      uint4 nx[U][2];
      if (c0 + U < ce) {
        load(wr, c0 + U, nx);
      } else if (in < tiles) {
        const bf16* wn[2];
        rows(in, wn);
        load(wn, cb, nx);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (c0 + u >= ce) break;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const uint4 xv = xok[j] ? __ldg(xr[j] + 4 * (c0 + u)) : make_uint4(0, 0, 0, 0);
          const uint4 &lo = wv[u][0], &hi = wv[u][1];
          mma(acc[j], lo.x, hi.x, lo.y, hi.y, xv.x, xv.y);
          mma(acc[j], lo.z, hi.z, lo.w, hi.w, xv.z, xv.w);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) wv[u][0] = nx[u][0], wv[u][1] = nx[u][1];
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      part[warp][g][8 * j + 2 * t] = acc[j][0];
      part[warp][g][8 * j + 2 * t + 1] = acc[j][1];
      part[warp][g + 8][8 * j + 2 * t] = acc[j][2];
      part[warp][g + 8][8 * j + 2 * t + 1] = acc[j][3];
    }
    __syncthreads();
    if (threadIdx.x < 16 * COLS) {
      const int rr = threadIdx.x / COLS, m = threadIdx.x % COLS;
      if (m < M) {
        float s = 0.f;
#pragma unroll
        for (int q = 0; q < kWarps; ++q) s += part[q][rr][m];
        out[size_t(m) * N + i * 16 + rr] = __float2bfloat16(s);
      }
    }
    __syncthreads();
    rows(in < tiles ? in : 0, wr);
  }
}

// ---- async: tiles of 16 weight rows, warp w an eighth of K in chunks of 64 elements; each warp streams its
// chunks (tile after tile) through its own ring of S stages of 16 rows x 128 bytes (one cp.async instruction
// covers 4 rows x one 128-byte line each; 16-byte pieces swizzled by row), ldmatrix gives the A fragments,
// x's B fragments come from L1 in the plain layout.
template <int NT, int S, int BPS>
__global__ void __launch_bounds__(kThreads, BPS)
    async_k(const bf16* __restrict__ x, int M, const bf16* __restrict__ w, bf16* __restrict__ out, int N, int K) {
  constexpr int COLS = 8 * NT;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ float part[kWarps][16][COLS];
  pdl_release();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  uint8_t* ring = smem + warp * (S * 2048);
  const int chunks = K / 64, per = chunks / kWarps;  // chunks per warp per tile (K a multiple of 512)
  const int cb = per * warp;
  const int tiles = N / 16;
  const int my_tiles = blockIdx.x < tiles ? (tiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  const int items = my_tiles * per;  // this warp's chunks, tile-major
  // Item q -> stage q % S: lane copies rows 4 j + lane / 8, piece lane % 8 (j = 0..3).
  auto issue = [&](int q) {
    if (q < items) {
      const int tile = blockIdx.x + (q / per) * gridDim.x, c = cb + q % per;
      uint8_t* st = ring + (q % S) * 2048;
      const int piece = lane & 7;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int r = 4 * j + (lane >> 3);
        cp16(st + r * 128 + ((piece ^ (r & 7)) << 4), w + size_t(tile * 16 + r) * K + c * 64 + piece * 8);
      }
    }
    cp_commit();
  };
#pragma unroll
  for (int q = 0; q < S - 1; ++q) issue(q);
  pdl_wait();
  const bf16* xr[NT];
  bool xok[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    xok[j] = g + 8 * j < M;
    xr[j] = x + size_t(xok[j] ? g + 8 * j : 0) * K + 2 * t;
  }
  // ldmatrix x4 addresses: lane l gives row (l & 7) + 8 ((l >> 3) & 1) of matrix l >> 3, whose 16-byte piece
  // is 2 ks + (l >> 4) for k-step ks.
  const int lr = (lane & 7) + 8 * ((lane >> 3) & 1), lhi = lane >> 4;
  float acc[NT][4] = {};
  for (int q = 0; q < items; ++q) {
    cp_wait<S - 2>();
    __syncwarp();
    const uint8_t* st = ring + (q % S) * 2048;
    const int c = cb + q % per;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      uint32_t a0, a1, a2, a3;
      ldsm4(a0, a1, a2, a3, st + lr * 128 + (((2 * ks + lhi) ^ (lr & 7)) << 4));
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        uint32_t b0 = 0, b1 = 0;
        if (xok[j]) {
          b0 = __ldg(reinterpret_cast<const uint32_t*>(xr[j] + c * 64 + 16 * ks));
          b1 = __ldg(reinterpret_cast<const uint32_t*>(xr[j] + c * 64 + 16 * ks + 8));
        }
        mma(acc[j], a0, a1, a2, a3, b0, b1);
      }
    }
    __syncwarp();
    issue(q + S - 1);
    if (q % per == per - 1) {  // the tile's last chunk: the warps meet
      const int tile = blockIdx.x + (q / per) * gridDim.x;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        part[warp][g][8 * j + 2 * t] = acc[j][0];
        part[warp][g][8 * j + 2 * t + 1] = acc[j][1];
        part[warp][g + 8][8 * j + 2 * t] = acc[j][2];
        part[warp][g + 8][8 * j + 2 * t + 1] = acc[j][3];
        acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
      }
      __syncthreads();
      if (threadIdx.x < 16 * COLS) {
        const int rr = threadIdx.x / COLS, m = threadIdx.x % COLS;
        if (m < M) {
          float s = 0.f;
#pragma unroll
          for (int p = 0; p < kWarps; ++p) s += part[p][rr][m];
          out[size_t(m) * N + tile * 16 + rr] = __float2bfloat16(s);
        }
      }
      __syncthreads();
    }
  }
  cp_wait<0>();
}

// ---- coop: the block's warps stream one tile of 16 MT weight rows together, K from 0 on, in stages of
// 16 MT rows x KS elements (a ring of S stages; one cp.async instruction copies 512 contiguous bytes of one
// row, warp w the rows w, w + 8, ...), so a row is one stream read front to back, as in the one-row GEMV.
// Warp w multiplies k-steps w KPW .. of every stage (ldmatrix A fragments, every m-tile against the same x
// fragments from L1); the warps' sums meet in shared memory at the tile's end.
template <int NT, int MT, int KS, int S, int BPS>
__global__ void __launch_bounds__(kThreads, BPS)
    coop(const bf16* __restrict__ x, int M, const bf16* __restrict__ w, bf16* __restrict__ out, int N, int K) {
  constexpr int COLS = 8 * NT, ROWS = 16 * MT, PITCH = KS * 2, STAGE = ROWS * PITCH;
  constexpr int KPW = KS / 16 / kWarps;  // k-steps per warp per stage
  constexpr int IPR = KS / 256;          // cp.async instructions per row per stage
  static_assert(KPW >= 1, "stage too short");
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ float part[kWarps][ROWS][COLS];
  pdl_release();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int spt = K / KS;  // stages per tile
  const int tiles = N / ROWS;
  const int my_tiles = int(blockIdx.x) < tiles ? (tiles - 1 - int(blockIdx.x)) / int(gridDim.x) + 1 : 0;
  const int items = my_tiles * spt;
  auto issue = [&](int q) {
    if (q < items) {
      const int tile = blockIdx.x + (q / spt) * gridDim.x, kc = (q % spt) * KS;
      uint8_t* st = smem + (q % S) * STAGE;
#pragma unroll
      for (int rr = 0; rr < ROWS / kWarps; ++rr) {
        const int r = warp + kWarps * rr;
        const bf16* src = w + size_t(tile * ROWS + r) * K + kc;
#pragma unroll
        for (int i = 0; i < IPR; ++i) {
          const int piece = 32 * i + lane;
          cp16(st + r * PITCH + ((piece ^ (r & 7)) << 4), src + piece * 8);
        }
      }
    }
    cp_commit();
  };
#pragma unroll
  for (int q = 0; q < S - 1; ++q) issue(q);
  pdl_wait();
  const bf16* xr[NT];
  bool xok[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    xok[j] = g + 8 * j < M;
    xr[j] = x + size_t(xok[j] ? g + 8 * j : 0) * K + 2 * t;
  }
  const int lr = (lane & 7) + 8 * ((lane >> 3) & 1), lhi = lane >> 4;
  float acc[MT][NT][4] = {};
  for (int q = 0; q < items; ++q) {
    cp_wait<S - 2>();
    __syncthreads();  // stage q is in for every warp; stage q - 1 is free for the refill below
    issue(q + S - 1);
    const uint8_t* st = smem + (q % S) * STAGE;
    const int kc = (q % spt) * KS;
#pragma unroll
    for (int kk = 0; kk < KPW; ++kk) {
      const int ks = warp * KPW + kk;
      uint32_t b[NT][2];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        b[j][0] = xok[j] ? __ldg(reinterpret_cast<const uint32_t*>(xr[j] + kc + 16 * ks)) : 0u;
        b[j][1] = xok[j] ? __ldg(reinterpret_cast<const uint32_t*>(xr[j] + kc + 16 * ks + 8)) : 0u;
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int row = 16 * mt + lr;
        uint32_t a0, a1, a2, a3;
        ldsm4(a0, a1, a2, a3, st + row * PITCH + (((2 * ks + lhi) ^ (row & 7)) << 4));
#pragma unroll
        for (int j = 0; j < NT; ++j) mma(acc[mt][j], a0, a1, a2, a3, b[j][0], b[j][1]);
      }
    }
    if (q % spt == spt - 1) {  // the tile's last stage: the warps meet
      const int tile = blockIdx.x + (q / spt) * gridDim.x;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          part[warp][16 * mt + g][8 * j + 2 * t] = acc[mt][j][0];
          part[warp][16 * mt + g][8 * j + 2 * t + 1] = acc[mt][j][1];
          part[warp][16 * mt + g + 8][8 * j + 2 * t] = acc[mt][j][2];
          part[warp][16 * mt + g + 8][8 * j + 2 * t + 1] = acc[mt][j][3];
          acc[mt][j][0] = acc[mt][j][1] = acc[mt][j][2] = acc[mt][j][3] = 0.f;
        }
      __syncthreads();
      for (int e = threadIdx.x; e < ROWS * COLS; e += kThreads) {
        const int rr = e / COLS, m = e % COLS;
        if (m < M) {
          float s = 0.f;
#pragma unroll
          for (int p = 0; p < kWarps; ++p) s += part[p][rr][m];
          out[size_t(m) * N + tile * ROWS + rr] = __float2bfloat16(s);
        }
      }
      // part is rewritten only after the next tile's stages, each behind a __syncthreads.
    }
  }
  cp_wait<0>();
}

// Reference on the host side of the check: out[m, n] = sum_k x[m, k] w[n, k] for a few n.
__global__ void ref_dot(const bf16* x, const bf16* w, int K, int N, int m, int n, float* r) {
  float s = 0.f;
  for (int k = threadIdx.x; k < K; k += 32) s += __bfloat162float(x[size_t(m) * K + k]) * __bfloat162float(w[size_t(n) * K + k]);
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (threadIdx.x == 0) *r = s;
}

__global__ void fill(bf16* p, size_t n, uint32_t seed) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    p[i] = __float2bfloat16((float(h & 0xffff) / 65536.f - 0.5f) * 0.25f);
  }
}

struct Shape {
  int N, K;
};

template <typename Kernel, typename... Args>
void launch(Kernel k, int grid, size_t smem, cudaStream_t s, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = kThreads;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute a[1];
  a[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = a;
  cfg.numAttrs = 1;
  CK(cudaLaunchKernelEx(&cfg, k, args...));
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const bool lt_algos = mode == "lt-algos";
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int L = 36;
  const std::vector<Shape> layer = {{6144, 4096}, {4096, 4096}, {24576, 4096}, {4096, 12288}};
  size_t per_layer = 0, shape_off[4];  // elements of a layer; each shape's offset within it
  for (int i = 0; i < 4; ++i) shape_off[i] = per_layer, per_layer += size_t(layer[i].N) * layer[i].K;
  const size_t elems = per_layer * L;
  const double bytes = double(elems) * 2;
  bf16 *w = nullptr, *x = nullptr, *o = nullptr;
  CK(cudaMalloc(&w, elems * 2));
  CK(cudaMalloc(&x, size_t(128) * 12288 * 2));
  CK(cudaMalloc(&o, size_t(128) * 24576 * 2));
  fill<<<1024, 256>>>(w, elems, 1u);
  fill<<<64, 256>>>(x, size_t(128) * 12288, 7u);
  float* dev = nullptr;
  CK(cudaMalloc(&dev, 64));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaDeviceSynchronize());
  std::printf("GPU SMs %d, weights %.2f GB per step (%d products)\n", sms, bytes / 1e9, int(layer.size()) * L);

  auto time_graph = [&](auto enqueue) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed));
    enqueue();
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, st));
    CK(cudaStreamSynchronize(st));
    const int reps = 20;
    CK(cudaEventRecord(e0, st));
    for (int i = 0; i < reps; ++i) CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    return ms / reps;
  };
  auto run_step = [&](auto one) {
    return time_graph([&] {
      size_t off = 0;
      for (int l = 0; l < L; ++l)
        for (const Shape& s : layer) {
          one(w + off, s.N, s.K);
          off += size_t(s.N) * s.K;
        }
    });
  };
  auto report = [&](const char* name, int M, float ms) {
    std::printf("%-40s M=%-2d %8.3f ms  %6.3f TB/s\n", name, M, ms, bytes / (ms * 1e-3) / 1e12);
  };
  // Checks one product of the last layer's down shape against a plain dot product.
  auto check = [&](const char* name, int M, auto one) {
    const Shape s = layer[3];
    const bf16* wl = w + elems - size_t(s.N) * s.K;
    CK(cudaMemset(o, 0, size_t(16) * 24576 * 2));
    one(wl, s.N, s.K);
    CK(cudaStreamSynchronize(st));
    float worst = 0.f;
    const int ns[3] = {0, 777, s.N - 1};
    for (int m = 0; m < M; m += (M > 4 ? 3 : 1))
      for (int n : ns) {
        ref_dot<<<1, 32>>>(x, wl, s.K, s.N, m, n, dev);
        float r = 0.f;
        bf16 got;
        CK(cudaMemcpy(&r, dev, 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(&got, o + size_t(m) * s.N + n, 2, cudaMemcpyDeviceToHost));
        const float d = std::fabs(__bfloat162float(got) - r) / (std::fabs(r) + 1e-2f);
        worst = d > worst ? d : worst;
      }
    if (worst > 2e-2f) std::printf("  CHECK FAILED %s M=%d: relative error %.3g\n", name, M, worst);
  };

  // cuBLASLt plans per (shape, M).
  cublasLtHandle_t lt;
  LK(cublasLtCreate(&lt));
  void* ws = nullptr;
  const size_t ws_bytes = size_t(32) << 20;
  CK(cudaMalloc(&ws, ws_bytes));
  struct Plan {
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
  };
  auto plan = [&](int N, int K, int M) {
    Plan p;
    LK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    LK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    LK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    LK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, K, N, K));
    LK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, K, M, K));
    LK(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_16BF, N, M, N));
    cublasLtMatmulPreference_t pref;
    LK(cublasLtMatmulPreferenceCreate(&pref));
    LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));
    cublasLtMatmulHeuristicResult_t res{};
    int found = 0;
    LK(cublasLtMatmulAlgoGetHeuristic(lt, p.op, p.a, p.b, p.c, p.c, pref, 1, &res, &found));
    if (!found) std::exit(2);
    p.algo = res.algo;
    return p;
  };

  // One product on cuBLASLt with the plan of its shape (plans in the order of `layer`).
  auto lt_product = [&](const std::vector<Plan>& plans) {
    return [&, plans](const bf16* wp, int N, int K) {
      int i = 0;
      while (layer[i].N != N || layer[i].K != K) ++i;
      const float alpha = 1.f, beta = 0.f;
      LK(cublasLtMatmul(lt, plans[i].op, &alpha, wp, plans[i].a, x, plans[i].b, &beta, o, plans[i].c, o,
                        plans[i].c, &plans[i].algo, ws, ws_bytes, st));
    };
  };
  if (lt_algos) {
    cublasLtMatmulPreference_t pref;
    LK(cublasLtMatmulPreferenceCreate(&pref));
    LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));
    for (int M : {32, 64, 128})
      for (int si = 0; si < 4; ++si) {
        const Shape s = layer[si];
        Plan p = plan(s.N, s.K, M);
        cublasLtMatmulHeuristicResult_t res[12];
        int found = 0;
        LK(cublasLtMatmulAlgoGetHeuristic(lt, p.op, p.a, p.b, p.c, p.c, pref, 12, res, &found));
        std::vector<cublasLtMatmulAlgo_t> algos;
        for (int i = 0; i < found; ++i) algos.push_back(res[i].algo);
        for (int split : {2, 3, 4})  // the first algorithm forced to split-K
          for (uint32_t scheme : {uint32_t(CUBLASLT_REDUCTION_SCHEME_INPLACE),
                                  uint32_t(CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE)}) {
            cublasLtMatmulAlgo_t a = res[0].algo;
            const int32_t sk = split;
            cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &sk, sizeof(sk));
            cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme, sizeof(scheme));
            cublasLtMatmulHeuristicResult_t chk{};
            if (cublasLtMatmulAlgoCheck(lt, p.op, p.a, p.b, p.c, p.c, &a, &chk) == CUBLAS_STATUS_SUCCESS &&
                chk.workspaceSize <= ws_bytes)
              algos.push_back(a);
          }
        const double sbytes = double(L) * s.N * s.K * 2;
        for (size_t ai = 0; ai < algos.size(); ++ai) {
          const cublasLtMatmulAlgo_t& a = algos[ai];
          int32_t tile = 0, split = 0, stages = 0, swz = 0, cluster = 0;
          uint32_t scheme = 0;
          size_t n = 0;
          cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &n);
          cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split, sizeof(split), &n);
          cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages), &n);
          cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swz, sizeof(swz), &n);
          cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster), &n);
          cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme, sizeof(scheme), &n);
          const float ms = time_graph([&] {
            for (int l = 0; l < L; ++l) {
              const float alpha = 1.f, beta = 0.f;
              LK(cublasLtMatmul(lt, p.op, &alpha, w + shape_off[si] + size_t(l) * per_layer, p.a, x, p.b, &beta, o, p.c, o,
                                p.c, &a, ws, ws_bytes, st));
            }
          });
          std::printf("M=%-3d N=%-5d K=%-5d %s%-2zu tile %3d split %d scheme %u stages %3d swizzle %d cluster %2d "
                      "waves %.2f  %7.2f us  %5.2f TB/s\n",
                      M, s.N, s.K, ai < size_t(found) ? "h" : "s", ai, tile, split, scheme, stages, swz, cluster,
                      ai < size_t(found) ? res[ai].wavesCount : 0.f, ms * 1e3 / L, sbytes / (ms * 1e-3) / 1e12);
        }
      }
    return 0;
  }
  if (mode == "skinny") {
    namespace sk = qrt::cuda::skinny;
    float* part = nullptr;
    int* arrivals = nullptr;
    CK(cudaMalloc(&part, size_t(16) << 20 << 2));
    CK(cudaMalloc(&arrivals, 4096 * 4));
    CK(cudaMemset(arrivals, 0, 4096 * 4));
    for (int nt : {1, 2, 4}) {
      auto set_smem = [&](auto kernel) {
        CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 * 1024));
      };
      if (nt == 1) set_smem(sk::skinny_gemm_kernel<bf16, 1>);
      if (nt == 2) set_smem(sk::skinny_gemm_kernel<bf16, 2>);
      if (nt == 4) set_smem(sk::skinny_gemm_kernel<bf16, 4>);
    }
    for (const Shape& s : layer) {
      const sk::Plan p = sk::make_plan(s.N, s.K, sms);
      std::printf("plan N=%d K=%d: slice %d, slices %d, tiles %d, blocks %d, smem %zu (M=64)\n", s.N, s.K, p.ks,
                  p.slices, p.tiles, p.blocks, sk::smem_bytes(p, 4));
    }
    for (int M : {9, 20, 45, 16, 32, 64}) {
      std::vector<Plan> plans;
      for (const Shape& s : layer) plans.push_back(plan(s.N, s.K, M));
      auto lt_one = lt_product(plans);
      auto sk_one = [&](const bf16* wp, int N, int K) {
        sk::Args<bf16> a{x, K, M, wp, K, N, K, o, N, part, arrivals, sk::make_plan(N, K, sms), 1e-6f, false, false};
        const int nt = sk::tiles_per_group(M);
        const size_t sm = sk::smem_bytes(a.plan, nt);
        if (nt == 1) launch(sk::skinny_gemm_kernel<bf16, 1>, a.plan.blocks, sm, st, a);
        if (nt == 2) launch(sk::skinny_gemm_kernel<bf16, 2>, a.plan.blocks, sm, st, a);
        if (nt == 4) launch(sk::skinny_gemm_kernel<bf16, 4>, a.plan.blocks, sm, st, a);
      };
#ifndef SKINNY_NO_REDUCE
      check("skinny", M, sk_one);
#endif
      std::printf("checked skinny M=%d\n", M);
      if (M % 16) continue;
      check("lt", M, lt_one);
      for (int r = 0; r < 2; ++r) {
        report("lt (cuBLASLt heuristic)", M, run_step(lt_one));
        report("skinny", M, run_step(sk_one));
      }
      // Per shape, 36 layers each.
      for (int si = 0; si < 4; ++si) {
        const size_t off = shape_off[si];
        const Shape s = layer[si];
        for (int v = 0; v < 2; ++v) {
          const float ms = time_graph([&] {
            for (int l = 0; l < L; ++l) {
              if (v) sk_one(w + off + size_t(l) * per_layer, s.N, s.K);
              else lt_one(w + off + size_t(l) * per_layer, s.N, s.K);
            }
          });
          std::printf("  M=%d N=%d K=%d %-7s %7.2f us %5.2f TB/s\n", M, s.N, s.K, v ? "skinny" : "lt", ms * 1e3 / L,
                      double(L) * s.N * s.K * 2 / (ms * 1e-3) / 1e12);
        }
      }
    }
    return 0;
  }
  for (int M : {2, 4, 8, 16}) {
    std::vector<Plan> plans;
    for (const Shape& s : layer) plans.push_back(plan(s.N, s.K, M));
    auto lt_one = lt_product(plans);
    check("lt", M, lt_one);
    report("lt (cuBLASLt heuristic)", M, run_step(lt_one));
  }
  // The weight streams alone.
#define READ16(U, BPS)                                                                                   \
  report("read16 U=" #U " blocks/SM=" #BPS, 0, run_step([&](const bf16* wp, int N, int K) {               \
           launch(read16<U, BPS>, std::min(N / 16, sms * BPS), 0, st, wp, N, K, dev);                      \
         }))
  READ16(2, 2);
  READ16(4, 2);
  READ16(4, 3);
  READ16(8, 2);
#define READROW(U, BPS)                                                                                  \
  report("readrow U=" #U " blocks/SM=" #BPS, 0, run_step([&](const bf16* wp, int N, int K) {              \
           launch(readrow<U, BPS>, std::min(N / 4, sms * BPS), 0, st, wp, N, K, dev);                      \
         }))
  READROW(4, 4);
  READROW(8, 2);
  // The products.
#define DIRECT(NT, U, BPS, M)                                                                            \
  {                                                                                                      \
    auto one = [&](const bf16* wp, int N, int K) {                                                       \
      launch(direct<NT, U, BPS>, std::min(N / 16, sms * BPS), 0, st, x, M, wp, o, N, K);                 \
    };                                                                                                   \
    check("direct", M, one);                                                                             \
    report("direct NT=" #NT " U=" #U " blocks/SM=" #BPS, M, run_step(one));                              \
  }
#define ASYNC(NT, S, BPS, M)                                                                             \
  {                                                                                                      \
    const size_t sm = size_t(kWarps) * S * 2048;                                                         \
    CK(cudaFuncSetAttribute(async_k<NT, S, BPS>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sm))); \
    auto one = [&](const bf16* wp, int N, int K) {                                                       \
      launch(async_k<NT, S, BPS>, std::min(N / 16, sms * BPS), sm, st, x, M, wp, o, N, K);               \
    };                                                                                                   \
    check("async", M, one);                                                                              \
    report("async NT=" #NT " stages=" #S " blocks/SM=" #BPS, M, run_step(one));                          \
  }
#define COOP(NT, MT, KS, S, BPS, M)                                                                      \
  {                                                                                                      \
    const size_t sm = size_t(S) * 16 * MT * KS * 2;                                                      \
    CK(cudaFuncSetAttribute(coop<NT, MT, KS, S, BPS>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sm))); \
    auto one = [&](const bf16* wp, int N, int K) {                                                       \
      launch(coop<NT, MT, KS, S, BPS>, std::min(N / (16 * MT), sms * BPS), sm, st, x, M, wp, o, N, K);   \
    };                                                                                                   \
    check("coop", M, one);                                                                               \
    report("coop NT=" #NT " MT=" #MT " KS=" #KS " S=" #S " BPS=" #BPS, M, run_step(one));               \
  }
  for (int M : {2, 8}) {
    ASYNC(1, 6, 2, M);
    COOP(1, 1, 256, 4, 4, M);
    COOP(1, 1, 256, 6, 3, M);
    COOP(1, 1, 256, 8, 2, M);
    COOP(1, 1, 512, 4, 2, M);
    COOP(1, 1, 512, 3, 3, M);
    COOP(1, 2, 256, 4, 2, M);
    COOP(1, 2, 256, 3, 3, M);
  }
  COOP(1, 1, 256, 6, 3, 4);
  COOP(1, 2, 256, 4, 2, 4);
  COOP(2, 1, 256, 6, 3, 16);
  COOP(2, 2, 256, 4, 2, 16);
  return 0;
}
