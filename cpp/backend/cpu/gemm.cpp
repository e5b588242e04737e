// Cache-blocked GEMM for y = x @ w^T with weights kept in their stored dtype, in fp32 arithmetic: float32 weights
// exactly, 16-bit ones widened exactly (bf16 weights multiply x rounded to bf16, the contract of ops.h).
// Tiles of MR x NR dot products share loads; each dot product keeps 16 fp32 lanes accumulated in K order,
// then a fixed pairwise lane sum (AVX-512: sum_lanes16, 16 accumulators at a time), so results do not depend
// on the tiling (batch invariance); tails past K / 16 * 16 add in K order by fma. Without AVX-512 but with AVX2 +
// FMA, the 16 lanes are two 8-lane halves accumulated in two passes (16 registers), summed by lane_sum's order,
// which is not sum_lanes16's: results agree within rounding across the two builds, not bit for bit.
// From kPackedMinRows x rows (prefill) the same chains of products run as outer products over packed x tiles and
// weight panels (gemm_packed), bit-identical to the few-row tiles.
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "backend/cpu/cpu_kernels.h"
#include "core/error.h"

namespace qrt::cpu {
namespace {

// n floats of buf, 64-byte aligned (a vector load that crosses a cache line costs two).
inline float* aligned_floats(std::vector<float>& buf, size_t n) {
  buf.resize(n + 16);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
}

// Tiles that read weight rows in place (few x rows: decode) prefetch each 64-byte line of the rows kPrefetchTiles
// tiles on (the rows a thread walks next when the x rows fit one tile; with more, the last tiles of a pass
// prefetch ahead of the next pass's start, which is harmless). Addresses past the last row are only prefetched
// (no fault on x86), never read. On a 2-core AVX512-BF16 VM this took one decode step's bf16 products at 1 / 8
// rows from 4.86 / 6.33 to 4.60 / 5.04 ms (tools/gemm_cpu_bench.cpp); fp32 at 8 rows 43 -> 33 ms and fp16 at 1
// row 21 -> 16 ms on a Sapphire Rapids VM (one thread, issue 35's step, tools/gemm_cpu_bench.cpp).
constexpr int kPrefetchTiles = 2;

constexpr int kLanes = 16;
constexpr int MR = 4;  // rows of x per tile
constexpr int NR = 4;  // rows of w per tile

// A tile's dot products: up to 8 rows of x by up to 8 rows of w (every tile family fits).
using TileResult = float[8][8];

// out[m0 + i, n0 + j] = res[i * ldr + j] (+ bias[n0 + j]).
// accumulate: out += the tile (the residual connection of linear_add).
inline void store_tile(const float* res, int ldr, int mr, int nr, int64_t m0, int64_t n0, const Tensor* bias,
                       Tensor& out, bool accumulate) {
  float* op = out.ptr<float>();
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) {
      float v = res[i * ldr + j];
      if (bias) v += load_f32(*bias, 0, n0 + j);
      float& o = op[(m0 + i) * out.stride + n0 + j];
      o = accumulate ? o + v : v;
    }
}

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
  v16h h;
  std::memcpy(&h, static_cast<const uint16_t*>(base) + i, 32);
  return half_to_f32(h);
}

template <DType WT> inline float load_w1(const void* base, int64_t i);
template <> inline float load_w1<DType::F32>(const void* b, int64_t i) { return static_cast<const float*>(b)[i]; }
template <> inline float load_w1<DType::BF16>(const void* b, int64_t i) { return bf16_to_f32(static_cast<const uint16_t*>(b)[i]); }
template <> inline float load_w1<DType::F16>(const void* b, int64_t i) { return f16_to_f32(static_cast<const uint16_t*>(b)[i]); }

#if defined(__AVX512F__)
// out[a] = the lane sum of acc[a] for a < n, by sum_lanes16 over groups of 16 (zeros pad the last group):
// the same order for every accumulator of every tile shape.
template <int n>
inline void lane_sums(const __m512* acc, float* out) {
  for (int g = 0; g < (n + 15) / 16; ++g) {
    __m512 v[16];
    alignas(64) float sums[16];
    for (int q = 0; q < 16; ++q) v[q] = g * 16 + q < n ? acc[g * 16 + q] : _mm512_setzero_ps();
    _mm512_store_ps(sums, sum_lanes16(v));
    for (int q = 0; q < 16 && g * 16 + q < n; ++q) out[g * 16 + q] = sums[q];
  }
}
#endif

// One tile: rows m0..m0+mr of x against rows n0..n0+nr of w.
template <DType WT, int mr, int nr>
void tile(const float* x, int64_t ldx, const char* w, int64_t ldw_bytes, int64_t K, TileResult& res) {
  v16f acc[mr][nr];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) acc[i][j] = v16f{};
  const int64_t kv = K / kLanes * kLanes;
  const int64_t esz = WT == DType::F32 ? 4 : 2;
  for (int64_t k = 0; k < kv; k += kLanes) {
    v16f wv[nr];
    if (k * esz % 64 == 0)
      for (int j = 0; j < nr; ++j) __builtin_prefetch(w + (j + kPrefetchTiles * nr) * ldw_bytes + k * esz, 0, 3);
    for (int j = 0; j < nr; ++j) wv[j] = load_w<WT>(w + j * ldw_bytes, k);
    for (int i = 0; i < mr; ++i) {
      v16f xv;
      std::memcpy(&xv, x + i * ldx + k, 64);
      for (int j = 0; j < nr; ++j) acc[i][j] += xv * wv[j];
    }
  }
  float sums[mr][nr];
#if defined(__AVX512F__)
  lane_sums<mr * nr>(reinterpret_cast<const __m512*>(&acc[0][0]), &sums[0][0]);
#else
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) sums[i][j] = lane_sum(acc[i][j]);
#endif
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) {
      float tail = 0.f;
      for (int64_t k = kv; k < K; ++k) tail = std::fma(x[i * ldx + k], load_w1<WT>(w + j * ldw_bytes, k), tail);
      res[i][j] = sums[i][j] + tail;
    }
}

// dst[k] = src[k] rounded to bf16 (nearest even; NaN stays NaN) as fp32, 16 at a time: f32_to_bf16's rule.
inline void round_to_bf16(const float* src, int64_t n, float* dst) {
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    v16u u;
    std::memcpy(&u, src + k, 64);
    // All ones where |u| > inf (NaN), by the sign of inf - |u| (a shift: AVX2 builds scalarize a 16-lane compare).
    const v16u nan = (v16u)((v16i)(0x7f800000u - (u & 0x7fffffffu)) >> 31);
    const v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    const v16u quiet = (u | 0x400000u) & 0xffff0000u;
    u = (rounded & ~nan) | (quiet & nan);
    std::memcpy(dst + k, &u, 64);
  }
  for (; k < n; ++k) dst[k] = bf16_to_f32(f32_to_bf16(src[k]));
}

// An x row for the AVX2 bf16 tiles (tile_bf16_pairs): each whole 16-element block as its 8 even elements,
// then its 8 odd ones; the tail stays in place.
inline void permute_x_pairs(float* row, int64_t K) {
  float t[kLanes];
  for (int64_t k = 0; k + kLanes <= K; k += kLanes) {
    for (int j = 0; j < 8; ++j) t[j] = row[k + 2 * j], t[8 + j] = row[k + 2 * j + 1];
    std::memcpy(row + k, t, sizeof t);
  }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
constexpr bool kAvx2Tiles = true;

// Eight elements of a weight row as fp32.
template <DType WT> inline __m256 load_w8(const void* base, int64_t i);
template <> inline __m256 load_w8<DType::F32>(const void* base, int64_t i) {
  return _mm256_loadu_ps(static_cast<const float*>(base) + i);
}
template <> inline __m256 load_w8<DType::BF16>(const void* base, int64_t i) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
template <> inline __m256 load_w8<DType::F16>(const void* base, int64_t i) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i)));
}

// lane_sum of the 16 lanes lo | hi, in the same pairwise order.
inline float lane_sum(__m256 lo, __m256 hi) {
  const __m256 s = _mm256_add_ps(lo, hi);                                          // a[i] += a[i + 8]
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));  // a[i] += a[i + 4]
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));                                          // a[i] += a[i + 2]
  q = _mm_add_ss(q, _mm_movehdup_ps(q));                                           // a[0] += a[1]
  return _mm_cvtss_f32(q);
}

// The two passes of an AVX2 tile: pass h multiplies the 8 elements x[i][kb + 8 h ..] by weight(h, j, kb),
// the 8-lane weight vector of row j that pairs with them, for every whole 16-element block kb, each lane
// in K order through fused multiply-adds; part[h][i][j] gets pass h's 8 lanes. The second pass reads the
// tile's weights from cache, so only mr x nr accumulators are live at a time.
template <int mr, int nr, typename WeightVec, typename Ahead>
inline void accumulate_halves(const float* x, int64_t ldx, int64_t kv, WeightVec weight, Ahead ahead,
                              float (&part)[2][mr][nr][8]) {
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    __m256 acc[mr][nr];
#pragma GCC unroll 8
    for (int i = 0; i < mr; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < nr; ++j) acc[i][j] = _mm256_setzero_ps();
    for (int64_t kb = 0; kb < kv; kb += kLanes) {
      if (h == 0) ahead(kb);
      __m256 wv[nr];
#pragma GCC unroll 8
      for (int j = 0; j < nr; ++j) wv[j] = weight(h, j, kb);
#pragma GCC unroll 8
      for (int i = 0; i < mr; ++i) {
        __m256 xv = _mm256_loadu_ps(x + i * ldx + kb + 8 * h);
        asm("" : "+x"(xv));  // one load, not one per fma (as in panel_tile)
#pragma GCC unroll 8
        for (int j = 0; j < nr; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < mr; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < nr; ++j) _mm256_storeu_ps(part[h][i][j], acc[i][j]);
  }
}

// res[i][j]: the lanes of part[.][i][j] added by lane_sum2(pass 0, pass 1), plus the products past kv in K order.
template <DType WT, int mr, int nr, typename LaneSum2>
inline void finish_halves(const float (&part)[2][mr][nr][8], LaneSum2 lane_sum2, const float* x, int64_t ldx,
                          const char* w, int64_t ldw_bytes, int64_t kv, int64_t K, TileResult& res) {
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) {
      float tail = 0.f;
      for (int64_t k = kv; k < K; ++k) tail = std::fma(x[i * ldx + k], load_w1<WT>(w + j * ldw_bytes, k), tail);
      res[i][j] = lane_sum2(_mm256_loadu_ps(part[0][i][j]), _mm256_loadu_ps(part[1][i][j])) + tail;
    }
}

// tile() with each 16-lane accumulator held as two 8-lane halves: lanes 0-7 take the elements k with
// k % 16 < 8, lanes 8-15 the others (accumulate_halves).
template <DType WT, int mr, int nr>
void tile_avx2(const float* x, int64_t ldx, const char* w, int64_t ldw_bytes, int64_t K, TileResult& res) {
  const int64_t kv = K / kLanes * kLanes;
  float part[2][mr][nr][8];
  const int64_t esz = WT == DType::F32 ? 4 : 2;
  accumulate_halves<mr, nr>(x, ldx, kv, [&](int h, int j, int64_t kb) {
    return load_w8<WT>(w + j * ldw_bytes, kb + 8 * h);
  }, [&](int64_t kb) {
    if (kb * esz % 64 == 0)
      for (int j = 0; j < nr; ++j) _mm_prefetch(w + (j + kPrefetchTiles * nr) * ldw_bytes + kb * esz, _MM_HINT_T0);
  }, part);
  finish_halves<WT>(part, [](__m256 lo, __m256 hi) { return lane_sum(lo, hi); }, x, ldx, w, ldw_bytes, kv, K, res);
}

// bf16 weights against x permuted within each 16-element block (its 8 even elements, then its 8 odd ones):
// one 16-element load of a weight row gives the even elements (shifted up) and the odd ones (masked) as
// fp32, i.e. the lanes of residues 2j and 2j + 1. Every residue accumulates the same products in the same K
// order as tile_avx2, and the lanes go back to residue order for the same lane sum: bit-identical results,
// with fewer instructions per weight (one tile row: both residue sets in one pass over the weights).
inline __m256 bf16_even(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline __m256 bf16_odd(__m256i v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xffff0000u))));
}
// lane_sum of the residues r[2j] = even[j], r[2j + 1] = odd[j].
inline float lane_sum_pairs(__m256 even, __m256 odd) {
  const __m256 a = _mm256_unpacklo_ps(even, odd), b = _mm256_unpackhi_ps(even, odd);
  return lane_sum(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// Rows of permuted x (x_pairs) against rows of bf16 w; the tail past K / 16 * 16 is in place, as in tile_avx2.
template <int mr, int nr>
void tile_bf16_pairs(const float* xp, int64_t ldx, const char* w, int64_t ldw_bytes, int64_t K, TileResult& res) {
  const int64_t kv = K / kLanes * kLanes;
  auto wrow = [&](int j, int64_t k) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const uint16_t*>(w + j * ldw_bytes) + k));
  };
  float part[2][mr][nr][8];
  if constexpr (mr == 1) {  // 2 nr accumulators: even and odd residues in one pass
    __m256 ae[nr], ao[nr];
#pragma GCC unroll 8
    for (int j = 0; j < nr; ++j) ae[j] = ao[j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < kv; k += kLanes) {
      const __m256 xe = _mm256_loadu_ps(xp + k), xo = _mm256_loadu_ps(xp + k + 8);
      if ((k & 31) == 0) {  // each 64-byte line of the next tile's rows (the caller walks rows upward)
#pragma GCC unroll 8
        for (int j = 0; j < nr; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(w + (j + nr) * ldw_bytes) + 2 * k, _MM_HINT_T0);
      }
#pragma GCC unroll 8
      for (int j = 0; j < nr; ++j) {
        const __m256i v = wrow(j, k);
        ae[j] = _mm256_fmadd_ps(xe, bf16_even(v), ae[j]);
        ao[j] = _mm256_fmadd_ps(xo, bf16_odd(v), ao[j]);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < nr; ++j) {
      _mm256_storeu_ps(part[0][0][j], ae[j]);
      _mm256_storeu_ps(part[1][0][j], ao[j]);
    }
  } else {  // even residues, then odd ones
    accumulate_halves<mr, nr>(xp, ldx, kv, [&](int h, int j, int64_t kb) {
      return h == 0 ? bf16_even(wrow(j, kb)) : bf16_odd(wrow(j, kb));
    }, [&](int64_t kb) {
      if (kb % 32 == 0)
        for (int j = 0; j < nr; ++j) _mm_prefetch(w + (j + kPrefetchTiles * nr) * ldw_bytes + 2 * kb, _MM_HINT_T0);
    }, part);
  }
  finish_halves<DType::BF16>(part, lane_sum_pairs, xp, ldx, w, ldw_bytes, kv, K, res);
}

// Calls f(std::integral_constant<int, nc>) for the AVX2 tile width nc = min(nr, cap) of a tile of mr rows:
// 1 x 4 (decode), 2 x 4, 3 x 3 and 4 x 3, at most 12 accumulators and their operands in 16 registers.
template <int mr, typename F>
void with_avx2_cols(int nr, F&& f) {
  constexpr int cap = mr <= 2 ? 4 : 3;
  if (nr >= cap) f(std::integral_constant<int, cap>{});
  else if (nr == 3) f(std::integral_constant<int, 3>{});
  else if (nr == 2) f(std::integral_constant<int, 2>{});
  else f(std::integral_constant<int, 1>{});
}

template <DType WT, int mr>
void tile_n(int nr, const float* x, int64_t ldx, const char* w, int64_t ldw, int64_t K, TileResult& res) {
  if constexpr (mr <= 4)
    with_avx2_cols<mr>(nr, [&](auto cols) { tile_avx2<WT, mr, decltype(cols)::value>(x, ldx, w, ldw, K, res); });
  else
    tile<WT, mr, 1>(x, ldx, w, ldw, K, res);  // not planned (tile heights stay <= 4)
}
#else
constexpr bool kAvx2Tiles = false;

template <DType WT, int mr>
void tile_n(int nr, const float* x, int64_t ldx, const char* w, int64_t ldw, int64_t K, TileResult& res) {
  if constexpr (mr > 4) {  // 8 x 3 at most (fp32 weights; 8 x 2 for 16-bit ones, widened in registers)
    if (nr >= 3 && WT == DType::F32) tile<WT, mr, 3>(x, ldx, w, ldw, K, res);
    else if (nr == 2) tile<WT, mr, 2>(x, ldx, w, ldw, K, res);
    else tile<WT, mr, 1>(x, ldx, w, ldw, K, res);
  } else {
    switch (nr) {
      case 4: tile<WT, mr, 4>(x, ldx, w, ldw, K, res); break;
      case 3: tile<WT, mr, 3>(x, ldx, w, ldw, K, res); break;
      case 2: tile<WT, mr, 2>(x, ldx, w, ldw, K, res); break;
      default: tile<WT, mr, 1>(x, ldx, w, ldw, K, res); break;
    }
  }
}

#endif

// Exact conversion of one weight row to fp32.
template <DType WT>
void widen_row(const char* w, int64_t K, float* dst) {
  const int64_t kv = K / kLanes * kLanes;
  for (int64_t k = 0; k < kv; k += kLanes) {
    const v16f v = load_w<WT>(w, k);
    std::memcpy(dst + k, &v, 64);
  }
  for (int64_t k = kv; k < K; ++k) dst[k] = load_w1<WT>(w, k);
}

template <DType WT>
void run_tile(int mr, int nr, const float* x, int64_t ldx, const char* w, int64_t ldw, int64_t K, TileResult& res,
              bool x_pairs) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  if constexpr (WT == DType::BF16) {
    if (x_pairs) {
      with_const<8>(mr, [&](auto rows) {
        constexpr int rows_v = decltype(rows)::value;
        if constexpr (rows_v <= 4)
          with_avx2_cols<rows_v>(nr, [&](auto cols) {
            tile_bf16_pairs<rows_v, decltype(cols)::value>(x, ldx, w, ldw, K, res);
          });
      });
      return;
    }
  }
#endif
  (void)x_pairs;
  with_const<8>(mr, [&](auto rows) { tile_n<WT, decltype(rows)::value>(nr, x, ldx, w, ldw, K, res); });
}

// x_pairs: x's rows are permuted for tile_bf16_pairs (bf16 weights, AVX2, fewer than 16 rows).
template <DType WT>
void gemm_t(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out, ThreadPool& pool, bool accumulate,
            bool x_pairs = false) {
  const int64_t M = x.rows, N = w.rows, K = x.cols;
  const int64_t esz = int64_t(dtype_size(WT));
  const int64_t ldw = w.stride * esz;
  // A block of NB weight rows stays in cache while every row of x passes over it.
  // Tiles: up to 4 x 4 for few rows (decode), 8 x 3 (fp32) or 8 x 2 for 5..15 rows (each weight load serves
  // 8 rows), and from 16 rows (up to kPackedMinRows; all of them in builds without AVX2) a 16-bit block is
  // widened to fp32 once (exactly) and then 4 x 4 tiles. AVX2 tiles (tile_n): 1 x 4, 2 x 4, 3 x 3, 4 x 3.
  const int64_t NB = 16;
  const int64_t nblocks = (N + NB - 1) / NB;
  const bool widen = WT != DType::F32 && M >= 16;
  const int64_t tm = kAvx2Tiles ? std::min<int64_t>(M, 4) : (M > 4 && M < 16) ? 8 : MR;
  const int64_t tn = kAvx2Tiles ? (tm <= 2 ? 4 : 3) : tm > 4 ? (WT == DType::F32 ? 3 : 2) : NR;
  const float* xp = x.ptr<float>();
  const char* wp = static_cast<const char*>(w.data);
  const bool par = M * N * K > (1 << 16);
  pool.run(par, [&](int t, int T) {
    std::vector<float> wide(widen ? size_t(NB * K) : 0);
    const auto [nb_begin, nb_end] = ThreadPool::static_range(nblocks, t, T);
    for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
      const int64_t n_begin = nb * NB, nend = std::min(N, n_begin + NB);
      if (widen)
        for (int64_t j = n_begin; j < nend; ++j) widen_row<WT>(wp + j * ldw, K, wide.data() + (j - n_begin) * K);
      for (int64_t m0 = 0; m0 < M; m0 += tm) {
        const int mr = int(std::min<int64_t>(tm, M - m0));
        for (int64_t n0 = n_begin; n0 < nend; n0 += tn) {
          const int nr = int(std::min<int64_t>(tn, nend - n0));
          TileResult res;
          const float* xr = xp + m0 * x.stride;
          if (widen)
            run_tile<DType::F32>(mr, nr, xr, x.stride, reinterpret_cast<const char*>(wide.data() + (n0 - n_begin) * K),
                                 K * 4, K, res, false);
          else
            run_tile<WT>(mr, nr, xr, x.stride, wp + n0 * ldw, ldw, K, res, x_pairs);
          store_tile(&res[0][0], 8, mr, nr, m0, n0, bias, out, accumulate);
        }
      }
    }
  });
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// ---- Many rows (prefill): the same chains as outer products ------------------------------------------------
// The few-row tiles compute output (i, j) as 16 chains: chain l takes x[i][k] w[j][k] for k = l mod 16 in K order
// by fma; the build's lane sum adds the chains, then the tail past K / 16 * 16 adds by fma in K order. Here chain l
// of a tile of kTileRows x rows by a panel of kPanelCols weight rows is an outer product: per step, one broadcast
// x element per row against kTileVecs weight vectors, each vector element one output's chain, so the register
// tile needs no lane sum (per step: kTileVecs loads and kTileRows broadcasts for kTileRows x kTileVecs fma's). The
// chains go to scratch and the lane sum's tree adds them elementwise: every output gets the few-row tiles'
// operations in their order, bit-identical; only the data layout and the register blocking differ. This runs at 1.45x the dot-product tiles' rate on a Sapphire Rapids
// core (issue 35's prefill GEMMs, tools/gemm_cpu_bench.cpp).
// Packed layouts: x tiles [chain][step][kTileRows], panels [chain][step][kPanelCols] (16-bit weights widened
// exactly), then the panel's tail [K - K / 16 * 16][kPanelCols]; rows past the matrix are zeros, their outputs
// dropped.
#if defined(__AVX512F__)
using VecF = __m512;
constexpr int kVecLanes = 16, kTileRows = 12, kTileVecs = 2;  // 24 accumulators + 2 weights + 1 broadcast of 32
inline VecF vload(const float* p) { return _mm512_load_ps(p); }
inline void vstore(float* p, VecF v) { _mm512_store_ps(p, v); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline VecF vadd(VecF a, VecF b) { return _mm512_add_ps(a, b); }
inline VecF vzero() { return _mm512_setzero_ps(); }
inline VecF vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline VecF vloadu(const float* p) { return _mm512_loadu_ps(p); }
inline void vstoreu(float* p, VecF v) { _mm512_storeu_ps(p, v); }
#else
using VecF = __m256;
constexpr int kVecLanes = 8, kTileRows = 6, kTileVecs = 2;  // 12 accumulators + 2 weights + 1 broadcast of 16
inline VecF vload(const float* p) { return _mm256_load_ps(p); }
inline void vstore(float* p, VecF v) { _mm256_store_ps(p, v); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline VecF vadd(VecF a, VecF b) { return _mm256_add_ps(a, b); }
inline VecF vzero() { return _mm256_setzero_ps(); }
inline VecF vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline VecF vloadu(const float* p) { return _mm256_loadu_ps(p); }
inline void vstoreu(float* p, VecF v) { _mm256_storeu_ps(p, v); }
#endif
constexpr int kChains = 16;
constexpr int kPanelCols = kVecLanes * kTileVecs;

// chains[l][i][j] (l < kChains, i < mr, j < kPanelCols): chain l of x tile row i by panel row j.
template <int mr>
void tile_chains(const float* xs, const float* ws, int64_t steps, float* chains) {
  for (int l = 0; l < kChains; ++l) {
    VecF acc[mr][kTileVecs];
#pragma GCC unroll 16
    for (int i = 0; i < mr; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < kTileVecs; ++v) acc[i][v] = vzero();
    const auto* a = xs + l * steps * kTileRows;
    const auto* b = ws + l * steps * kPanelCols;
    for (int64_t s = 0; s < steps; ++s, a += kTileRows, b += kPanelCols) {
      VecF wv[kTileVecs];
#pragma GCC unroll 4
      for (int v = 0; v < kTileVecs; ++v) wv[v] = vload(b + v * kVecLanes);
#pragma GCC unroll 16
      for (int i = 0; i < mr; ++i) {
        VecF xv = vbroadcast(a + i);
        asm("" : "+x"(xv));  // one broadcast per row, not one folded into each fma
#pragma GCC unroll 4
        for (int v = 0; v < kTileVecs; ++v) acc[i][v] = vfma(xv, wv[v], acc[i][v]);
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < mr; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < kTileVecs; ++v) vstore(chains + (l * kTileRows + i) * kPanelCols + v * kVecLanes, acc[i][v]);
  }
}

// res[i][.] = the lane sum of chains[.][i][.] in the few-row tiles' order (AVX-512: sum_lanes16's; AVX2:
// lane_sum's), plus the tail: x[i][kv + t] * tail[t][.] by fma in K order from zero.
template <int mr>
void finish_chains(const float* chains, const float* x, int64_t ldx, const float* tail, int64_t kv, int64_t K,
                   float* res) {
  for (int i = 0; i < mr; ++i)
    for (int v = 0; v < kTileVecs; ++v) {
      auto at = [&](int l) { return vload(chains + (l * kTileRows + i) * kPanelCols + v * kVecLanes); };
#if defined(__AVX512F__)
      VecF s[4];
      for (int c = 0; c < 4; ++c) s[c] = vadd(vadd(at(4 * c), at(4 * c + 2)), vadd(at(4 * c + 1), at(4 * c + 3)));
      VecF sum = vadd(vadd(s[0], s[1]), vadd(s[2], s[3]));
#else
      VecF a[kChains];
      for (int l = 0; l < kChains; ++l) a[l] = at(l);
      for (int w = kChains / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; ++l) a[l] = vadd(a[l], a[l + w]);
      VecF sum = a[0];
#endif
      VecF t = vzero();
      for (int64_t k = kv; k < K; ++k)
        t = vfma(vbroadcast(x + i * ldx + k), vload(tail + (k - kv) * kPanelCols + v * kVecLanes), t);
      vstore(res + i * kPanelCols + v * kVecLanes, vadd(sum, t));
    }
}

// Packs n <= 16 rows into chains: dst[(l * steps + s) * ld + j] = element 16 s + l of row j, where row(j, s) gives
// elements [16 s, 16 s + 16) of row j (j < n) as fp32: a transpose of 16 x 16 blocks in registers.
#if defined(__AVX512F__)
// r transposed in place: stage b swaps bit b of the row index with bit b of the element index.
template <int b>
inline void transpose_stage(v16f (&r)[16]) {
  static const v16i lo = [] {
    v16i m{};
    for (int e = 0; e < 16; ++e) m[e] = e & b ? 16 + e - b : e;
    return m;
  }();
  static const v16i hi = [] {
    v16i m{};
    for (int e = 0; e < 16; ++e) m[e] = e & b ? 16 + e : e + b;
    return m;
  }();
  for (int i = 0; i < 16; ++i)
    if (!(i & b)) {
      const v16f x = r[i], y = r[i + b];
      r[i] = __builtin_shuffle(x, y, lo);
      r[i + b] = __builtin_shuffle(x, y, hi);
    }
}

template <int n, typename Row>
void pack_rows(Row row, int64_t steps, float* dst, int64_t ld) {
  for (int64_t s = 0; s < steps; ++s) {
    v16f r[16];
    for (int j = 0; j < 16; ++j) r[j] = j < n ? row(j, s) : v16f{};
    transpose_stage<1>(r);
    transpose_stage<2>(r);
    transpose_stage<4>(r);
    transpose_stage<8>(r);
    for (int l = 0; l < kChains; ++l) std::memcpy(dst + (l * steps + s) * ld, &r[l], n * 4);
  }
}
#else
inline void transpose8(__m256 (&r)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 2; ++g) {
    u[4 * g] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
    u[4 * g + 1] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
    u[4 * g + 2] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
    u[4 * g + 3] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
  }
  for (int e = 0; e < 4; ++e) {
    r[e] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x20);
    r[e + 4] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x31);
  }
}

template <int n, typename Row>
void pack_rows(Row row, int64_t steps, float* dst, int64_t ld) {
  for (int64_t s = 0; s < steps; ++s)
    for (int g = 0; g * 8 < n; ++g) {  // rows 8 g .. 8 g + 7: their elements 0-7 and 8-15 as two 8 x 8 blocks
      __m256 lo[8], hi[8];
      for (int j = 0; j < 8; ++j) {
        const v16f v = 8 * g + j < n ? row(8 * g + j, s) : v16f{};
        std::memcpy(&lo[j], &v, 32);
        std::memcpy(&hi[j], reinterpret_cast<const char*>(&v) + 32, 32);
      }
      transpose8(lo);
      transpose8(hi);
      const int cnt = std::min(8, n - 8 * g);
      for (int l = 0; l < 8; ++l) {
        std::memcpy(dst + (l * steps + s) * ld + 8 * g, &lo[l], cnt * 4);
        std::memcpy(dst + ((l + 8) * steps + s) * ld + 8 * g, &hi[l], cnt * 4);
      }
    }
}
#endif

// x rows [m0, m0 + kTileRows) as a packed tile of fp32 chains (rows past M zeros).
void pack_x_tile(const float* x, int64_t ldx, int64_t M, int64_t m0, int64_t steps, float* xs) {
  pack_rows<kTileRows>([&](int j, int64_t s) {
    v16f v{};
    if (m0 + j < M) std::memcpy(&v, x + (m0 + j) * ldx + s * kChains, 64);
    return v;
  }, steps, xs, kTileRows);
}

// Weight rows [n0, n0 + rows) (16-bit ones widened exactly) as a packed fp32 panel, then its tail.
template <DType WT>
void pack_panel(const char* w, int64_t ldw_bytes, int rows, int64_t K, float* panel) {
  const int64_t steps = K / kChains, kv = steps * kChains;
  for (int j0 = 0; j0 < kPanelCols; j0 += 16)
    pack_rows<16>([&](int j, int64_t s) {
      return j0 + j < rows ? load_w<WT>(w + (j0 + j) * ldw_bytes, s * kChains) : v16f{};
    }, steps, panel + j0, kPanelCols);
  float* tail = panel + kv * kPanelCols;
  for (int j = 0; j < kPanelCols; ++j)
    for (int64_t k = kv; k < K; ++k)
      tail[(k - kv) * kPanelCols + j] = j < rows ? load_w1<WT>(w + j * ldw_bytes, k) : 0.f;
}

// store_tile for a tile of a panel, whole panels a vector at a time (the same additions): out = res (+ bias), or
// out += it. bias32: the bias as fp32 (null where bias is).
void store_panel_tile(const float* res, int mr, int nr, int64_t m0, int64_t n0, const Tensor* bias,
                      const float* bias32, Tensor& out, bool accumulate) {
  if (nr < kPanelCols) return store_tile(res, kPanelCols, mr, nr, m0, n0, bias, out, accumulate);
  for (int i = 0; i < mr; ++i) {
    float* o = out.ptr<float>() + (m0 + i) * out.stride + n0;
    const float* r = res + i * kPanelCols;
    for (int v = 0; v < kTileVecs; ++v) {
      VecF t = vload(r + v * kVecLanes);
      if (bias32) t = vadd(t, vloadu(bias32 + n0 + v * kVecLanes));
      if (accumulate) t = vadd(vloadu(o + v * kVecLanes), t);
      vstoreu(o + v * kVecLanes, t);
    }
  }
}

// x (fp32) @ w^T for many rows: x packed once (tiles in parallel), then threads take blocks of panels, pack
// them, and run every x tile over the block (a tile's chains stay in L1 while the block's panels stream from L2).
template <DType WT>
void gemm_packed(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out, ThreadPool& pool,
                 bool accumulate) {
  constexpr int64_t kChunkRows = 1024;  // x is packed this many rows at a time (its scratch stays allocated)
  if (x.rows > kChunkRows) {
    for (int64_t m0 = 0; m0 < x.rows; m0 += kChunkRows) {
      const int64_t n = std::min(kChunkRows, x.rows - m0);
      const Tensor xc(x.ptr<float>() + m0 * x.stride, DType::F32, n, x.cols, x.stride);
      Tensor oc(out.ptr<float>() + m0 * out.stride, DType::F32, n, out.cols, out.stride);
      gemm_packed<WT>(xc, w, bias, oc, pool, accumulate);
    }
    return;
  }
  const int64_t M = x.rows, N = w.rows, K = x.cols, steps = K / kChains, kv = steps * kChains;
  const int64_t ldw = w.stride * int64_t(dtype_size(WT));
  const float* xp = x.ptr<float>();
  const char* wp = static_cast<const char*>(w.data);
  const int64_t tiles = (M + kTileRows - 1) / kTileRows, tile_floats = kv * kTileRows, panel_floats = K * kPanelCols;
  thread_local std::vector<float> xs_mem;  // the caller's, kept: no page faults on every call
  float* xs = aligned_floats(xs_mem, size_t(tiles * tile_floats));
  const bool par = M * N * K > (1 << 16);
  pool.for_static(tiles, par,
                  [&](int64_t t) { pack_x_tile(xp, x.stride, M, t * kTileRows, steps, xs + t * tile_floats); });
  thread_local std::vector<float> bias_mem;
  if (bias) {
    bias_mem.resize(size_t(N));
    for (int64_t n = 0; n < N; ++n) bias_mem[size_t(n)] = load_f32(*bias, 0, n);
  }
  const float* bias32 = bias ? bias_mem.data() : nullptr;
  // Panels per block: the block within ~1 MB of L2, and at least 4 blocks per thread where N allows.
  const int64_t panels = (N + kPanelCols - 1) / kPanelCols;
  const int64_t by_cache = std::max<int64_t>(1, (int64_t(1) << 20) / (panel_floats * 4));
  const int64_t by_threads = std::max<int64_t>(1, panels / (4 * int64_t(pool.size())));
  const int64_t per_block = std::min(by_cache, by_threads), blocks = (panels + per_block - 1) / per_block;
  pool.for_dynamic(blocks, par, [&](int64_t b, int) {
    thread_local std::vector<float> block_mem, scratch_mem;
    const int64_t p_begin = b * per_block, p_end = std::min(panels, p_begin + per_block);
    float* block = aligned_floats(block_mem, size_t((p_end - p_begin) * panel_floats));
    float* chains = aligned_floats(scratch_mem, size_t((kChains + 1) * kTileRows * kPanelCols));
    float* res = chains + kChains * kTileRows * kPanelCols;
    for (int64_t p = p_begin; p < p_end; ++p) {
      const int64_t n0 = p * kPanelCols;
      pack_panel<WT>(wp + n0 * ldw, ldw, int(std::min<int64_t>(kPanelCols, N - n0)), K,
                     block + (p - p_begin) * panel_floats);
    }
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t m0 = t * kTileRows;
      const int mr = int(std::min<int64_t>(kTileRows, M - m0));
      for (int64_t p = p_begin; p < p_end; ++p) {
        const int64_t n0 = p * kPanelCols;
        const float* panel = block + (p - p_begin) * panel_floats;
        with_const<kTileRows>(mr, [&](auto rows) {
          constexpr int r = decltype(rows)::value;
          tile_chains<r>(xs + t * tile_floats, panel, steps, chains);
          finish_chains<r>(chains, xp + m0 * x.stride, x.stride, panel + kv * kPanelCols, kv, K, res);
        });
        store_panel_tile(res, mr, int(std::min<int64_t>(kPanelCols, N - n0)), m0, n0, bias, bias32, out, accumulate);
      }
    }
  });
}
constexpr bool kPackedPath = true;
#else
constexpr bool kPackedPath = false;
template <DType WT>
void gemm_packed(const Tensor&, const Tensor&, const Tensor*, Tensor&, ThreadPool&, bool) {}
#endif
// Row count from which the packed path runs (below it, tiles read the weights in place: decode).
constexpr int64_t kPackedMinRows = 24;

}  // namespace

void gemm(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out, ThreadPool& pool, bool accumulate) {
  QRT_CHECK(x.dtype == DType::F32 && out.dtype == DType::F32, "cpu linear: activations must be float32");
  QRT_CHECK(x.cols == w.cols && out.rows == x.rows && out.cols == w.rows,
            "cpu linear: shape mismatch x[", x.rows, ",", x.cols, "] w[", w.rows, ",", w.cols, "] out[",
            out.rows, ",", out.cols, "]");
  const bool packed = kPackedPath && x.rows >= kPackedMinRows && x.cols > 0;
  switch (w.dtype) {
    case DType::F32:
      if (packed) gemm_packed<DType::F32>(x, w, bias, out, pool, accumulate);
      else gemm_t<DType::F32>(x, w, bias, out, pool, accumulate);
      break;
    case DType::BF16: {  // the products of bf16 values (ops.h): x rounded to bf16
        thread_local std::vector<float> xr_mem;  // the caller's, kept
        float* xr = aligned_floats(xr_mem, size_t(x.rows * x.cols));
        const bool pairs = kAvx2Tiles && x.rows < 16;  // gemm_t widens 16-bit blocks from 16 rows on
        pool.for_static(x.rows, x.rows * x.cols > (1 << 16), [&](int64_t r) {
          round_to_bf16(x.ptr<float>() + r * x.stride, x.cols, xr + r * x.cols);
          if (pairs) permute_x_pairs(xr + r * x.cols, x.cols);
        });
        Tensor xt(xr, DType::F32, x.rows, x.cols);
        if (packed) gemm_packed<DType::BF16>(xt, w, bias, out, pool, accumulate);
        else gemm_t<DType::BF16>(xt, w, bias, out, pool, accumulate, pairs);
      break;
    }
    case DType::F16:
      if (packed) gemm_packed<DType::F16>(x, w, bias, out, pool, accumulate);
      else gemm_t<DType::F16>(x, w, bias, out, pool, accumulate);
      break;
    default: QRT_CHECK(false, "cpu linear: weight dtype ", dtype_name(w.dtype), " not supported");
  }
}

}  // namespace qrt::cpu
