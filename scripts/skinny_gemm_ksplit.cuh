// Skinny GEMM on tensor cores for decode steps of 9..64 rows: out[m, n] = x[m, :] . w[n, :], 16-bit x and
// w of one dtype, fp32 accumulation, optionally with a folded RMSNorm (the rows scaled by 1/rms(x[m]) at the
// end, the norm's gain already in w) and optionally added into out. A study (scripts/skinny_gemm_study.cu
// times it against cuBLASLt), not in the runtime: it computes right but ran at half of cuBLASLt's speed at
// 16-64 rows (docs/runs/2026-12-04-h200.md, session 12).
//
// Layout. w is cut into tiles of 128 rows and K into slices of `ks` columns (the plan, a function of N, K
// and the SM count only, so a row's arithmetic does not depend on M). A persistent grid of one block per SM
// gives block b the slice b % slices and every (b / slices)-th tile of it: the block loads its slice of
// all x rows into shared memory once, then streams its tiles' weights through a ring of stages (128 rows x
// 64 columns, whole 128-byte lines per row, cp.async), ldmatrix gives both operands, mma.sync m16n8k16.
// The first stages are requested before grid_wait (the weights do not depend on the previous kernel).
// Each (tile, slice) writes its fp32 partial sums (and the slice's sums of squares of x, for the norm)
// to a workspace; the block that arrives last at a tile (an arrival counter per tile) adds the slices in
// order 0, 1, ... and writes the tile: the result does not depend on which block came last.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace qrt::cuda::skinny {

constexpr int kThreads = 256;   // 8 warps: 4 row groups of 32 weight rows x 2 token groups
constexpr int kTileRows = 128;  // weight rows per tile
constexpr int kStageK = 64;     // columns per ring stage (one 128-byte line per row)
#ifndef SKINNY_STAGES
#define SKINNY_STAGES 5
#endif
constexpr int kStages = SKINNY_STAGES;  // ring depth
constexpr int kMaxRows = 64;    // x rows
constexpr int kStageBytes = kTileRows * kStageK * 2;

struct Plan {
  int ks = 0;      // columns per slice (a multiple of kStageK; the last slice may be shorter)
  int slices = 0;  // ceil(K / ks)
  int tiles = 0;   // N / kTileRows
  int blocks = 0;  // grid size (>= slices)
};

// Slice width from {1024, 512, 256} minimizing the busiest block's weight columns plus a per-item cost
// for its partial sums; N must be a multiple of kTileRows and K of kStageK.
inline Plan make_plan(int N, int K, int num_sms) {
  Plan best;
  int64_t best_cost = INT64_MAX;
  for (int ks : {1024, 512, 256}) {
    Plan p;
    p.ks = std::min(ks, K);
    p.slices = (K + p.ks - 1) / p.ks;
    p.tiles = N / kTileRows;
    p.blocks = std::min(num_sms, p.tiles * p.slices);
    if (p.blocks < p.slices) continue;
    const int fewest = p.blocks / p.slices;  // blocks of the slice with the fewest
    const int64_t busiest = (p.tiles + fewest - 1) / fewest;
    const int64_t cost = busiest * (p.ks + 128);
    if (cost < best_cost) best_cost = cost, best = p;
    if (ks >= K) break;
  }
  return best;
}

// Shared memory of a launch: the ring and the x slice (16 * nt rows, the token groups' padding included).
inline size_t smem_bytes(const Plan& p, int nt) {
  return size_t(kStages) * kStageBytes + size_t(16 * nt) * p.ks * 2;
}

// Workspace floats: partial sums [slices][M][N] and sums of squares [slices][tiles][M].
inline size_t workspace_floats(const Plan& p, int M, int N) {
  return size_t(p.slices) * M * N + size_t(p.slices) * p.tiles * M;
}

template <typename T>
struct Args {
  const T* x;
  int64_t ldx;
  int M;
  const T* w;
  int64_t ldw;
  int N, K;
  T* out;
  int64_t ldo;
  float* partial;  // workspace_floats(plan, M, N)
  int* arrivals;   // [tiles], zero before the launch; left zero after it
  Plan plan;
  float eps;  // with norm
  bool norm;  // scale row m by 1 / rms(x[m, :])
  bool add;   // out += the product (rounded once)
};

namespace detail {

__device__ __forceinline__ void cp16(uint32_t smem, const void* g) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(g));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float f32(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_f32(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_f32(float v) { return __float2half_rn(v); }

// Byte offset of 16-byte chunk c of row r in rows of `pitch` bytes, chunks swizzled by the row's low bits.
__device__ __forceinline__ uint32_t swz(int r, int c, int pitch) { return r * pitch + ((c ^ (r & 7)) << 4); }

__device__ __forceinline__ void wait_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void release_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace detail

// NT: n8 tiles per token group (x rows <= 16 NT).
template <typename T, int NT>
__global__ void __launch_bounds__(kThreads, 1) skinny_gemm_kernel(const Args<T> a) {
  using namespace detail;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ float row_scale[kMaxRows];
  __shared__ int last;
  release_next_grid();
  const Plan& p = a.plan;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int slice = blockIdx.x % p.slices, first_tile = blockIdx.x / p.slices;
  const int blocks_here = (p.blocks - slice + p.slices - 1) / p.slices;  // blocks sharing this slice
  const int k0 = slice * p.ks, len = min(p.ks, a.K - k0), spt = len / kStageK;  // stages per tile
  const int my_tiles = first_tile < p.tiles ? (p.tiles - 1 - first_tile) / blocks_here + 1 : 0;
  const int items = my_tiles * spt;
  const uint32_t ring = uint32_t(__cvta_generic_to_shared(smem));
  const uint32_t xs = ring + kStages * kStageBytes;
  const int xpitch = p.ks * 2;

  auto issue = [&](int q) {
    if (q < items) {
      const int tile = first_tile + (q / spt) * blocks_here, kk = k0 + (q % spt) * kStageK;
      const uint32_t st = ring + (q % kStages) * kStageBytes;
      const int c = tid & 7;
#pragma unroll
      for (int i = 0; i < kTileRows * 8 / kThreads; ++i) {
        const int r = (tid >> 3) + i * (kThreads / 8);
        cp16(st + swz(r, c, 128), a.w + size_t(tile * kTileRows + r) * a.ldw + kk + 8 * c);
      }
    }
    cp_commit();
  };
#pragma unroll
  for (int q = 0; q < kStages - 1; ++q) issue(q);
  wait_prior_grid();
  // The x slice: rows >= M are zero (they fill the token groups' mma columns).
  const int xrows = 16 * NT, chunks = len / 8;
  for (int e = tid; e < xrows * chunks; e += kThreads) {
    const int m = e / chunks, c = e % chunks;
    if (m < a.M) cp16(xs + swz(m, c, xpitch), a.x + size_t(m) * a.ldx + k0 + 8 * c);
    else *reinterpret_cast<uint4*>(smem + (xs - ring) + swz(m, c, xpitch)) = make_uint4(0, 0, 0, 0);
  }
  cp_commit();
  cp_wait<0>();
  __syncthreads();
  // Sums of squares of the slice, row m by threads 4m .. 4m + 3 (M <= 64), in a fixed order.
  float sumsq = 0.f;
  if (a.norm) {
    const int m = tid >> 2, part = tid & 3;
    if (m < a.M)
      for (int c = part; c < chunks; c += 4) {
        const T* e = reinterpret_cast<const T*>(smem + (xs - ring) + swz(m, c, xpitch));
#pragma unroll
        for (int i = 0; i < 8; ++i) sumsq = fmaf(f32(e[i]), f32(e[i]), sumsq);
      }
    sumsq += __shfl_xor_sync(0xffffffffu, sumsq, 1);
    sumsq += __shfl_xor_sync(0xffffffffu, sumsq, 2);
  }

  const int rg = warp & 3, tg = warp >> 2;  // 32 weight rows, 8 NT tokens
  const int lrow = (lane & 7) + 8 * ((lane >> 3) & 1), lhalf = lane >> 4;  // ldmatrix x4 address roles (A)
  float acc[2][NT][4] = {};
  float* sums_sq = a.partial + size_t(p.slices) * a.M * a.N;  // [slices][tiles][M]
  for (int q = 0; q < items; ++q) {
    cp_wait<kStages - 2>();
    __syncthreads();  // stage q is in for every thread; the slot of stage q - 1 is free
    issue(q + kStages - 1);
    const uint32_t st = ring + (q % kStages) * kStageBytes;
    const int kc = (q % spt) * (kStageK / 8);  // the stage's first chunk within the x slice
#pragma unroll
    for (int s = 0; s < kStageK / 16; ++s) {
      uint32_t af[2][4];
#pragma unroll
      for (int i = 0; i < 2; ++i) ldsm4(af[i], st + swz(32 * rg + 16 * i + lrow, 2 * s + lhalf, 128));
#pragma unroll
      for (int j = 0; j < NT; j += 2) {
        if (j + 1 < NT) {  // two n8 tiles: matrices (tokens, k lo), (tokens, k hi), (tokens + 8, lo), (+ 8, hi)
          uint32_t bf[4];
          const int tok = 8 * NT * tg + 8 * j + (lane & 7) + 8 * (lane >> 4);
          ldsm4(bf, xs + swz(tok, kc + 2 * s + ((lane >> 3) & 1), xpitch));
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            mma<T>(acc[i][j], af[i], bf[0], bf[1]);
            mma<T>(acc[i][j + 1], af[i], bf[2], bf[3]);
          }
        } else {
          uint32_t bf[2];
          const int tok = 8 * NT * tg + 8 * j + (lane & 7);
          ldsm2(bf, xs + swz(tok, kc + 2 * s + ((lane >> 3) & 1), xpitch));
#pragma unroll
          for (int i = 0; i < 2; ++i) mma<T>(acc[i][j], af[i], bf[0], bf[1]);
        }
      }
    }
    if (q % spt != spt - 1) continue;
#ifdef SKINNY_NO_REDUCE  // study of the streaming loop alone: the partial sums are dropped
    if (acc[0][0][0] == 1234.5f) a.out[0] = from_f32<T>(acc[1][NT - 1][3]);
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < NT; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
    continue;
#endif
    // The tile's slice is done: its partial sums to the workspace, then the arrival.
    const int tile = first_tile + (q / spt) * blocks_here;
    float* part = a.partial + size_t(slice) * a.M * a.N;
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int n = tile * kTileRows + 32 * rg + 16 * i + g, m = 8 * NT * tg + 8 * j + 2 * t;
        if (m < a.M) {
          part[size_t(m) * a.N + n] = acc[i][j][0];
          part[size_t(m) * a.N + n + 8] = acc[i][j][2];
        }
        if (m + 1 < a.M) {
          part[size_t(m + 1) * a.N + n] = acc[i][j][1];
          part[size_t(m + 1) * a.N + n + 8] = acc[i][j][3];
        }
        acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
      }
    if (a.norm && (tid & 3) == 0 && (tid >> 2) < a.M)
      sums_sq[(size_t(slice) * p.tiles + tile) * a.M + (tid >> 2)] = sumsq;
    __syncthreads();
    if (tid == 0) {
      __threadfence();  // the block's stores (ordered before by the barrier) before the arrival
      last = atomicAdd(a.arrivals + tile, 1) == p.slices - 1;
    }
    __syncthreads();
    if (!last) continue;
    __threadfence();
    if (tid < a.M) {
      float sc = 1.f;
      if (a.norm) {
        float ss = 0.f;
        for (int j = 0; j < p.slices; ++j) ss += __ldcg(sums_sq + (size_t(j) * p.tiles + tile) * a.M + tid);
        sc = rsqrtf(ss / float(a.K) + a.eps);
      }
      row_scale[tid] = sc;
    }
    __syncthreads();
    // Thread tid sums groups of 4 columns e = tid + 256 i (row e / 32), slices in order, four slices' loads
    // in flight at a time.
    constexpr int kGroups = kMaxRows * kTileRows / 4 / kThreads;
    const int groups = a.M * (kTileRows / 4);
    float4 sum[kGroups];
#pragma unroll
    for (int i = 0; i < kGroups; ++i) sum[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    auto at = [&](int j, int e) {
      return reinterpret_cast<const float4*>(a.partial + (size_t(j) * a.M + e / 32) * a.N + tile * kTileRows +
                                             4 * (e % 32));
    };
    for (int j0 = 0; j0 < p.slices; j0 += 4) {
      float4 v[4][kGroups];
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int i = 0; i < kGroups; ++i) {
          const int e = tid + kThreads * i;
          v[u][i] = j0 + u < p.slices && e < groups ? __ldcg(at(j0 + u, e)) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int i = 0; i < kGroups; ++i) {
          sum[i].x += v[u][i].x;
          sum[i].y += v[u][i].y;
          sum[i].z += v[u][i].z;
          sum[i].w += v[u][i].w;
        }
    }
#pragma unroll
    for (int i = 0; i < kGroups; ++i) {
      const int e = tid + kThreads * i;
      if (e >= groups) break;
      const int m = e / 32, n = tile * kTileRows + 4 * (e % 32);
      const float sc = row_scale[m];
      float r[4] = {sum[i].x * sc, sum[i].y * sc, sum[i].z * sc, sum[i].w * sc};
      T* o = a.out + size_t(m) * a.ldo + n;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if (a.add) r[c] += f32(o[c]);
        o[c] = from_f32<T>(r[c]);
      }
    }
    if (tid == 0) a.arrivals[tile] = 0;
    __syncthreads();  // row_scale and `last` are rewritten at the next tile
  }
  cp_wait<0>();
}

// Token groups' n8 tiles for M rows: 1, 2 or 4 (M <= 16, 32, 64).
inline int tiles_per_group(int M) { return M <= 16 ? 1 : M <= 32 ? 2 : 4; }

}  // namespace qrt::cuda::skinny
