// Elementwise and row-wise kernels of the CUDA backend: fp32 math, any float storage dtype.
#include <algorithm>

#include "backend/cuda/cuda_common.cuh"
#include "backend/random.h"

namespace qrt::cuda {
namespace {

constexpr int kThreads = 256;

unsigned threads_for(int64_t cols) {
  if (cols >= 1024) return 256;
  if (cols >= 256) return 128;
  return 64;
}

// ---- fill_random / convert --------------------------------------------------------------------
__global__ void fill_random_kernel(void* p, DType t, int64_t cols, int64_t stride, uint64_t seed, float scale,
                                   float offset, int64_t row0, int64_t col0) {
  const int64_t r = blockIdx.x;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float u = uniform01(seed, uint64_t(row0 + r), uint64_t(col0 + c));
    // The same two FMAs as the CPU backend (ops.h).
    const float v = __fmaf_rn(scale, __fmaf_rn(2.0f, u, -1.0f), offset);
    store_any(p, t, r * stride + c, v);
  }
}

__global__ void convert_kernel(const void* src, DType st, int64_t ss, void* dst, DType dt, int64_t ds, int64_t cols) {
  const int64_t r = blockIdx.x;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) store_any(dst, dt, r * ds + c, load_any(src, st, r * ss + c));
}

__global__ void scale_columns_kernel(void* w, DType t, int64_t stride, int64_t cols, const float* gain, bool zc) {
  const int64_t r = blockIdx.x;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float g = zc ? 1.0f + gain[c] : gain[c];
    store_any(w, t, r * stride + c, load_any(w, t, r * stride + c) * g);
  }
}

__global__ void embedding_kernel(const int32_t* ids, const void* table, DType tt, int64_t ts, int64_t trows,
                                 void* out, DType ot, int64_t os, int64_t cols) {
  grid_release();
  grid_wait();
  const int64_t r = blockIdx.x;
  const int64_t id = ids[r];
  const bool ok = id >= 0 && id < trows;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    store_any(out, ot, r * os + c, ok ? load_any(table, tt, id * ts + c) : 0.f);
}

// out = rmsnorm(residual_in + x  or  x) * w'; residual (if given) receives residual_in + x in T.
template <typename T>
__global__ void rms_norm_kernel(const T* res_in, int64_t rs_in, const T* x, int64_t xs, const void* w, DType wt,
                                float eps, bool zc, T* res_out, int64_t rs_out, T* out, int64_t os, int64_t n) {
  const int64_t r = blockIdx.x;
  const T* xr = x + r * xs;
  float ss = 0.f;
  if (res_in) {
    const T* ri = res_in + r * rs_in;
    T* ro = res_out + r * rs_out;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const T sum = from_f<T>(to_f(ri[i]) + to_f(xr[i]));
      ro[i] = sum;
      const float v = to_f(sum);
      ss += v * v;
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const float v = to_f(xr[i]);
      ss += v * v;
    }
  }
  ss = block_sum(ss);
  const float inv = 1.0f / sqrtf(ss / float(n) + eps);
  const T* src = res_in ? res_out + r * rs_out : xr;  // each thread re-reads only what it wrote
  T* o = out + r * os;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float wi = load_any(w, wt, i);
    o[i] = from_f<T>(to_f(src[i]) * inv * (zc ? 1.0f + wi : wi));
  }
}

// rms_norm_kernel with 16-byte pieces held in registers (up to V per thread): every load of a row is in
// flight at once, which is what a one-row (decode) step waits on. The gains are weights: they are read
// before grid_wait, while the kernel before is still finishing. Same arithmetic per element.
template <typename T, int V>
__global__ void __launch_bounds__(1024) rms_norm_vec_kernel(const T* res_in, int64_t rs_in, const T* x, int64_t xs,
                                                            const void* w, DType wt, bool w_vec, float eps, bool zc,
                                                            T* res_out, int64_t rs_out, T* out, int64_t os, int64_t n) {
  constexpr int N = Vec16<T>::N;
  grid_release();
  const int64_t r = blockIdx.x;
  const int nv = int(n / N);
  Vec16<T> g[V];  // gains (1 + w when zero-centred)
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i >= nv) break;
    if (w_vec) {  // gains of dtype T, 16-byte aligned
      g[j].load(static_cast<const T*>(w) + int64_t(i) * N);
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) g[j].f[k] = load_any(w, wt, int64_t(i) * N + k);
    }
#pragma unroll
    for (int k = 0; k < N; ++k) g[j].f[k] = zc ? 1.0f + g[j].f[k] : g[j].f[k];
  }
  grid_wait();
  Vec16<T> v[V];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i >= nv) break;
    v[j].load(x + r * xs + int64_t(i) * N);
    if (res_in) {
      Vec16<T> a;
      a.load(res_in + r * rs_in + int64_t(i) * N);
#pragma unroll
      for (int k = 0; k < N; ++k) v[j].f[k] = to_f(from_f<T>(a.f[k] + v[j].f[k]));
      v[j].store(res_out + r * rs_out + int64_t(i) * N);
    }
#pragma unroll
    for (int k = 0; k < N; ++k) ss += v[j].f[k] * v[j].f[k];
  }
  ss = block_sum(ss);
  const float inv = 1.0f / sqrtf(ss / float(n) + eps);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i >= nv) break;
#pragma unroll
    for (int k = 0; k < N; ++k) v[j].f[k] = v[j].f[k] * inv * g[j].f[k];
    v[j].store(out + r * os + int64_t(i) * N);
  }
}

// One warp per (row, head), in place.
template <typename T>
__global__ void head_rms_norm_kernel(T* x, int64_t xs, int64_t rows, int heads, int hd, const void* w, DType wt,
                                     float eps, bool zc) {
  const int64_t task = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (task >= rows * heads) return;
  const int lane = threadIdx.x & 31;
  const int64_t r = task / heads;
  const int h = int(task % heads);
  T* p = x + r * xs + int64_t(h) * hd;
  const float inv = warp_inv_rms(p, hd, eps);
  for (int i = lane; i < hd; i += 32) {
    const float wi = load_any(w, wt, i);
    p[i] = from_f<T>(to_f(p[i]) * inv * (zc ? 1.0f + wi : wi));
  }
}

template <typename T>
__global__ void rope_kernel(T* x, int64_t xs, int heads, int hd, const int32_t* positions, const float* cs_tab,
                            int rot_dim, int max_pos) {
  const int64_t r = blockIdx.x;
  const int pos = positions[r];
  if (pos < 0 || pos >= max_pos) return;
  const int half = rot_dim / 2;
  const float* cs = cs_tab + int64_t(pos) * rot_dim;
  T* row = x + r * xs;
  for (int j = threadIdx.x; j < heads * half; j += blockDim.x) {
    const int h = j / half, i = j - h * half;
    T* p = row + int64_t(h) * hd;
    const float a = to_f(p[i]), b = to_f(p[i + half]), c = cs[i], s = cs[half + i];
    p[i] = from_f<T>(a * c - b * s);
    p[i + half] = from_f<T>(b * c + a * s);
  }
}

template <typename T>
__global__ void silu_mul_kernel(const T* gu, int64_t gs, T* out, int64_t os, int64_t I) {
  const int64_t r = blockIdx.x;
  const T* g = gu + r * gs;
  T* o = out + r * os;
  for (int64_t i = threadIdx.x; i < I; i += blockDim.x) {
    const float a = to_f(g[i]), b = to_f(g[I + i]);
    o[i] = from_f<T>(silu_mul1(a, b));
  }
}

// silu_mul_kernel over 16-byte pieces, one per thread, rows spread over the whole grid.
template <typename T>
__global__ void silu_mul_vec_kernel(const T* gu, int64_t gs, T* out, int64_t os, int64_t I, int64_t pieces) {
  constexpr int N = Vec16<T>::N;
  grid_release();
  grid_wait();
  const int64_t per_row = I / N;
  const int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p >= pieces) return;
  const int64_t r = p / per_row, c = (p - r * per_row) * N;
  Vec16<T> g, u;
  g.load(gu + r * gs + c);
  u.load(gu + r * gs + I + c);
#pragma unroll
  for (int k = 0; k < N; ++k) g.f[k] = silu_mul1(g.f[k], u.f[k]);
  g.store(out + r * os + c);
}

template <typename T>
__global__ void add_kernel(T* x, int64_t xs, const T* y, int64_t ys, int64_t cols) {
  const int64_t r = blockIdx.x;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) x[r * xs + c] = from_f<T>(to_f(x[r * xs + c]) + to_f(y[r * ys + c]));
}

__global__ void add_bias_kernel(void* out, DType ot, int64_t os, const void* bias, DType bt, int64_t cols) {
  const int64_t r = blockIdx.x;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    store_any(out, ot, r * os + c, load_any(out, ot, r * os + c) + load_any(bias, bt, c));
}

// Same-dtype row copy in units of U (16, 8, 4 or 2 bytes); strides and widths in units.
template <typename U>
__global__ void copy_rows_kernel(const U* src, int64_t ss, const int32_t* src_rows, U* dst, int64_t ds,
                                 const int32_t* dst_rows, int64_t units) {
  grid_release();
  grid_wait();
  const int64_t i = blockIdx.x;
  const int64_t sr = src_rows ? src_rows[i] : i;
  const int64_t dr = dst_rows ? dst_rows[i] : i;
  if (sr < 0 || dr < 0) return;
  const U* s = src + sr * ss;
  U* d = dst + dr * ds;
  for (int64_t c = threadIdx.x; c < units; c += blockDim.x) d[c] = s[c];
}

__global__ void convert_rows_kernel(const void* src, DType st, int64_t ss, const int32_t* src_rows, void* dst,
                                    DType dt, int64_t ds, const int32_t* dst_rows, int64_t cols) {
  const int64_t i = blockIdx.x;
  const int64_t sr = src_rows ? src_rows[i] : i;
  const int64_t dr = dst_rows ? dst_rows[i] : i;
  if (sr < 0 || dr < 0) return;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) store_any(dst, dt, dr * ds + c, load_any(src, st, sr * ss + c));
}

}  // namespace

void launch_fill_random(Tensor& t, uint64_t seed, float scale, float offset, int64_t row0, int64_t col0,
                        cudaStream_t s) {
  QRT_CHECK(is_float_dtype(t.dtype), "cuda fill_random: not a float tensor (", dtype_name(t.dtype), ")");
  if (t.rows == 0 || t.cols == 0) return;
  fill_random_kernel<<<unsigned(t.rows), threads_for(t.cols), 0, s>>>(t.data, t.dtype, t.cols, t.stride, seed, scale,
                                                                        offset, row0, col0);
  check_launch("fill_random");
}

void launch_convert(const Tensor& src, Tensor& dst, cudaStream_t s) {
  QRT_CHECK(src.rows == dst.rows && src.cols == dst.cols, "cuda convert: shape mismatch");
  QRT_CHECK(is_float_dtype(src.dtype) && is_float_dtype(dst.dtype), "cuda convert: not float tensors");
  if (src.rows == 0 || src.cols == 0) return;
  convert_kernel<<<unsigned(src.rows), threads_for(src.cols), 0, s>>>(src.data, src.dtype, src.stride, dst.data,
                                                                       dst.dtype, dst.stride, src.cols);
  check_launch("convert");
}

void launch_scale_columns(Tensor& w, const Tensor& gain, bool zc, cudaStream_t s) {
  QRT_CHECK(gain.dtype == DType::F32 && gain.cols >= w.cols, "cuda scale_columns: the gain must be float32 with ",
            w.cols, " columns");
  if (w.rows == 0) return;
  scale_columns_kernel<<<unsigned(w.rows), threads_for(w.cols), 0, s>>>(w.data, w.dtype, w.stride, w.cols,
                                                                        gain.ptr<float>(), zc);
  check_launch("scale_columns");
}

void launch_embedding(const int32_t* ids, const Tensor& table, Tensor& out, cudaStream_t s) {
  QRT_CHECK(table.cols == out.cols, "cuda embedding: table has ", table.cols, " columns, out ", out.cols);
  if (out.rows == 0) return;
  launch_chained(embedding_kernel, unsigned(out.rows), threads_for(out.cols), 0, s, ids, table.data, table.dtype,
                 table.stride, table.rows, out.data, out.dtype, out.stride, out.cols);
  check_launch("embedding");
}

void launch_rms_norm(const Tensor* residual_in, const Tensor& x, const Tensor& w, float eps, bool zc,
                     Tensor* residual, Tensor& out, cudaStream_t s) {
  check_act(x, "rms_norm");
  QRT_CHECK(out.dtype == x.dtype && out.rows == x.rows && out.cols == x.cols, "cuda rms_norm: out shape/dtype");
  QRT_CHECK(w.cols >= x.cols, "cuda rms_norm: weight has ", w.cols, " columns for rows of ", x.cols);
  if (residual) QRT_CHECK(residual->dtype == x.dtype && residual->rows == x.rows && residual->cols == x.cols,
                          "cuda add_rms_norm: residual shape/dtype");
  if (x.rows == 0) return;
  dispatch_act(x.dtype, "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    constexpr int N = 16 / int(sizeof(T)), V = 4;
    const int64_t es = int64_t(sizeof(T)), nv = x.cols / N;
    const bool vec = x.cols % N == 0 && nv <= 1024 * V && aligned16(x.data, x.stride * es) &&
                     aligned16(out.data, out.stride * es) &&
                     (!residual_in || aligned16(residual_in->data, residual_in->stride * es)) &&
                     (!residual || aligned16(residual->data, residual->stride * es));
    const bool w_vec = w.dtype == x.dtype && aligned16(w.data, 0);
    if (vec) {
      const unsigned threads = unsigned(std::max<int64_t>(32, (ceil_div(nv, V) + 31) / 32 * 32));
      launch_chained(
          rms_norm_vec_kernel<T, V>, unsigned(x.rows), threads, 0, s, residual_in ? residual_in->ptr<T>() : nullptr, residual_in ? residual_in->stride : 0, x.ptr<T>(),
          x.stride, w.data, w.dtype, w_vec, eps, zc, residual ? residual->ptr<T>() : nullptr,
          residual ? residual->stride : 0, out.ptr<T>(), out.stride, x.cols);
      return;
    }
    rms_norm_kernel<T><<<unsigned(x.rows), kThreads, 0, s>>>(
        residual_in ? residual_in->ptr<T>() : nullptr, residual_in ? residual_in->stride : 0, x.ptr<T>(), x.stride,
        w.data, w.dtype, eps, zc, residual ? residual->ptr<T>() : nullptr, residual ? residual->stride : 0,
        out.ptr<T>(), out.stride, x.cols);
  });
  check_launch(residual ? "add_rms_norm" : "rms_norm");
}

void launch_head_rms_norm(Tensor& x, int hd, const Tensor& w, float eps, bool zc, cudaStream_t s) {
  check_act(x, "head_rms_norm");
  QRT_CHECK(hd > 0 && x.cols % hd == 0, "cuda head_rms_norm: ", x.cols, " columns are not heads of ", hd);
  const int heads = int(x.cols / hd);
  const int64_t tasks = x.rows * heads;
  if (tasks == 0) return;
  dispatch_act(x.dtype, "head_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    head_rms_norm_kernel<T><<<ceil_div(tasks, 8), 256, 0, s>>>(x.ptr<T>(), x.stride, x.rows, heads, hd, w.data,
                                                                w.dtype, eps, zc);
  });
  check_launch("head_rms_norm");
}

void launch_rope(Tensor& x, int hd, const int32_t* positions, const RopeTable& tab, cudaStream_t s) {
  check_act(x, "rope");
  QRT_CHECK(hd > 0 && x.cols % hd == 0, "cuda rope: ", x.cols, " columns are not heads of ", hd);
  QRT_CHECK(tab.rot_dim > 0 && tab.rot_dim <= hd && tab.rot_dim % 2 == 0, "cuda rope: bad rot_dim ", tab.rot_dim);
  if (x.rows == 0) return;
  const int heads = int(x.cols / hd);
  dispatch_act(x.dtype, "rope", [&](auto tag) {
    using T = decltype(tag);
    rope_kernel<T><<<unsigned(x.rows), threads_for(int64_t(heads) * tab.rot_dim / 2), 0, s>>>(
        x.ptr<T>(), x.stride, heads, hd, positions, tab.cos_sin, tab.rot_dim, tab.max_positions);
  });
  check_launch("rope");
}

void launch_silu_mul(const Tensor& gu, Tensor& out, cudaStream_t s) {
  check_act(gu, "silu_mul");
  QRT_CHECK(out.dtype == gu.dtype && out.rows == gu.rows && gu.cols >= 2 * out.cols, "cuda silu_mul: shapes");
  if (out.rows == 0) return;
  dispatch_act(gu.dtype, "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    constexpr int N = 16 / int(sizeof(T));
    const int64_t es = int64_t(sizeof(T));
    if (out.cols % N == 0 && aligned16(gu.data, gu.stride * es) && aligned16(out.data, out.stride * es)) {
      const int64_t pieces = out.rows * (out.cols / N);
      launch_chained(silu_mul_vec_kernel<T>, ceil_div(pieces, 256), 256, 0, s, gu.ptr<T>(), gu.stride, out.ptr<T>(),
                     out.stride, out.cols, pieces);
      return;
    }
    silu_mul_kernel<T><<<unsigned(out.rows), threads_for(out.cols), 0, s>>>(gu.ptr<T>(), gu.stride, out.ptr<T>(),
                                                                             out.stride, out.cols);
  });
  check_launch("silu_mul");
}

__global__ void fill_tokens_kernel(int32_t* ids, const int32_t* src_index, const int32_t* src, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n && src_index[i] >= 0) ids[i] = src[src_index[i]];
}

__global__ void stall_kernel(uint64_t ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

void launch_stall(double ms, cudaStream_t s) {
  stall_kernel<<<1, 1, 0, s>>>(uint64_t(ms * 1e6));
  check_launch("stall");
}

void launch_fill_tokens(int32_t* ids, const int32_t* src_index, const int32_t* src, int n, cudaStream_t s) {
  if (n <= 0) return;
  fill_tokens_kernel<<<ceil_div(n, 256), 256, 0, s>>>(ids, src_index, src, n);
  check_launch("fill_tokens");
}

void launch_add(Tensor& x, const Tensor& y, cudaStream_t s) {
  check_act(x, "add");
  QRT_CHECK(y.dtype == x.dtype && y.rows == x.rows && y.cols == x.cols, "cuda add: shape/dtype mismatch");
  if (x.rows == 0) return;
  dispatch_act(x.dtype, "add", [&](auto tag) {
    using T = decltype(tag);
    add_kernel<T><<<unsigned(x.rows), threads_for(x.cols), 0, s>>>(x.ptr<T>(), x.stride, y.ptr<T>(), y.stride, x.cols);
  });
  check_launch("add");
}

void launch_add_bias(Tensor& out, const Tensor& bias, cudaStream_t s) {
  if (out.rows == 0) return;
  add_bias_kernel<<<unsigned(out.rows), threads_for(out.cols), 0, s>>>(out.data, out.dtype, out.stride, bias.data,
                                                                        bias.dtype, out.cols);
  check_launch("linear bias");
}

void launch_copy_rows(const void* src, DType st, int64_t src_stride, const int32_t* src_rows, void* dst, DType dt,
                      int64_t dst_stride, const int32_t* dst_rows, int64_t n, int64_t row_elems, cudaStream_t s) {
  if (n == 0 || row_elems == 0) return;
  if (st != dt) {
    convert_rows_kernel<<<unsigned(n), threads_for(row_elems), 0, s>>>(src, st, src_stride, src_rows, dst, dt,
                                                                       dst_stride, dst_rows, row_elems);
    check_launch("copy_rows");
    return;
  }
  const int64_t es = int64_t(dtype_size(st));
  const uint64_t mix = uint64_t(reinterpret_cast<uintptr_t>(src)) | uint64_t(reinterpret_cast<uintptr_t>(dst)) |
                       uint64_t(row_elems * es) | uint64_t(src_stride * es) | uint64_t(dst_stride * es);
  auto go = [&](auto unit) {
    using U = decltype(unit);
    const int64_t k = int64_t(sizeof(U));
    launch_chained(
        copy_rows_kernel<U>, unsigned(n), threads_for(row_elems * es / k), 0, s, static_cast<const U*>(src), src_stride * es / k, src_rows, static_cast<U*>(dst), dst_stride * es / k,
        dst_rows, row_elems * es / k);
  };
  if (mix % 16 == 0) go(uint4{});
  else if (mix % 8 == 0) go(uint2{});
  else if (mix % 4 == 0) go(uint32_t{});
  else if (mix % 2 == 0) go(uint16_t{});
  else go(uint8_t{});
  check_launch("copy_rows");
}

}  // namespace qrt::cuda

// ---- finish_qkv: q/k head norm + RoPE + K/V cache write in one launch --------------------------
namespace qrt::cuda {
namespace {

// One warp per (row, head) of q | k | v. Lane l holds elements l + 32 j of its head; with rot_dim / 2 a
// multiple of 32, the rotation partner of element i (i + rot_dim / 2) sits in the same lane.
template <typename T, int NJ, int HJ>  // NJ = head_dim / 32, HJ = rot_dim / 64 (compile time: v[] in registers)
__global__ void finish_qkv_kernel(T* qkv, int64_t qs, int64_t rows, int hq, int hkv, const void* qw, const void* kw,
                                  DType nt, float eps, bool zc, const int32_t* positions, const float* cs_tab,
                                  int rot_dim, int max_pos, const int32_t* kv_rows, void* kc, void* vc,
                                  float* k_scale, float* v_scale) {
  grid_release();
  grid_wait();
  constexpr int D = NJ * 32;
  (void)rot_dim;  // HJ * 64, known at compile time
  const int heads = hq + 2 * hkv;
  const int64_t task = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (task >= rows * heads) return;
  const int lane = threadIdx.x & 31;
  const int64_t r = task / heads;
  const int h = int(task % heads);
  T* p = qkv + r * qs + int64_t(h) * D;
  float v[NJ];
#pragma unroll
  for (int j = 0; j < NJ; ++j) v[j] = to_f(p[lane + 32 * j]);
  const int32_t kv_row = kv_rows[r];
  const int64_t cache_row = int64_t(kv_row) * (int64_t(hkv) * D);
  // Head j's values into K (or V) cache row kv_row: as T, or (k_scale set: an fp8 cache) quantized with its scale.
  auto store = [&](void* cache, float* scales, int j) {
    const int64_t at = cache_row + int64_t(j) * D;
    if (k_scale) {
      float x[NJ];
#pragma unroll
      for (int i = 0; i < NJ; ++i) x[i] = to_f(from_f<T>(v[i]));  // what a T cache row would hold
      store_fp8_head<NJ>(x, static_cast<uint8_t*>(cache) + at, scales + int64_t(kv_row) * hkv + j);
      return;
    }
    T* dst = static_cast<T*>(cache) + at;
#pragma unroll
    for (int i = 0; i < NJ; ++i) dst[lane + 32 * i] = from_f<T>(v[i]);
  };
  if (h >= hq + hkv) {  // a v head: only the cache write
    if (kv_row >= 0) store(vc, v_scale, h - hq - hkv);
    return;
  }
  const bool is_q = h < hq;
  const void* w = is_q ? qw : kw;
  if (w) {
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < NJ; ++j) ss += v[j] * v[j];
    ss = warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / float(D) + eps);
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const float wi = load_any(w, nt, lane + 32 * j);
      v[j] = v[j] * inv * (zc ? 1.0f + wi : wi);
    }
  }
  const int pos = positions[r];
  if (pos >= 0 && pos < max_pos) {
    const int half = HJ * 32;
    const float* cs = cs_tab + int64_t(pos) * (2 * half);
#pragma unroll
    for (int j = 0; j < HJ; ++j) {
      const int i = lane + 32 * j;
      const float a = v[j], b = v[j + HJ], c = cs[i], s = cs[half + i];
      v[j] = a * c - b * s;
      v[j + HJ] = b * c + a * s;
    }
  }
#pragma unroll
  for (int j = 0; j < NJ; ++j) p[lane + 32 * j] = from_f<T>(v[j]);
  if (!is_q && kv_row >= 0) store(kc, k_scale, h - hq);
}

// write_kv into an fp8 cache: one warp per (row, kv head) of k or of v, any head_dim (two passes over the head).
template <typename T>
__global__ void write_kv_fp8_kernel(const T* k, int64_t ks, const T* v, int64_t vs, int64_t rows, int heads, int D,
                                    const int32_t* kv_rows, uint8_t* kc, uint8_t* vc, float* k_scale,
                                    float* v_scale) {
  grid_release();
  grid_wait();
  const int64_t task = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (task >= rows * heads * 2) return;
  const int lane = threadIdx.x & 31;
  const bool is_v = task >= rows * heads;
  const int64_t t = is_v ? task - rows * heads : task, r = t / heads;
  const int h = int(t % heads);
  const int32_t row = kv_rows[r];
  if (row < 0) return;
  const T* src = (is_v ? v + r * vs : k + r * ks) + int64_t(h) * D;
  float amax = 0.f;
  for (int i = lane; i < D; i += 32) amax = fmaxf(amax, fabsf(to_f(src[i])));
  amax = warp_max(amax);
  const float s = amax > 0.f ? amax / 448.0f : 1.0f;
  uint8_t* dst = (is_v ? vc : kc) + (int64_t(row) * heads + h) * D;
  for (int i = lane; i < D; i += 32) dst[i] = __nv_cvt_float_to_fp8(to_f(src[i]) / s, __NV_SATFINITE, __NV_E4M3);
  if (lane == 0) (is_v ? v_scale : k_scale)[int64_t(row) * heads + h] = s;
}

}  // namespace

bool launch_finish_qkv(Tensor& qkv, const AttnShape& sh, const Tensor* qn, const Tensor* kn, float eps, bool zc,
                       const int32_t* positions, const RopeTable& tab, const AttnBatch& b, KvLayer& cache,
                       cudaStream_t s) {
  const int D = sh.head_dim;
  if ((D != 64 && D != 128 && D != 256) || tab.rot_dim <= 0 || tab.rot_dim % 64 != 0 || tab.rot_dim > D ||
      tab.rot_dim / 64 == 3 || (cache.dtype != qkv.dtype && !cache.fp8()) ||
      (cache.fp8() && !(cache.k_scale && cache.v_scale && cache.kv_heads == sh.kv_heads)))
    return false;  // the caller composes the single ops (write_kv names a missing scale)
  if (qn && kn && qn->dtype != kn->dtype) return false;
  if (qkv.rows == 0) return true;
  const int64_t tasks = qkv.rows * int64_t(sh.q_heads + 2 * sh.kv_heads);
  const DType nt = qn ? qn->dtype : (kn ? kn->dtype : DType::F32);
  dispatch_act(qkv.dtype, "finish_qkv", [&](auto tag) {
    using T = decltype(tag);
    auto go = [&](auto kernel) {
      launch_chained(kernel, ceil_div(tasks, 8), 256, 0, s, qkv.ptr<T>(), qkv.stride, qkv.rows, sh.q_heads, sh.kv_heads,
                                                 qn ? qn->data : nullptr, kn ? kn->data : nullptr, nt, eps, zc,
                                                 positions, tab.cos_sin, tab.rot_dim, tab.max_positions, b.kv_rows,
                                                 cache.k, cache.v, cache.fp8() ? cache.k_scale : nullptr,
                                                 cache.fp8() ? cache.v_scale : nullptr);
    };
    const int hj = tab.rot_dim / 64;  // 1, 2 or 4 (checked above), at most NJ / 2
    if (D == 64) go(finish_qkv_kernel<T, 2, 1>);
    else if (D == 128) hj == 1 ? go(finish_qkv_kernel<T, 4, 1>) : go(finish_qkv_kernel<T, 4, 2>);
    else if (hj == 1) go(finish_qkv_kernel<T, 8, 1>);
    else if (hj == 2) go(finish_qkv_kernel<T, 8, 2>);
    else go(finish_qkv_kernel<T, 8, 4>);
  });
  check_launch("finish_qkv");
  return true;
}

namespace {
// Block i copies segment i: 16 bytes a thread where both ends and the size allow, else bytes.
__global__ void copy_segments_kernel(const CopySegment* segs) {
  const CopySegment sg = segs[blockIdx.x];
  const bool wide = (reinterpret_cast<uintptr_t>(sg.dst) | reinterpret_cast<uintptr_t>(sg.src) | sg.bytes) % 16 == 0;
  if (wide) {
    uint4* d = static_cast<uint4*>(sg.dst);
    const uint4* src = static_cast<const uint4*>(sg.src);
    for (size_t i = threadIdx.x; i < sg.bytes / 16; i += blockDim.x) d[i] = src[i];
  } else {
    char* d = static_cast<char*>(sg.dst);
    const char* src = static_cast<const char*>(sg.src);
    for (size_t i = threadIdx.x; i < sg.bytes; i += blockDim.x) d[i] = src[i];
  }
}
}  // namespace

void launch_copy_segments(const CopySegment* segs, int n, cudaStream_t s) {
  if (n == 0) return;
  copy_segments_kernel<<<unsigned(n), 256, 0, s>>>(segs);
  check_launch("copy_segments");
}

void launch_write_kv_fp8(const Tensor& k, const Tensor& v, const AttnBatch& b, const KvLayer& cache, cudaStream_t s) {
  QRT_CHECK(cache.fp8() && cache.k_scale && cache.v_scale && cache.kv_heads > 0 && k.cols % cache.kv_heads == 0,
            "cuda write_kv: an fp8 KV cache needs its scales");
  QRT_CHECK(k.dtype == v.dtype, "cuda write_kv: k and v differ in dtype");
  if (k.rows == 0) return;
  const int64_t tasks = k.rows * cache.kv_heads * 2;
  dispatch_act(k.dtype, "write_kv", [&](auto tag) {
    using T = decltype(tag);
    launch_chained(write_kv_fp8_kernel<T>, ceil_div(tasks, 8), 256, 0, s, k.ptr<T>(), k.stride, v.ptr<T>(), v.stride,
                   k.rows, cache.kv_heads, int(k.cols / cache.kv_heads), b.kv_rows, static_cast<uint8_t*>(cache.k),
                   static_cast<uint8_t*>(cache.v), cache.k_scale, cache.v_scale);
  });
  check_launch("write_kv (fp8)");
}

}  // namespace qrt::cuda
