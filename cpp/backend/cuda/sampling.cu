// Sampling on the GPU with the semantics stated at the end of ops.h, in two kernels:
// - logit_stats_kernel: blocks over (chunk of the vocabulary, row) reduce the raw logits to a per-chunk
//   (max, sum of exp(v - max), best (value, id)), so the log-softmax and the greedy token of a row take the
//   whole GPU, not one SM (a single block scanning Qwen's 151,936 logits took ~60 us at batch 1);
// - sample_kernel: one block per row merges its chunks in a fixed order (greedy ends there), then
//   top-N logprobs, penalties (on a copy of the row, only when a row has them), temperature, top_k / top_p /
//   min_p and the draw, by one of three paths that give the same token:
//   * a small top_k (<= 1024, Qwen's generation_config asks for 20): two passes over the row collect a short
//     candidate list that holds every kept token; the rest works on that list in shared memory;
//   * top_p without top_k: a Gumbel draw over the row, then rejection while the winner is outside the top_p
//     prefix (a pass or two more);
//   * anything else (or a candidate list that overflows): bitwise searches over order-preserving integer
//     keys find the top_k value and the top_p cut, each step one pass over the row; no sorting.
#include "backend/cuda/cuda_common.cuh"
#include "backend/random.h"

namespace qrt::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;

struct Cand {
  float v;
  int i;
};
// a before b in the order (value descending, id ascending); NaN never wins.
__device__ __forceinline__ bool better(const Cand& a, const Cand& b) {
  if (b.i < 0) return a.i >= 0;
  if (a.i < 0) return false;
  return a.v > b.v || (a.v == b.v && a.i < b.i);
}

template <typename T> __device__ __forceinline__ T shfl(T v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }

struct MaxOp { __device__ float operator()(float a, float b) const { return fmaxf(a, b); } };
struct SumF { __device__ float operator()(float a, float b) const { return a + b; } };
struct SumD { __device__ double operator()(double a, double b) const { return a + b; } };
struct SumI { __device__ int operator()(int a, int b) const { return a + b; } };

// All threads of a block of NW warps get the result. Each instantiation has its own shared scratch.
template <typename T, typename Op, int NW = kWarps>
__device__ T block_reduce(T v, Op op) {
  __shared__ T sm[NW];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, shfl(v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sm[warp] = v;
  __syncthreads();
  T r = sm[0];
  for (int w = 1; w < NW; ++w) r = op(r, sm[w]);
  __syncthreads();
  return r;
}

template <int NW = kWarps>
__device__ Cand block_best(Cand c) {
  __shared__ Cand sm[NW];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Cand x{shfl(c.v, o), shfl(c.i, o)};
    if (better(x, c)) c = x;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sm[warp] = c;
  __syncthreads();
  Cand r = sm[0];
  for (int w = 1; w < NW; ++w)
    if (better(sm[w], r)) r = sm[w];
  __syncthreads();
  return r;
}

// NaN counts as -inf once penalties and temperature are applied (ops.h): no draw picks it.
__device__ __forceinline__ float nan_to_neg_inf(float v) { return isnan(v) ? -INFINITY : v; }

// Order-preserving key of a float (larger float, larger key); -0 and +0 share a key.
__device__ __forceinline__ uint32_t fkey(float f) {
  if (f == 0.0f) f = 0.0f;
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_value(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// One chunk of a row's raw logits: its max, the sum of exp(v - max) over it, its best (value desc, id asc).
struct ChunkStats {
  float m, se, best_v;
  int best_i;
};
static_assert(sizeof(ChunkStats) == 16, "sample_stats_bytes counts 16 bytes per chunk");
constexpr int kStatThreads = 256, kStatPer = 16, kStatChunk = kStatThreads * kStatPer;

// Block (chunk c, row r): stats[r * chunks + c].
__global__ void __launch_bounds__(kStatThreads) logit_stats_kernel(const float* logits, int V, int64_t stride,
                                                                   int chunks, ChunkStats* stats) {
  grid_release();
  grid_wait();
  constexpr int NW = kStatThreads / 32;
  const int c = blockIdx.x, r = blockIdx.y, tid = threadIdx.x;
  const float* raw = logits + int64_t(r) * stride;
  float v[kStatPer], m = -INFINITY;
  bool nan = false;
  Cand best{0.f, -1};
#pragma unroll
  for (int k = 0; k < kStatPer; ++k) {
    const int i = c * kStatChunk + k * kStatThreads + tid;
    v[k] = i < V ? raw[i] : -INFINITY;
    m = fmaxf(m, v[k]);
    nan = nan || isnan(v[k]);
    const Cand x{v[k], i};
    if (i < V && better(x, best)) best = x;
  }
  float se = 0.f;
  if (m != -INFINITY)
#pragma unroll
    for (int k = 0; k < kStatPer; ++k) se += expf(v[k] - m);
  // A NaN logit makes the row's sum NaN (fmaxf passes over it: a thread whose values are NaN or -inf alone would
  // otherwise add nothing).
  const float M = block_reduce<float, MaxOp, NW>(m, MaxOp{});
  se = nan ? NAN : m == -INFINITY ? 0.f : se * expf(m - M);
  const float S = block_reduce<float, SumF, NW>(se, SumF{});
  best = block_best<NW>(best);
  if (tid == 0) stats[int64_t(r) * chunks + c] = ChunkStats{M, S, best.v, best.i};
}

// The largest key K with count(key(get(i)) >= K, i < n) >= k: key_value(K) is the k-th largest value, with
// multiplicity. 32 steps, each one pass over the n values and a block-wide count.
template <typename Get>
__device__ uint32_t kth_largest_key(Get get, int n, int k) {
  uint32_t K = 0;
  for (int b = 31; b >= 0; --b) {
    const uint32_t cand = K | (1u << b);
    int cnt = 0;
    for (int i = threadIdx.x; i < n; i += kThreads) cnt += fkey(get(i)) >= cand;
    if (block_reduce(cnt, SumI{}) >= k) K = cand;
  }
  return K;
}

// min_p's floor on the (tempered) values: p >= min_p * p_max is v >= kmx + log(min_p); -inf when off.
__device__ __forceinline__ float min_p_floor(const SampleParamsDev& p, float kmx) {
  return p.min_p > 0.0f ? kmx + logf(p.min_p) : -INFINITY;
}

// The Gumbel-max score of token i with value v, or no candidate when v is under the min_p floor or -inf.
__device__ __forceinline__ Cand gumbel(const SampleParamsDev& p, float floor_v, int i, float v) {
  if (v < floor_v || v == -INFINITY) return Cand{0.f, -1};
  const float u = uniform01(p.seed, uint64_t(p.draw), uint64_t(i));
  return Cand{v - logf(-logf(u)), i};
}

// The draw for a small top_k (1..kThreads) from a short list instead of the whole row. The k-th largest of
// the threads' maxima (tmax) is a lower bound L on the row's k-th largest value (k distinct tokens reach it),
// so the tokens >= L, usually a few times k, hold all the top_k keeps. They are collected into shared memory
// and sorted (value desc, id asc); top_k, top_p (sums in that order, as the CPU backend) and the Gumbel draw
// then read only that list. Returns -1 when more than kCandCap tokens reach L (the caller takes the full path).
constexpr int kCandCap = 1024;
struct CandList {
  union {
    struct { float v[kCandCap]; int id[kCandCap]; } in;  // collected, in any order
    double e[kCandCap];                                     // after sorting: exp(v - kmx) in sorted order
  };
  float v[kCandCap];  // sorted
  int id[kCandCap];
  float tmax[kThreads];
  int n, keep;
};

template <typename X>
__device__ int draw_from_candidates(X xv, int V, float tmax, float kmx, const SampleParamsDev& p, CandList& cl) {
  const int tid = threadIdx.x;
  cl.tmax[tid] = tmax;
  if (tid == 0) cl.n = 0;
  __syncthreads();
  const uint32_t L = kth_largest_key([&](int i) { return cl.tmax[i]; }, kThreads, p.top_k);
  for (int i = tid; i < V; i += kThreads) {
    const float v = xv(i);
    if (fkey(v) >= L) {
      const int at = atomicAdd(&cl.n, 1);
      if (at < kCandCap) {
        cl.in.v[at] = v;
        cl.in.id[at] = i;
      }
    }
  }
  __syncthreads();
  const int n = cl.n;
  if (n > kCandCap || n < p.top_k) return -1;  // n >= k unless values sort below -inf (negative NaNs)
  // Sort by rank: (key desc, id asc) is a total order, so every rank is taken once.
  for (int j = tid; j < n; j += kThreads) {
    const uint32_t kj = fkey(cl.in.v[j]);
    const int ij = cl.in.id[j];
    int rank = 0;
    for (int i = 0; i < n; ++i) {
      const uint32_t ki = fkey(cl.in.v[i]);
      rank += ki > kj || (ki == kj && cl.in.id[i] < ij);
    }
    cl.v[rank] = cl.in.v[j];
    cl.id[rank] = ij;
  }
  __syncthreads();
  // top_k: all with the k-th value (n >= k: the k maxima that set L are in the list).
  const uint32_t kth = fkey(cl.v[p.top_k - 1]);
  int m = 0;
  for (int j = tid; j < n; j += kThreads) m += fkey(cl.v[j]) >= kth;
  m = block_reduce(m, SumI{});
  if (p.top_p < 1.0f && isfinite(kmx)) {  // the smallest prefix whose mass reaches top_p, summed in order
    // (kmx +inf: no cut, the +inf tokens win the draw as the CPU's cut to them; -inf: none has mass)
    for (int j = tid; j < m; j += kThreads) cl.e[j] = exp(double(cl.v[j] - kmx));
    __syncthreads();
    if (tid == 0) {
      double z = 0.0, cum = 0.0;
      for (int j = 0; j < m; ++j) z += cl.e[j];
      int keep = 0;
      while (keep < m) {
        cum += cl.e[keep++] / z;
        if (cum >= double(p.top_p)) break;
      }
      cl.keep = keep;
    }
    __syncthreads();
    m = cl.keep;
  }
  const float floor_v = min_p_floor(p, kmx);
  Cand g{0.f, -1};
  for (int j = tid; j < m; j += kThreads) {
    const Cand c = gumbel(p, floor_v, cl.id[j], cl.v[j]);
    if (better(c, g)) g = c;
  }
  g = block_best(g);
  return g.i >= 0 ? g.i : cl.id[0];  // none above the floor: the first kept
}

// top_p without top_k, by rejection: the Gumbel-max winner over the candidates is kept when the mass of the
// tokens before it in the order (value desc, id asc) is under top_p; the kept set is a prefix of that order,
// so a rejected winner and everything after it are out, and the next winner is taken among the tokens before
// it. Each winner is kept with probability at least top_p, so a round or two is usual; the same token as the
// cut-then-draw of draw_full up to the rounding of the mass sums. Returns -1 after kMaxRounds (the caller
// then takes the full path).
constexpr int kMaxRounds = 16;
template <typename X>
__device__ int draw_top_p(X xv, int V, float kmx, const SampleParamsDev& p) {
  const int tid = threadIdx.x;
  const double tp = double(p.top_p);
  const float floor_v = min_p_floor(p, kmx);
  // One pass: z, the best token by value (always kept: the answer when no candidate is) and the first winner.
  double z = 0.0;
  Cand best{0.f, -1}, win{0.f, -1};
  for (int i = tid; i < V; i += kThreads) {
    const float v = xv(i);
    z += double(expf(v - kmx));
    const Cand b{v, i};
    if (better(b, best)) best = b;
    const Cand c = gumbel(p, floor_v, i, v);
    if (better(c, win)) win = c;
  }
  z = block_reduce(z, SumD{});
  best = block_best(best);
  win = block_best(win);
  for (int round = 0; round < kMaxRounds; ++round) {
    if (win.i < 0) return best.i < 0 ? 0 : best.i;
    // One pass: the mass before the winner t, and the next winner among the tokens before t.
    const int t = win.i;
    const float vt = xv(t);
    double before = 0.0;
    Cand next{0.f, -1};
    for (int i = tid; i < V; i += kThreads) {
      const float v = xv(i);
      if (!(v > vt || (v == vt && i < t))) continue;
      before += double(expf(v - kmx));
      const Cand c = gumbel(p, floor_v, i, v);
      if (better(c, next)) next = c;
    }
    before = block_reduce(before, SumD{});
    next = block_best(next);
    if (before / z < tp) return t;
    win = next;
  }
  return -1;
}

// Any top_k and top_p over the whole row: the k-th value and the top_p cut by bitwise searches over keys
// (each step one pass), then the Gumbel draw over the kept.
template <typename X>
__device__ int draw_full(X xv, int V, float kmx, const SampleParamsDev& p) {
  const int tid = threadIdx.x;
  const float thr_k = p.top_k > 0 && p.top_k < V ? key_value(kth_largest_key(xv, V, p.top_k)) : -INFINITY;
  // top_p: the smallest prefix (value desc, id asc) of the kept whose mass reaches top_p.
  uint32_t cut_key = 0;  // kept: key > cut_key, or key == cut_key and id <= cut_id
  int cut_id = V;
  if (p.top_p < 1.0f && kmx == INFINITY) {  // the +inf values hold all the mass
    cut_key = fkey(INFINITY);
  } else if (p.top_p < 1.0f && kmx != -INFINITY) {
    double z = 0.0;
    for (int i = tid; i < V; i += kThreads) {
      const float v = xv(i);
      if (v >= thr_k) z += double(expf(v - kmx));
    }
    z = block_reduce(z, SumD{});
    const double tp = double(p.top_p);
    auto mass_from = [&](uint32_t k) {  // mass of the kept with key >= k
      double ms = 0.0;
      for (int i = tid; i < V; i += kThreads) {
        const float v = xv(i);
        if (v >= thr_k && fkey(v) >= k) ms += double(expf(v - kmx));
      }
      return block_reduce(ms, SumD{});
    };
    if (mass_from(0) / z >= tp) {
      uint32_t K = 0;
      for (int b = 31; b >= 0; --b) {
        const uint32_t cand = K | (1u << b);
        if (mass_from(cand) / z >= tp) K = cand;
      }
      // K is the cut value; how many of its ties (in id order) complete the mass?
      const double above = K == 0xffffffffu ? 0.0 : mass_from(K + 1);
      auto is_tie = [&](int i) { const float v = xv(i); return v >= thr_k && fkey(v) == K; };
      int ties = 0;
      for (int i = tid; i < V; i += kThreads) ties += is_tie(i);
      ties = block_reduce(ties, SumI{});
      const double e = double(expf(key_value(K) - kmx));
      int need = ties;
      double cum = above / z;
      for (int j = 1; j <= ties; ++j) {
        cum += e / z;
        if (cum >= tp) {
          need = j;
          break;
        }
      }
      cut_key = K;
      if (need < ties) {  // the need-th smallest id among the ties
        int I = -1;       // largest id with count(tie ids <= I) < need
        for (int b = 30; b >= 0; --b) {
          const int cand = I + (1 << b);
          if (cand >= V) continue;
          int cnt = 0;
          for (int i = tid; i <= cand && i < V; i += kThreads) cnt += is_tie(i);
          if (block_reduce(cnt, SumI{}) < need) I = cand;
        }
        cut_id = I + 1;
      }
    }
  }
  // min_p, then 7. Gumbel-max over the kept.
  const float floor_v = min_p_floor(p, kmx);
  Cand g{0.f, -1}, fallback{0.f, -1};
  for (int i = tid; i < V; i += kThreads) {
    const float v = xv(i);
    if (v < thr_k) continue;
    const uint32_t k = fkey(v);
    if (k < cut_key || (k == cut_key && i > cut_id)) continue;
    const Cand f{v, i};
    if (better(f, fallback)) fallback = f;
    const Cand c = gumbel(p, floor_v, i, v);
    if (better(c, g)) g = c;
  }
  g = block_best(g);
  fallback = block_best(fallback);
  return g.i >= 0 ? g.i : (fallback.i >= 0 ? fallback.i : 0);
}

__global__ void __launch_bounds__(kThreads) sample_kernel(const float* logits, int V, int64_t stride,
                                                           const ChunkStats* stats, int chunks,
                                                           const SampleParamsDev* params, const int32_t* lists,
                                                           float* scratch, int max_n, int32_t* tok_out,
                                                           float* lp_out, int32_t* top_ids, float* top_lps) {
  grid_release();
  grid_wait();
  const int r = blockIdx.x, tid = threadIdx.x;
  const SampleParamsDev p = params[r];
  const float* raw = logits + int64_t(r) * stride;

  // 1. log_softmax of the raw logits (and the raw argmax) from the row's chunks, merged in a fixed order.
  float m = -INFINITY, se = 0.f;
  Cand best{0.f, -1};
  for (int j = tid; j < chunks; j += kThreads) {
    const ChunkStats c = stats[int64_t(r) * chunks + j];
    if (isnan(c.se)) {  // a NaN logit in the chunk: the row's log_softmax is undefined
      se = NAN;
    } else if (c.m > m) {
      se = se * expf(m - c.m) + c.se;
      m = c.m;
    } else if (c.m != -INFINITY) {
      se += c.se * expf(c.m - m);
    }
    const Cand x{c.best_v, c.best_i};
    if (better(x, best)) best = x;
  }
  const float M = block_reduce(m, MaxOp{});
  se = isnan(se) ? NAN : m == -INFINITY ? 0.f : se * expf(m - M);
  const float S = block_reduce(se, SumF{});
  const float lse = M + logf(S);
  best = block_best(best);

  // Top-N raw logprobs: N passes, each the best strictly after the previous one.
  if (max_n > 0) {
    Cand prev{INFINITY, -1};
    for (int k = 0; k < max_n; ++k) {
      Cand c{0.f, -1};
      if (k < p.num_logprobs) {
        for (int i = tid; i < V; i += kThreads) {
          const float v = raw[i];
          const bool after = prev.i < 0 || v < prev.v || (v == prev.v && i > prev.i);
          const Cand x{v, i};
          if (after && better(x, c)) c = x;
        }
        c = block_best(c);
        prev = c;
      }
      if (tid == 0) {
        const bool ok = k < p.num_logprobs && c.i >= 0;
        top_ids[int64_t(r) * max_n + k] = ok ? c.i : -1;
        top_lps[int64_t(r) * max_n + k] = ok ? c.v - lse : -INFINITY;
      }
    }
  }

  int tok = best.i < 0 ? 0 : best.i;  // greedy on the raw logits
  if (p.has_lists || p.inv_temperature != 0.0f) {
    // 2-4. Banned tokens and penalties go into a copy of the row; without them the raw row is read.
    const float* src = raw;
    if (p.has_lists) {
      float* x = scratch + int64_t(r) * V;
      for (int i = tid; i < V; i += kThreads) x[i] = raw[i];
      __syncthreads();
      for (int j = tid; j < p.banned_n; j += kThreads) {
        const int t = lists[p.banned_off + j];
        if (t >= 0 && t < V) x[t] = -INFINITY;
      }
      __syncthreads();
      for (int j = tid; j < p.seen_n; j += kThreads) {
        const int t = lists[p.seen_off + j];
        if (t >= 0 && t < V) x[t] = x[t] > 0 ? x[t] / p.repetition_penalty : x[t] * p.repetition_penalty;
      }
      __syncthreads();
      for (int j = tid; j < p.out_n; j += kThreads) {
        const int t = lists[p.out_off + j];
        const int c = lists[p.out_off + p.out_n + j];
        if (t >= 0 && t < V) x[t] -= float(c) * p.frequency_penalty + p.presence_penalty;
      }
      __syncthreads();
      src = x;
    }
    if (p.inv_temperature == 0.0f) {  // 5. greedy
      Cand c{0.f, -1};
      for (int i = tid; i < V; i += kThreads) {
        const Cand y{nan_to_neg_inf(src[i]), i};
        if (better(y, c)) c = y;
      }
      c = block_best(c);
      tok = c.i < 0 ? 0 : c.i;
    } else {
      // 6. temperature, applied where a value is read; then top_k / top_p / min_p and 7. the draw.
      const float inv_t = p.inv_temperature;
      // Rounded, never fused: the CPU's x / t.
      auto xv = [=](int i) { return nan_to_neg_inf(__fmul_rn(src[i], inv_t)); };
      float tmax = -INFINITY;
      for (int i = tid; i < V; i += kThreads) tmax = fmaxf(tmax, xv(i));
      const float kmx = block_reduce(tmax, MaxOp{});  // the maximum is always kept
      __shared__ CandList cl;
      tok = -1;
      if (p.top_k > 0 && p.top_k < V && p.top_k <= kThreads) tok = draw_from_candidates(xv, V, tmax, kmx, p, cl);
      if (tok < 0 && (p.top_k <= 0 || p.top_k >= V) && p.top_p < 1.0f && isfinite(kmx))
        tok = draw_top_p(xv, V, kmx, p);
      if (tok < 0) tok = draw_full(xv, V, kmx, p);
    }
  }
  if (tid == 0) {
    tok_out[r] = tok;
    lp_out[r] = isfinite(lse) ? raw[tok] - lse : NAN;  // NaN: the row's log_softmax is undefined (ops.h)
  }
}

}  // namespace

int64_t sample_stats_chunks(int64_t vocab) { return (vocab + kStatChunk - 1) / kStatChunk; }

void launch_sample(const float* logits, int64_t rows, int64_t vocab, int64_t stride, const SampleParamsDev* params,
                   const int32_t* lists, void* stats, float* scratch, int max_n, int32_t* tok_out, float* lp_out,
                   int32_t* top_ids, float* top_lps, cudaStream_t s) {
  if (rows == 0) return;
  const int chunks = int(sample_stats_chunks(vocab));
  launch_chained(logit_stats_kernel, dim3(unsigned(chunks), unsigned(rows)), kStatThreads, 0, s, logits, int(vocab),
                 stride, chunks, static_cast<ChunkStats*>(stats));
  check_launch("sample (logit stats)");
  launch_chained(sample_kernel, unsigned(rows), kThreads, 0, s, logits, int(vocab), stride,
                 static_cast<const ChunkStats*>(stats), chunks, params, lists, scratch, max_n, tok_out, lp_out,
                 top_ids, top_lps);
  check_launch("sample");
}

}  // namespace qrt::cuda
