// Cache-blocked GEMM for y = x @ w^T with weights kept in their stored dtype.
// Tiles of MR x NR dot products share loads; each dot product keeps 16 fp32 lanes accumulated in K order,
// then a fixed pairwise lane sum, so results do not depend on the tiling (batch invariance).
#include <omp.h>

#include <algorithm>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "backend/cpu/cpu_kernels.h"
#include "core/error.h"

namespace qrt::cpu {
namespace {

typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef _Float16 v16f16 __attribute__((vector_size(32)));

constexpr int kLanes = 16;
constexpr int MR = 4;  // rows of x per tile
constexpr int NR = 4;  // rows of w per tile

template <DType WT> inline v16f load_w(const void* base, int64_t i);

template <> inline v16f load_w<DType::F32>(const void* base, int64_t i) {
  v16f v;
  std::memcpy(&v, static_cast<const float*>(base) + i, 64);
  return v;
}
template <> inline v16f load_w<DType::BF16>(const void* base, int64_t i) {
#if defined(__AVX512F__)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
  return reinterpret_cast<v16f>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#else
  v16h h;
  std::memcpy(&h, static_cast<const uint16_t*>(base) + i, 32);
  v16u u = __builtin_convertvector(h, v16u) << 16;
  v16f f;
  std::memcpy(&f, &u, 64);
  return f;
#endif
}
template <> inline v16f load_w<DType::F16>(const void* base, int64_t i) {
  v16f16 h;
  std::memcpy(&h, static_cast<const uint16_t*>(base) + i, 32);
  return __builtin_convertvector(h, v16f);
}

template <DType WT> inline float load_w1(const void* base, int64_t i);
template <> inline float load_w1<DType::F32>(const void* b, int64_t i) { return static_cast<const float*>(b)[i]; }
template <> inline float load_w1<DType::BF16>(const void* b, int64_t i) { return bf16_to_f32(static_cast<const uint16_t*>(b)[i]); }
template <> inline float load_w1<DType::F16>(const void* b, int64_t i) { return f16_to_f32(static_cast<const uint16_t*>(b)[i]); }

inline float lane_sum(v16f v) {
  float a[16];
  std::memcpy(a, &v, 64);
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) a[i] += a[i + w];
  return a[0];
}

// One tile: rows m0..m0+mr of x against rows n0..n0+nr of w.
template <DType WT, int mr, int nr>
void tile(const float* x, int64_t ldx, const char* w, int64_t ldw_bytes, int64_t K, float (*res)[NR]) {
  v16f acc[mr][nr];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) acc[i][j] = v16f{};
  const int64_t kv = K / kLanes * kLanes;
  for (int64_t k = 0; k < kv; k += kLanes) {
    v16f wv[nr];
    for (int j = 0; j < nr; ++j) wv[j] = load_w<WT>(w + j * ldw_bytes, k);
    for (int i = 0; i < mr; ++i) {
      v16f xv;
      std::memcpy(&xv, x + i * ldx + k, 64);
      for (int j = 0; j < nr; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) {
      float tail = 0.f;
      for (int64_t k = kv; k < K; ++k) tail += x[i * ldx + k] * load_w1<WT>(w + j * ldw_bytes, k);
      res[i][j] = lane_sum(acc[i][j]) + tail;
    }
}

template <DType WT, int mr>
void tile_n(int nr, const float* x, int64_t ldx, const char* w, int64_t ldw, int64_t K, float (*res)[NR]) {
  switch (nr) {
    case 4: tile<WT, mr, 4>(x, ldx, w, ldw, K, res); break;
    case 3: tile<WT, mr, 3>(x, ldx, w, ldw, K, res); break;
    case 2: tile<WT, mr, 2>(x, ldx, w, ldw, K, res); break;
    default: tile<WT, mr, 1>(x, ldx, w, ldw, K, res); break;
  }
}

template <DType WT>
void run_tile(int mr, int nr, const float* x, int64_t ldx, const char* w, int64_t ldw, int64_t K, float (*res)[NR]) {
  switch (mr) {
    case 4: tile_n<WT, 4>(nr, x, ldx, w, ldw, K, res); break;
    case 3: tile_n<WT, 3>(nr, x, ldx, w, ldw, K, res); break;
    case 2: tile_n<WT, 2>(nr, x, ldx, w, ldw, K, res); break;
    default: tile_n<WT, 1>(nr, x, ldx, w, ldw, K, res); break;
  }
}

template <DType WT>
void gemm_t(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out, int threads) {
  const int64_t M = x.rows, N = w.rows, K = x.cols;
  const int64_t esz = int64_t(dtype_size(WT));
  const int64_t ldw = w.stride * esz;
  // A block of NB weight rows stays in cache while every row of x passes over it. With more rows of x
  // than one tile, a 16-bit block is widened to fp32 once (exactly) instead of once per tile.
  const int64_t NB = 16;
  const int64_t nblocks = (N + NB - 1) / NB;
  const bool widen = WT != DType::F32 && M > MR;
  const float* xp = x.ptr<float>();
  float* op = out.ptr<float>();
  const char* wp = static_cast<const char*>(w.data);
  const bool par = M * N * K > (1 << 16);
#pragma omp parallel num_threads(threads) if (par)
  {
    std::vector<float> wide(widen ? size_t(NB * K) : 0);
#pragma omp for schedule(static)
    for (int64_t nb = 0; nb < nblocks; ++nb) {
      const int64_t n_begin = nb * NB, nend = std::min(N, n_begin + NB);
      if (widen)
        for (int64_t j = n_begin; j < nend; ++j)
          convert_host(wp + j * ldw, WT, wide.data() + (j - n_begin) * K, DType::F32, size_t(K));
      for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int mr = int(std::min<int64_t>(MR, M - m0));
        for (int64_t n0 = n_begin; n0 < nend; n0 += NR) {
          const int nr = int(std::min<int64_t>(NR, nend - n0));
          float res[MR][NR];
          const float* xr = xp + m0 * x.stride;
          if (widen)
            run_tile<DType::F32>(mr, nr, xr, x.stride, reinterpret_cast<const char*>(wide.data() + (n0 - n_begin) * K),
                                 K * 4, K, res);
          else
            run_tile<WT>(mr, nr, xr, x.stride, wp + n0 * ldw, ldw, K, res);
          for (int i = 0; i < mr; ++i)
            for (int j = 0; j < nr; ++j) {
              float v = res[i][j];
              if (bias) v += load_f32(*bias, 0, n0 + j);
              op[(m0 + i) * out.stride + n0 + j] = v;
            }
        }
      }
    }
  }
}

}  // namespace

void gemm(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out, int threads) {
  QRT_CHECK(x.dtype == DType::F32 && out.dtype == DType::F32, "cpu linear: activations must be float32");
  QRT_CHECK(x.cols == w.cols && out.rows == x.rows && out.cols == w.rows,
            "cpu linear: shape mismatch x[", x.rows, ",", x.cols, "] w[", w.rows, ",", w.cols, "] out[",
            out.rows, ",", out.cols, "]");
  switch (w.dtype) {
    case DType::F32: gemm_t<DType::F32>(x, w, bias, out, threads); break;
    case DType::BF16: gemm_t<DType::BF16>(x, w, bias, out, threads); break;
    case DType::F16: gemm_t<DType::F16>(x, w, bias, out, threads); break;
    default: QRT_CHECK(false, "cpu linear: weight dtype ", dtype_name(w.dtype), " not supported");
  }
}

}  // namespace qrt::cpu
