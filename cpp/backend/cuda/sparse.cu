// Sparse decode on CUDA (ops.h SparseAttention): page summaries, page scores and the per-head page lists.
// The lists are cpu/sparse.cpp's: the same candidates, the same order of scores (ties: the earlier page), so the
// two backends select the same pages wherever their fp32 scores order the same.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "backend/cuda/cuda_common.cuh"

namespace qrt::cuda {
namespace {

constexpr int kSummaryThreads = 128;
constexpr int kScoreWarps = 4, kScorePagesPerWarp = 8;
constexpr int kSelectThreads = 1024;

// x rounded toward -inf / +inf into T.
template <typename T> __device__ __forceinline__ T round_down(float x);
template <typename T> __device__ __forceinline__ T round_up(float x);
template <> __device__ __forceinline__ float round_down<float>(float x) { return x; }
template <> __device__ __forceinline__ float round_up<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 round_down<__nv_bfloat16>(float x) { return __float2bfloat16_rd(x); }
template <> __device__ __forceinline__ __nv_bfloat16 round_up<__nv_bfloat16>(float x) { return __float2bfloat16_ru(x); }
template <> __device__ __forceinline__ __half round_down<__half>(float x) { return __float2half_rd(x); }
template <> __device__ __forceinline__ __half round_up<__half>(float x) { return __float2half_ru(x); }

// Block t: the step's row t, when it is the step's last in its page, recomputes that page's per-column min and max
// over the page's rows up to it (the rows of a page belong to one sequence, in order). T: the cache's elements and
// the summaries', or (fp8 cache, k_scale set) the summaries' with the keys e4m3 times their scales.
template <typename T>
__global__ void __launch_bounds__(kSummaryThreads) summarize_kernel(const void* k, const float* k_scale, int heads,
                                                                    T* sum, const int32_t* kv_rows, int num_tokens,
                                                                    int page_size, int64_t cols) {
  grid_release();
  grid_wait();
  const int t = blockIdx.x, row = kv_rows[t];
  if (row < 0) return;
  const int page = row / page_size;
  if (t + 1 < num_tokens && kv_rows[t + 1] >= 0 && kv_rows[t + 1] / page_size == page) return;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float lo = INFINITY, hi = -INFINITY;
    for (int r = page * page_size; r <= row; ++r) {
      const int64_t i = int64_t(r) * cols + c;
      const float x = k_scale ? load_any(k, DType::F8E4M3, i) * k_scale[int64_t(r) * heads + c / (cols / heads)]
                              : to_f(static_cast<const T*>(k)[i]);
      lo = fminf(lo, x);
      hi = fmaxf(hi, x);
    }
    // Exact where the keys are values of T (a T cache); an fp8 cache's rounded outward (still bounds).
    sum[int64_t(2 * page) * cols + c] = k_scale ? round_down<T>(lo) : from_f<T>(lo);
    sum[int64_t(2 * page + 1) * cols + c] = k_scale ? round_up<T>(hi) : from_f<T>(hi);
  }
}

struct SelectArgs {
  const void* q;
  int64_t q_stride;
  const void* sum;
  const int32_t* q_start;
  const int32_t* ctx_len;
  const int32_t* page_table;
  int max_pages, page_size, kv_heads, group, head_dim;
  SparseAttention rule;
  float* scores;
  int32_t* pages;
  int32_t* keys;
  bool aggregate;  // QWEN_RT_SELECT_AGG=1: select_kernel's warp-aggregated histogram (not yet run on a GPU)
};

// Sequence s's candidates for selection, [first, end), and the pages it selects among them; false when it
// attends to all of its pages.
__device__ __forceinline__ bool candidates(const SelectArgs& a, int s, int& n, int& first, int& end, int& k) {
  const int ctx = a.ctx_len[s], q_len = a.q_start[s + 1] - a.q_start[s];
  n = (ctx + a.page_size - 1) / a.page_size;
  first = a.rule.sink_pages;
  end = n - a.rule.window_pages;
  k = a.rule.budget_pages - a.rule.sink_pages - a.rule.window_pages;
  return a.rule.selects(ctx, q_len, a.page_size);
}

// Grid (page blocks, kv heads, sequences): each warp scores kScorePagesPerWarp candidate pages of (s, h); a lane
// holds D / 32 dims of each of the G query heads (fp32, in shared memory).
template <typename T, int D>
__global__ void __launch_bounds__(kScoreWarps * 32) score_kernel(const SelectArgs a) {
  grid_release();
  grid_wait();
  extern __shared__ float q_s[];  // [G][D]
  const int s = blockIdx.z, h = blockIdx.y, G = a.group;
  int n, first, end, k;
  if (!candidates(a, s, n, first, end, k)) return;
  const int p0 = first + blockIdx.x * kScoreWarps * kScorePagesPerWarp;
  if (p0 >= end) return;
  const T* q = static_cast<const T*>(a.q) + int64_t(a.q_start[s]) * a.q_stride + int64_t(h) * G * D;
  for (int i = threadIdx.x; i < G * D; i += blockDim.x) q_s[i] = to_f(q[i]);
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t cols = int64_t(a.kv_heads) * D;
  const T* sum = static_cast<const T*>(a.sum) + int64_t(h) * D;
  const int32_t* table = a.page_table + int64_t(s) * a.max_pages;
  float* out = a.scores + (int64_t(s) * a.kv_heads + h) * a.max_pages;
  for (int i = 0; i < kScorePagesPerWarp; ++i) {
    const int c = p0 + warp * kScorePagesPerWarp + i;
    if (c >= end) break;  // warp-uniform
    const int64_t pg = table[c];
    float lo[D / 32], hi[D / 32];
#pragma unroll
    for (int j = 0; j < D / 32; ++j) {
      lo[j] = to_f(sum[2 * pg * cols + lane + 32 * j]);
      hi[j] = to_f(sum[(2 * pg + 1) * cols + lane + 32 * j]);
    }
    float best = -INFINITY;
    for (int g = 0; g < G; ++g) {
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < D / 32; ++j) {
        const float x = q_s[g * D + lane + 32 * j];
        acc += fmaxf(x * lo[j], x * hi[j]);
      }
      best = fmaxf(best, warp_sum(acc));  // a NaN score counts as -inf
    }
    if (lane == 0) out[c] = best;
  }
}

// A score as an unsigned key of the same order (NaN below everything).
__device__ __forceinline__ uint32_t order_key(float f) {
  if (f != f) return 0u;
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix count of flag over the block's threads in order; total: the block's count. Every thread calls it.
__device__ __forceinline__ int block_prefix(bool flag, int* warp_counts, int& total) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const uint32_t ballot = __ballot_sync(0xffffffffu, flag);
  __syncthreads();  // warp_counts free (an earlier call's readers are done)
  if (lane == 0) warp_counts[warp] = __popc(ballot);
  __syncthreads();
  int before = 0;
  total = 0;
  for (int w = 0; w < warps; ++w) {
    before += w < warp ? warp_counts[w] : 0;
    total += warp_counts[w];
  }
  return before + __popc(ballot & ((1u << lane) - 1u));
}

// Block (kv head, sequence): the list of (s, h). A selecting sequence's k best candidates are found by a radix
// select of their keys (8 bits a pass, from the top), then written in page order between the sink and the window.
__global__ void __launch_bounds__(kSelectThreads) select_kernel(const SelectArgs a) {
  grid_release();
  grid_wait();
  __shared__ int hist[256];
  __shared__ int warp_counts[kSelectThreads / 32];
  __shared__ uint32_t sel_prefix;
  __shared__ int sel_left;
  const int h = blockIdx.x, s = blockIdx.y, tid = threadIdx.x;
  const int64_t list = int64_t(s) * a.kv_heads + h;
  const int32_t* src = a.page_table + int64_t(s) * a.max_pages;
  int32_t* dst = a.pages + list * a.max_pages;
  int n, first, end, k;
  if (!candidates(a, s, n, first, end, k)) {
    for (int c = tid; c < a.max_pages; c += blockDim.x) dst[c] = src[c];
    if (tid == 0) a.keys[list] = a.ctx_len[s];
    return;
  }
  const float* sc = a.scores + list * a.max_pages;
  uint32_t prefix = 0, mask = 0;
  int left = k;  // of the keys matching prefix under mask, how many are taken (the largest)
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < 256; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    if (a.aggregate) {
      // Lanes of a warp that count into the same bin add once (their leader): scores of nearby pages share their
      // top bits, and same-address atomics serialize (at 1M tokens a pass counts 65,536 scores in this block).
      for (int c0 = first; c0 < end; c0 += blockDim.x) {
        const int c = c0 + tid;
        const uint32_t key = c < end ? order_key(sc[c]) : 0u;
        const int bin = c < end && (key & mask) == prefix ? int((key >> shift) & 255u) : -1;
        const uint32_t same = __match_any_sync(0xffffffffu, bin);
        if (bin >= 0 && (tid & 31) == __ffs(same) - 1) atomicAdd(&hist[bin], __popc(same));
      }
    } else {
      for (int c = first + tid; c < end; c += blockDim.x) {
        const uint32_t key = order_key(sc[c]);
        if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
      }
    }
    __syncthreads();
    if (tid < 32) {  // the bin where the count from the top reaches `left`: lane l holds bins 8 l .. 8 l + 7
      int cnt[8], mine = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) mine += (cnt[j] = hist[tid * 8 + j]);
      int incl = mine;  // bins from this lane's up
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_down_sync(0xffffffffu, incl, o);
        if (tid + o < 32) incl += v;
      }
      int cum = incl - mine;  // bins above this lane's
      if (cum < left && left <= incl) {
        for (int j = 7; j >= 0; --j) {
          if (cum + cnt[j] >= left) {
            sel_prefix = prefix | (uint32_t(tid * 8 + j) << shift);
            sel_left = left - cum;
            break;
          }
          cum += cnt[j];
        }
      }
    }
    __syncthreads();
    prefix = sel_prefix;
    left = sel_left;
    mask |= 255u << shift;
  }
  // prefix: the k-th largest key; every larger key is taken, and the first `left` equal to it in page order.
  const int sink = first;
  for (int c = tid; c < sink; c += blockDim.x) dst[c] = src[c];
  int taken = 0, equal_seen = 0;
  for (int c0 = first; c0 < end; c0 += blockDim.x) {
    const int c = c0 + tid;
    const uint32_t key = c < end ? order_key(sc[c]) : 0u;
    const bool equal = c < end && key == prefix;
    int equal_total, taken_total;
    const int equal_before = equal_seen + block_prefix(equal, warp_counts, equal_total);
    const bool take = c < end && (key > prefix || (equal && equal_before < left));
    const int at = taken + block_prefix(take, warp_counts, taken_total);
    if (take) dst[sink + at] = src[c];
    equal_seen += equal_total;
    taken += taken_total;
  }
  for (int j = tid; j < n - end; j += blockDim.x) dst[sink + k + j] = src[end + j];
  if (tid == 0) a.keys[list] = (a.rule.budget_pages - 1) * a.page_size + (a.ctx_len[s] - (n - 1) * a.page_size);
}

// ---- staging (ops.h KvStaging) ----
constexpr int kStageThreads = 512;
constexpr int kStageLoads = 4;  // 16-byte host reads in flight a thread while copying (PCIe latency; a block a head)

struct StageArgs {
  KvStaging st;
  const char* host_k;
  const char* host_v;
  char* k;
  char* v;
  const float* host_k_scale;
  const float* host_v_scale;
  float* k_scale;
  float* v_scale;
  int elem_bytes, host0, heads, head_dim, page_size, max_pages, num_seqs;
  const int32_t* q_start;
  const int32_t* ctx_len;
  const int32_t* keys;
  int32_t* pages;
  SparseAttention rule;
};

// Block h: kv head h's staging after select_kernel, cpu/sparse.cpp stage_pages' rule in its order. The lists are
// walked one after another; within a list, its entries a chunk of the block's threads at a time: the chunk's pages
// no slot holds take, in entry order, the slots the hand reaches first among those not read this call.
__global__ void __launch_bounds__(kStageThreads) stage_kernel(const StageArgs a) {
  grid_release();
  grid_wait();
  __shared__ int warp_counts[kStageThreads / 32];
  __shared__ int victims[kStageThreads];
  __shared__ int copy_from[kStageThreads];  // host frame of each page the chunk copies
  __shared__ int sums[2][kStageThreads / 32];
  const int h = blockIdx.x, tid = threadIdx.x, S = a.st.slots, H = a.heads, ps = a.page_size;
  int32_t* slot_page = a.st.slot_page + int64_t(h) * S;
  uint32_t* used = a.st.used + int64_t(h) * S;
  uint32_t* clock = a.st.clock + 2 * h;
  auto map = [&](int f) { return a.st.map + int64_t(f - a.host0) * a.st.map_stride + a.st.map_col + h; };
  auto selects = [&](int s) { return a.rule.selects(a.ctx_len[s], a.q_start[s + 1] - a.q_start[s], ps); };
  auto list_of = [&](int s) { return a.pages + (int64_t(s) * H + h) * a.max_pages; };
  auto entries = [&](int s) { return (a.keys[int64_t(s) * H + h] + ps - 1) / ps; };
  const uint32_t call = clock[1] + 1;
  for (int s = 0; s < a.num_seqs; ++s) {  // slots holding a chosen page are read this call
    if (!selects(s)) continue;
    const int32_t* list = list_of(s);
    for (int e = tid; e < entries(s); e += blockDim.x) {
      const int f = list[e];
      if (f >= a.host0 && *map(f) > 0) used[*map(f) - 1] = call;
    }
    __syncthreads();  // (lists may share pages: one list's writes at a time)
  }
  uint32_t hand = clock[0];
  int64_t copies = 0;
  bool full = false;  // no slot left this call
  const int units = a.head_dim * a.elem_bytes / 16;  // 16-byte pieces of a head's row
  const int64_t row_bytes = int64_t(H) * a.head_dim * a.elem_bytes;
  for (int s = 0; s < a.num_seqs && !full; ++s) {
    if (!selects(s)) continue;
    const int32_t* list = list_of(s);
    const int m = entries(s);
    for (int e0 = 0; e0 < m && !full; e0 += blockDim.x) {
      const int e = e0 + tid, f = e < m ? list[e] : -1;
      const bool miss = f >= a.host0 && *map(f) == 0;
      int total;
      const int idx = block_prefix(miss, warp_counts, total);
      if (total == 0) continue;
      int found = 0;
      for (int i0 = 0; i0 < S && found < total; i0 += blockDim.x) {
        const int i = i0 + tid, slot = int((hand + uint32_t(i)) % uint32_t(S));
        const bool free = i < S && used[slot] != call;
        int cnt;
        const int j = found + block_prefix(free, warp_counts, cnt);
        if (free && j < total) victims[j] = slot;
        found += cnt;
      }
      const int got = min(found, total);
      __syncthreads();
      if (got > 0) hand = uint32_t(victims[got - 1] + 1) % uint32_t(S);
      const bool takes = miss && idx < got;
      if (takes) {  // the slot's page, where the map still leads to it, is no longer staged
        const int slot = victims[idx], old = slot_page[slot] - 1;
        if (old >= 0 && *map(a.host0 + old) == slot + 1) *map(a.host0 + old) = 0;
      }
      __syncthreads();  // (a page the map no longer leads to may be one this chunk stages again)
      if (takes) {
        const int slot = victims[idx];
        slot_page[slot] = f - a.host0 + 1;
        *map(f) = slot + 1;
        used[slot] = call;
        copy_from[idx] = f;
      }
      __syncthreads();
      // Head h's columns of each copied page's rows: K and V in 16-byte pieces, then the fp8 scales.
      auto rows = [&](int c, int r, int64_t& src, int64_t& dst) {  // copied page c's row r in each tier
        src = int64_t(copy_from[c] - a.host0) * ps + r;
        dst = int64_t(a.st.first + victims[c]) * ps + r;
      };
      auto piece_at = [&](int64_t u, bool host) -> char* {  // 16-byte piece u of the copy, in either tier
        const int piece = int(u % units), kv = int(u / units % 2);
        int64_t src, dst;
        rows(int(u / units / 2 / ps), int(u / units / 2 % ps), src, dst);
        const int64_t at = (host ? src : dst) * row_bytes + int64_t(h) * a.head_dim * a.elem_bytes + piece * 16;
        return host ? const_cast<char*>(kv ? a.host_v : a.host_k) + at : (kv ? a.v : a.k) + at;
      };
      const int64_t pieces = int64_t(got) * ps * 2 * units;
      for (int64_t u0 = tid; u0 < pieces; u0 += int64_t(kStageLoads) * blockDim.x) {
        uint4 buf[kStageLoads];
#pragma unroll
        for (int j = 0; j < kStageLoads; ++j) {
          const int64_t u = u0 + int64_t(j) * blockDim.x;
          if (u < pieces) buf[j] = *reinterpret_cast<const uint4*>(piece_at(u, true));
        }
#pragma unroll
        for (int j = 0; j < kStageLoads; ++j) {
          const int64_t u = u0 + int64_t(j) * blockDim.x;
          if (u < pieces) *reinterpret_cast<uint4*>(piece_at(u, false)) = buf[j];
        }
      }
      if (a.k_scale)
        for (int u = tid; u < got * ps; u += blockDim.x) {
          int64_t src, dst;
          rows(u / ps, u % ps, src, dst);
          a.k_scale[dst * H + h] = a.host_k_scale[src * H + h];
          a.v_scale[dst * H + h] = a.host_v_scale[src * H + h];
        }
      copies += got;
      full = got < total;
      __syncthreads();  // victims and copy_from are free again
    }
  }
  int staged = 0, in_place = 0;  // this call's
  for (int s = 0; s < a.num_seqs; ++s) {
    if (!selects(s)) continue;
    int32_t* list = list_of(s);
    for (int e = tid; e < entries(s); e += blockDim.x) {
      const int f = list[e];
      if (f < a.host0) continue;
      const int v = *map(f);
      if (v > 0) list[e] = a.st.first + v - 1, ++staged;
      else ++in_place;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    staged += __shfl_xor_sync(0xffffffffu, staged, o);
    in_place += __shfl_xor_sync(0xffffffffu, in_place, o);
  }
  if ((tid & 31) == 0) sums[0][tid >> 5] = staged, sums[1][tid >> 5] = in_place;
  __syncthreads();
  if (tid == 0) {
    for (int w = 1; w < kStageThreads / 32; ++w) staged += sums[0][w], in_place += sums[1][w];
    clock[0] = hand;
    clock[1] = call;
    int64_t* n = a.st.counts + 3 * h;
    n[0] += staged, n[1] += copies, n[2] += in_place;
    for (int j = 0; j < 3; ++j) a.st.counts_host[3 * h + j] = n[j];
  }
}

}  // namespace

void launch_summarize_pages(const KvLayer& cache, const AttnBatch& b, int kv_cols, cudaStream_t st) {
  QRT_CHECK(cache.summary, "cuda summarize_pages: the cache has no page summaries");
  if (b.num_tokens == 0) return;
  QRT_CHECK(cache.fp8() ? cache.k_scale != nullptr && cache.kv_heads > 0 : cache.summary_dtype == cache.dtype,
            "cuda summarize_pages: summaries of ",
            dtype_name(cache.summary_dtype), " for a cache of ", dtype_name(cache.dtype));
  dispatch_act(cache.summary_dtype, "summarize_pages", [&](auto tag) {
    using T = decltype(tag);
    launch_chained(summarize_kernel<T>, unsigned(b.num_tokens), kSummaryThreads, 0, st, cache.k,
                   cache.fp8() ? cache.k_scale : nullptr, std::max(cache.kv_heads, 1), static_cast<T*>(cache.summary),
                   b.kv_rows, b.num_tokens, b.page_size, int64_t(kv_cols));
  });
  check_launch("summarize_pages");
}

void launch_select_pages(const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& sh,
                         const SparseAttention& rule, float* scores, int32_t* pages, int32_t* keys, cudaStream_t st) {
  QRT_CHECK(cache.summary, "cuda select_pages: the cache has no page summaries");
  QRT_CHECK(q.dtype == cache.summary_dtype, "cuda select_pages: q ", dtype_name(q.dtype), " and the summaries ",
            dtype_name(cache.summary_dtype), " differ");
  QRT_CHECK(sh.head_dim == 64 || sh.head_dim == 128 || sh.head_dim == 256, "cuda select_pages: head_dim ",
            sh.head_dim, " (64, 128, 256)");
  if (b.num_seqs == 0) return;
  const char* agg = std::getenv("QWEN_RT_SELECT_AGG");  // read at every call (the tests set it)
  SelectArgs a{q.data, q.stride, cache.summary, b.q_start, b.ctx_len, b.page_table, b.max_pages, b.page_size,
               sh.kv_heads, sh.q_heads / sh.kv_heads, sh.head_dim, rule, scores, pages, keys,
               agg && std::strcmp(agg, "1") == 0};
  const size_t smem = size_t(a.group) * sh.head_dim * 4;
  const dim3 grid(ceil_div(std::max(b.max_pages, 1), kScoreWarps * kScorePagesPerWarp), unsigned(sh.kv_heads),
                  unsigned(b.num_seqs));
  dispatch_act(q.dtype, "select_pages", [&](auto tag) {
    using T = decltype(tag);
    auto run = [&](auto kernel) {
      if (smem > 48 * 1024)
        check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
              "select_pages (smem attribute)");
      launch_chained(kernel, grid, kScoreWarps * 32, smem, st, a);
    };
    switch (sh.head_dim) {
      case 64: run(score_kernel<T, 64>); break;
      case 128: run(score_kernel<T, 128>); break;
      default: run(score_kernel<T, 256>); break;
    }
  });
  check_launch("select_pages (scores)");
  launch_chained(select_kernel, dim3(unsigned(sh.kv_heads), unsigned(b.num_seqs)), kSelectThreads, 0, st, a);
  check_launch("select_pages (lists)");
  if (cache.staging.slots == 0) return;
  QRT_CHECK(cache.host_k && cache.host_page0 == cache.staging.first + cache.staging.slots,
            "cuda select_pages: staging without a host tier after it");
  QRT_CHECK(sh.head_dim * dtype_size(cache.dtype) % 16 == 0, "cuda select_pages: staging copies 16-byte pieces");
  StageArgs g{cache.staging, static_cast<const char*>(cache.host_k), static_cast<const char*>(cache.host_v),
              static_cast<char*>(cache.k), static_cast<char*>(cache.v), cache.host_k_scale, cache.host_v_scale,
              cache.fp8() ? cache.k_scale : nullptr, cache.v_scale, int(dtype_size(cache.dtype)), cache.host_page0,
              sh.kv_heads, sh.head_dim, b.page_size, b.max_pages, b.num_seqs, b.q_start, b.ctx_len, keys, pages,
              rule};
  launch_chained(stage_kernel, unsigned(sh.kv_heads), kStageThreads, 0, st, g);
  check_launch("select_pages (staging)");
}

}  // namespace qrt::cuda
