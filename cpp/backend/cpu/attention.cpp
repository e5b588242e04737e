// Causal paged attention on the CPU, fp32. A task is a block of one sequence's query rows for one KV head, taken
// a block of keys at a time so that its rows share each block of K and V rows while it is in the core's caches.
// A row's arithmetic is the same in any block, step or batch (tests/test_cpu_ops.py checks a row of a long chunk
// against the same row alone). With AVX-512 or AVX2 + FMA (head_dim a multiple of the vector width, at most 16
// vectors), the query heads of a KV head take their scores kW keys at a time (one lane sum per block of keys, not
// per key), sharing each key's loads, and their weighted sums of V rows in registers, several heads' chains
// interleaved. One causal prefill of issue 35's layer (12 / 4 heads of 64, tools/attention_cpu_bench.cpp, one
// core): 512 tokens 9.6 ms AVX-512 / 11.6 ms AVX2 (the rows alone, each reading its whole context: 10.0 / 13.8);
// 2,048 tokens 156 / 183 ms (248 / 338). The cache holds fp32, or bf16 / fp16 rows (16-bit weights: the KV dtype
// of a bf16 model, half the bytes a step reads), converted to fp32 as they are read, or fp8 rows with a scale per
// (row, kv head): a key's score is (q . k8) * scale * k_scale, and a value's weight p * v_scale multiplies its
// e4m3 values.

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
constexpr int kVecRegs = 32;
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
constexpr int kVecRegs = 16;
#endif
constexpr bool kVectorPath = true;
constexpr int kScoreHeads = 4;  // query heads whose scores share each key's loads
// Keys whose score chains run interleaved with gn heads': a power of two dividing kW, gn * KJ chains at most
// kChainRegs (with KJ key vectors, they fit the registers).
constexpr int kChainRegs = kW == 16 ? 12 : 8;
constexpr int chain_keys(int gn) {
  int kj = kW;
  while (kj > 1 && gn * kj > kChainRegs) kj /= 2;
  return kj;
}

// A row's vectors per weighted-sum pass for gn heads: gn x CC accumulators, CC values and a weight fit the
// registers, the row's C vectors split evenly.
constexpr int pass_vectors(int C, int gn) {
  const int most = std::max(1, (kVecRegs - 1) / (gn + 1)), passes = (C + most - 1) / most;
  return (C + passes - 1) / passes;
}

// scores[g * ld + p] = scale * q_g . k(p) for the query heads g < G of one KV head (q_g at q + g * C * kW) and the
// keys p < n, kW keys at a time: each key's C vectors of products (a product, then fused in order) summed by
// sum_lanes (a key past n in a block repeats the block's first; its score is dropped). Within a block, the chains
// of gn heads x KJ keys run interleaved (FMA latency, not a single chain, sets the pace otherwise) and land in
// prod; the arithmetic of a score is the same whatever G, gn and KJ. key(p) points at k(p) of kind R.
template <int C, typename R, typename KeyRow>
void group_scores(R kind, const float* q, int G, int p_begin, int n, float scale, KeyRow key, float* scores,
                  int64_t ld) {
  for (int g0 = 0; g0 < G; g0 += kScoreHeads) {
    with_const<kScoreHeads>(std::min(kScoreHeads, G - g0), [&](auto heads) {
      constexpr int gn = decltype(heads)::value;
      constexpr int KJ = chain_keys(gn);
      const float* qg = q + int64_t(g0) * C * kW;
      AV prod[gn][kW];
      for (int p0 = p_begin; p0 < n; p0 += kW) {
        for (int j0 = 0; j0 < kW; j0 += KJ) {
          const typename R::E* k[KJ];
          for (int j = 0; j < KJ; ++j) k[j] = key(p0 + j0 + j < n ? p0 + j0 + j : p0);
          AV a[gn][KJ];
          for (int c = 0; c < C; ++c) {
            AV kc[KJ];
            for (int j = 0; j < KJ; ++j) kc[j] = av_load(kind, k[j] + c * kW);
            for (int g = 0; g < gn; ++g) {
              const AV qc = av_loadf(qg + (g * C + c) * kW);
              for (int j = 0; j < KJ; ++j) a[g][j] = c == 0 ? av_mul(qc, kc[j]) : av_fma(qc, kc[j], a[g][j]);
            }
          }
          for (int g = 0; g < gn; ++g)
            for (int j = 0; j < KJ; ++j) prod[g][j0 + j] = a[g][j];
        }
        for (int g = 0; g < gn; ++g)
          av_store_first(scores + (g0 + g) * ld + p0, av_mul(sum_lanes(prod[g]), av_set1(scale)),
                         std::min(kW, n - p0));
      }
    });
  }
}

// out_g[0, C * kW) += sum over p_begin <= p < n of w_g[p] * v(p) (w_g at w + g * ld) for the heads g < G,
// accumulated in p order in registers (from and back to out, so a sum taken over consecutive key ranges equals one
// taken at once): up to 4 heads at a time and as many of a row's C vectors as the registers hold (their chains
// interleave; each element's sum is the same whatever the split). val(p) points at v(p) of kind R.
template <int C, typename R, typename ValRow>
void group_weighted_sum(R kind, const float* w, int64_t ld, int G, int p_begin, int n, ValRow val, float* out) {
  for (int g0 = 0; g0 < G; g0 += 4) {
    with_const<4>(std::min(4, G - g0), [&](auto heads) {
      constexpr int gn = decltype(heads)::value;
      constexpr int CC = pass_vectors(C, gn);
      for (int c0 = 0; c0 < C; c0 += CC) {
        with_const<CC>(std::min(CC, C - c0), [&](auto cols) {
          constexpr int cn = decltype(cols)::value;
          AV acc[gn][cn];
          for (int g = 0; g < gn; ++g)
            for (int c = 0; c < cn; ++c) acc[g][c] = av_loadf(out + ((g0 + g) * C + c0 + c) * kW);
          for (int p = p_begin; p < n; ++p) {
            const auto* v = val(p) + c0 * kW;
            AV vc[cn];
            for (int c = 0; c < cn; ++c) vc[c] = av_load(kind, v + c * kW);
            for (int g = 0; g < gn; ++g) {
              const AV wp = av_set1(w[(g0 + g) * ld + p]);
              for (int c = 0; c < cn; ++c) acc[g][c] = av_fma(wp, vc[c], acc[g][c]);
            }
          }
          for (int g = 0; g < gn; ++g)
            for (int c = 0; c < cn; ++c) av_store(out + ((g0 + g) * C + c0 + c) * kW, acc[g][c]);
        });
      }
    });
  }
}
#else
constexpr bool kVectorPath = false;
constexpr int kW = 16;
#endif

// Rows of one task: a block of a sequence's query rows for one KV head, taken kKeyBlock keys at a time so that the
// rows share each block of K and V rows while it is in the core's caches (a row reading all of a long context
// alone fetched it from L3 or memory once per row). A row's scores, softmax and weighted sums take the same
// operations in any block, so results do not depend on the blocking or the batch.
constexpr int kRowBlock = 16;
constexpr int kKeyBlock = 128;          // a multiple of kW
constexpr int64_t kScoreFloats = 1 << 18;  // a task's scores at most (1 MiB), unless one row needs more

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
  struct Task {
    int seq, kh, r0, rows;
  };
  std::vector<Task> tasks;
  int64_t scratch = 1, work = 0;  // scores per task at most; score count of the step
  for (int si = 0; si < b.num_seqs; ++si) {
    const int q0 = b.q_start[si], q_len = b.q_start[si + 1] - q0;
    for (int kh = 0; kh < Hkv; ++kh) {
      const int64_t list = b.head_tables ? int64_t(si) * Hkv + kh : si;
      const int n_last = b.ctx_len[list];  // keys of the sequence's last row
      const int rows = int(std::clamp<int64_t>(kScoreFloats / (int64_t(group) * n_last), 1, kRowBlock));
      for (int r0 = q0; r0 < q0 + q_len; r0 += rows) {
        tasks.push_back({si, kh, r0, std::min(rows, q0 + q_len - r0)});
        scratch = std::max(scratch, int64_t(tasks.back().rows) * group * (n_last + kW));
      }
      work += int64_t(q_len) * group * n_last;
    }
  }
  const bool par = tasks.size() > 1 && work > 4096;
  std::atomic<size_t> next{0};  // tasks taken one at a time by the next free thread
  // The vector path: head_dim a multiple of kW, up to 16 vectors.
  const bool vector_path = kVectorPath && D % kW == 0 && D / kW <= 16;
  pool.run(par, [&](int, int) {
    std::vector<float> scores(static_cast<size_t>(scratch)), acc(size_t(kRowBlock) * group * D),
        inv(size_t(kRowBlock) * group), row(D);
    for (size_t ti; (ti = next.fetch_add(1, std::memory_order_relaxed)) < tasks.size();) {
      const Task& t = tasks[ti];
      const int si = t.seq, kh = t.kh, hq = t.rows * group;  // (row, head) pairs of the task
      const int q_len = b.q_start[si + 1] - b.q_start[si];
      // The (sequence, kv head) page list: one per head (sparse attention) or the sequence's.
      const int64_t list = b.head_tables ? int64_t(si) * Hkv + kh : si;
      const int n0 = b.ctx_len[list] - q_len + (t.r0 - b.q_start[si]) + 1;  // row i sees keys [0, n0 + i)
      const int n_max = n0 + t.rows - 1;
      const int64_t ld = n_max;  // scores of pair (i, g) at scores + (i * group + g) * ld
      const int32_t* pages = b.page_table + list * b.max_pages;
      auto q_at = [&](int i) { return q.ptr<float>() + int64_t(t.r0 + i) * q.stride + int64_t(kh) * group * D; };
      // Key p's K (or V) row of head kh: in the device tier, or (pages from host_page0 on) the host tier.
      auto at = [&](const E* dev, const E* host, int p) {
        const int page = pages[p / b.page_size];
        const bool on_host = page >= cache.host_page0;
        const int64_t r = int64_t(on_host ? page - cache.host_page0 : page) * b.page_size + p % b.page_size;
        return (on_host ? host : dev) + r * kv_cols + int64_t(kh) * D;
      };
      // The K or V rows of keys [kb, kb + kKeyBlock), looked up once per block for all the task's rows.
      const E* rows_of_block[kKeyBlock];
      int block0 = 0;
      auto look_up = [&](const E* dev, const E* host, int kb) {
        block0 = kb;
        for (int p = kb; p < std::min(kb + kKeyBlock, n_max); ++p) rows_of_block[p - kb] = at(dev, host, p);
      };
      auto key = [&](int p) { return rows_of_block[p - block0]; };
      auto val = key;
      // FP8: scores of row i times the scale of key p's row (K or V scales of either tier).
      auto scale_by = [&](const float* dev, const float* host) {
        for (int i = 0; i < t.rows; ++i)
          for (int p = 0; p < n0 + i; ++p) {
            const int page = pages[p / b.page_size];
            const bool on_host = page >= cache.host_page0;
            const int64_t r = int64_t(on_host ? page - cache.host_page0 : page) * b.page_size + p % b.page_size;
            const float sc = ((on_host ? host : dev) + r * Hkv)[kh];
            for (int g = 0; g < group; ++g) scores[size_t(i * group + g) * ld + p] *= sc;
          }
      };
      for (int kb = 0; kb < n_max; kb += kKeyBlock) {
        look_up(kc, host_kc, kb);
        for (int i = 0; i < t.rows; ++i) {
          const int end = std::min(kb + kKeyBlock, n0 + i);
          float* sc = scores.data() + size_t(i) * group * ld;
          if (vector_path) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
            with_const<16>(D / kW, [&](auto chunks) {
              group_scores<decltype(chunks)::value>(kind, q_at(i), group, kb, end, s.scale, key, sc, ld);
            });
#endif
          } else {
            for (int p = kb; p < end; ++p) {
              const float* kr = as_f32(kind, key(p), D, row.data());
              for (int g = 0; g < group; ++g) sc[g * ld + p] = dot(q_at(i) + g * D, kr, D) * s.scale;
            }
          }
        }
      }
      if constexpr (std::is_same_v<R, F8Rows>) scale_by(cache.k_scale, cache.host_k_scale);
      for (int h = 0; h < hq; ++h) {
        float* sc = scores.data() + size_t(h) * ld;
        const int n = n0 + h / group;
        float mx = -INFINITY;
        for (int p = 0; p < n; ++p) mx = std::max(mx, sc[p]);
        inv[h] = 1.f / exp_shift_sum(sc, n, mx);
      }
      if constexpr (std::is_same_v<R, F8Rows>) scale_by(cache.v_scale, cache.host_v_scale);
      std::fill(acc.begin(), acc.begin() + int64_t(hq) * D, 0.f);
      for (int kb = 0; kb < n_max; kb += kKeyBlock) {
        look_up(vc, host_vc, kb);
        for (int i = 0; i < t.rows; ++i) {
          const int end = std::min(kb + kKeyBlock, n0 + i);
          const float* w = scores.data() + size_t(i) * group * ld;
          float* a = acc.data() + size_t(i) * group * D;
          if (vector_path) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
            with_const<16>(D / kW, [&](auto chunks) {
              group_weighted_sum<decltype(chunks)::value>(kind, w, ld, group, kb, end, val, a);
            });
#endif
          } else {
            for (int p = kb; p < end; ++p) {
              const float* vr = as_f32(kind, val(p), D, row.data());
              for (int g = 0; g < group; ++g) {
                const float wp = w[g * ld + p];
                float* __restrict__ ag = a + size_t(g) * D;
                for (int d = 0; d < D; ++d) ag[d] += wp * vr[d];
              }
            }
          }
        }
      }
      for (int i = 0; i < t.rows; ++i) {
        float* orow = out.ptr<float>() + int64_t(t.r0 + i) * out.stride + int64_t(kh) * group * D;
        for (int g = 0; g < group; ++g) {
          const int h = i * group + g;
          for (int d = 0; d < D; ++d) orow[g * D + d] = acc[size_t(h) * D + d] * inv[h];
        }
      }
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
