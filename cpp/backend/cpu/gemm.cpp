// Cache-blocked GEMM for y = x @ w^T with weights kept in their stored dtype.
// bf16 weights on CPUs with AVX512-BF16 take bf16 x bf16 products with fp32 accumulation (x rounded to
// bf16 at the GEMM input, as bf16 inference does); float32 weights keep exact fp32 arithmetic.
// Tiles of MR x NR dot products share loads; each dot product keeps 16 fp32 lanes accumulated in K order,
// then a fixed pairwise lane sum (AVX-512: sum_lanes16, 16 accumulators at a time), so results do not depend
// on the tiling (batch invariance); in the fp32/fp16-weight tiles, tails past K / 16 * 16 add in K order by fma
// (the bf16 dot-product tile reads its tail as one masked step instead). Without AVX-512 but with AVX2 + FMA,
// the 16 lanes are two 8-lane halves accumulated in two passes (16 registers), summed by lane_sum's order,
// which is not sum_lanes16's: results agree within rounding across the two builds, not bit for bit.
// From kPackedMinRows x rows (prefill) each thread packs a block of weight rows into panels laid out as its
// tiles read them (16-bit weights widened to fp32 there, except on the AVX512-BF16 path) and runs tiles of 8
// (AVX-512) or 4 (AVX2) x rows by 3 weight rows over them, with the same arithmetic as the few-row tiles.
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

// Calls f(std::integral_constant<int, mr>) for a run-time tile height mr in 1..8.
template <typename F>
void with_rows(int mr, F&& f) {
  switch (mr) {
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

// out[m0 + i, n0 + j] = res[i][j] (+ bias[n0 + j]).
// accumulate: out += the tile (the residual connection of linear_add).
inline void store_tile(const TileResult& res, int mr, int nr, int64_t m0, int64_t n0, const Tensor* bias,
                       Tensor& out, bool accumulate) {
  float* op = out.ptr<float>();
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) {
      float v = res[i][j];
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
#if defined(__AVX512F__)
  return reinterpret_cast<v16f>(
      _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i))));
#else
  v16f16 h;
  std::memcpy(&h, static_cast<const uint16_t*>(base) + i, 32);
  return __builtin_convertvector(h, v16f);
#endif
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
      with_rows(mr, [&](auto rows) {
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
  with_rows(mr, [&](auto rows) { tile_n<WT, decltype(rows)::value>(nr, x, ldx, w, ldw, K, res); });
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
  // 8 rows), and for prefill (16+ rows; builds without AVX2 only, gemm_packed takes them otherwise) a 16-bit
  // block is widened to fp32 once (exactly) and then 4 x 4 tiles. AVX2 tiles (tile_n): 1 x 4, 2 x 4, 3 x 3, 4 x 3.
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
          store_tile(res, mr, nr, m0, n0, bias, out, accumulate);
        }
      }
    }
  });
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// ---- Many rows (prefill): packed weight panels and register-blocked tiles ----------------------------------
// The same arithmetic as tile() / tile_avx2() (each output's 16 lanes accumulate k = lane mod 16 in K order by
// fma, the build's lane sum, then the tail past K / 16 * 16 in K order), so every output is bit-identical to the
// few-row paths: only the data layout and the register blocking differ. A panel holds kPanelRows weight rows
// as fp32 (16-bit weights widened exactly), ordered as the tile reads them: for each pass (a 16-lane vector
// on AVX-512; two 8-lane halves on AVX2), each 16-element block k, the rows' vectors side by side, then the
// rows' tails. Tiles: AVX-512 8 x rows by 3 panel rows = 24 accumulators + 3 weight vectors + 1 x vector of
// the 32 registers (11 loads per 24 fmas); AVX2 4 x 3 = 12 accumulators + 3 + 1 of 16, per half.
#if defined(__AVX512F__)
using VecF = __m512;
constexpr int kVecLanes = 16, kPasses = 1, kPackedTileRows = 8;
inline VecF vload(const float* p) { return _mm512_loadu_ps(p); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline VecF vzero() { return _mm512_setzero_ps(); }
#else
using VecF = __m256;
constexpr int kVecLanes = 8, kPasses = 2, kPackedTileRows = 4;
inline VecF vload(const float* p) { return _mm256_loadu_ps(p); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline VecF vzero() { return _mm256_setzero_ps(); }
#endif
constexpr int kPanelRows = 3;
constexpr int64_t kPanelsPerBlock = 16;  // a thread's unit of work: 48 weight rows, packed once per call

// Floats of one panel for K: the vector part, then the rows' tails.
inline int64_t panel_floats(int64_t K) { return int64_t(kPanelRows) * K; }

// Packs weight rows [n0, n0 + rows) (rows <= kPanelRows; missing rows are zeros, their outputs dropped).
template <DType WT>
void pack_panel(const char* w, int64_t ldw_bytes, int rows, int64_t K, float* panel) {
  const int64_t kv = K / kLanes * kLanes, nkb = kv / kLanes, tail = K - kv;
  float row[kLanes];
  for (int j = 0; j < kPanelRows; ++j) {
    const char* wr = w + j * ldw_bytes;
    for (int64_t kb = 0; kb < nkb; ++kb) {
      if (j < rows) {
        const v16f v = load_w<WT>(wr, kb * kLanes);
        std::memcpy(row, &v, sizeof row);
      } else {
        std::fill(row, row + kLanes, 0.f);
      }
      for (int h = 0; h < kPasses; ++h)
        std::memcpy(panel + ((h * nkb + kb) * kPanelRows + j) * kVecLanes, row + h * kVecLanes, kVecLanes * 4);
    }
    float* pt = panel + kPanelRows * kv + j * tail;
    for (int64_t k = kv; k < K; ++k) pt[k - kv] = j < rows ? load_w1<WT>(wr, k) : 0.f;
  }
}

// res[i][j] = x row i . panel row j for i < mr, j < kPanelRows.
template <int mr>
void panel_tile(const float* x, int64_t ldx, const float* panel, int64_t K, TileResult& res) {
  const int64_t kv = K / kLanes * kLanes, nkb = kv / kLanes, tail = K - kv;
  alignas(64) float part[kPasses][mr][kPanelRows][kVecLanes];
  for (int h = 0; h < kPasses; ++h) {
    VecF acc[mr][kPanelRows];
#pragma GCC unroll 8
    for (int i = 0; i < mr; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < kPanelRows; ++j) acc[i][j] = vzero();
    const float* wp = panel + h * nkb * kPanelRows * kVecLanes;
    const float* xp = x + h * kVecLanes;
    for (int64_t kb = 0; kb < nkb; ++kb, wp += kPanelRows * kVecLanes, xp += kLanes) {
      VecF wv[kPanelRows];
#pragma GCC unroll 8
      for (int j = 0; j < kPanelRows; ++j) wv[j] = vload(wp + j * kVecLanes);
#pragma GCC unroll 8
      for (int i = 0; i < mr; ++i) {
        VecF xv = vload(xp + i * ldx);
        // One load per x vector: without this, -mtune=haswell folds it into each fma as a memory operand
        // (3 loads instead of 1; 30% slower on a Sapphire Rapids VM, tools/gemm_cpu_bench.cpp).
        asm("" : "+x"(xv));
#pragma GCC unroll 8
        for (int j = 0; j < kPanelRows; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < mr; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < kPanelRows; ++j) std::memcpy(part[h][i][j], &acc[i][j], sizeof(VecF));
  }
  float sums[mr][kPanelRows];
#if defined(__AVX512F__)
  lane_sums<mr * kPanelRows>(reinterpret_cast<const __m512*>(&part[0][0][0][0]), &sums[0][0]);
#else
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < kPanelRows; ++j) sums[i][j] = lane_sum(vload(part[0][i][j]), vload(part[1][i][j]));
#endif
  const float* pt = panel + kPanelRows * kv;
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < kPanelRows; ++j) {
      float t = 0.f;
      for (int64_t k = kv; k < K; ++k) t = std::fma(x[i * ldx + k], pt[j * tail + k - kv], t);
      res[i][j] = sums[i][j] + t;
    }
}

// x (fp32) @ w^T for many rows: threads take blocks of kPanelsPerBlock panels; each packs its block, then every
// tile of x rows passes over it (the x tile stays in L1 while the block's panels stream from L2).
template <DType WT>
void gemm_packed(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out, ThreadPool& pool,
                 bool accumulate) {
  const int64_t M = x.rows, N = w.rows, K = x.cols;
  const int64_t ldw = w.stride * int64_t(dtype_size(WT));
  const int64_t block_rows = kPanelsPerBlock * kPanelRows, nblocks = (N + block_rows - 1) / block_rows;
  const int64_t pf = panel_floats(K);
  const char* wp = static_cast<const char*>(w.data);
  const float* xp = x.ptr<float>();
  pool.for_dynamic(nblocks, M * N * K > (1 << 16), [&](int64_t nb, int) {
    thread_local std::vector<float> block_mem;
    float* block = aligned_floats(block_mem, size_t(kPanelsPerBlock * pf));
    const int64_t n_begin = nb * block_rows, n_end = std::min(N, n_begin + block_rows);
    const int64_t panels = (n_end - n_begin + kPanelRows - 1) / kPanelRows;
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t n0 = n_begin + p * kPanelRows;
      pack_panel<WT>(wp + n0 * ldw, ldw, int(std::min<int64_t>(kPanelRows, n_end - n0)), K, block + p * pf);
    }
    for (int64_t m0 = 0; m0 < M; m0 += kPackedTileRows) {
      const int mr = int(std::min<int64_t>(kPackedTileRows, M - m0));
      for (int64_t p = 0; p < panels; ++p) {
        const int64_t n0 = n_begin + p * kPanelRows;
        TileResult res;
        with_rows(mr, [&](auto rows) {
          constexpr int r = decltype(rows)::value;
          if constexpr (r <= kPackedTileRows) panel_tile<r>(xp + m0 * x.stride, x.stride, block + p * pf, K, res);
        });
        store_tile(res, mr, int(std::min<int64_t>(kPanelRows, n_end - n0)), m0, n0, bias, out, accumulate);
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
constexpr int64_t kPackedMinRows = 16;

#if defined(__AVX512BF16__)
// bf16 weights with AVX512-BF16 dot products: x is rounded to bf16 once per call, each instruction
// multiplies 32 pairs and accumulates in fp32. Same lane order for every tile shape (batch invariance).

template <int mr, int nr>
void tile_dp(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t K, TileResult& res) {
  __m512 acc[mr][nr];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t kv = K / 32 * 32;
  auto step = [&](int64_t k, auto load) {
    __m512i wv[nr];
    for (int j = 0; j < nr; ++j) wv[j] = load(w + j * ldw + k);
    for (int i = 0; i < mr; ++i) {
      const __m512i xv = load(x + i * ldx + k);
      for (int j = 0; j < nr; ++j)
        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], reinterpret_cast<__m512bh>(xv), reinterpret_cast<__m512bh>(wv[j]));
    }
  };
  for (int64_t k = 0; k < kv; k += 32) {
    for (int j = 0; j < nr; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (j + kPrefetchTiles * nr) * ldw + k), _MM_HINT_T0);
    step(k, [](const uint16_t* p) { return _mm512_loadu_si512(p); });
  }
  if (kv < K) {
    const __mmask32 m = __mmask32((1u << (K - kv)) - 1);
    step(kv, [m](const uint16_t* p) { return _mm512_maskz_loadu_epi16(m, p); });
  }
  float sums[mr][nr];
  lane_sums<mr * nr>(&acc[0][0], &sums[0][0]);
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) res[i][j] = sums[i][j];
}

template <int mr>
void tile_dp_n(int nr, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t K, TileResult& res) {
  // Tiles: 1-2 rows x 8 weight rows (batch 1: independent chains), 3-6 rows x 4, 7-8 rows x 2.
  if constexpr (mr > 6) {
    if (nr >= 2) tile_dp<mr, 2>(x, ldx, w, ldw, K, res);
    else tile_dp<mr, 1>(x, ldx, w, ldw, K, res);
  } else if constexpr (mr > 2) {  // up to 6 x 4: 24 accumulators (prefill tiles)
    switch (nr) {
      case 4: tile_dp<mr, 4>(x, ldx, w, ldw, K, res); break;
      case 3: tile_dp<mr, 3>(x, ldx, w, ldw, K, res); break;
      case 2: tile_dp<mr, 2>(x, ldx, w, ldw, K, res); break;
      default: tile_dp<mr, 1>(x, ldx, w, ldw, K, res); break;
    }
  } else {
    switch (nr) {
      case 8: tile_dp<mr, 8>(x, ldx, w, ldw, K, res); break;
      case 7: tile_dp<mr, 7>(x, ldx, w, ldw, K, res); break;
      case 6: tile_dp<mr, 6>(x, ldx, w, ldw, K, res); break;
      case 5: tile_dp<mr, 5>(x, ldx, w, ldw, K, res); break;
      case 4: tile_dp<mr, 4>(x, ldx, w, ldw, K, res); break;
      case 3: tile_dp<mr, 3>(x, ldx, w, ldw, K, res); break;
      case 2: tile_dp<mr, 2>(x, ldx, w, ldw, K, res); break;
      default: tile_dp<mr, 1>(x, ldx, w, ldw, K, res); break;
    }
  }
}

// Many rows with AVX512-BF16: panels of kPanelRows bf16 weight rows, each 32-element block of the rows side by
// side (zeros past K and past the last row), against x rows padded with zeros to a whole block: the zero pairs
// are tile_dp's masked last step, so every output is bit-identical to the few-row tiles. Tiles of 8 x rows by
// 3 panel rows: 24 accumulators + 3 weight vectors + 1 x vector of the 32 registers.
void pack_panel_bf16(const uint16_t* w, int64_t ldw, int rows, int64_t K, uint16_t* panel) {
  const int64_t nkb = (K + 31) / 32;
  for (int64_t kb = 0; kb < nkb; ++kb)
    for (int j = 0; j < kPanelRows; ++j) {
      uint16_t* dst = panel + (kb * kPanelRows + j) * 32;
      const int64_t n = j < rows ? std::min<int64_t>(32, K - kb * 32) : 0;
      if (n > 0) std::memcpy(dst, w + j * ldw + kb * 32, size_t(n) * 2);
      std::fill(dst + std::max<int64_t>(n, 0), dst + 32, uint16_t(0));
    }
}

template <int mr>
void panel_tile_dp(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t nkb, TileResult& res) {
  __m512 acc[mr][kPanelRows];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < kPanelRows; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < nkb; ++kb, panel += kPanelRows * 32, x += 32) {
    __m512i wv[kPanelRows];
    for (int j = 0; j < kPanelRows; ++j) wv[j] = _mm512_load_si512(panel + j * 32);
    for (int i = 0; i < mr; ++i) {
      const __m512i xv = _mm512_loadu_si512(x + i * ldx);
      for (int j = 0; j < kPanelRows; ++j)
        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], reinterpret_cast<__m512bh>(xv), reinterpret_cast<__m512bh>(wv[j]));
    }
  }
  float sums[mr][kPanelRows];
  lane_sums<mr * kPanelRows>(&acc[0][0], &sums[0][0]);
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < kPanelRows; ++j) res[i][j] = sums[i][j];
}

void gemm_bf16_dp(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out, ThreadPool& pool,
                  bool accumulate) {
  const int64_t M = x.rows, N = w.rows, K = x.cols;
  const bool packed = M >= kPackedMinRows;
  const int64_t nkb = (K + 31) / 32, ldx = packed ? nkb * 32 : K;  // packed: rows padded with zeros to 32
  std::vector<float> xb_mem;
  uint16_t* xb = reinterpret_cast<uint16_t*>(aligned_floats(xb_mem, size_t(M * ldx + 1) / 2));
  pool.for_static(M, M * K > (1 << 14), [&](int64_t r) {
    for (int64_t k = 0; k < K; ++k) xb[r * ldx + k] = f32_to_bf16(x.ptr<float>()[r * x.stride + k]);
    for (int64_t k = K; k < ldx; ++k) xb[r * ldx + k] = 0;
  });
  const uint16_t* wp = w.ptr<uint16_t>();
  const bool par = M * N * K > (1 << 16);
  if (packed) {  // threads take blocks of kPanelsPerBlock panels, as gemm_packed
    const int64_t block_rows = kPanelsPerBlock * kPanelRows, nblocks = (N + block_rows - 1) / block_rows;
    const int64_t panel_elems = nkb * kPanelRows * 32;
    pool.for_dynamic(nblocks, par, [&](int64_t nb, int) {
      thread_local std::vector<float> block_mem;
      uint16_t* block = reinterpret_cast<uint16_t*>(aligned_floats(block_mem, size_t(kPanelsPerBlock * panel_elems / 2)));
      const int64_t n_begin = nb * block_rows, n_end = std::min(N, n_begin + block_rows);
      const int64_t panels = (n_end - n_begin + kPanelRows - 1) / kPanelRows;
      for (int64_t p = 0; p < panels; ++p) {
        const int64_t n0 = n_begin + p * kPanelRows;
        pack_panel_bf16(wp + n0 * w.stride, w.stride, int(std::min<int64_t>(kPanelRows, n_end - n0)), K,
                        block + p * panel_elems);
      }
      for (int64_t m0 = 0; m0 < M; m0 += kPackedTileRows) {
        const int mr = int(std::min<int64_t>(kPackedTileRows, M - m0));
        for (int64_t p = 0; p < panels; ++p) {
          const int64_t n0 = n_begin + p * kPanelRows;
          TileResult res;
          with_rows(mr, [&](auto rows) {
            panel_tile_dp<decltype(rows)::value>(xb + m0 * ldx, ldx, block + p * panel_elems, nkb, res);
          });
          store_tile(res, mr, int(std::min<int64_t>(kPanelRows, n_end - n0)), m0, n0, bias, out, accumulate);
        }
      }
    });
    return;
  }
  const int64_t NB = 16, nblocks = (N + NB - 1) / NB;
  // Row tile by batch: 5..15 rows 8 x 2, 3-4 rows 4 x 4, 1-2 rows 2 x 8.
  const int64_t tm = M > 4 ? 8 : (M > 2 ? 4 : 2), tn = tm == 8 ? 2 : (tm > 2 ? 4 : 8);
  pool.for_static(nblocks, par, [&](int64_t nb) {
    const int64_t n_begin = nb * NB, nend = std::min(N, n_begin + NB);
    for (int64_t m0 = 0; m0 < M; m0 += tm) {
      const int mr = int(std::min<int64_t>(tm, M - m0));
      for (int64_t n0 = n_begin; n0 < nend; n0 += tn) {
        const int nr = int(std::min<int64_t>(tn, nend - n0));
        TileResult res;
        const uint16_t* xr = xb + m0 * ldx;
        const uint16_t* wr = wp + n0 * w.stride;
        with_rows(mr, [&](auto rows) { tile_dp_n<decltype(rows)::value>(nr, xr, ldx, wr, w.stride, K, res); });
        store_tile(res, mr, nr, m0, n0, bias, out, accumulate);
      }
    }
  });
}
#endif

}  // namespace

void gemm(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out, ThreadPool& pool, bool accumulate) {
  QRT_CHECK(x.dtype == DType::F32 && out.dtype == DType::F32, "cpu linear: activations must be float32");
  QRT_CHECK(x.cols == w.cols && out.rows == x.rows && out.cols == w.rows,
            "cpu linear: shape mismatch x[", x.rows, ",", x.cols, "] w[", w.rows, ",", w.cols, "] out[",
            out.rows, ",", out.cols, "]");
  const bool packed = kPackedPath && x.rows >= kPackedMinRows;
  switch (w.dtype) {
    case DType::F32:
      if (packed) gemm_packed<DType::F32>(x, w, bias, out, pool, accumulate);
      else gemm_t<DType::F32>(x, w, bias, out, pool, accumulate);
      break;
    case DType::BF16:
#if defined(__AVX512BF16__)
      gemm_bf16_dp(x, w, bias, out, pool, accumulate);
#else
      {  // same products as the dot-product path: x rounded to bf16
        std::vector<float> xr_mem;
        float* xr = aligned_floats(xr_mem, size_t(x.rows * x.cols));
        const bool pairs = kAvx2Tiles && !packed;
        for (int64_t r = 0; r < x.rows; ++r) {
          for (int64_t k = 0; k < x.cols; ++k)
            xr[r * x.cols + k] = bf16_to_f32(f32_to_bf16(x.ptr<float>()[r * x.stride + k]));
          if (pairs) permute_x_pairs(xr + r * x.cols, x.cols);
        }
        Tensor xt(xr, DType::F32, x.rows, x.cols);
        if (packed) gemm_packed<DType::BF16>(xt, w, bias, out, pool, accumulate);
        else gemm_t<DType::BF16>(xt, w, bias, out, pool, accumulate, pairs);
      }
#endif
      break;
    case DType::F16:
      if (packed) gemm_packed<DType::F16>(x, w, bias, out, pool, accumulate);
      else gemm_t<DType::F16>(x, w, bias, out, pool, accumulate);
      break;
    default: QRT_CHECK(false, "cpu linear: weight dtype ", dtype_name(w.dtype), " not supported");
  }
}

}  // namespace qrt::cpu
