// Causal paged attention on the CPU, fp32. A task is a query row and a run of KV heads. Results do not depend
// on the batch (each task is independent). With AVX-512 or AVX2 + FMA (head_dim a multiple of the vector width,
// at most 16 vectors), the query heads of a KV head take their scores kW keys at a time (one lane sum per block of
// keys, not per key), sharing each key's loads, and their weighted sums of V rows in registers, several heads'
// chains interleaved: one 512-token prefill of issue 35's layer (12 / 4 heads of 64) went from 18-20 to 9-11 ms
// (AVX-512) and from 40-43 to 19-21 ms (AVX2 build) on one core (tools/attention_cpu_bench.cpp; the AVX-512
// results are bit-identical to the per-head code before). Otherwise the query heads of a GQA group share each K/V
// row load. The cache holds fp32, or bf16 / fp16 rows (16-bit weights: the KV dtype of a bf16 model, half the
// bytes a step reads), converted to fp32 as they are read, or fp8 rows with a scale per (row, kv head): a key's
// score is (q . k8) * scale * k_scale, and a value's weight p * v_scale multiplies its e4m3 values.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "backend/cpu/cpu_kernels.h"
#include "core/error.h"

namespace qrt::cpu {
namespace {

inline float dot(const float* a, const float* b, int n) {
  v16f acc{};
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    v16f x, y;
    std::memcpy(&x, a + i, 64);
    std::memcpy(&y, b + i, 64);
    acc += x * y;
  }
#if defined(__AVX512F__)
  float s = _mm512_reduce_add_ps(reinterpret_cast<__m512>(acc));
#else
  float s = lane_sum(acc);
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// The cache's element types: K/V rows of fp32, bf16 or fp16 (both 16-bit kinds stored as uint16_t).
struct F32Rows {
  using E = float;
};
struct Bf16Rows {
  using E = uint16_t;
};
struct F16Rows {
  using E = uint16_t;
};
struct F8Rows {
  using E = uint8_t;
};
// n elements as fp32: the row itself, or converted into buf (8 at a time with AVX2 / F16C).
inline const float* as_f32(F32Rows, const float* p, int, float*) { return p; }
inline const float* as_f32(Bf16Rows, const uint16_t* p, int n, float* buf) {
  int i = 0;
#if defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)));
    _mm256_storeu_ps(buf + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
#endif
  for (; i < n; ++i) buf[i] = bf16_to_f32(p[i]);
  return buf;
}
inline const float* as_f32(F16Rows, const uint16_t* p, int n, float* buf) {
  int i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
#endif
  for (; i < n; ++i) buf[i] = f16_to_f32(p[i]);
  return buf;
}
inline const float* as_f32(F8Rows, const uint8_t* p, int n, float* buf) {
  f8_to_f32(p, n, buf);
  return buf;
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// The vector path: kW-lane vectors (AVX-512: 16; AVX2: 8), head_dim a multiple of kW up to 16 vectors.
#if defined(__AVX512F__)
using AV = __m512;
constexpr int kW = 16;
inline AV av_load(F32Rows, const float* p) { return _mm512_loadu_ps(p); }
inline AV av_load(Bf16Rows, const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline AV av_load(F16Rows, const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline AV av_load(F8Rows, const uint8_t* p) {
  const v16f v = f8x16_over_256(p);
  return _mm512_mul_ps(reinterpret_cast<const __m512&>(v), _mm512_set1_ps(256.0f));
}
inline AV av_loadf(const float* p) { return _mm512_loadu_ps(p); }
inline AV av_set1(float x) { return _mm512_set1_ps(x); }
inline AV av_zero() { return _mm512_setzero_ps(); }
inline AV av_mul(AV a, AV b) { return _mm512_mul_ps(a, b); }
inline AV av_fma(AV a, AV b, AV c) { return _mm512_fmadd_ps(a, b, c); }
inline void av_store(float* p, AV v) { _mm512_storeu_ps(p, v); }
inline AV sum_lanes(const AV (&v)[kW]) { return sum_lanes16(v); }
inline void av_store_first(float* p, AV v, int m) { _mm512_mask_storeu_ps(p, __mmask16((1u << m) - 1), v); }
constexpr int kAccRegs = 16;  // accumulators of a weighted sum's pass (of 32 registers)
#else
using AV = __m256;
constexpr int kW = 8;
inline AV av_load(F32Rows, const float* p) { return _mm256_loadu_ps(p); }
inline AV av_load(Bf16Rows, const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline AV av_load(F16Rows, const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline AV av_load(F8Rows, const uint8_t* p) {
  alignas(32) float t[kW];
  f8_to_f32(p, kW, t);
  return _mm256_load_ps(t);
}
inline AV av_loadf(const float* p) { return _mm256_loadu_ps(p); }
inline AV av_set1(float x) { return _mm256_set1_ps(x); }
inline AV av_zero() { return _mm256_setzero_ps(); }
inline AV av_mul(AV a, AV b) { return _mm256_mul_ps(a, b); }
inline AV av_fma(AV a, AV b, AV c) { return _mm256_fmadd_ps(a, b, c); }
inline void av_store(float* p, AV v) { _mm256_storeu_ps(p, v); }
// Lane j: the sum of the 8 lanes of v[j] (pairs, then quads, then halves: the same order for every j).
inline AV sum_lanes(const AV (&v)[kW]) {
  const AV ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));  // quads of v0..v3
  const AV cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));  // quads of v4..v7
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}
inline void av_store_first(float* p, AV v, int m) {
  alignas(32) float t[kW];
  _mm256_store_ps(t, v);
  std::memcpy(p, t, sizeof(float) * m);
}
constexpr int kAccRegs = 8;  // (of 16 registers)
#endif
constexpr bool kVectorPath = true;
constexpr int kScoreHeads = 4;  // query heads whose scores share each key's loads

// Calls f(std::integral_constant<int, c>) for a run-time c in 1..N.
template <int N, typename F>
void with_const(int c, F&& f) {
  if constexpr (N >= 1) {
    if (c == N) f(std::integral_constant<int, N>{});
    else with_const<N - 1>(c, f);
  }
}

// scores[g * ld + p] = scale * q_g . k(p) for the query heads g < G of one KV head (q_g at q + g * C * kW) and the
// keys p < n, kW keys at a time: each key's C vectors of products (a product, then fused in order) summed by
// sum_lanes, kScoreHeads heads sharing each key's loads (a key past n in a block repeats the block's first; its
// score is dropped). A head's scores take the same operations whatever G. key(p) points at k(p) of kind R.
template <int C, typename R, typename KeyRow>
void group_scores(R kind, const float* q, int G, int n, float scale, KeyRow key, float* scores, int64_t ld) {
  for (int g0 = 0; g0 < G; g0 += kScoreHeads) {
    with_const<kScoreHeads>(std::min(kScoreHeads, G - g0), [&](auto heads) {
      constexpr int gn = decltype(heads)::value;
      const float* qg = q + int64_t(g0) * C * kW;
      for (int p0 = 0; p0 < n; p0 += kW) {
        AV v[gn][kW];
        for (int j = 0; j < kW; ++j) {
          const auto* k = key(p0 + j < n ? p0 + j : p0);
          AV kc[C];
          for (int c = 0; c < C; ++c) kc[c] = av_load(kind, k + c * kW);
          for (int g = 0; g < gn; ++g) {
            AV a = av_mul(av_loadf(qg + g * C * kW), kc[0]);
            for (int c = 1; c < C; ++c) a = av_fma(av_loadf(qg + (g * C + c) * kW), kc[c], a);
            v[g][j] = a;
          }
        }
        for (int g = 0; g < gn; ++g)
          av_store_first(scores + (g0 + g) * ld + p0, av_mul(sum_lanes(v[g]), av_set1(scale)), std::min(kW, n - p0));
      }
    });
  }
}

// out_g[0, C * kW) = sum over p < n of w_g[p] * v(p) (w_g at w + g * ld) for the heads g < G, accumulated in p
// order in registers, as many heads at a time as kAccRegs accumulators hold (their chains interleave; a head alone
// waits on its C chains). val(p) points at v(p) of kind R.
template <int C, typename R, typename ValRow>
void group_weighted_sum(R kind, const float* w, int64_t ld, int G, int n, ValRow val, float* out) {
  constexpr int per_pass = std::max(1, std::min(4, kAccRegs / C));
  for (int g0 = 0; g0 < G; g0 += per_pass) {
    with_const<per_pass>(std::min(per_pass, G - g0), [&](auto heads) {
      constexpr int gn = decltype(heads)::value;
      AV acc[gn][C];
      for (int g = 0; g < gn; ++g)
        for (int c = 0; c < C; ++c) acc[g][c] = av_zero();
      for (int p = 0; p < n; ++p) {
        const auto* v = val(p);
        AV vc[C];
        for (int c = 0; c < C; ++c) vc[c] = av_load(kind, v + c * kW);
        for (int g = 0; g < gn; ++g) {
          const AV wp = av_set1(w[(g0 + g) * ld + p]);
          for (int c = 0; c < C; ++c) acc[g][c] = av_fma(wp, vc[c], acc[g][c]);
        }
      }
      for (int g = 0; g < gn; ++g)
        for (int c = 0; c < C; ++c) av_store(out + ((g0 + g) * C + c) * kW, acc[g][c]);
    });
  }
}
#else
constexpr bool kVectorPath = false;
constexpr int kW = 16;
#endif

template <typename R>
void attention_rows(R kind, const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& s,
                    Tensor& out, ThreadPool& pool) {
  using E = typename R::E;
  const int D = s.head_dim, Hkv = s.kv_heads, group = s.q_heads / s.kv_heads;
  const int64_t kv_cols = int64_t(Hkv) * D;
  const E* kc = static_cast<const E*>(cache.k);
  const E* vc = static_cast<const E*>(cache.v);
  const E* host_kc = static_cast<const E*>(cache.host_k);
  const E* host_vc = static_cast<const E*>(cache.host_v);
  std::vector<int> row_seq(b.num_tokens);
  for (int si = 0; si < b.num_seqs; ++si)
    for (int r = b.q_start[si]; r < b.q_start[si + 1]; ++r) row_seq[r] = si;
  // A task is a query row and a run of KV heads: whole rows when there are enough of them (each
  // cache row is then taken by one task), single KV heads otherwise.
  const int heads_per_task = b.num_tokens >= 2 * pool.size() && !b.head_tables ? Hkv : 1;
  const int tasks_per_row = Hkv / heads_per_task;
  const int64_t tasks = int64_t(b.num_tokens) * tasks_per_row;
  const bool par = tasks > 1 && int64_t(b.max_ctx_len) * b.num_tokens * s.q_heads > 4096;
  std::atomic<int64_t> next{0};  // tasks taken one at a time by the next free thread
  // The vector path: head_dim a multiple of kW, up to 16 vectors.
  const bool vector_path = kVectorPath && D % kW == 0 && D / kW <= 16;
  pool.run(par, [&](int, int) {
    const int hq = heads_per_task * group;  // query heads of one task
    std::vector<float> scores(size_t(std::max(1, b.max_ctx_len)) * hq);
    std::vector<float> acc(size_t(D) * hq), inv(hq), row(size_t(D) * heads_per_task);
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      const int r = int(t / tasks_per_row), kh0 = int(t % tasks_per_row) * heads_per_task;
      const int si = row_seq[r];
      const int q_len = b.q_start[si + 1] - b.q_start[si];
      // The (sequence, kv head) list of the task's heads: one per head (a task of one head) or the sequence's.
      const int64_t list = b.head_tables ? int64_t(si) * Hkv + kh0 : si;
      const int n = b.ctx_len[list] - q_len + (r - b.q_start[si]) + 1;  // positions [0, pos]
      const int32_t* pages = b.page_table + list * b.max_pages;
      const float* qr = q.ptr<float>() + int64_t(r) * q.stride + int64_t(kh0) * group * D;
      // Key p's K (or V) row of head kh0 + kh: in the device tier, or (pages from host_page0 on) the host tier.
      auto at = [&](const E* dev, const E* host, int p, int kh) {
        const int page = pages[p / b.page_size];
        const bool on_host = page >= cache.host_page0;
        const int64_t r = int64_t(on_host ? page - cache.host_page0 : page) * b.page_size + p % b.page_size;
        return (on_host ? host : dev) + r * kv_cols + int64_t(kh0 + kh) * D;
      };
      // FP8: scores[h][p] *= the scale of key p's row of head h's kv head (K or V scales of either tier).
      auto scale_by = [&](const float* dev, const float* host, int heads) {
        for (int p = 0; p < n; ++p) {
          const int page = pages[p / b.page_size];
          const bool on_host = page >= cache.host_page0;
          const int64_t r = int64_t(on_host ? page - cache.host_page0 : page) * b.page_size + p % b.page_size;
          const float* sr = (on_host ? host : dev) + r * Hkv + kh0;
          for (int h = 0; h < heads; ++h) scores[size_t(h) * n + p] *= sr[h / group];
        }
      };
      if (vector_path) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
        with_const<16>(D / kW, [&](auto chunks) {
          for (int kh = 0; kh < heads_per_task; ++kh) {
            group_scores<decltype(chunks)::value>(kind, qr + int64_t(kh) * group * D, group, n, s.scale,
                                                  [&](int p) { return at(kc, host_kc, p, kh); },
                                                  scores.data() + size_t(kh) * group * n, n);
          }
        });
#endif
      } else {
        for (int p = 0; p < n; ++p) {
          const float* kr = as_f32(kind, at(kc, host_kc, p, 0), int(row.size()), row.data());
          for (int h = 0; h < hq; ++h) scores[size_t(h) * n + p] = dot(qr + h * D, kr + (h / group) * D, D) * s.scale;
        }
      }
      if constexpr (std::is_same_v<R, F8Rows>) scale_by(cache.k_scale, cache.host_k_scale, hq);
      for (int h = 0; h < hq; ++h) {
        float* sc = scores.data() + size_t(h) * n;
        float mx = -INFINITY;
        for (int p = 0; p < n; ++p) mx = std::max(mx, sc[p]);
        inv[h] = 1.f / exp_shift_sum(sc, n, mx);
      }
      if constexpr (std::is_same_v<R, F8Rows>) scale_by(cache.v_scale, cache.host_v_scale, hq);
      if (vector_path) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
        with_const<16>(D / kW, [&](auto chunks) {
          for (int kh = 0; kh < heads_per_task; ++kh) {
            group_weighted_sum<decltype(chunks)::value>(kind, scores.data() + size_t(kh) * group * n, n, group, n,
                                                        [&](int p) { return at(vc, host_vc, p, kh); },
                                                        acc.data() + size_t(kh) * group * D);
          }
        });
#endif
      } else {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int p = 0; p < n; ++p) {
          const float* vr = as_f32(kind, at(vc, host_vc, p, 0), int(row.size()), row.data());
          for (int h = 0; h < hq; ++h) {
            const float w = scores[size_t(h) * n + p];
            float* __restrict__ a = acc.data() + size_t(h) * D;
            const float* __restrict__ v = vr + (h / group) * D;
            for (int i = 0; i < D; ++i) a[i] += w * v[i];
          }
        }
      }
      float* orow = out.ptr<float>() + int64_t(r) * out.stride + int64_t(kh0) * group * D;
      for (int h = 0; h < hq; ++h)
        for (int i = 0; i < D; ++i) orow[h * D + i] = acc[size_t(h) * D + i] * inv[h];
    }
  });
}

}  // namespace

void attention(const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& s,
               Tensor& out, ThreadPool& pool) {
  QRT_CHECK(q.dtype == DType::F32, "cpu attention: float32 queries only");
  switch (cache.dtype) {
    case DType::F32: attention_rows(F32Rows{}, q, cache, b, s, out, pool); break;
    case DType::BF16: attention_rows(Bf16Rows{}, q, cache, b, s, out, pool); break;
    case DType::F16: attention_rows(F16Rows{}, q, cache, b, s, out, pool); break;
    case DType::F8E4M3:
      QRT_CHECK(cache.k_scale && cache.v_scale && cache.kv_heads == s.kv_heads, "cpu attention: an fp8 KV cache ",
                "needs its scales");
      attention_rows(F8Rows{}, q, cache, b, s, out, pool);
      break;
    default:
      QRT_CHECK(false, "cpu attention: KV cache of ", dtype_name(cache.dtype),
                " (float32, bfloat16, float16 or float8_e4m3)");
  }
}

}  // namespace qrt::cpu
