// GEMV for few-row linears (decode): out[m, n] = x[m, :] . w[n, :] (+ bias[n]) for m < M <= 8, 16-bit
// x and w of the same dtype. One warp per output column; each lane streams 16-byte pieces of the weight
// row (several in flight) and multiplies them with the same pieces of every x row; fp32 accumulation.
// The arithmetic of row m does not depend on M (batch invariance among M <= 8).
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

template <typename T, typename O, int M>
__global__ void __launch_bounds__(256) gemv_kernel(const T* __restrict__ x, int64_t ldx, const T* __restrict__ w,
                                                   int64_t ldw, O* __restrict__ out, int64_t ldo, int64_t N, int64_t K,
                                                   const void* bias, DType bias_t) {
  const int64_t n = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (n >= N) return;
  const int lane = threadIdx.x & 31;
  const uint4* wr = reinterpret_cast<const uint4*>(w + n * ldw);
  const int64_t chunks = K / 8;  // 16-byte pieces per row
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.f;
  constexpr int U = 4;  // pieces in flight per lane
  int64_t c = lane;
  for (; c + 32 * (U - 1) < chunks; c += 32 * U) {
    uint4 wv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) wv[u] = __ldg(wr + c + 32 * u);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int m = 0; m < M; ++m)
        acc[m] += dot8<T>(__ldg(reinterpret_cast<const uint4*>(x + m * ldx) + c + 32 * u), wv[u]);
  }
  for (; c < chunks; c += 32) {
    const uint4 wv = __ldg(wr + c);
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] += dot8<T>(__ldg(reinterpret_cast<const uint4*>(x + m * ldx) + c), wv);
  }
  const float b = bias ? load_any(bias, bias_t, n) : 0.f;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const float s = warp_sum(acc[m]);
    if (lane == 0) out[m * ldo + n] = from_f<O>(s + b);
  }
}

template <typename T, typename O>
void launch_m(int M, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out, cudaStream_t s) {
  const unsigned blocks = ceil_div(w.rows, 8);
  const void* bp = bias ? bias->data : nullptr;
  const DType bt = bias ? bias->dtype : DType::F32;
  auto go = [&](auto kernel) {
    kernel<<<blocks, 256, 0, s>>>(x.ptr<T>(), x.stride, w.ptr<T>(), w.stride, out.ptr<O>(), out.stride, w.rows,
                                   w.cols, bp, bt);
  };
  switch (M) {
    case 1: go(gemv_kernel<T, O, 1>); break;
    case 2: go(gemv_kernel<T, O, 2>); break;
    case 3: go(gemv_kernel<T, O, 3>); break;
    case 4: go(gemv_kernel<T, O, 4>); break;
    case 5: go(gemv_kernel<T, O, 5>); break;
    case 6: go(gemv_kernel<T, O, 6>); break;
    case 7: go(gemv_kernel<T, O, 7>); break;
    default: go(gemv_kernel<T, O, 8>); break;
  }
}

}  // namespace

bool launch_gemv(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out, cudaStream_t s) {
  const bool sixteen = x.dtype == w.dtype && (x.dtype == DType::BF16 || x.dtype == DType::F16);
  const bool out_ok = out.dtype == x.dtype || out.dtype == DType::F32;
  auto aligned = [](const void* p, int64_t stride_elems) {
    return reinterpret_cast<uintptr_t>(p) % 16 == 0 && (stride_elems * 2) % 16 == 0;
  };
  if (!sixteen || !out_ok || x.rows < 1 || x.rows > 8 || w.cols % 8 != 0 || !aligned(x.data, x.stride) ||
      !aligned(w.data, w.stride))
    return false;
  if (x.dtype == DType::BF16) {
    if (out.dtype == DType::F32) launch_m<__nv_bfloat16, float>(int(x.rows), x, w, bias, out, s);
    else launch_m<__nv_bfloat16, __nv_bfloat16>(int(x.rows), x, w, bias, out, s);
  } else {
    if (out.dtype == DType::F32) launch_m<__half, float>(int(x.rows), x, w, bias, out, s);
    else launch_m<__half, __half>(int(x.rows), x, w, bias, out, s);
  }
  check_launch("gemv");
  return true;
}

}  // namespace qrt::cuda
