// Kernels of the CPU backend (fp32 compute). Internal to cpp/backend/cpu/.
#pragma once
#include <cstdint>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "backend/cpu/thread_pool.h"
#include "backend/ops.h"

namespace qrt::cpu {

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint8_t v16b __attribute__((vector_size(16)));
// Half-width lanes: without AVX-512, GCC scalarizes some 16-lane operations (float16 widening, selects against a
// bound), so exp16 and f8x16_over_256 run on two 8-lane halves there (the same values lane by lane).
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef _Float16 v8f16 __attribute__((vector_size(16)));
typedef uint8_t v8b __attribute__((vector_size(8)));

// Calls f(std::integral_constant<int, c>) for a run-time c in 1..N (tile heights, heads, vectors of a row: counts
// the kernels unroll at compile time).
template <int N, typename F>
inline void with_const(int c, F&& f) {
  if constexpr (N > 1) {
    if (c == N) f(std::integral_constant<int, N>{});
    else with_const<N - 1>(c, f);
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

// IEEE half bit patterns widened to fp32 (exact), by F16C where present: GCC converts a vector of _Float16 one lane
// at a time, even with AVX512-FP16.
inline v8f half_to_f32(v8h bits) {
#if defined(__F16C__)
  __m128i b;
  std::memcpy(&b, &bits, 16);
  const __m256 f = _mm256_cvtph_ps(b);
  v8f v;
  std::memcpy(&v, &f, 32);
  return v;
#else
  v8f16 h;
  std::memcpy(&h, &bits, 16);
  return __builtin_convertvector(h, v8f);
#endif
}
inline v16f half_to_f32(v16h bits) {
#if defined(__AVX512F__)
  __m256i b;
  std::memcpy(&b, &bits, 32);
  const __m512 f = _mm512_cvtph_ps(b);
  v16f v;
  std::memcpy(&v, &f, 64);
  return v;
#else
  v8h h[2];
  std::memcpy(h, &bits, 32);
  const v8f f[2] = {half_to_f32(h[0]), half_to_f32(h[1])};
  v16f v;
  std::memcpy(&v, f, 64);
  return v;
#endif
}

// e4m3 values times 2^-8, exactly (VB bytes in, VF floats out, lane by lane): the 7 magnitude bits placed as a
// half's exponent and mantissa (bias 15 against e4m3's 7), then widened; NaN codes (S.1111.111) give NaN.
template <typename VB, typename VH, typename VF, typename VU>
inline VF f8_over_256(VB b) {
  const VH h = __builtin_convertvector(b, VH);
  const VH bits = ((h & 0x80) << 8) | ((h & 0x7f) << 7);
  VF v = half_to_f32(bits);
  const VU nan = (VU)(__builtin_convertvector(h & 0x7f, VU) == 0x7fu);
  VU u;
  std::memcpy(&u, &v, sizeof u);
  u = (u & ~nan) | (nan & 0x7fc00000u);
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// 16 e4m3 values times 2^-8, exactly.
inline v16f f8x16_over_256(const uint8_t* p) {
#if defined(__AVX512F__)
  v16b b;
  std::memcpy(&b, p, 16);
  return f8_over_256<v16b, v16h, v16f, v16u>(b);
#else
  v8b b[2];
  std::memcpy(b, p, 16);
  v8f h[2] = {f8_over_256<v8b, v8h, v8f, v8u>(b[0]), f8_over_256<v8b, v8h, v8f, v8u>(b[1])};
  v16f v;
  std::memcpy(&v, h, 64);
  return v;
#endif
}

// n e4m3 values as fp32 into out.
inline void f8_to_f32(const uint8_t* p, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const v16f v = f8x16_over_256(p + i) * 256.0f;
    std::memcpy(out + i, &v, 64);
  }
  for (; i < n; ++i) out[i] = f8e4m3_to_f32(p[i]);
}

#if defined(__AVX512F__)
// Lane j of the result: the sum of the 16 lanes of v[j], by a transpose-add tree (~45 instructions for 16
// sums); every j is summed in the same order, so a sum does not depend on its neighbours.
// (GCC 12 warns that the intrinsics' unused pass-through operands may be uninitialized: a false alarm.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
inline __m512 sum_lanes16(const __m512 (&v)[16]) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}
#pragma GCC diagnostic pop
#endif

// The 16 lanes of v added pairwise in a fixed order (lane i + w onto lane i, w = 8, 4, 2, 1). sum_lanes16 adds
// in another order (neighbouring lanes first): code that needs equal sums uses one of the two throughout.
inline float lane_sum(v16f v) {
  float a[16];
  std::memcpy(a, &v, 64);
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) a[i] += a[i + w];
  return a[0];
}

// exp(x) for x <= 0 in 16 lanes: 2^n * p(r) with r = x - n ln2, |r| <= ln2 / 2, a degree-6 polynomial
// (relative error ~2e-7), vectorized without -ffast-math. The same bits on every build with FMA (the multiply-adds
// fuse); a build without FMA rounds them twice.
template <typename VF, typename VI>
inline VF exp_lanes(VF x) {
  const VF lim = VF{} - 87.0f;  // keeps 2^n a normal number
  x = x < lim ? lim : x;
  const VF u = x * 1.44269504f + 0.5f;
  VI ni = __builtin_convertvector(u, VI);             // truncates toward zero
  ni += (VI)(__builtin_convertvector(ni, VF) > u);     // ... so step down to floor where needed
  const VF n = __builtin_convertvector(ni, VF);
  const VF r = x - n * 0.693145752f - n * 1.42860677e-6f;
  VF q = VF{} + 1.0f / 720.0f;
  q = q * r + 1.0f / 120.0f;
  q = q * r + 1.0f / 24.0f;
  q = q * r + 1.0f / 6.0f;
  q = q * r + 0.5f;
  q = q * r + 1.0f;
  q = q * r + 1.0f;
  return q * (VF)((ni + 127) << 23);
}
inline v16f exp16(v16f x) {
#if defined(__AVX512F__)
  return exp_lanes<v16f, v16i>(x);
#else
  v8f h[2];
  std::memcpy(h, &x, 64);
  h[0] = exp_lanes<v8f, v8i>(h[0]);
  h[1] = exp_lanes<v8f, v8i>(h[1]);
  std::memcpy(&x, h, 64);
  return x;
#endif
}

// In place: x[i] = exp(x[i] - shift) for i < n; returns their sum.
inline float exp_shift_sum(float* x, int64_t n, float shift) {
  v16f acc{};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v16f v;
    std::memcpy(&v, x + i, 64);
    v = exp16(v - shift);
    std::memcpy(x + i, &v, 64);
    acc += v;
  }
  float lanes[16];
  std::memcpy(lanes, &acc, 64);
  float s = 0.f;
  for (float l : lanes) s += l;
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - shift);
    s += x[i];
  }
  return s;
}

// Row r of a weight/activation tensor converted to fp32 into dst (cols elements).
void load_row_f32(const Tensor& t, int64_t r, float* dst);
// Element (r, c) as fp32.
float load_f32(const Tensor& t, int64_t r, int64_t c);
void store_row_f32(const float* src, Tensor& t, int64_t r);

// out[M,N] = x[M,K] @ w[N,K]^T (+ bias). x F32; w F32/F16/BF16. Each output element is computed by the
// same sequence of operations whatever M, N or the thread count (batch invariance).
void gemm(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out, ThreadPool& pool,
          bool accumulate = false);

// gemm with FP8 weights (gemm_fp8.cpp): out = x @ (w * scale)^T, the fp32 products of the dequantized weights.
void gemm_fp8(const Tensor& x, const Linear& w, const Tensor* bias, Tensor& out, ThreadPool& pool,
              bool accumulate = false);
// Throws std::runtime_error (naming op) unless w is FP8 with a scale grid that covers it.
void check_fp8_linear(const Linear& w, const char* op);
// Backend::quantize_fp8.
void quantize_fp8(const Tensor& src, Tensor& q, Tensor& scale, ThreadPool& pool);

// One K (or V) row of an fp8 KV cache (ops.h KvLayer): each head's cols / heads values x as e4m3(x / s) into q,
// s = amax|x| / 448 (1 where all are zero) into scale[head].
inline void quantize_kv_row(const float* x, int64_t cols, int heads, uint8_t* q, float* scale) {
  const int64_t D = cols / heads;
  for (int h = 0; h < heads; ++h) {
    const float* xh = x + h * D;
    float amax = 0.f;
    for (int64_t i = 0; i < D; ++i) amax = std::fmax(amax, std::fabs(xh[i]));
    const float s = amax > 0.f ? amax / 448.0f : 1.0f;
    for (int64_t i = 0; i < D; ++i) q[h * D + i] = f32_to_f8e4m3(xh[i] / s);
    scale[h] = s;
  }
}
// Its inverse: out = q8 * s per head (fp32 products).
inline void dequantize_kv_row(const uint8_t* q, const float* scale, int64_t cols, int heads, float* out) {
  const int64_t D = cols / heads;
  f8_to_f32(q, cols, out);
  for (int64_t i = 0; i < cols; ++i) out[i] *= scale[i / D];
}

void attention(const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& s,
               Tensor& out, ThreadPool& pool);

// Backend::summarize_pages and select_pages (sparse.cpp).
void summarize_pages(const KvLayer& cache, const AttnBatch& b, int64_t kv_cols, ThreadPool& pool);
void select_pages(const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& sh,
                  const SparseAttention& sp, float* scores, int32_t* pages, int32_t* keys, ThreadPool& pool);
// ops.h KvStaging's rule for kv head h, after select_pages wrote the lists.
void stage_pages(const KvLayer& cache, const AttnBatch& b, const AttnShape& sh, const SparseAttention& sp,
                 int32_t* pages, const int32_t* keys, int h);

void causal_conv1d(const Tensor& x, const Tensor& w, const AttnBatch& b, const DeltaNetShape& s, StateLayer& st,
                   Tensor& out, ThreadPool& pool);
void gated_delta_rule(const Tensor& qkv, const Tensor& a, const Tensor& b, const Tensor& a_log, const Tensor& dt_bias,
                      const AttnBatch& batch, const DeltaNetShape& s, StateLayer& st, Tensor& out, ThreadPool& pool);

void sample(const Tensor& logits, const std::vector<SampleRow>& rows, SampleResult& out, ThreadPool& pool);

}  // namespace qrt::cpu
