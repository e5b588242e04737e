// GEMV for few-row linears (decode): out[m, n] = x[m, :] . w[n, :] (+ bias[n]) for m < M <= 8, 16-bit
// x and w of the same dtype; fp32 accumulation.
// Layout: a weight row is streamed by one warp (rows of at most kShortRow = 3072 elements) or by two warps, each
// a contiguous half of it, in 16-byte pieces (several in flight per lane, read past L1) against the same pieces
// of every x row; a block of 8 warps takes a row group of 8 weight rows (one warp per row) or 4 (two). The grid is
// persistent (QWEN_RT_GEMV_BLOCKS blocks per SM, default 4: one resident wave, so a chained kernel after it finds
// room as soon as a block exits, walk the row groups), and a warp loads the first pieces of its next row before it
// finishes the current one, so the weight stream does not pause between rows or blocks. Two halves meet in
// shared memory in a fixed order: the arithmetic of row m does not depend on M or on the grid (batch
// invariance among M <= 8; with a folded norm too). Measured on the H200 (tools/gemv_study.cu, Qwen3-8B's 144
// GEMVs of a step, rows of 4096 and 12288, before short rows took one warp): one warp per row with cached loads
// 3.64 TB/s, two warps per row with loads past L1 4.02 TB/s (4.18 with chained launches).
// Chained launches with a one-wave grid: Qwen3-8B batch 1 4.137 ms per step against 4.452 unchained with
// 8 blocks per SM (two waves) and 4.417 unchained with 4.
// Epilogues: Store; Add (out += the product rounded to out's dtype, what linear then add gives); SiluMul
// (warp n also streams row n + N and writes silu(g) * u of the two rounded results, what linear then
// silu_mul gives).
// Folded norm (norm_linear with RmsNorm::unit_gain: the gain is already in w): each block first sums the
// squares of the x rows (every thread a fixed set of pieces, the warps' sums added in a fixed order), and
// the dot products are scaled by 1/rms at the end (the normalized rows are not rounded to x's dtype); the
// streaming loop is the plain one. A norm with a gain runs as the composition (rms_norm, then the GEMV).
// Measured before (gain and sums of squares inside the streaming loop, 1-2 rows): Qwen3-8B batch 1 q|k|v
// GEMV 19.3 us against 13.7 us without a norm (profile at 9335681).
// Short rows (K <= kShortRow): one warp per row (a whole K = 1024 row is one round of 4 pieces per lane), no
// meeting in shared memory and no block barrier per group, so each warp streams on by itself. (Session 12
// before this: K < 2048 rows with 2 pieces per lane per round took Qwen3-0.6B batch 1 from 0.830 to 0.78 ms;
// with 4, a K = 1024 row half had no whole round and was read piece by piece.) Qwen3-0.6B batch 1 0.742-0.750
// against 0.789-0.790 ms, batch 2 0.866-0.871 against 0.914-0.920 (session 13, two alternated rounds).
// Tried and left out by measurement: staging x (x * gain with a norm) in shared memory once per block
// (Qwen3-8B batch 1: 5.2 against 4.7 ms per step). QWEN_RT_NORM_GEMV=off turns the folding off.
// QWEN_RT_GEMV_BLOCKS=<n> sets the blocks per SM (default 4; 0: one block per row group, not persistent), at most
// as many as fit (the registers of 3-8 rows fit 1-2 blocks: a larger grid ran its last blocks after the first wave;
// session 32, not yet measured).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <unordered_map>

#include "backend/cuda/cuda_common.cuh"

namespace qrt::cuda {
namespace {

constexpr int kThreads = 256;  // 8 warps
// Warps per weight row: 2 for long rows (two halves meet in shared memory), 1 for rows of at most
// kShortRow elements (each warp a whole row: no meeting, no block barrier per group of rows).
constexpr int kShortRow = 3072;
constexpr int warps_per_row(int64_t K) { return K <= kShortRow ? 1 : 2; }
__host__ __device__ constexpr int rows_per_group(int wpr) { return kThreads / 32 / wpr; }

// Blocks of the persistent grid for `groups` row groups on a device of num_sms SMs, where `resident` blocks of the
// kernel fit an SM: at most one wave (a grid of 4 an SM where 1-3 fit left a quarter or more of the row groups to
// blocks that start only as the first wave ends: at 3+ rows the registers fit 1-2 blocks).
int64_t grid_blocks(int64_t groups, int num_sms, int resident) {
  static const int per_sm = [] {
    const char* e = std::getenv("QWEN_RT_GEMV_BLOCKS");
    return e ? std::atoi(e) : 4;
  }();
  if (per_sm <= 0) return groups;
  return std::min<int64_t>(groups, int64_t(num_sms) * std::max(1, std::min(per_sm, resident)));
}

// Blocks of `kernel` that fit an SM (asked once per kernel; the launches of every rank's thread share the answers).
int resident_blocks(const void* kernel) {
  static std::mutex mu;
  static std::unordered_map<const void*, int> fit;
  std::lock_guard<std::mutex> lk(mu);
  auto it = fit.find(kernel);
  if (it != fit.end()) return it->second;
  int n = 0;
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0), "gemv (occupancy)");
  return fit[kernel] = n;
}


template <typename T> struct Pair;
template <> struct Pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ float2 f2(type v) { return __bfloat1622float2(v); }
};
template <> struct Pair<__half> {
  using type = __half2;
  static __device__ __forceinline__ float2 f2(type v) { return __half22float2(v); }
};

// 8 elements (16 bytes) of x against 8 of w, accumulated pairwise in a fixed order.
template <typename T>
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b) {
  using P = Pair<T>;
  const typename P::type* pa = reinterpret_cast<const typename P::type*>(&a);
  const typename P::type* pb = reinterpret_cast<const typename P::type*>(&b);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 u = P::f2(pa[i]), v = P::f2(pb[i]);
    s = fmaf(u.x, v.x, s);
    s = fmaf(u.y, v.y, s);
  }
  return s;
}

struct NormArgs {
  float eps = 0.f;
};

// Resident blocks per SM asked of the register allocator: 4 at one row, 3 at two (the measured setting).
constexpr int min_blocks(int M) { return M == 1 ? 4 : M == 2 ? 3 : 1; }

// WPR: warps per weight row (warps_per_row(K)).
template <typename T, typename O, int M, GemvEpilogue EPI, bool NORM, int WPR>
__global__ void __launch_bounds__(kThreads, min_blocks(M))
    gemv_kernel(const T* __restrict__ x, int64_t ldx, const T* __restrict__ w, int64_t ldw, O* __restrict__ out,
                int64_t ldo, int64_t N, int64_t K, const void* bias, DType bias_t, NormArgs nm) {
  constexpr bool GATED = EPI == GemvEpilogue::SiluMul;
  constexpr int R = GATED ? 2 : 1;  // weight rows per warp: n (and n + N)
  constexpr int U = GATED ? 2 : 4;  // pieces in flight per lane and weight row
  constexpr int kWarps = kThreads / 32;
  constexpr int kRowsPerGroup = rows_per_group(WPR);
  __shared__ float part[kWarps][R][M], part_ss[kWarps][M];
  grid_release();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = warp / WPR, half = warp % WPR;
  const int chunks = int(K / 8);  // 16-byte pieces per row
  const int lo = WPR == 1 ? 0 : half * (chunks / 2);
  const int len = WPR == 1 ? chunks : half == 0 ? chunks / 2 : chunks - chunks / 2;
  const int groups = int((N + kRowsPerGroup - 1) / kRowsPerGroup);
  // This warp's part (the whole row, or a half) of weight row n (and n + N) of group g; the last group's
  // missing rows read row N - 1.
  auto locate = [&](int g, const uint4* (&p)[R]) {
    const int64_t n = g * kRowsPerGroup + row < N ? g * kRowsPerGroup + row : N - 1;
#pragma unroll
    for (int r = 0; r < R; ++r) p[r] = reinterpret_cast<const uint4*>(w + (n + r * N) * ldw) + lo;
  };
  auto load = [&](const uint4* const (&p)[R], int c0, uint4 (&dst)[R][U]) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int u = 0; u < U; ++u) dst[r][u] = load_weight(p[r] + c0 + 32 * u);
  };
  auto full = [&](int c0) { return c0 + 32 * (U - 1) < len; };  // U whole pieces from c0 on
  int g = blockIdx.x;
  const uint4* wr[R];
  locate(g, wr);
  // wv holds the pieces at lane of the current row when full(lane): the first group's load before
  // grid_wait (weights are never written) overlaps the previous kernel's tail.
  uint4 wv[R][U];
  if (g < groups && full(lane)) load(wr, lane, wv);
  grid_wait();
  // NORM: 1/rms of x row `lane` (lane < M), the same arithmetic whatever M and the grid.
  float inv_rms = 1.0f;
  if constexpr (NORM) {
    float ss[M];
#pragma unroll
    for (int m = 0; m < M; ++m) ss[m] = 0.f;
    for (int p = threadIdx.x; p < chunks; p += kThreads)
#pragma unroll
      for (int m = 0; m < M; ++m) {
        Vec16<T> xv;
        xv.load(x + m * ldx + int64_t(p) * 8);
#pragma unroll
        for (int k = 0; k < 8; ++k) ss[m] = fmaf(xv.f[k], xv.f[k], ss[m]);
      }
#pragma unroll
    for (int m = 0; m < M; ++m) {
      ss[m] = warp_sum(ss[m]);
      if (lane == 0) part_ss[warp][m] = ss[m];
    }
    __syncthreads();
    if (lane < M) {
      float t = 0.f;
#pragma unroll
      for (int w8 = 0; w8 < kWarps; ++w8) t += part_ss[w8][lane];
      inv_rms = 1.0f / sqrtf(t / float(K) + nm.eps);
    }
  }
  for (; g < groups; g += gridDim.x) {
    float acc[R][M];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r][m] = 0.f;
    // One piece (index within this half) of every x row against the weight pieces wp[r].
    auto multiply = [&](int c, const uint4 (&wp)[R]) {
      const int piece = lo + c;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + m * ldx) + piece);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r][m] += dot8<T>(xv, wp[r]);
      }
    };
    auto multiply_all = [&](int c0, const uint4 (&v)[R][U]) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        uint4 wp[R];
#pragma unroll
        for (int r = 0; r < R; ++r) wp[r] = v[r][u];
        multiply(c0 + 32 * u, wp);
      }
    };
    // Whole rounds of U pieces; each loads the next round (or the next group's first round) before it
    // multiplies its own.
    const int gn = g + int(gridDim.x);
    uint4 nx[R][U];
    int c = lane;
    if (full(c)) {
      for (;;) {
        const int cn = c + 32 * U;
        const bool more = full(cn);
        if (more) {
          load(wr, cn, nx);
        } else if (gn < groups) {
          const uint4* wn[R];
          locate(gn, wn);
          load(wn, lane, nx);
        }
        multiply_all(c, wv);
        c = cn;
        if (!more) break;
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int u = 0; u < U; ++u) wv[r][u] = nx[r][u];
      }
    }
    for (; c < len; c += 32) {  // the pieces left over (fewer than U per lane)
      uint4 wp[R];
#pragma unroll
      for (int r = 0; r < R; ++r) wp[r] = load_weight(wr[r] + c);
      multiply(c, wp);
    }
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r][m] = warp_sum(acc[r][m]);
    const int64_t n = int64_t(g) * kRowsPerGroup + row;
    // The row's result for x row m: the epilogue.
    auto write = [&](int m, float s, float s_up) {
      gemv_store<T, O, EPI>(out + m * ldo + n, s, s_up, bias, bias_t, n);
    };
    if constexpr (WPR == 1) {  // the warp holds the whole row: lane m < M writes x row m's result
      if (lane < M && n < N) {
        float s = 0.f, s_up = 0.f;
#pragma unroll
        for (int m = 0; m < M; ++m)
          if (m == lane) s = acc[0][m], s_up = acc[R - 1][m];
        write(lane, s * inv_rms, s_up * inv_rms);
      }
    } else {  // the two halves meet in shared memory; warp half 0 adds them (in that order) and writes
      if (lane == 0) {
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
          for (int r = 0; r < R; ++r) part[warp][r][m] = acc[r][m];
      }
      __syncthreads();
      if (half == 0 && lane < M && n < N) {
        const int m = lane, o0 = warp, o1 = warp + 1;
        write(m, (part[o0][0][m] + part[o1][0][m]) * inv_rms, (part[o0][R - 1][m] + part[o1][R - 1][m]) * inv_rms);
      }
      __syncthreads();
    }
    locate(gn, wr);
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int u = 0; u < U; ++u) wv[r][u] = nx[r][u];
  }
}

// N: output columns (for the gated form, half the weight rows).
template <typename T, typename O, GemvEpilogue EPI, bool NORM>
void launch_m(int M, const Tensor& x, const Tensor& w, int64_t N, const Tensor* bias, Tensor& out, const NormArgs& nm,
              int num_sms, cudaStream_t s) {
  const void* bp = bias ? bias->data : nullptr;
  const DType bt = bias ? bias->dtype : DType::F32;
  auto go = [&](auto wpr, auto kernel) {
    constexpr int kRows = rows_per_group(decltype(wpr)::value);
    const int fit = resident_blocks(reinterpret_cast<const void*>(kernel));
    const unsigned blocks = unsigned(grid_blocks((N + kRows - 1) / kRows, num_sms, fit));
    launch_chained(kernel, blocks, kThreads, 0, s, x.ptr<T>(), x.stride, w.ptr<T>(), w.stride, out.ptr<O>(),
                   out.stride, N, w.cols, bp, bt, nm);
  };
  auto with_wpr = [&](auto wpr) {
    constexpr int W = decltype(wpr)::value;
    switch (M) {
      case 1: go(wpr, gemv_kernel<T, O, 1, EPI, NORM, W>); break;
      case 2: go(wpr, gemv_kernel<T, O, 2, EPI, NORM, W>); break;
      case 3: go(wpr, gemv_kernel<T, O, 3, EPI, NORM, W>); break;
      case 4: go(wpr, gemv_kernel<T, O, 4, EPI, NORM, W>); break;
      case 5: go(wpr, gemv_kernel<T, O, 5, EPI, NORM, W>); break;
      case 6: go(wpr, gemv_kernel<T, O, 6, EPI, NORM, W>); break;
      case 7: go(wpr, gemv_kernel<T, O, 7, EPI, NORM, W>); break;
      default: go(wpr, gemv_kernel<T, O, 8, EPI, NORM, W>); break;
    }
  };
  if (warps_per_row(w.cols) == 1) with_wpr(std::integral_constant<int, 1>{});
  else with_wpr(std::integral_constant<int, 2>{});
}

// The instantiations that exist: Store and the normed Store to T or F32 (logits), Add and SiluMul (with or
// without norm) to T.
template <typename T, bool NORM>
void launch_t(int M, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out, GemvEpilogue epi,
              const NormArgs& nm, int num_sms, cudaStream_t s) {
  switch (epi) {
    case GemvEpilogue::Store:
      if (out.dtype == DType::F32) launch_m<T, float, GemvEpilogue::Store, NORM>(M, x, w, w.rows, bias, out, nm, num_sms, s);
      else launch_m<T, T, GemvEpilogue::Store, NORM>(M, x, w, w.rows, bias, out, nm, num_sms, s);
      break;
    case GemvEpilogue::Add:
      if constexpr (!NORM) launch_m<T, T, GemvEpilogue::Add, NORM>(M, x, w, w.rows, bias, out, nm, num_sms, s);
      break;
    case GemvEpilogue::SiluMul:
      launch_m<T, T, GemvEpilogue::SiluMul, NORM>(M, x, w, out.cols, nullptr, out, nm, num_sms, s);
      break;
  }
}

}  // namespace

bool gemv_folds_norms() {
  static const bool on = [] {
    const char* e = std::getenv("QWEN_RT_NORM_GEMV");
    return !(e && std::strcmp(e, "off") == 0);
  }();
  return on;
}

// The most rows a GEMV takes for rows of K elements; more go to cuBLASLt (with the norm and silu_mul as their
// own kernels). Rows of more than kShortRow (3072): 1 (Qwen2.5-7B's 3584 and up). On the H200 cuBLASLt ran Qwen3-8B decode
// steps of batch 2 / 4 / 8 in 4.78 / 5.32 / 5.04 ms, against 5.76 ms at batch 4 for this GEMV (and 5.03 /
// 5.55-5.67 / 5.91 for a tensor-core GEMV, tried and left out: docs/PERFORMANCE_HISTORY.md, session 8). Up to kShortRow: 4,
// the range measured: Qwen3-0.6B (K 1024 to 3072), whose products are a few MB and whose step is kernel
// latency, ran batch 2 / 4 / 8 in 0.79-0.92 / 1.14 / 2.0-2.3 ms with the GEMV against 1.16-1.36 / 1.06-1.26 /
// 1.10-1.50 with cuBLASLt (session 12).
// QWEN_RT_GEMV_ROWS=<n> (up to 8) sets it for every K; read at every call, so the op tests can set it.
int gemv_max_rows(int64_t K) {
  const char* e = std::getenv("QWEN_RT_GEMV_ROWS");
  return e ? std::clamp(std::atoi(e), 0, 8) : K <= kShortRow ? 4 : 1;
}

bool launch_gemv(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out, GemvEpilogue epi,
                 const RmsNorm* norm, int num_sms, cudaStream_t s) {
  const bool sixteen = x.dtype == w.dtype && (x.dtype == DType::BF16 || x.dtype == DType::F16);
  if (!sixteen || x.rows < 1 || x.rows > gemv_max_rows(w.cols) || w.cols % 8 != 0 || !aligned16(x.data, x.stride * 2) ||
      !aligned16(w.data, w.stride * 2))
    return false;
  switch (epi) {
    case GemvEpilogue::Store:
      if (out.dtype != x.dtype && out.dtype != DType::F32) return false;
      break;
    case GemvEpilogue::Add:
      if (out.dtype != x.dtype || bias || norm) return false;
      break;
    case GemvEpilogue::SiluMul:
      if (out.dtype != x.dtype || bias || w.rows != 2 * out.cols) return false;
      break;
  }
  NormArgs nm;
  if (norm) {
    if (!gemv_folds_norms() || !norm->unit_gain) return false;
    nm = NormArgs{norm->eps};
  }
  const int M = int(x.rows);
  auto go = [&](auto tag) {
    using T = decltype(tag);
    if (norm) launch_t<T, true>(M, x, w, bias, out, epi, nm, num_sms, s);
    else launch_t<T, false>(M, x, w, bias, out, epi, nm, num_sms, s);
  };
  if (x.dtype == DType::BF16) go(__nv_bfloat16{});
  else go(__half{});
  check_launch("gemv");
  return true;
}

}  // namespace qrt::cuda
