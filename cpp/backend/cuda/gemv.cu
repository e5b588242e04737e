// GEMV for few-row linears (decode): out[m, n] = x[m, :] . w[n, :] (+ bias[n]) for m < M <= 8, 16-bit
// x and w of the same dtype. One warp per output column; each lane streams 16-byte pieces of the weight
// row (several in flight) and multiplies them with the same pieces of every x row; fp32 accumulation.
// The arithmetic of row m does not depend on M (batch invariance among M <= 8).
// Gated form (the MLP's gate|up projection): warp n also streams row n + N and writes
// silu(g) * u of the two rounded results, exactly what linear followed by silu_mul gives.
#include "backend/cuda/cuda_common.cuh"

namespace qrt::cuda {
namespace {

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

template <typename T, typename O, int M, bool GATED>
__global__ void __launch_bounds__(256) gemv_kernel(const T* __restrict__ x, int64_t ldx, const T* __restrict__ w,
                                                   int64_t ldw, O* __restrict__ out, int64_t ldo, int64_t N, int64_t K,
                                                   const void* bias, DType bias_t) {
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
  while (full(c)) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + m * ldx) + c + 32 * u);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r][m] += dot8<T>(xv, wv[r][u]);
      }
    c += 32 * U;
    if (full(c)) load_w(c);
  }
  for (; c < chunks; c += 32) {
    uint4 wt[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wt[r] = __ldg(wr[r] + c);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + m * ldx) + c);
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r][m] += dot8<T>(xv, wt[r]);
    }
  }
  const float b = bias ? load_any(bias, bias_t, n) : 0.f;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const float s = warp_sum(acc[0][m]);
    if constexpr (GATED) {
      const float g = to_f(from_f<T>(s)), u = to_f(from_f<T>(warp_sum(acc[R - 1][m])));
      if (lane == 0) out[m * ldo + n] = from_f<O>(silu_mul1(g, u));
    } else {
      if (lane == 0) out[m * ldo + n] = from_f<O>(s + b);
    }
  }
}

// N: output columns (for the gated form, half the weight rows).
template <typename T, typename O, bool GATED>
void launch_m(int M, const Tensor& x, const Tensor& w, int64_t N, const Tensor* bias, Tensor& out, cudaStream_t s) {
  const unsigned blocks = ceil_div(N, 8);
  const void* bp = bias ? bias->data : nullptr;
  const DType bt = bias ? bias->dtype : DType::F32;
  auto go = [&](auto kernel) {
    launch_chained(kernel, blocks, 256, 0, s, x.ptr<T>(), x.stride, w.ptr<T>(), w.stride, out.ptr<O>(), out.stride,
                   N, w.cols, bp, bt);
  };
  switch (M) {
    case 1: go(gemv_kernel<T, O, 1, GATED>); break;
    case 2: go(gemv_kernel<T, O, 2, GATED>); break;
    case 3: go(gemv_kernel<T, O, 3, GATED>); break;
    case 4: go(gemv_kernel<T, O, 4, GATED>); break;
    case 5: go(gemv_kernel<T, O, 5, GATED>); break;
    case 6: go(gemv_kernel<T, O, 6, GATED>); break;
    case 7: go(gemv_kernel<T, O, 7, GATED>); break;
    default: go(gemv_kernel<T, O, 8, GATED>); break;
  }
}

bool gemv_applies(const Tensor& x, const Tensor& w, const Tensor& out) {
  const bool sixteen = x.dtype == w.dtype && (x.dtype == DType::BF16 || x.dtype == DType::F16);
  const bool out_ok = out.dtype == x.dtype || out.dtype == DType::F32;
  return sixteen && out_ok && x.rows >= 1 && x.rows <= 8 && w.cols % 8 == 0 && aligned16(x.data, x.stride * 2) &&
         aligned16(w.data, w.stride * 2);
}

}  // namespace

bool launch_gemv(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out, cudaStream_t s) {
  if (!gemv_applies(x, w, out)) return false;
  if (x.dtype == DType::BF16) {
    if (out.dtype == DType::F32) launch_m<__nv_bfloat16, float, false>(int(x.rows), x, w, w.rows, bias, out, s);
    else launch_m<__nv_bfloat16, __nv_bfloat16, false>(int(x.rows), x, w, w.rows, bias, out, s);
  } else {
    if (out.dtype == DType::F32) launch_m<__half, float, false>(int(x.rows), x, w, w.rows, bias, out, s);
    else launch_m<__half, __half, false>(int(x.rows), x, w, w.rows, bias, out, s);
  }
  check_launch("gemv");
  return true;
}

bool launch_gemv_silu_mul(const Tensor& x, const Tensor& w, Tensor& out, cudaStream_t s) {
  if (!gemv_applies(x, w, out) || out.dtype != x.dtype || w.rows != 2 * out.cols) return false;
  if (x.dtype == DType::BF16) launch_m<__nv_bfloat16, __nv_bfloat16, true>(int(x.rows), x, w, out.cols, nullptr, out, s);
  else launch_m<__half, __half, true>(int(x.rows), x, w, out.cols, nullptr, out, s);
  check_launch("gemv (silu_mul)");
  return true;
}

}  // namespace qrt::cuda
