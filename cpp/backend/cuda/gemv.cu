// GEMV for few-row linears (decode): out[m, n] = x[m, :] . w[n, :] (+ bias[n]) for m < M <= 8, 16-bit
// x and w of the same dtype. One warp per output column; each lane streams 16-byte pieces of the weight
// row (several in flight) and multiplies them with the same pieces of every x row; fp32 accumulation.
// The arithmetic of row m does not depend on M (batch invariance among M <= 8; with a folded norm, among
// M <= kNormMaxRows).
// Epilogues: Store; Add (out += the product rounded to out's dtype, what linear then add gives); SiluMul
// (warp n also streams row n + N and writes silu(g) * u of the two rounded results, what linear then
// silu_mul gives).
// Folded norm (norm_linear, M <= kNormMaxRows): each warp takes the sum of squares of the x rows as it
// streams them, multiplies x by the gain on the fly and scales its dot products by 1/rms at the end (the
// normalized rows are not rounded to x's dtype). Beyond kNormMaxRows the extra arithmetic per weight
// piece costs more than a separate rms_norm (measured at M = 4 on the H200: 8.76 against 6.92 ms per
// Qwen3-8B step), so the composition runs. QWEN_RT_NORM_GEMV=off turns the folding off.
#include <cstdlib>
#include <cstring>

#include "backend/cuda/cuda_common.cuh"

namespace qrt::cuda {
namespace {

constexpr int kThreads = 256;  // 8 warps, 8 output columns per block
constexpr int kNormMaxRows = 2;

bool norm_folding() {
  static const bool on = [] {
    const char* e = std::getenv("QWEN_RT_NORM_GEMV");
    return !(e && std::strcmp(e, "off") == 0);
  }();
  return on;
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

// 8 fp32 values of x against 8 elements of w.
template <typename T>
__device__ __forceinline__ float dot8f(const float* a, const uint4& b) {
  using P = Pair<T>;
  const typename P::type* pb = reinterpret_cast<const typename P::type*>(&b);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = P::f2(pb[i]);
    s = fmaf(a[2 * i], v.x, s);
    s = fmaf(a[2 * i + 1], v.y, s);
  }
  return s;
}

struct NormArgs {
  const float* w = nullptr;  // the gain, fp32
  float eps = 0.f;
  bool zc = false;
};

template <typename T, typename O, int M, GemvEpilogue EPI, bool NORM>
__global__ void __launch_bounds__(kThreads) gemv_kernel(const T* __restrict__ x, int64_t ldx, const T* __restrict__ w,
                                                        int64_t ldw, O* __restrict__ out, int64_t ldo, int64_t N,
                                                        int64_t K, const void* bias, DType bias_t, NormArgs nm) {
  constexpr bool GATED = EPI == GemvEpilogue::SiluMul;
  constexpr int R = GATED ? 2 : 1;  // weight rows per warp: n (and n + N)
  grid_release();
  const int64_t n = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (n >= N) return;
  const int lane = threadIdx.x & 31;
  const uint4* wr[R];
#pragma unroll
  for (int r = 0; r < R; ++r) wr[r] = reinterpret_cast<const uint4*>(w + (n + r * N) * ldw);
  const int64_t chunks = K / 8;  // 16-byte pieces per row
  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
  constexpr int U = GATED ? 2 : 4;  // pieces in flight per lane and weight row
  // The first pieces load before grid_wait (weights are never written), overlapping the previous
  // kernel's tail; then each iteration multiplies its pieces and loads the next.
  uint4 wv[R][U];
  auto load_w = [&](int64_t c0) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int u = 0; u < U; ++u) wv[r][u] = __ldg(wr[r] + c0 + 32 * u);
  };
  auto full = [&](int64_t c0) { return c0 + 32 * (U - 1) < chunks; };
  int64_t c = lane;
  if (full(c)) load_w(c);
  grid_wait();
  float ss[M];  // NORM: sum of squares of row m
#pragma unroll
  for (int m = 0; m < M; ++m) ss[m] = 0.f;
  // One piece of every x row against the weight pieces wp[r].
  auto multiply = [&](int64_t piece, const uint4 (&wp)[R]) {
    if constexpr (NORM) {
      const float4* gp = reinterpret_cast<const float4*>(nm.w + piece * 8);
      const float4 g0 = __ldg(gp), g1 = __ldg(gp + 1);
      float g[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
      if (nm.zc)
#pragma unroll
        for (int k = 0; k < 8; ++k) g[k] += 1.0f;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        Vec16<T> xv;
        xv.load(x + m * ldx + piece * 8);
        float xg[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          ss[m] = fmaf(xv.f[k], xv.f[k], ss[m]);
          xg[k] = xv.f[k] * g[k];
        }
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r][m] += dot8f<T>(xg, wp[r]);
      }
    } else {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + m * ldx) + piece);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r][m] += dot8<T>(xv, wp[r]);
      }
    }
  };
  while (full(c)) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      uint4 wp[R];
#pragma unroll
      for (int r = 0; r < R; ++r) wp[r] = wv[r][u];
      multiply(c + 32 * u, wp);
    }
    c += 32 * U;
    if (full(c)) load_w(c);
  }
  for (; c < chunks; c += 32) {
    uint4 wt[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wt[r] = __ldg(wr[r] + c);
    multiply(c, wt);
  }
  const float b = bias ? load_any(bias, bias_t, n) : 0.f;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float inv = 1.0f;
    if constexpr (NORM) inv = 1.0f / sqrtf(warp_sum(ss[m]) / float(K) + nm.eps);
    const float s = warp_sum(acc[0][m]) * inv;
    O* o = out + m * ldo + n;
    if constexpr (GATED) {
      const float g = to_f(from_f<T>(s)), u = to_f(from_f<T>(warp_sum(acc[R - 1][m]) * inv));
      if (lane == 0) *o = from_f<O>(silu_mul1(g, u));
    } else if constexpr (EPI == GemvEpilogue::Add) {
      if (lane == 0) *o = from_f<O>(to_f(*o) + to_f(from_f<O>(s + b)));
    } else {
      if (lane == 0) *o = from_f<O>(s + b);
    }
  }
}

// N: output columns (for the gated form, half the weight rows).
template <typename T, typename O, GemvEpilogue EPI, bool NORM>
void launch_m(int M, const Tensor& x, const Tensor& w, int64_t N, const Tensor* bias, Tensor& out, const NormArgs& nm,
              cudaStream_t s) {
  const unsigned blocks = ceil_div(N, kThreads / 32);

  const void* bp = bias ? bias->data : nullptr;
  const DType bt = bias ? bias->dtype : DType::F32;
  auto go = [&](auto kernel) {
    launch_chained(kernel, blocks, kThreads, 0, s, x.ptr<T>(), x.stride, w.ptr<T>(), w.stride, out.ptr<O>(),
                   out.stride, N, w.cols, bp, bt, nm);
  };
  switch (M) {
    case 1: go(gemv_kernel<T, O, 1, EPI, NORM>); break;
    case 2: go(gemv_kernel<T, O, 2, EPI, NORM>); break;
    case 3: go(gemv_kernel<T, O, 3, EPI, NORM>); break;
    case 4: go(gemv_kernel<T, O, 4, EPI, NORM>); break;
    case 5: go(gemv_kernel<T, O, 5, EPI, NORM>); break;
    case 6: go(gemv_kernel<T, O, 6, EPI, NORM>); break;
    case 7: go(gemv_kernel<T, O, 7, EPI, NORM>); break;
    default: go(gemv_kernel<T, O, 8, EPI, NORM>); break;
  }
}

// The instantiations that exist: Store and the normed Store to T or F32 (logits), Add and SiluMul (with or
// without norm) to T.
template <typename T, bool NORM>
void launch_t(int M, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out, GemvEpilogue epi,
              const NormArgs& nm, cudaStream_t s) {
  switch (epi) {
    case GemvEpilogue::Store:
      if (out.dtype == DType::F32) launch_m<T, float, GemvEpilogue::Store, NORM>(M, x, w, w.rows, bias, out, nm, s);
      else launch_m<T, T, GemvEpilogue::Store, NORM>(M, x, w, w.rows, bias, out, nm, s);
      break;
    case GemvEpilogue::Add:
      if constexpr (!NORM) launch_m<T, T, GemvEpilogue::Add, NORM>(M, x, w, w.rows, bias, out, nm, s);
      break;
    case GemvEpilogue::SiluMul:
      launch_m<T, T, GemvEpilogue::SiluMul, NORM>(M, x, w, out.cols, nullptr, out, nm, s);
      break;
  }
}

}  // namespace

bool launch_gemv(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out, GemvEpilogue epi,
                 const RmsNorm* norm, cudaStream_t s) {
  const bool sixteen = x.dtype == w.dtype && (x.dtype == DType::BF16 || x.dtype == DType::F16);
  if (!sixteen || x.rows < 1 || x.rows > 8 || w.cols % 8 != 0 || !aligned16(x.data, x.stride * 2) ||
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
    if (!norm_folding() || x.rows > kNormMaxRows || norm->w.cols < w.cols || norm->w.dtype != DType::F32 ||
        !aligned16(norm->w.data, 0))
      return false;
    nm = NormArgs{norm->w.ptr<float>(), norm->eps, norm->zero_centred};
  }
  const int M = int(x.rows);
  auto go = [&](auto tag) {
    using T = decltype(tag);
    if (norm) launch_t<T, true>(M, x, w, bias, out, epi, nm, s);
    else launch_t<T, false>(M, x, w, bias, out, epi, nm, s);
  };
  if (x.dtype == DType::BF16) go(__nv_bfloat16{});
  else go(__half{});
  check_launch("gemv");
  return true;
}

}  // namespace qrt::cuda
