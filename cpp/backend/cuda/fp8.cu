// FP8 (e4m3, block-scaled: ops.h Linear) weights on CUDA, weight-only (W8A16): a few-row GEMV that dequantizes in
// registers (decode), a dequantization of row blocks for the cuBLASLt GEMM of larger batches, and the block
// quantization of Backend::quantize_fp8.
// The GEMV has two forms. On CUDA cores (1 row, fp32 x, K not a multiple of 128): a weight's value is the fp32
// product e4m3 * scale, as on the CPU, multiplied with the fp32 value of x and accumulated in fp32, so with fp32
// activations it computes what the CPU does up to the order of the sums; one warp per weight row (two rows, n and
// n + N, for the gated form), each lane 16 weights (one 16-byte load, read past L1) at a time, lane-strided over the
// row (4 pieces in flight per lane, the first before the wait), then a warp sum. On tensor cores (16-bit x, 2-32
// rows; see gemv_fp8_mma_kernel): Qwen3.8-27B FP8 decode on the H100 at 2 / 4 / 8 / 16 rows 12.7 / 13.3 / 14.5 /
// 17.7 ms a step, where the CUDA-core form took 13.9 / 18.5 / 31.3 / - and W8A8 - / 18.9 / 18.5 / 20.2; at 1 row
// 12.6 against the CUDA-core form's 11.4-11.6 (docs/PERFORMANCE_HISTORY.md, session 28). Each form's arithmetic of
// x row m does not depend on M.
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/fp8.cuh"

namespace qrt::cuda {
namespace {

constexpr int kThreads = 256;  // 8 warps: 8 weight rows per block
constexpr int kWarps = kThreads / 32;


__device__ __forceinline__ float fp8_value(uint8_t b) {
  __nv_fp8_e4m3 v;
  v.__x = b;
  return float(v);
}

// 16 e4m3 weights times their scale (each an fp32 product, as dequantize computes it).
__device__ __forceinline__ void dequantize16(const uint4& v, float sc, float (&w)[16]) {
  const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&v);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const __half2 h = __half2(__nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3));
    const float2 f = __half22float2(h);
    w[2 * i] = __fmul_rn(f.x, sc);
    w[2 * i + 1] = __fmul_rn(f.y, sc);
  }
}

// U: pieces in flight per lane and weight row (4; at 1 row QWEN_RT_FP8_GEMV_INFLIGHT=1 takes 1, as before session
// 29's rework: 40 registers in the gated form against 120, 6 blocks an SM against 2; to be measured).
template <typename T, typename O, int M, GemvEpilogue EPI, int U = 4>
__global__ void __launch_bounds__(kThreads)
    gemv_fp8_kernel(const T* __restrict__ x, int64_t ldx, const uint8_t* __restrict__ w, int64_t ldw,
                    const float* __restrict__ scale, int64_t lds, int shift, O* __restrict__ out, int64_t ldo,
                    int64_t N, int64_t K, const void* bias, DType bias_t) {
  constexpr bool GATED = EPI == GemvEpilogue::SiluMul;
  constexpr int R = GATED ? 2 : 1;  // weight rows per warp: n (and n + N)
  constexpr int XN = Vec16<T>::N;   // x elements per 16-byte load
  grid_release();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t n = int64_t(blockIdx.x) * kWarps + warp;
  if (n >= N) return;  // (no block barrier below)
  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
  const int64_t pieces = K / 16;
  // A lane's pieces are lane, lane + 32, ...: U of them loaded at a time (the first U before the wait: weights),
  // then multiplied in that order.
  uint4 wv[R][U];
  float sc[R][U];
  auto load = [&](int64_t p0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t p = p0 + 32 * u;
      if (p < pieces)
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int64_t row = n + r * N;
          wv[r][u] = load_weight(w + row * ldw + p * 16);
          sc[r][u] = __ldg(scale + (row >> shift) * lds + ((p * 16) >> 7));
        }
    }
  };
  load(lane);
  grid_wait();
  for (int64_t p0 = lane; p0 < pieces; p0 += 32 * U) {
    uint4 cur[R][U];
    float cur_sc[R][U];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int u = 0; u < U; ++u) cur[r][u] = wv[r][u], cur_sc[r][u] = sc[r][u];
    if (p0 + 32 * U < pieces) load(p0 + 32 * U);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t p = p0 + 32 * u;
      if (p >= pieces) break;
      const int64_t k = p * 16;
      float wf[R][16];
#pragma unroll
      for (int r = 0; r < R; ++r) dequantize16(cur[r][u], cur_sc[r][u], wf[r]);
#pragma unroll
      for (int m = 0; m < M; ++m)
#pragma unroll
        for (int h = 0; h < 16 / XN; ++h) {
          Vec16<T> xv;
          xv.load(x + m * ldx + k + h * XN);
#pragma unroll
          for (int e = 0; e < XN; ++e)
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r][m] = fmaf(xv.f[e], wf[r][h * XN + e], acc[r][m]);
        }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = warp_sum(acc[r][m]);
  if (lane >= M) return;
  float s = 0.f, s_up = 0.f;
#pragma unroll
  for (int m = 0; m < M; ++m)
    if (m == lane) s = acc[0][m], s_up = acc[R - 1][m];
  gemv_store<T, O, EPI>(out + lane * ldo + n, s, s_up, bias, bias_t, n);
}

template <typename T, typename O, GemvEpilogue EPI>
void launch_gemv_m(const Tensor& x, const Linear& lw, int64_t N, const Tensor* bias, Tensor& out, cudaStream_t s) {
  const unsigned blocks = ceil_div(N, kWarps);
  const void* bp = bias ? bias->data : nullptr;
  const DType bt = bias ? bias->dtype : DType::F32;
  auto go = [&](auto kernel) {
    launch_chained(kernel, blocks, kThreads, 0, s, x.ptr<T>(), x.stride, lw.w.ptr<uint8_t>(), lw.w.stride,
                   lw.scale.ptr<float>(), lw.scale.stride, lw.scale_row_shift, out.ptr<O>(), out.stride, N,
                   lw.w.cols, bp, bt);
  };
  const char* inflight = std::getenv("QWEN_RT_FP8_GEMV_INFLIGHT");  // read at every call (the tests set it)
  const bool one = inflight && std::strcmp(inflight, "1") == 0;
  switch (x.rows) {
    case 1: one ? go(gemv_fp8_kernel<T, O, 1, EPI, 1>) : go(gemv_fp8_kernel<T, O, 1, EPI>); break;
    case 2: go(gemv_fp8_kernel<T, O, 2, EPI>); break;
    case 3: go(gemv_fp8_kernel<T, O, 3, EPI>); break;
    case 4: go(gemv_fp8_kernel<T, O, 4, EPI>); break;
    case 5: go(gemv_fp8_kernel<T, O, 5, EPI>); break;
    case 6: go(gemv_fp8_kernel<T, O, 6, EPI>); break;
    case 7: go(gemv_fp8_kernel<T, O, 7, EPI>); break;
    default: go(gemv_fp8_kernel<T, O, 8, EPI>); break;
  }
}

// ---- the tensor-core GEMV: 16-bit x, K a multiple of 128, up to kMmaRows rows ----
// A block of kMmaWarps warps owns 16 weight rows (gated: and the 16 rows N further) and splits K between its warps
// in whole 128-column scale blocks. A warp multiplies its columns of the 16 rows by up to 8 * NT x rows with
// mma.sync m16n8k16 (the weights converted to x's dtype in registers, exactly; fp32 accumulation); each 128-column
// block's products are summed alone, then scaled by that block's weight scales. Lane (g, t) = (lane / 4, lane % 4)
// reads 16 contiguous weights of rows g and g + 8 and the same 16 columns of x row g: the mma's k order is a
// permutation of the columns, the same for both operands. Each lane streams its own weights through a ring of
// stages in shared memory (cp.async: stages - 1 blocks in flight, no registers held, no barrier). The warps' sums
// meet in shared memory in a fixed order: row m's arithmetic depends neither on M nor on the other rows (batch
// invariance among M <= kMmaRows).
constexpr int kMmaWarps = 4;
constexpr int kMmaRows = 32;
// Ring stages: a stage is one 128-column block, 64 bytes a lane per 16-row tile.
constexpr int mma_stages(GemvEpilogue epi) { return epi == GemvEpilogue::SiluMul ? 4 : 6; }  // (measured: a73a211)
constexpr size_t mma_smem(GemvEpilogue epi) {
  return size_t(mma_stages(epi)) * (epi == GemvEpilogue::SiluMul ? 2 : 1) * 4 * 16 * kMmaWarps * 32;
}

// NT: 8-row tiles of x (M <= 8 * NT). Block i takes the 16-row tiles i, i + gridDim.x, ...: its warps' rings run on
// from one tile into the next (the grid may be persistent).
template <typename T, typename O, int NT, GemvEpilogue EPI>
__global__ void __launch_bounds__(kMmaWarps * 32)
    gemv_fp8_mma_kernel(const T* __restrict__ x, int64_t ldx, int M, const uint8_t* __restrict__ w, int64_t ldw,
                        const float* __restrict__ scale, int64_t lds, int shift, O* __restrict__ out, int64_t ldo,
                        int64_t N, int64_t K, const void* bias, DType bias_t) {
  constexpr bool GATED = EPI == GemvEpilogue::SiluMul;
  constexpr int R = GATED ? 2 : 1;  // 16-row tiles: rows n0 + [0, 16) (and n0 + N + [0, 16))
  constexpr int P = R * 4;          // a lane's 16-byte pieces per block: [tile][row g, g + 8][64-column half]
  constexpr int STAGES = mma_stages(EPI);
  extern __shared__ uint4 ring[];   // [stage][piece][thread]
  __shared__ float part[kMmaWarps][R][NT * 8][16];
  grid_release();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t tiles = (N + 15) / 16;
  const int blocks = int(K / kFp8Block), per = (blocks + kMmaWarps - 1) / kMmaWarps;
  const int b_begin = min(warp * per, blocks), b_end = min(b_begin + per, blocks), nb = b_end - b_begin;
  // Weight row h (0: g, 1: g + 8) of tile `tile`'s part r; the last tile's missing rows read row N - 1.
  auto wrow = [&](int64_t tile, int r, int h) { return min(tile * 16 + g + 8 * h, N - 1) + r * N; };
  // The warp's item i (its i-th block of weights: tile blockIdx.x + (i / nb) gridDim.x, block b_begin + i % nb)
  // into stage i % STAGES (nothing past its last tile), one commit group either way.
  auto issue = [&](int64_t i) {
    const int64_t tile = nb > 0 ? blockIdx.x + (i / nb) * int64_t(gridDim.x) : tiles;
    if (tile < tiles) {
      const int b = b_begin + int(i % nb);
      uint4* stage = ring + (i % STAGES) * P * (kMmaWarps * 32) + threadIdx.x;
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint8_t* src = w + wrow(tile, r, h) * ldw + 16 * t + int64_t(b) * kFp8Block;
#pragma unroll
          for (int c = 0; c < 2; ++c) cp_async16(stage + ((r * 2 + h) * 2 + c) * (kMmaWarps * 32), src + c * 64, true);
        }
    }
    cp_async_commit();
  };
  const T* xr[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) xr[j] = x + min(8 * j + g, M - 1) * ldx + 16 * t;  // rows past M read row M - 1
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue(s);  // weights: before the wait
  grid_wait();
  int64_t item = 0;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const float* sr[R][2];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int h = 0; h < 2; ++h) sr[r][h] = scale + (wrow(tile, r, h) >> shift) * lds;
    float acc[R][NT][4] = {};
    for (int b = b_begin; b < b_end; ++b, ++item) {
      uint4 xv[NT][2][2];  // [x tile][64-column half][16-byte piece]
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const uint4* xp = reinterpret_cast<const uint4*>(xr[j] + b * kFp8Block + c * 64);
          xv[j][c][0] = xp[0];
          xv[j][c][1] = xp[1];
        }
      cp_async_wait<STAGES - 2>();  // item `item` landed
      uint4 wv[P];
      const uint4* stage = ring + (item % STAGES) * P * (kMmaWarps * 32) + threadIdx.x;
#pragma unroll
      for (int i = 0; i < P; ++i) wv[i] = stage[i * (kMmaWarps * 32)];
      issue(item + STAGES - 1);  // into the stage item - 1 left
      float p[R][NT][4] = {};  // this item's products, scaled into acc after it
#pragma unroll
      for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int q = 0; q < 4; ++q)
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const uint32_t lo = word(wv[(r * 2 + 0) * 2 + c], q), hi = word(wv[(r * 2 + 1) * 2 + c], q);
            const uint32_t a0 = e4m3x2_to<T>(lo), a2 = e4m3x2_to<T>(lo >> 16);
            const uint32_t a1 = e4m3x2_to<T>(hi), a3 = e4m3x2_to<T>(hi >> 16);
#pragma unroll
            for (int j = 0; j < NT; ++j)
              mma16816<T>(p[r][j], a0, a1, a2, a3, word(xv[j][c][q >> 1], 2 * (q & 1)),
                          word(xv[j][c][q >> 1], 2 * (q & 1) + 1));
          }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float s0 = __ldg(sr[r][0] + b), s1 = __ldg(sr[r][1] + b);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          acc[r][j][0] = fmaf(p[r][j][0], s0, acc[r][j][0]);
          acc[r][j][1] = fmaf(p[r][j][1], s0, acc[r][j][1]);
          acc[r][j][2] = fmaf(p[r][j][2], s1, acc[r][j][2]);
          acc[r][j][3] = fmaf(p[r][j][3], s1, acc[r][j][3]);
        }
      }
    }
    // c[e] is (row g + 8 * (e / 2), x row 2t + e % 2) of the tile.
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) part[warp][r][8 * j + 2 * t + (e & 1)][g + 8 * (e >> 1)] = acc[r][j][e];
    __syncthreads();
    for (int i = threadIdx.x; i < NT * 8 * 16; i += kMmaWarps * 32) {
      const int m = i / 16, row = i % 16;
      const int64_t n = tile * 16 + row;
      if (m >= M || n >= N) continue;
      float v[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        v[r] = 0.f;
#pragma unroll
        for (int k = 0; k < kMmaWarps; ++k) v[r] += part[k][r][m][row];
      }
      gemv_store<T, O, EPI>(out + m * ldo + n, v[0], v[R - 1], bias, bias_t, n);
    }
    __syncthreads();  // part is read before the next tile writes it
  }
  cp_async_wait<0>();
}

// Blocks of the tensor-core GEMV's grid for `tiles` 16-row tiles: QWEN_RT_FP8_GEMV_BLOCKS=<n> (read at every call)
// blocks per SM at most (a persistent grid: each block walks several tiles), 0 or unset one block per tile.
template <typename Kernel>
unsigned mma_grid(Kernel kernel, int64_t tiles, size_t smem) {
  const char* e = std::getenv("QWEN_RT_FP8_GEMV_BLOCKS");
  const int per_sm = e ? std::max(0, std::atoi(e)) : 0;
  if (per_sm == 0) return unsigned(tiles);
  int dev = 0, sms = 0, fit = 0;
  check(cudaGetDevice(&dev), "fp8 gemv (device)");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "fp8 gemv (SMs)");
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, kMmaWarps * 32, smem), "fp8 gemv (occupancy)");
  return unsigned(std::min<int64_t>(tiles, int64_t(sms) * std::max(1, std::min(per_sm, fit))));
}

template <typename T, typename O, GemvEpilogue EPI>
void launch_gemv_mma(const Tensor& x, const Linear& lw, int64_t N, const Tensor* bias, Tensor& out, cudaStream_t s) {
  const void* bp = bias ? bias->data : nullptr;
  const DType bt = bias ? bias->dtype : DType::F32;
  constexpr size_t smem = mma_smem(EPI);
  auto go = [&](auto kernel) {
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
          "fp8 gemv (smem attribute)");
    launch_chained(kernel, mma_grid(kernel, (N + 15) / 16, smem), kMmaWarps * 32, smem, s, x.ptr<T>(), x.stride,
                   int(x.rows), lw.w.ptr<uint8_t>(), lw.w.stride, lw.scale.ptr<float>(), lw.scale.stride,
                   lw.scale_row_shift, out.ptr<O>(), out.stride, N, lw.w.cols, bp, bt);
  };
  if (x.rows <= 8) go(gemv_fp8_mma_kernel<T, O, 1, EPI>);
  else if (x.rows <= 16) go(gemv_fp8_mma_kernel<T, O, 2, EPI>);
  else go(gemv_fp8_mma_kernel<T, O, 4, EPI>);
}

// Rows [n0, n0 + dst.rows) of w dequantized into dst (fp32 products, rounded to dst's dtype).
template <typename O>
__global__ void dequantize_fp8_kernel(const uint8_t* __restrict__ w, int64_t ldw, const float* __restrict__ scale,
                                      int64_t lds, int shift, int64_t n0, int64_t K, O* __restrict__ dst,
                                      int64_t ldd) {
  const int64_t r = blockIdx.x, row = n0 + r;
  const uint8_t* src = w + row * ldw;
  const float* sc = scale + (row >> shift) * lds;
  for (int64_t k = threadIdx.x; k < K; k += blockDim.x)
    dst[r * ldd + k] = from_f<O>(__fmul_rn(fp8_value(src[k]), sc[k >> 7]));
}

// One 128 x 128 block per thread block: its amax, s = amax / 448 (1 for a zero block), q = e4m3(src / s).
__global__ void quantize_fp8_kernel(const void* __restrict__ src, DType st, int64_t lds, int64_t R, int64_t C,
                                    uint8_t* __restrict__ q, int64_t ldq, float* __restrict__ scale,
                                    int64_t ldsc) {
  const int64_t r0 = int64_t(blockIdx.y) * kFp8Block, c0 = int64_t(blockIdx.x) * kFp8Block;
  const int64_t rows = min(int64_t(kFp8Block), R - r0), cols = min(int64_t(kFp8Block), C - c0);
  float amax = 0.f;
  for (int64_t i = threadIdx.x; i < rows * kFp8Block; i += blockDim.x) {
    const int64_t r = i / kFp8Block, c = i % kFp8Block;
    if (c < cols) amax = fmaxf(amax, fabsf(load_any(src, st, (r0 + r) * lds + c0 + c)));
  }
  __shared__ float red[kWarps];
  amax = warp_max(amax);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
  __syncthreads();
  amax = 0.f;
#pragma unroll
  for (int i = 0; i < kWarps; ++i) amax = fmaxf(amax, red[i]);
  const float s = amax > 0.f ? __fdiv_rn(amax, 448.0f) : 1.0f;
  if (threadIdx.x == 0) scale[blockIdx.y * ldsc + blockIdx.x] = s;
  for (int64_t i = threadIdx.x; i < rows * kFp8Block; i += blockDim.x) {
    const int64_t r = i / kFp8Block, c = i % kFp8Block;
    if (c < cols) {
      const float v = __fdiv_rn(load_any(src, st, (r0 + r) * lds + c0 + c), s);
      q[(r0 + r) * ldq + c0 + c] = uint8_t(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
    }
  }
}

}  // namespace

void check_fp8_linear(const Linear& lw) {
  const Tensor& w = lw.w;
  QRT_CHECK(w.dtype == DType::F8E4M3 && lw.scale.dtype == DType::F32, "cuda linear: FP8 weights must be ",
            "float8_e4m3 with float32 scales, got ", dtype_name(w.dtype), " and ", dtype_name(lw.scale.dtype));
  QRT_CHECK(lw.scale_row_shift >= 0 && lw.scale_row_shift <= 7, "cuda linear: scale_row_shift ",
            lw.scale_row_shift, " is not in [0, 7]");
  const int64_t rows = w.rows ? ((w.rows - 1) >> lw.scale_row_shift) + 1 : 0;
  const int64_t cols = (w.cols + kFp8Block - 1) / kFp8Block;
  QRT_CHECK(lw.scale.rows >= rows && lw.scale.cols >= cols, "cuda linear: FP8 scales [", lw.scale.rows, ", ",
            lw.scale.cols, "] for weights [", w.rows, ", ", w.cols, "] need [", rows, ", ", cols, "]");
}

// Whether the tensor-core GEMV takes x and w (16-bit x, whole 128-column blocks).
bool gemv_fp8_mma(const Tensor& x, const Linear& lw) { return x.dtype != DType::F32 && lw.w.cols % kFp8Block == 0; }

int gemv_fp8_rows(const Tensor& x, const Linear& lw, bool w8a8) {
  return gemv_fp8_mma(x, lw) ? kMmaRows : w8a8 ? 4 : 8;
}

bool launch_gemv_fp8(const Tensor& x, const Linear& lw, const Tensor* bias, Tensor& out, GemvEpilogue epi,
                     int max_rows, cudaStream_t s) {
  const Tensor& w = lw.w;
  const int64_t xes = int64_t(dtype_size(x.dtype));
  // QWEN_RT_FP8_GEMV_MMA_FROM=<rows> (read at every call, default 2): the tensor-core form from that many rows, the
  // CUDA-core form below it (Qwen3.8-27B FP8 decode on the H100 at 1 row: 11.6 ms a step against 12.6).
  const char* from = std::getenv("QWEN_RT_FP8_GEMV_MMA_FROM");
  const bool mma = gemv_fp8_mma(x, lw) && x.rows >= (from ? std::atoi(from) : 2);
  // QWEN_RT_GEMV_ROWS (read at every call) overrides max_rows as for the 16-bit GEMV (0: every FP8 linear to the
  // GEMMs).
  const char* e = std::getenv("QWEN_RT_GEMV_ROWS");
  const int rows = std::clamp(e ? std::atoi(e) : max_rows, 0, mma ? kMmaRows : 8);
  if (x.rows < 1 || x.rows > rows || w.cols % 16 != 0 || !aligned16(w.data, w.stride) ||
      !aligned16(x.data, x.stride * xes))
    return false;
  switch (epi) {
    case GemvEpilogue::Store:
      if (out.dtype != x.dtype && out.dtype != DType::F32) return false;
      break;
    case GemvEpilogue::Add:
      if (out.dtype != x.dtype || bias) return false;
      break;
    case GemvEpilogue::SiluMul:
      if (out.dtype != x.dtype || bias || w.rows != 2 * out.cols) return false;
      break;
  }
  auto go = [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto out_tag, auto epi_tag, int64_t N, const Tensor* b) {
      using O = decltype(out_tag);
      constexpr GemvEpilogue EPI = decltype(epi_tag)::value;
      if constexpr (!std::is_same_v<T, float>)
        if (mma) return launch_gemv_mma<T, O, EPI>(x, lw, N, b, out, s);
      launch_gemv_m<T, O, EPI>(x, lw, N, b, out, s);
    };
    using Store = std::integral_constant<GemvEpilogue, GemvEpilogue::Store>;
    using Add = std::integral_constant<GemvEpilogue, GemvEpilogue::Add>;
    using SiluMul = std::integral_constant<GemvEpilogue, GemvEpilogue::SiluMul>;
    switch (epi) {
      case GemvEpilogue::Store:
        if (out.dtype == DType::F32) launch(float(), Store(), w.rows, bias);
        else launch(T(), Store(), w.rows, bias);
        break;
      case GemvEpilogue::Add: launch(T(), Add(), w.rows, nullptr); break;
      case GemvEpilogue::SiluMul: launch(T(), SiluMul(), out.cols, nullptr); break;
    }
  };
  dispatch_act(x.dtype, "fp8 gemv", go);
  check_launch("fp8 gemv");
  return true;
}

void launch_dequantize_fp8(const Linear& lw, int64_t n0, Tensor& dst, cudaStream_t s) {
  QRT_CHECK(dst.cols == lw.w.cols && n0 >= 0 && n0 + dst.rows <= lw.w.rows, "cuda dequantize_fp8: rows [", n0, ", ",
            n0 + dst.rows, ") of [", lw.w.rows, ", ", lw.w.cols, "] into [", dst.rows, ", ", dst.cols, "]");
  if (dst.rows == 0) return;
  dispatch_act(dst.dtype, "dequantize_fp8", [&](auto tag) {
    using O = decltype(tag);
    dequantize_fp8_kernel<O><<<unsigned(dst.rows), kThreads, 0, s>>>(
        lw.w.ptr<uint8_t>(), lw.w.stride, lw.scale.ptr<float>(), lw.scale.stride, lw.scale_row_shift, n0, lw.w.cols,
        dst.ptr<O>(), dst.stride);
  });
  check_launch("dequantize_fp8");
}

namespace {

// Warp (row m, group g of 128 columns): s = amax / 448 (1 for an all-zero group), q = e4m3(x / s), rounded to
// nearest even and saturated; the scale at scale[m * s_row + g * s_group].
template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_rows_kernel(const T* __restrict__ x, int64_t ldx, int64_t M,
                                                                 int64_t K, uint8_t* __restrict__ q, int64_t ldq,
                                                                 float* __restrict__ scale, int64_t s_row,
                                                                 int64_t s_group) {
  grid_release();
  grid_wait();
  const int64_t task = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const int64_t groups = (K + kFp8Block - 1) / kFp8Block;
  if (task >= M * groups) return;
  const int64_t m = task / groups, g = task % groups;
  const int lane = threadIdx.x & 31;
  float v[kFp8Block / 32], amax = 0.f;
#pragma unroll
  for (int j = 0; j < kFp8Block / 32; ++j) {
    const int64_t c = g * kFp8Block + lane + 32 * j;
    v[j] = c < K ? to_f(x[m * ldx + c]) : 0.f;
    amax = fmaxf(amax, fabsf(v[j]));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float sc = amax > 0.f ? amax / 448.0f : 1.0f;
#pragma unroll
  for (int j = 0; j < kFp8Block / 32; ++j) {
    const int64_t c = g * kFp8Block + lane + 32 * j;
    if (c < K) q[m * ldq + c] = __nv_cvt_float_to_fp8(v[j] / sc, __NV_SATFINITE, __NV_E4M3);
  }
  if (lane == 0) scale[m * s_row + g * s_group] = sc;
}

// dst[c * R + r] = src[r * lds + c]: a scale grid transposed.
__global__ void transpose_f32_kernel(const float* __restrict__ src, int64_t R, int64_t C, int64_t lds,
                                     float* __restrict__ dst) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= R * C) return;
  const int64_t r = i % R, c = i / R;
  dst[c * R + r] = src[r * lds + c];
}

}  // namespace

void launch_transpose_scales(const Tensor& src, float* dst, cudaStream_t s) {
  transpose_f32_kernel<<<ceil_div(src.rows * src.cols, 256), 256, 0, s>>>(src.ptr<float>(), src.rows, src.cols,
                                                                           src.stride, dst);
  check_launch("fp8 scale transpose");
}

void launch_quantize_rows_fp8(const Tensor& x, uint8_t* q, float* scale, int64_t s_row, int64_t s_group,
                              cudaStream_t s) {
  check_act(x, "fp8 activation quantization");
  const int64_t tasks = x.rows * ((x.cols + kFp8Block - 1) / kFp8Block);
  if (tasks == 0) return;
  dispatch_act(x.dtype, "fp8 activation quantization", [&](auto tag) {
    using T = decltype(tag);
    launch_chained(quantize_rows_kernel<T>, ceil_div(tasks, kWarps), kThreads, 0, s, x.ptr<T>(), x.stride, x.rows,
                   x.cols, q, x.cols, scale, s_row, s_group);
  });
  check_launch("fp8 activation quantization");
}

void launch_quantize_fp8(const Tensor& src, Tensor& q, Tensor& scale, cudaStream_t s) {
  const int64_t R = src.rows, C = src.cols, B = kFp8Block;
  QRT_CHECK(q.dtype == DType::F8E4M3 && q.rows == R && q.cols == C, "cuda quantize_fp8: q must be float8_e4m3 [", R,
            ", ", C, "]");
  QRT_CHECK(scale.dtype == DType::F32 && scale.rows == (R + B - 1) / B && scale.cols == (C + B - 1) / B,
            "cuda quantize_fp8: scale must be float32 [", (R + B - 1) / B, ", ", (C + B - 1) / B, "]");
  check_act(src, "quantize_fp8");
  if (R == 0 || C == 0) return;
  quantize_fp8_kernel<<<dim3(ceil_div(C, B), ceil_div(R, B)), kThreads, 0, s>>>(
      src.data, src.dtype, src.stride, R, C, q.ptr<uint8_t>(), q.stride, scale.ptr<float>(), scale.stride);
  check_launch("quantize_fp8");
}

}  // namespace qrt::cuda
