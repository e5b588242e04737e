// Causal paged attention on the GPU. Three kernels:
// - rows kernel: one block per (query row, kv head, split of the keys); the GQA group of query heads
//   shares each K/V tile; FMA math. Used for fp32 (the exactness mode) and the decode batches the decode
//   kernel does not take (split over the keys, flash-decoding, then a combine kernel).
// - decode kernel (bf16/fp16, one query row per sequence, a 16-bit or an fp8 cache): the rows kernel's job on
//   tensor cores, K and V read straight into mma fragments; the same split and combine. At small batches it
//   also does finish_qkv's work for its rows (launch_qkv_attention).
// - tile kernel (bf16/fp16): FlashAttention-2 style; a block holds 128 (token, head) rows of one
//   sequence and one kv head, streams K/V pages through shared memory (cp.async, two stages) and
//   computes QK^T and PV with mma.sync m16n8k16 tensor-core instructions, online softmax in fp32.
//   On sm_90a its job goes to the wgmma kernel (attention_sm90.cuh).
// Launch shapes come from the host maxima of AttnBatch; lengths are read on the device, so a
// captured graph stays valid while the real lengths stay within the maxima it was captured with.
#include <algorithm>
#include <cfloat>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "backend/cuda/cuda_common.cuh"

namespace qrt::cuda {
namespace {

constexpr int kRowThreads = 128;
constexpr int kGMax = 8;       // most query heads per rows-kernel block (GM = 4 or 8)
constexpr int kMaxSplits = 64;
// A 4-head variant of the rows kernel for GQA <= 4 (the 8-wide one would idle half its heads).
constexpr bool kRowsGM4 = true;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kTileMaxGroup = 32;  // GQA groups the tile kernel takes: two or more tokens per 64-row block

__device__ __forceinline__ int find_seq(const int32_t* q_start, int num_seqs, int row) {
  int lo = 0, hi = num_seqs - 1;  // largest s with q_start[s] <= row
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (q_start[mid] <= row) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ float2 load2(const float* p) { return *reinterpret_cast<const float2*>(p); }
__device__ __forceinline__ float2 load2(const __half* p) { return __half22float2(*reinterpret_cast<const __half2*>(p)); }
__device__ __forceinline__ float2 load2(const __nv_bfloat16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}

// fp8 (e4m3) cache elements: two, and eight consecutive (8-byte aligned), as fp32.
__device__ __forceinline__ float2 load2(const uint8_t* p) {
  return __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(*reinterpret_cast<const __nv_fp8x2_storage_t*>(p),
                                                            __NV_E4M3)));
}
__device__ __forceinline__ void load8(const uint8_t* p, float (&f)[8]) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const uint32_t w[2] = {u.x, u.y};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(
        __nv_fp8x2_storage_t((w[i >> 1] >> (16 * (i & 1))) & 0xffffu), __NV_E4M3)));
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

// Eight consecutive elements (16-byte aligned for 16-bit types, 32 for fp32) as fp32.
__device__ __forceinline__ void load8(const float* p, float (&f)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}
__device__ __forceinline__ void load8(const __half* p, float (&f)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __half2float(__ushort_as_half((unsigned short)(w[i] & 0xffffu)));
    f[2 * i + 1] = __half2float(__ushort_as_half((unsigned short)(w[i] >> 16)));
  }
}
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&f)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// ================================================================================================
// Rows kernel
// ================================================================================================
// C: the cache's element type (T, or uint8_t for an fp8 cache).
template <typename C> struct RowCfg {
  static constexpr int kTile = sizeof(C) == 4 ? 16 : 32;  // keys per shared-memory tile
  static constexpr int kPad = 16 / int(sizeof(C));         // elements of row padding (16 bytes)
};

template <typename C, int D, int GM>
constexpr size_t rows_smem_bytes() {
  constexpr int TILE = RowCfg<C>::kTile, LD = D + RowCfg<C>::kPad;
  return size_t(GM) * D * 4                    // q (fp32, pre-scaled)
         + size_t(2) * 2 * TILE * LD * sizeof(C)  // K and V, two stages
         + size_t(TILE) * GM * 4                // probabilities [t][g]
         + 3 * GM * 4                           // m, l, alpha
         + (sizeof(C) == 1 ? size_t(2) * 2 * TILE * 4 : 0);  // fp8: K and V scales, two stages
}

// What both attention kernels read: q, the paged cache, the batch, the output (filled by attn_args).
struct AttnArgs {
  const void* q;
  int64_t q_stride;
  const void* kc;
  const void* vc;
  const void* host_k;  // the host tier (ops.h KvLayer), from page host_page0 on
  const void* host_v;
  int host_page0;
  const float* k_scale;  // fp8 caches: each tier's scales per (row, kv head) (ops.h KvLayer); else null
  const float* v_scale;
  const float* host_k_scale;
  const float* host_v_scale;
  const int32_t* q_start;
  const int32_t* ctx_len;
  const int32_t* page_table;
  int max_pages, page_size, kv_heads, group;
  bool head_tables;  // a page list (and key count) per (sequence, kv head): ops.h AttnBatch::head_tables
  float scale_log2;
  void* out;
  int64_t out_stride;
};

// The page list (row of page_table and ctx_len) of sequence s's kv head kvh.
__device__ __forceinline__ int64_t list_of(const AttnArgs& a, int s, int kvh) {
  return a.head_tables ? int64_t(s) * a.kv_heads + kvh : s;
}

// Key j's K and V rows (one head's D elements each).
template <typename T> struct KvPtr {
  const T* k;
  const T* v;
};
// One sequence's kv head in the paged cache: key j's rows are row(j) * cols elements into its tier's K and V
// (pages from host_page0 on: the host tier, ops.h KvLayer); fp8: their scales at tier_row(j) * kv_heads.
template <typename T> struct KvHead {
  const T* k;
  const T* v;
  const T* host_k;
  const T* host_v;
  int host_page0;
  int64_t cols;
  const int32_t* pages;
  int page_size;
  const float* k_scale;  // fp8: this head's scales (offset by the kv head) of each tier
  const float* v_scale;
  const float* host_k_scale;
  const float* host_v_scale;
  int kv_heads;
  // Key j's row in its tier; on_host: the tier.
  __device__ __forceinline__ int64_t tier_row(int j, bool& on_host) const {
    const int page = pages[j / page_size];
    on_host = page >= host_page0;
    return int64_t(on_host ? page - host_page0 : page) * page_size + (j % page_size);
  }
  // Key j's row offset (elements) from its tier's base.
  __device__ __forceinline__ int64_t row(int j, bool& on_host) const { return tier_row(j, on_host) * cols; }
  // fp8: the K and V scales of tier row r.
  __device__ __forceinline__ float2 scales(int64_t r, bool on_host) const {
    const int64_t i = r * kv_heads;
    return on_host ? make_float2(host_k_scale[i], host_v_scale[i]) : make_float2(k_scale[i], v_scale[i]);
  }
  __device__ __forceinline__ KvPtr<T> at(int64_t row, bool on_host) const {
    return on_host ? KvPtr<T>{host_k + row, host_v + row} : KvPtr<T>{k + row, v + row};
  }
  __device__ __forceinline__ KvPtr<T> at(int j) const {
    bool on_host;
    const int64_t r = row(j, on_host);
    return at(r, on_host);
  }
};
template <typename T, int D>
__device__ __forceinline__ KvHead<T> kv_head(const AttnArgs& a, int seq, int kvh) {
  const int64_t h = int64_t(kvh) * D;
  return {static_cast<const T*>(a.kc) + h, static_cast<const T*>(a.vc) + h,
          static_cast<const T*>(a.host_k) + h, static_cast<const T*>(a.host_v) + h, a.host_page0,
          int64_t(a.kv_heads) * D, a.page_table + list_of(a, seq, kvh) * a.max_pages, a.page_size,
          a.k_scale + kvh, a.v_scale + kvh, a.host_k_scale + kvh, a.host_v_scale + kvh, a.kv_heads};
}

struct RowsArgs : AttnArgs {
  int num_seqs, gsubs, q_heads;
  bool row_is_seq;  // every sequence has one query row (row r is sequence r's)
  float* part;  // nsplit > 1: [rows, q_heads, nsplit, D] outputs then [rows, q_heads, nsplit, 2] (m, l)
  int nsplit, num_tokens;
};

// Query row `row`'s sequence s and key count n_keys for kv head kvh; returns the keys per split (chunk): the row's
// keys cut into nsplit chunks, each rounded up to a multiple of `granule` (trailing splits may have none).
__device__ __forceinline__ int split_chunk(const RowsArgs& a, int row, int kvh, int granule, int& s, int& n_keys) {
  s = a.row_is_seq ? row : find_seq(a.q_start, a.num_seqs, row);
  n_keys = a.ctx_len[list_of(a, s, kvh)] - (a.q_start[s + 1] - a.q_start[s]) + (row - a.q_start[s]) + 1;
  const int chunk = (max(n_keys, 1) + a.nsplit - 1) / a.nsplit;
  return (chunk + granule - 1) / granule * granule;
}

// Split `split` of query row `row`: its sequence s and the keys [k_begin, k_end) it attends to. Returns the
// row's key count.
__device__ __forceinline__ int split_keys(const RowsArgs& a, int row, int kvh, int split, int granule, int& s,
                                          int& k_begin, int& k_end) {
  int n_keys;
  const int chunk = split_chunk(a, row, kvh, granule, s, n_keys);
  k_begin = split * chunk;
  k_end = min(n_keys, k_begin + chunk);
  return n_keys;
}

// nsplit > 1: where the normalized partial output [D] of (row, query head, split) goes, and its (max, sum).
__device__ __forceinline__ float* split_out(const RowsArgs& a, int row, int head, int split, int D) {
  return a.part + ((size_t(row) * a.q_heads + head) * a.nsplit + split) * D;
}
__device__ __forceinline__ float* split_ml(const RowsArgs& a, int row, int head, int split, int D) {
  return a.part + size_t(a.num_tokens) * a.q_heads * a.nsplit * D +
         ((size_t(row) * a.q_heads + head) * a.nsplit + split) * 2;
}

// A row without keys (nsplit 1, the whole block): heads [h0, h0 + ng) of `row` get a zero output. (A split
// without keys when nsplit > 1 writes nothing: the combine kernel reads only the splits that have keys.)
template <typename T, int D>
__device__ __forceinline__ void write_zero_output(const RowsArgs& a, int row, int h0, int ng) {
  T* o = static_cast<T*>(a.out) + int64_t(row) * a.out_stride + int64_t(h0) * D;
  for (int i = threadIdx.x; i < ng * D; i += blockDim.x) o[i] = from_f<T>(0.f);
}

// T: q and out; C: the cache's elements (T, or uint8_t: an fp8 cache, each key's score times its K scale and its
// probability times its V scale).
template <typename T, typename C, int D, int GM>
__global__ void __launch_bounds__(kRowThreads) attn_rows_kernel(const RowsArgs a) {
  grid_release();
  grid_wait();
  constexpr bool FP8 = sizeof(C) == 1;
  constexpr int TILE = RowCfg<C>::kTile, LD = D + RowCfg<C>::kPad;
  constexpr int CPR = D * int(sizeof(C)) / 16;  // 16-byte chunks per K/V row
  constexpr int EPC = 16 / int(sizeof(C));      // elements per chunk
  constexpr int NPH = 2 * kRowThreads / D;      // token phases of the PV step (each thread: 2 dims)
  static_assert(NPH >= 1 && GM % 4 == 0, "shape");
  static_assert(NPH == 1 || NPH * GM * D * 4 <= 2 * 2 * TILE * LD * int(sizeof(C)), "the phase sums fit the stages");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* qs = reinterpret_cast<float*>(smem_raw);                          // [GM][D]
  C* kvs = reinterpret_cast<C*>(qs + GM * D);                           // [2 stages][K,V][TILE][LD]
  float* ps = reinterpret_cast<float*>(kvs + 2 * 2 * TILE * LD);           // [TILE][GM]
  float* m_s = ps + TILE * GM;
  float* l_s = m_s + GM;
  float* al_s = l_s + GM;
  float* sc_s = al_s + GM;  // fp8: [2 stages][K,V][TILE] scales

  const int tid = threadIdx.x;
  const int split = blockIdx.x;
  const int kvh = blockIdx.y / a.gsubs, g0 = (blockIdx.y % a.gsubs) * GM;
  const int ng = min(GM, a.group - g0);
  const int row = blockIdx.z;
  int s, k_begin, k_end;
  split_keys(a, row, kvh, split, TILE, s, k_begin, k_end);
  const int h0 = kvh * a.group + g0;

  if (k_begin >= k_end) {  // a split without keys, or (nsplit 1) a row without keys
    if (a.nsplit == 1) write_zero_output<T, D>(a, row, h0, ng);
    return;
  }

  const KvHead<C> cache = kv_head<C, D>(a, s, kvh);

  float2 next_sc = make_float2(0.f, 0.f);  // fp8: the scales issue() loaded last, thread t < TILE holding key t's
  auto issue = [&](int k0, int stage) {
    C* ks = kvs + stage * 2 * TILE * LD;
    C* vs = ks + TILE * LD;
    for (int c = tid; c < TILE * CPR; c += kRowThreads) {
      const int t = c / CPR, part = c - t * CPR;
      const int j = k0 + t;
      const bool ok = j < k_end;
      const KvPtr<C> kv = ok ? cache.at(j) : KvPtr<C>{cache.k, cache.v};
      cp_async16(ks + t * LD + part * EPC, kv.k + part * EPC, ok);
      cp_async16(vs + t * LD + part * EPC, kv.v + part * EPC, ok);
    }
    cp_async_commit();
    if constexpr (FP8) {  // into registers now, into shared memory (put_scales) once this tile is computed
      static_assert(TILE <= kRowThreads, "a key's scales per thread");
      next_sc = make_float2(0.f, 0.f);
      if (tid < TILE && k0 + tid < k_end) {
        bool on_host;
        const int64_t r = cache.tier_row(k0 + tid, on_host);
        next_sc = cache.scales(r, on_host);
      }
    }
  };
  auto put_scales = [&](int stage) {
    if (tid < TILE) {
      sc_s[stage * 2 * TILE + tid] = next_sc.x;
      sc_s[stage * 2 * TILE + TILE + tid] = next_sc.y;
    }
  };

  issue(k_begin, 0);
  if constexpr (FP8) put_scales(0);
  {
    const T* qr = static_cast<const T*>(a.q) + int64_t(row) * a.q_stride + int64_t(h0) * D;
    for (int i = tid; i < GM * D; i += kRowThreads) qs[i] = i < ng * D ? to_f(qr[i]) * a.scale_log2 : 0.f;
    if (tid < GM) {
      m_s[tid] = -INFINITY;
      l_s[tid] = 0.f;
    }
  }

  const int pi = tid % (D / 2), ph = tid / (D / 2);
  float acc[GM][2];
#pragma unroll
  for (int g = 0; g < GM; ++g) acc[g][0] = acc[g][1] = 0.f;

  const int warp = tid >> 5, lane = tid & 31;
  const int ntiles = (k_end - k_begin + TILE - 1) / TILE;
  for (int it = 0; it < ntiles; ++it) {
    const int k0 = k_begin + it * TILE;
    if (it + 1 < ntiles) {
      issue(k0 + TILE, (it + 1) & 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const C* ks = kvs + (it & 1) * 2 * TILE * LD;
    const C* vs = ks + TILE * LD;
    const float* k_sc = sc_s + (it & 1) * 2 * TILE;  // fp8 only
    const float* v_sc = k_sc + TILE;

    // Scores (log2 domain) for (t, g) pairs.
    for (int p = tid; p < TILE * ng; p += kRowThreads) {
      const int t = p % TILE, g = p / TILE;
      {
        float sc = -INFINITY;
        if (k0 + t < k_end) {
          const float* qg = qs + g * D;
          const C* kr = ks + t * LD;
          float d0 = 0.f, d1 = 0.f;
#pragma unroll 4
          for (int e = 0; e < D; e += 8) {
            float kf[8];
            load8(kr + e, kf);
            const float4 qa = *reinterpret_cast<const float4*>(qg + e);
            const float4 qb = *reinterpret_cast<const float4*>(qg + e + 4);
            d0 = fmaf(qa.x, kf[0], d0);
            d1 = fmaf(qa.y, kf[1], d1);
            d0 = fmaf(qa.z, kf[2], d0);
            d1 = fmaf(qa.w, kf[3], d1);
            d0 = fmaf(qb.x, kf[4], d0);
            d1 = fmaf(qb.y, kf[5], d1);
            d0 = fmaf(qb.z, kf[6], d0);
            d1 = fmaf(qb.w, kf[7], d1);
          }
          sc = d0 + d1;
          if constexpr (FP8) sc *= k_sc[t];
        }
        ps[t * GM + g] = sc;
      }
    }
    __syncthreads();

    // Online softmax: warp w owns heads w and w + 4.
    for (int g = warp; g < ng; g += kRowThreads / 32) {
      const float v = lane < TILE ? ps[lane * GM + g] : -INFINITY;
      const float mx = warp_max(v);
      const float m_old = m_s[g];
      const float m_new = fmaxf(m_old, mx);
      const float p = v == -INFINITY ? 0.f : exp2f(v - m_new);
      if (lane < TILE) ps[lane * GM + g] = p;
      const float sum = warp_sum(p);
      if (lane == 0) {
        const float alpha = m_old == -INFINITY ? 0.f : exp2f(m_old - m_new);
        m_s[g] = m_new;
        l_s[g] = l_s[g] * alpha + sum;
        al_s[g] = alpha;
      }
    }
    __syncthreads();

    // acc = acc * alpha + P V.
    float al[GM];
#pragma unroll
    for (int g = 0; g < GM; ++g) al[g] = g < ng ? al_s[g] : 0.f;
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      acc[g][0] *= al[g];
      acc[g][1] *= al[g];
    }
    const int tn = min(TILE, k_end - k0);
    for (int t = ph; t < tn; t += NPH) {
      const float2 v = load2(vs + t * LD + 2 * pi);
      float pr[GM];
#pragma unroll
      for (int g4 = 0; g4 < GM; g4 += 4) {
        const float4 pa = *reinterpret_cast<const float4*>(ps + t * GM + g4);
        pr[g4] = pa.x;
        pr[g4 + 1] = pa.y;
        pr[g4 + 2] = pa.z;
        pr[g4 + 3] = pa.w;
      }
      if constexpr (FP8) {
#pragma unroll
        for (int g = 0; g < GM; ++g) pr[g] *= v_sc[t];
      }
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        acc[g][0] = fmaf(pr[g], v.x, acc[g][0]);
        acc[g][1] = fmaf(pr[g], v.y, acc[g][1]);
      }
    }
    // fp8: the next tile's scales into the other stage (last read in the previous iteration, before this one's
    // first barrier).
    if constexpr (FP8) {
      if (it + 1 < ntiles) put_scales((it + 1) & 1);
    }
    __syncthreads();  // the stage is refilled next iteration
  }

  // Sum the token phases, normalize, store.
  if constexpr (NPH > 1) {
    float* red = reinterpret_cast<float*>(kvs);  // [NPH][GM][D] fits in the K/V stages
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      red[(ph * GM + g) * D + 2 * pi] = acc[g][0];
      red[(ph * GM + g) * D + 2 * pi + 1] = acc[g][1];
    }
    __syncthreads();
    for (int i = tid; i < ng * D; i += kRowThreads) {
      const int g = i / D, d = i - g * D;
      float v = 0.f;
#pragma unroll
      for (int p = 0; p < NPH; ++p) v += red[(p * GM + g) * D + d];
      const float o = v / l_s[g];
      if (a.nsplit == 1) static_cast<T*>(a.out)[int64_t(row) * a.out_stride + int64_t(h0 + g) * D + d] = from_f<T>(o);
      else split_out(a, row, h0 + g, split, D)[d] = o;
    }
  } else {  // each thread owns dims 2 pi, 2 pi + 1 of every head
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      if (g < ng) {
        const float inv = 1.f / l_s[g];
        const int d = 2 * pi;
        if (a.nsplit == 1) {
          T* o = static_cast<T*>(a.out) + int64_t(row) * a.out_stride + int64_t(h0 + g) * D + d;
          o[0] = from_f<T>(acc[g][0] * inv);
          o[1] = from_f<T>(acc[g][1] * inv);
        } else {
          float* o = split_out(a, row, h0 + g, split, D) + d;
          o[0] = acc[g][0] * inv;
          o[1] = acc[g][1] * inv;
        }
      }
    }
  }
  if (a.nsplit > 1 && tid < ng) {
    float* ml = split_ml(a, row, h0 + tid, split, D);
    ml[0] = m_s[tid];
    ml[1] = l_s[tid];
  }
}

// nsplit > 1: block (row, query head) merges the row's splits that have keys (split_chunk with the granule of
// the kernel that wrote them) into out.
template <typename T>
__global__ void attn_combine_kernel(const RowsArgs a, int D, int granule) {
  grid_release();
  const int row = blockIdx.x / a.q_heads, h = blockIdx.x % a.q_heads;
  // Uploaded metadata is read before grid_wait; per-head lists' key counts are select_pages' output, written by an
  // earlier kernel of the chain.
  if (a.head_tables) grid_wait();
  int s, n_keys;
  const int chunk = split_chunk(a, row, h / a.group, granule, s, n_keys);
  const int splits = min(a.nsplit, (n_keys + chunk - 1) / chunk);
  __shared__ float m_s[kMaxSplits], w_s[kMaxSplits];
  grid_wait();
  const float* ml = split_ml(a, row, h, 0, D);   // split i: (max, sum) at ml[2 i]
  const float* po = split_out(a, row, h, 0, D);  // split i: po[i D ..]
  // The splits' (max, sum) are read all at once into shared memory and turned into weights there; then each
  // output element's partials are independent loads (a select, not a branch, between them). Read split by split,
  // a chain of dependent L2 loads, this kernel took as long as the attention itself at batch 1 (ncu, 33 splits).
  for (int i = threadIdx.x; i < splits; i += blockDim.x) m_s[i] = ml[2 * i], w_s[i] = ml[2 * i + 1];
  __syncthreads();
  float M = -INFINITY;
  for (int i = 0; i < splits; ++i) M = fmaxf(M, m_s[i]);
  for (int i = threadIdx.x; i < splits; i += blockDim.x)  // the entries this thread wrote: no barrier needed
    w_s[i] = m_s[i] == -INFINITY ? 0.f : w_s[i] * exp2f(m_s[i] - M);
  __syncthreads();
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float num = 0.f, den = 0.f;
#pragma unroll 8
    for (int i = 0; i < splits; ++i) {
      const float w = w_s[i], v = po[i * D + d];
      num = fmaf(w, w != 0.f ? v : 0.f, num);  // a split without weight adds nothing, whatever its slot holds
      den += w;
    }
    static_cast<T*>(a.out)[int64_t(row) * a.out_stride + int64_t(h) * D + d] = from_f<T>(den > 0.f ? num / den : 0.f);
  }
}

// ================================================================================================
// Tile kernel (tensor cores)
// ================================================================================================
template <int D, int WARPS, int MT> struct TileCfg {
  // A block is WARPS warps, a warp MT m-tiles of 16 (token, head) rows: each K/V fragment loaded from shared
  // memory feeds MT mma rows, so MT = 2 halves the shared-memory reads per flop (the 8-warp, MT = 1 form spent
  // 35% of its stalls on them, ncu, 8k prefill). Choices: 4x2 (128 rows, head_dim <= 128) or 8x1 (128 rows).
  static constexpr int BM = WARPS * 16 * MT;      // rows per block
  static constexpr int kThreads = WARPS * 32;
  static constexpr int BN = D > 128 ? 32 : 64;    // keys per tile
  static constexpr int LD = D + 8;                // smem row pitch in elements (16-byte pad)
  static constexpr size_t smem = size_t(BM + 4 * BN) * LD * 2;  // Q + two stages of K and V
};

struct TileArgs : AttnArgs {
  int tokens_per_tile;
};

// The rows and keys of one block of a prefill kernel (grid: tiles x kv heads x sequences, longest tiles first):
// tokens t0 .. t0 + nt - 1 of sequence s against keys 0 .. n_keys - 1. Row r is token t0 + r / G, query head
// kvh * G + r % G; token t0 sits at position base_pos and sees keys up to its own position.
struct QTile {
  int s, kvh, qs0, t0, nt, G, rows_valid, base_pos, max_pos, n_keys;
  // Element offset of row r in Q or the output (row stride `stride`, head_dim D).
  __device__ __forceinline__ int64_t row_offset(int r, int64_t stride, int D) const {
    return int64_t(qs0 + t0 + r / G) * stride + int64_t(kvh * G + r % G) * D;
  }
};
// False when this block's tile lies past its sequence's end (the block has nothing to do).
__device__ __forceinline__ bool q_tile(const TileArgs& a, QTile& t) {
  t.s = blockIdx.z;
  t.kvh = blockIdx.y;
  t.qs0 = a.q_start[t.s];
  const int q_len = a.q_start[t.s + 1] - t.qs0;
  t.t0 = (gridDim.x - 1 - blockIdx.x) * a.tokens_per_tile;
  if (t.t0 >= q_len) return false;
  t.G = a.group;
  t.nt = min(a.tokens_per_tile, q_len - t.t0);
  t.rows_valid = t.nt * t.G;
  t.base_pos = a.ctx_len[list_of(a, t.s, t.kvh)] - q_len + t.t0;
  t.max_pos = t.base_pos + t.nt - 1;
  t.n_keys = t.max_pos + 1;
  return true;
}
// put(r, part, src, ok) for each 16-byte part of Q rows 0 .. ROWS - 1 (ok: a valid row; else src is a.q), THREADS
// threads numbered from 0 (`me`) sharing the parts.
template <typename T, int D, int ROWS, int THREADS, typename Put>
__device__ __forceinline__ void for_q_parts(const TileArgs& a, const QTile& t, Put put, int me) {
  constexpr int CPR = D / 8;
  for (int c = me; c < ROWS * CPR; c += THREADS) {
    const int r = c / CPR, part = c - r * CPR;
    const bool ok = r < t.rows_valid;
    const T* src = static_cast<const T*>(a.q);
    if (ok) src += t.row_offset(r, a.q_stride, D) + part * 8;
    put(r, part, src, ok);
  }
}
// put(i, part, k_src, v_src, ok) for each 16-byte part of keys j * BN + i, i < BN (ok: key < n_keys), shared as
// for_q_parts.
template <typename T, int D, int BN, int THREADS, typename Put>
__device__ __forceinline__ void for_kv_parts(const KvHead<T>& cache, int j, int n_keys, Put put, int me) {
  constexpr int CPR = D / 8;
  for (int c = me; c < BN * CPR; c += THREADS) {
    const int i = c / CPR, part = c - i * CPR;
    const int key = j * BN + i;
    const bool ok = key < n_keys;
    const KvPtr<T> kv = ok ? cache.at(key) : KvPtr<T>{cache.k, cache.v};
    put(i, part, kv.k + part * 8, kv.v + part * 8, ok);
  }
}

__device__ __forceinline__ void ldsm_x4(unsigned addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}


// c[mt][n] += a[mt] b[0..1] and c[mt][n + 1] += a[mt] b[2..3] for every m-tile: two n-tiles of B (one
// ldmatrix x4) against each m-tile's A fragment.
template <typename T, int MT, int N>
__device__ __forceinline__ void mma_pair(float (&c)[MT][N][4], int n, const uint32_t (&a)[MT][4],
                                         const uint32_t (&b)[4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    mma16816<T>(c[mt][n], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b[0], b[1]);
    mma16816<T>(c[mt][n + 1], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b[2], b[3]);
  }
}

// FP8: the cache is fp8 (ops.h KvLayer); each thread loads its share of the next tile's K/V into registers before
// computing this one, then stores it, times the scales and rounded to T, into the other stage.
template <typename T, int D, int WARPS, int MT, bool FP8>
__global__ void __launch_bounds__(WARPS * 32) attn_tile_kernel(const TileArgs a) {
  using Cfg = TileCfg<D, WARPS, MT>;
  using C = std::conditional_t<FP8, uint8_t, T>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, LD = Cfg::LD;
  constexpr int NT = BN / 8;  // n-tiles of S
  constexpr int ND = D / 8;   // n-tiles of O
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);
  T* KVs = Qs + BM * LD;  // stage st: K at KVs + st*2*BN*LD, V after it

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  QTile qt;
  if (!q_tile(a, qt)) return;
  const int G = qt.G, base_pos = qt.base_pos, max_pos = qt.max_pos;
  const int n_tiles = (qt.n_keys + BN - 1) / BN;
  const KvHead<C> cache = kv_head<C, D>(a, qt.s, qt.kvh);

  for_q_parts<T, D, BM, Cfg::kThreads>(a, qt, [&](int r, int part, const T* src, bool ok) {
    cp_async16(Qs + r * LD + part * 8, src, ok);
  }, tid);
  auto issue = [&](int j, int stage) {
    if constexpr (!FP8) {
      T* ks = KVs + stage * 2 * BN * LD;
      T* vs = ks + BN * LD;
      for_kv_parts<T, D, BN, Cfg::kThreads>(cache, j, qt.n_keys,
                                            [&](int i, int part, const T* k_src, const T* v_src, bool ok) {
        cp_async16(ks + i * LD + part * 8, k_src, ok);
        cp_async16(vs + i * LD + part * 8, v_src, ok);
      }, tid);
    }
    cp_async_commit();
  };
  // FP8: chunk c of this thread: 16 bytes (elements) of key (tid + c * threads) / (D / 16), at its part % (D / 16).
  constexpr int kParts = D / 16, kChunks = FP8 ? BN * kParts / Cfg::kThreads : 1;
  static_assert(!FP8 || BN * kParts % Cfg::kThreads == 0, "attn_tile_kernel: fp8 chunks per thread");
  uint4 k_raw[kChunks], v_raw[kChunks];
  float2 kv_sc[kChunks];
  auto fetch = [&](int j) {  // tile j's chunks into registers (zeros past the keys)
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int idx = tid + c * Cfg::kThreads, key = j * BN + idx / kParts, part = idx % kParts;
      k_raw[c] = v_raw[c] = make_uint4(0, 0, 0, 0);
      kv_sc[c] = make_float2(0.f, 0.f);
      if (key < qt.n_keys) {
        bool on_host;
        const int64_t r = cache.tier_row(key, on_host);
        const KvPtr<C> kv = cache.at(r * cache.cols, on_host);
        k_raw[c] = *reinterpret_cast<const uint4*>(kv.k + part * 16);
        v_raw[c] = *reinterpret_cast<const uint4*>(kv.v + part * 16);
        kv_sc[c] = cache.scales(r, on_host);
      }
    }
  };
  auto put = [&](int stage) {  // the fetched chunks, times their scales, as T into a stage
    T* ks = KVs + stage * 2 * BN * LD;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int idx = tid + c * Cfg::kThreads, i = idx / kParts, part = idx % kParts;
#pragma unroll
      for (int kv = 0; kv < 2; ++kv) {
        const uint4 raw = kv ? v_raw[c] : k_raw[c];
        const float sc = kv ? kv_sc[c].y : kv_sc[c].x;
        const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
        uint32_t packed[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(
              __nv_fp8x2_storage_t((w[e >> 1] >> (16 * (e & 1))) & 0xffffu), __NV_E4M3)));
          packed[e] = pack2<T>(f.x * sc, f.y * sc);
        }
        uint4* dst = reinterpret_cast<uint4*>(ks + kv * BN * LD + i * LD + part * 16);
        dst[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        dst[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
      }
    }
  };
  issue(0, 0);  // Q joins the first group
  if constexpr (FP8) {
    fetch(0);
    put(0);
  }

  // m-tile mt of this warp: rows 16 (MT warp + mt) + lane / 4 (accumulator elements 0, 1) and 8 more (2, 3).
  const int row0 = warp * MT * 16 + (lane >> 2);

  float o[MT][ND][4];
  float m[MT][2], l[MT][2];  // running max of the raw scores, running sum of exp2
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < ND; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.f;
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.f;
  }
  const float scale = a.scale_log2;

  const unsigned q_addr = unsigned(__cvta_generic_to_shared(Qs)) +
                          unsigned(((warp * MT * 16 + (lane & 15)) * LD + (lane >> 4) * 8) * 2);

  for (int j = 0; j < n_tiles; ++j) {
    if constexpr (FP8) {
      if (j + 1 < n_tiles) fetch(j + 1);  // in flight while this tile is computed
      cp_async_wait<0>();                 // Q
    } else if (j + 1 < n_tiles) {
      issue(j + 1, (j + 1) & 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const T* ks = KVs + (j & 1) * 2 * BN * LD;
    const T* vs = ks + BN * LD;
    const unsigned k_addr = unsigned(__cvta_generic_to_shared(ks)) +
                            unsigned((((lane & 7) + ((lane >> 4) << 3)) * LD + ((lane >> 3) & 1) * 8) * 2);
    const unsigned v_addr = unsigned(__cvta_generic_to_shared(vs)) +
                            unsigned((((lane & 7) + (((lane >> 3) & 1) << 3)) * LD + (lane >> 4) * 8) * 2);

    // S = Q K^T (raw scores)
    float sc[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < NT; ++i) sc[mt][i][0] = sc[mt][i][1] = sc[mt][i][2] = sc[mt][i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t qa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        ldsm_x4(q_addr + unsigned(mt * 16 * LD * 2) + kk * 32, qa[mt][0], qa[mt][1], qa[mt][2], qa[mt][3]);
#pragma unroll
      for (int nn = 0; nn < NT / 2; ++nn) {
        uint32_t b[4];
        ldsm_x4(k_addr + unsigned(nn * 16 * LD * 2) + kk * 32, b[0], b[1], b[2], b[3]);
        mma_pair<T>(sc, 2 * nn, qa, b);
      }
    }

    // Causal mask and online softmax on the raw scores; the scale enters the exp2's fma.
    const bool need_mask = (j + 1) * BN - 1 > base_pos;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if (need_mask) {
        // A row's last visible key; rows past the tile's end see what its last token sees.
        const int pos0 = min(base_pos + (row0 + mt * 16) / G, max_pos);
        const int pos1 = min(base_pos + (row0 + mt * 16 + 8) / G, max_pos);
#pragma unroll
        for (int i = 0; i < NT; ++i) {
          const int key = j * BN + i * 8 + (lane & 3) * 2;
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (key + (e & 1) > (e < 2 ? pos0 : pos1)) sc[mt][i][e] = -INFINITY;
        }
      }
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], sc[mt][i][e]);
      float al[2], neg[2], sum[2] = {0.f, 0.f};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
        const float mn = fmaxf(m[mt][h], mx[h]);  // finite: every row sees key 0 in the first tile
        al[h] = m[mt][h] == -INFINITY ? 0.f : exp2f((m[mt][h] - mn) * scale);
        neg[h] = -mn * scale;
        m[mt][h] = mn;
      }
#pragma unroll
      for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          sc[mt][i][e] = exp2f(fmaf(sc[mt][i][e], scale, neg[e >> 1]));
          sum[e >> 1] += sc[mt][i][e];
        }
#pragma unroll
      for (int h = 0; h < 2; ++h) l[mt][h] = l[mt][h] * al[h] + sum[h];
#pragma unroll
      for (int i = 0; i < ND; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mt][i][e] *= al[e >> 1];
    }

    // O += P V
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        pa[mt][0] = pack2<T>(sc[mt][2 * kk][0], sc[mt][2 * kk][1]);
        pa[mt][1] = pack2<T>(sc[mt][2 * kk][2], sc[mt][2 * kk][3]);
        pa[mt][2] = pack2<T>(sc[mt][2 * kk + 1][0], sc[mt][2 * kk + 1][1]);
        pa[mt][3] = pack2<T>(sc[mt][2 * kk + 1][2], sc[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int nd = 0; nd < ND / 2; ++nd) {
        uint32_t b[4];
        ldsm_x4_t(v_addr + unsigned(kk * 16 * LD * 2) + nd * 32, b[0], b[1], b[2], b[3]);
        mma_pair<T>(o, 2 * nd, pa, b);
      }
    }
    // FP8: the next tile into the other stage (every thread passed this iteration's barrier: none reads it).
    if constexpr (FP8) {
      if (j + 1 < n_tiles) put((j + 1) & 1);
    }
    __syncthreads();  // this stage is refilled next iteration
  }

  T* out = static_cast<T*>(a.out);
  const int col = (lane & 3) * 2;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = l[mt][h];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float inv = 1.f / sum;
      const int r = row0 + mt * 16 + h * 8;
      if (r >= qt.rows_valid) continue;
      T* p = out + qt.row_offset(r, a.out_stride, D) + col;
#pragma unroll
      for (int i = 0; i < ND; ++i)
        *reinterpret_cast<uint32_t*>(p + i * 8) = pack2<T>(o[mt][i][2 * h] * inv, o[mt][i][2 * h + 1] * inv);
    }
}

#include "backend/cuda/attention_sm90.cuh"

// ================================================================================================
// Decode kernel (tensor cores): one query row per sequence (decode steps)
// ================================================================================================
// A block has 4 warps. WPR (warps per row) 4: the block is one (query row, kv head, split of the keys), its
// warps taking turns over steps of 16 keys (small batches, long contexts); WPR 2 or 1: the block holds 2 or
// 4 (row, kv head) pairs, every pair's keys in one split (large batches: a warp walks many steps, so loads
// stay in flight). Per step a warp computes S = Q K^T with the GQA group's query heads as the rows of
// mma.m16n8k16 (heads beyond the group are zero, rows 8..15 unused) and 16 keys as its columns, then
// O^T += V^T P^T with 16 head dimensions as the rows and the heads as the 8 columns: S's accumulator is P^T's
// B fragment as it stands, and the output accumulators hold 8 heads, not 16. K and V are read straight from
// the paged cache into registers in 16-byte pieces (no shared memory), a step ahead where the registers allow;
// the head dimensions are permuted so that each lane's 16 bytes are fragment operands (QK: a 16-bit piece's 8
// dims are two k-steps of B, an e4m3 piece's 16 four; PV: a lane holds 8 or 16 dims of 4 keys and pairs them
// with byte permutes). With pages of a multiple of 16 keys a step is one page lookup. A pair's warps meet in shared memory in a fixed order. Scores are kept in log2 units,
// like the rows kernel (the combine kernel reads both).
constexpr int kDecWarps = 4;
constexpr int kDecKeys = 16;                       // keys per warp step
constexpr int kDecGranule = kDecWarps * kDecKeys;  // a split's keys are a multiple of this
constexpr int kDecMaxGroup = 8;                    // query heads per kv head (the columns of O^T)
constexpr int kDecBlocksPerSm = 2;                 // resident blocks per SM asked of the register allocator

// FUSED: q is the layer's q|k|v projection and the kernel does finish_qkv's work for its rows first (ops.h):
// every block normalizes and rotates its query heads into shared memory; the block whose keys end with the
// row's own (new) token normalizes and rotates that k, writes k and v to the cache at kv_rows, and counts the
// new key from shared memory (its cache row is written, not read, by this kernel) as one more partial in the
// warps' merge. q|k|v itself is left as it was. Used at 4 warps per row (small batches): at 1 warp per row
// (batch 256) the prologue, not hidden behind other warps' loads, cost more than the separate finish kernel
// (11.30 against 10.59 ms per step).
struct DecodeArgs : RowsArgs {
  const void* q_norm;  // [head_dim] gains or null (no norm); k_norm likewise, both of norm_t
  const void* k_norm;
  DType norm_t;
  float eps;
  bool zero_centred;
  const int32_t* positions;  // [num_tokens]; a position outside [0, max_pos) is not rotated
  const float* cos_sin;      // [max_pos, rot_dim]: cos then sin of rot_dim / 2 frequencies
  int rot_dim, max_pos;
  const int32_t* kv_rows;    // [num_tokens]; < 0: not written
};

__device__ __forceinline__ uint4 load16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// FUSED prologue, run by the block's warps for its pair (row, kv head): its G query heads normalized (q_norm),
// rotated and rounded to T into q_s [G][D]; the owner also makes the new k (k_norm, rotation) and v, rounds
// them to T into kv_new [2][D] and writes them to the cache at kv_rows[row]. A head's D / 8 16-byte pieces
// sit in D / 8 consecutive lanes (the norm's sum and the rotation partner are lane shuffles).
template <typename T, int D>
__device__ __forceinline__ void finish_pair(const DecodeArgs& a, int row, int kvh, bool has_row, bool owner, T* q_s,
                                            T (&kv_new)[2][D], float (&s_new)[kDecMaxGroup]) {
  constexpr int CPH = D / 8;  // pieces per head
  const int G = a.group, tp = threadIdx.x;
  const int heads = has_row ? G + (owner ? 2 : 0) : 0;  // q heads, then k and v
  const int hq = a.kv_heads * G;
  const T* src = static_cast<const T*>(a.q) + int64_t(has_row ? row : 0) * a.q_stride;
  const int pos = has_row ? a.positions[row] : -1;
  const bool rotate = pos >= 0 && pos < a.max_pos;
  const int half = a.rot_dim / 2;
  const float* cs = a.cos_sin + int64_t(rotate ? pos : 0) * a.rot_dim;
  for (int base = tp - (tp & 31); base < heads * CPH; base += kDecWarps * 32) {  // warp-uniform bound
    const int c = base + (tp & 31), h = c / CPH, piece = c % CPH;
    const bool valid = c < heads * CPH;
    const int col = h < G ? (kvh * G + h) * D : (hq + (h - G) * a.kv_heads + kvh) * D;
    float f[8];
    if (valid) {
      Vec16<T> x;
      x.load(src + col + piece * 8);
#pragma unroll
      for (int k = 0; k < 8; ++k) f[k] = x.f[k];
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) f[k] = 0.f;
    }
    // Every lane of the warp takes part in the shuffles (its lanes may hold different heads).
    const bool is_v = h == G + 1;
    const void* w = h < G ? a.q_norm : a.k_norm;
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) ss = fmaf(f[k], f[k], ss);
#pragma unroll
    for (int o = 1; o < CPH; o <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (valid && w != nullptr && !is_v) {
      const float inv = 1.0f / sqrtf(ss / float(D) + a.eps);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float g = load_any(w, a.norm_t, piece * 8 + k);
        f[k] = f[k] * inv * (a.zero_centred ? 1.0f + g : g);
      }
    }
    if (rotate) {  // uniform over the block
      const int d0 = piece * 8;
      const bool first = d0 < half, second = !first && d0 < 2 * half;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float other = __shfl_xor_sync(0xffffffffu, f[k], half / 8);  // the partner piece's lane
        if (is_v) continue;
        if (first) f[k] = f[k] * cs[d0 + k] - other * cs[half + d0 + k];
        else if (second) f[k] = f[k] * cs[d0 - half + k] + other * cs[d0 + k];
      }
    }
    if (valid) {
      Vec16<T> y;
#pragma unroll
      for (int k = 0; k < 8; ++k) y.f[k] = f[k];
      y.store(h < G ? q_s + h * D + piece * 8 : kv_new[h - G] + piece * 8);
      const int32_t kv_row = a.kv_rows[row];
      if (h >= G && kv_row >= 0) {
        T* cache = static_cast<T*>(const_cast<void*>(h == G ? a.kc : a.vc));
        y.store(cache + int64_t(kv_row) * a.kv_heads * D + int64_t(kvh) * D + piece * 8);
      }
    }
  }
  if (!owner && tp < kDecMaxGroup) s_new[tp] = -INFINITY;
}

// FUSED, after finish_pair and a barrier: the owner's score of the new key for each query head, in log2 units.
template <typename T, int D>
__device__ __forceinline__ void new_key_scores(const DecodeArgs& a, bool has_row, bool owner, const T* q_s,
                                               const T* k_new, float (&s_new)[kDecMaxGroup]) {
  constexpr int CPH = D / 8;
  if (!has_row || !owner) return;  // uniform over the block
  const int G = a.group, tp = threadIdx.x;
  for (int base = tp - (tp & 31); base < G * CPH; base += kDecWarps * 32) {
    const int c = base + (tp & 31), h = c / CPH, piece = c % CPH;
    float dot = 0.f;
    if (c < G * CPH) {
      float q[8], k[8];
      load8(q_s + h * D + piece * 8, q);
      load8(k_new + piece * 8, k);
#pragma unroll
      for (int i = 0; i < 8; ++i) dot = fmaf(q[i], k[i], dot);
    }
#pragma unroll
    for (int o = 1; o < CPH; o <<= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (c < G * CPH && piece == 0) s_new[h] = dot * a.scale_log2;
  }
}

// C: the cache's elements, T or uint8_t (e4m3: K and V converted exactly to T in registers, each key's score times
// its K scale and its probability times its V scale in the PV product, the sum of probabilities unscaled).
template <typename T, typename C, int D, int WPR, bool FUSED>
__global__ void __launch_bounds__(kDecWarps * 32, kDecBlocksPerSm) attn_decode_kernel(const DecodeArgs a) {
  grid_release();
  constexpr bool FP8 = std::is_same_v<C, uint8_t>;
  static_assert(!FUSED || !FP8, "the fused prologue writes a 16-bit cache");
  static_assert(!FP8 || D >= 128, "an e4m3 V piece is 16 dims of 8 lanes");
  constexpr int E = 16 / int(sizeof(C));  // cache elements per 16-byte piece
  constexpr int KS = D / 16;              // k-steps of QK (a K piece is E / 4 of them)
  constexpr int KP = D / (4 * E);         // K pieces per lane and n-tile
  constexpr int VG = D / (8 * E);         // V pieces per lane and key (groups of 8 E dims, a lane holds E of each)
  constexpr int MT = D / 16;              // m-tiles of O^T (v_dim)
  // A warp loads its next step's K and V before it works on the current one, where both steps fit the registers
  // (not head_dim 256 with a 16-bit cache: that loads each step after the one before).
  constexpr bool PREFETCH = 2 * KP + 4 * VG <= 16;
  constexpr int LDO = D + 4;  // shared row pitch (floats) of the warps' partial outputs
  constexpr int PAIRS = kDecWarps / WPR;
  static_assert(kDecWarps % WPR == 0, "warps per row");
  static_assert(!FUSED || WPR == kDecWarps, "the fused prologue is written for one pair per block");
  __shared__ __align__(16) float o_s[kDecWarps][kDecMaxGroup][LDO];
  __shared__ float m_s[kDecWarps][kDecMaxGroup], l_s[kDecWarps][kDecMaxGroup];
  // FUSED: the pair's normalized, rotated query heads (aliasing o_s, which is written only after the main
  // loop), the new k and v, and the new key's score per query head (-inf: not this block's key).
  __shared__ __align__(16) T kv_new[2][D];
  __shared__ float s_new[kDecMaxGroup];
  static_assert(sizeof(T) * kDecMaxGroup * D <= sizeof(o_s), "q_s fits in o_s");
  T* const q_s = reinterpret_cast<T*>(&o_s[0][0][0]);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gid = lane >> 2, tig = lane & 3;
  const int G = a.group;
  // Pair `slot` of this block: its query row and kv head (row >= num_tokens: no pair).
  auto pair_of = [&](int slot, int& row, int& kvh) {
    if constexpr (WPR == kDecWarps) {
      row = blockIdx.z, kvh = blockIdx.y;
    } else {
      const int p = blockIdx.x * PAIRS + slot;
      row = p / a.kv_heads, kvh = p % a.kv_heads;
    }
  };
  // Up to grid_wait: the step's metadata (uploaded before the step's first kernel; no kernel writes it) and
  // the first keys when they are old. Per-head lists (sparse decode) are select_pages' output, written by an earlier
  // kernel of the chain: with them the kernel waits first.
  if (a.head_tables) grid_wait();
  const int split = WPR == kDecWarps ? int(blockIdx.x) : 0;
  int row, kvh, k_begin = 0, k_end = 0, s = 0, n_keys = 0;
  pair_of(warp / WPR, row, kvh);
  const bool has_row = row < a.num_tokens;
  if (has_row) n_keys = split_keys(a, row, kvh, split, kDecGranule, s, k_begin, k_end);
  const int h0 = kvh * G;
  // FUSED: whether this block holds the row's new key (the last one); the cache keys stop before it.
  const bool owner = FUSED && k_begin < k_end && k_end == n_keys;
  const int k_stop = owner ? k_end - 1 : k_end;
  const KvHead<C> cache = kv_head<C, D>(a, s, kvh);
  // A step's keys k0 .. k0 + 15 (k0 a multiple of 16) lie in one page when pages are a multiple of 16 keys.
  const bool one_page = a.page_size % kDecKeys == 0;
  // The permuted head dimensions. QK k-step ks, lane tig: k (2 tig, 2 tig + 1) is dims k_dim(ks) + {0, 1},
  // (2 tig + 8, 2 tig + 9) is + {2, 3}: a lane's K piece (E dims from 4 E i + E tig) is E / 4 k-steps. O^T m-tile
  // mt: row gid is dim v_dim(mt), row gid + 8 the next: a lane's V piece (E dims from 8 E g + E gid) is E / 2
  // m-tiles.
  auto k_dim = [&](int ks) { return 4 * E * (ks / (E / 4)) + E * tig + 4 * (ks % (E / 4)); };
  auto v_dim = [&](int mt) { return 8 * E * (mt / (E / 2)) + E * gid + 2 * (mt % (E / 2)); };
  // K: n-tile t's column gid is key k0 + 8 t + gid. V: key slot e is key k0 + 2 tig + (e & 1) + 8 (e >> 1), a
  // lane's E dims of each group; FP8: sv[e] its (K, V) scales, the keys of this lane's scores. Keys past k_stop
  // read key k0's row (finite values, masked or weighted 0).
  auto load_step = [&](int k0, uint4 (&kv)[2][KP], uint4 (&vv)[4][VG], float2 (&sv)[4]) {
    bool host0 = false;
    const int64_t r0 = one_page ? cache.tier_row(k0, host0) : 0;
    auto row_of = [&](int j, bool& on_host) {  // key j's row in its tier
      const int jj = j < k_stop ? j : k0;
      if (one_page) {
        on_host = host0;
        return r0 + (jj - k0);
      }
      return cache.tier_row(jj, on_host);
    };
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      bool on_host;
      const int64_t r = row_of(k0 + 8 * t + gid, on_host);
      const C* kr = cache.at(r * cache.cols, on_host).k + E * tig;
#pragma unroll
      for (int i = 0; i < KP; ++i) kv[t][i] = load16(kr + 4 * E * i);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      bool on_host;
      const int64_t r = row_of(k0 + 2 * tig + (e & 1) + 8 * (e >> 1), on_host);
      const C* vr = cache.at(r * cache.cols, on_host).v + E * gid;
#pragma unroll
      for (int g = 0; g < VG; ++g) vv[e][g] = load16(vr + 8 * E * g);
      if constexpr (FP8) sv[e] = cache.scales(r, on_host);
    }
  };
  constexpr int kStride = WPR * kDecKeys;
  uint4 kv[2][KP], vv[4][VG];
  float2 sv[4];
  int k0 = k_begin + (warp % WPR) * kDecKeys;
  // The first step loads before grid_wait when no kernel of this step writes its keys: every key but the
  // row's new one (n_keys - 1, written by the finish kernel before this one; FUSED: by this kernel, and
  // k_stop ends before it) was written by an earlier step.
  const bool early = k0 < k_stop && (FUSED || min(k0 + kDecKeys, k_stop) < n_keys);
  if constexpr (WPR == kDecWarps) {
    // A split without keys: nothing to write (the combine skips it). It leaves before grid_wait; the grid still
    // waits through the splits with keys, which every batch the model runs has (a row has >= 1 key).
    if (k_begin >= k_end && a.nsplit > 1) return;
  }
  if (early) load_step(k0, kv, vv, sv);
  grid_wait();
  if constexpr (WPR == kDecWarps) {
    if (k_begin >= k_end) {  // nsplit 1, a row without keys: the whole block
      write_zero_output<T, D>(a, row, h0, G);
      return;
    }
  }
  if (k0 < k_stop && !early) load_step(k0, kv, vv, sv);

  if constexpr (FUSED) {
    finish_pair<T, D>(a, row, kvh, has_row, owner, q_s, kv_new, s_new);
    __syncthreads();
  }

  // Q as A fragments of rows gid (rows gid + 8 are zero), the k-steps' dims as K's (k_dim). Held in registers,
  // except at head_dim 256 (no registers left): read again each step (from L1).
  constexpr bool Q_REGS = D <= 128;
  const T* const qr = (FUSED ? q_s : static_cast<const T*>(a.q) + int64_t(row) * a.q_stride + int64_t(h0) * D) +
                      gid * D;
  const bool q_mine = has_row && gid < G;
  auto q_frag = [&](int ks) {
    const T* p = qr + k_dim(ks);
    return !q_mine ? make_uint2(0, 0) : FUSED ? *reinterpret_cast<const uint2*>(p) : __ldg(reinterpret_cast<const uint2*>(p));
  };
  uint2 qa[Q_REGS ? KS : 1];
  if constexpr (Q_REGS) {
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) qa[ks] = q_frag(ks);
  }
  if constexpr (FUSED) {
    new_key_scores<T, D>(a, has_row, owner, q_s, kv_new[0], s_new);
    __syncthreads();  // q_s (in o_s) is read; the warps may now write o_s
  }

  // O^T: o[4 g + j][0..1] dim 64 g + 8 gid + 2 j, heads 2 tig and 2 tig + 1; [2..3] the next dim.
  float o[MT][4];
#pragma unroll
  for (int t = 0; t < MT; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;
  float m0 = -INFINITY, l0 = 0.f;  // head gid

  for (; k0 < k_stop; k0 += kStride) {
    uint4 kn[2][PREFETCH ? KP : 1], vn[4][PREFETCH ? VG : 1];
    float2 svn[4];
    if constexpr (PREFETCH) {
      if (k0 + kStride < k_stop) load_step(k0 + kStride, kn, vn, svn);
    }
    // S = Q K^T: sc[t][0..1] head gid, keys k0 + 8 t + 2 tig + {0, 1} ([2..3]: the zero rows gid + 8).
    float sc[2][4];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      sc[t][0] = sc[t][1] = sc[t][2] = sc[t][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        const uint4& k = kv[t][ks / (E / 4)];
        uint32_t b0, b1;
        if constexpr (FP8) {
          const uint32_t w = word(k, ks % 4);
          b0 = e4m3x2_to<T>(w), b1 = e4m3x2_to<T>(w >> 16);
        } else {
          b0 = word(k, 2 * (ks % 2)), b1 = word(k, 2 * (ks % 2) + 1);
        }
        const uint2 q = Q_REGS ? qa[ks] : q_frag(ks);
        mma16816<T>(sc[t], q.x, 0u, q.y, 0u, b0, b1);
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float f = FP8 ? sv[2 * t + e].x * a.scale_log2 : a.scale_log2;
        sc[t][e] = k0 + 8 * t + 2 * tig + e < k_stop ? sc[t][e] * f : -INFINITY;
      }
    }
    // Online softmax over the 16 keys (a head's 16 scores sit in the 4 lanes of one tig group).
    float mx = fmaxf(fmaxf(sc[0][0], sc[0][1]), fmaxf(sc[1][0], sc[1][1]));
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    const float n0 = fmaxf(m0, mx);
    const float b0 = n0 == -INFINITY ? 0.f : n0;
    const float al = exp2f(m0 - b0);
    m0 = n0;
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      sc[t][0] = exp2f(sc[t][0] - b0);
      sc[t][1] = exp2f(sc[t][1] - b0);
    }
    l0 = l0 * al + (sc[0][0] + sc[0][1]) + (sc[1][0] + sc[1][1]);
    // This lane's output columns are heads 2 tig and 2 tig + 1: their factors live in lanes 8 tig and 8 tig + 4.
    const float al_a = __shfl_sync(0xffffffffu, al, 8 * tig), al_b = __shfl_sync(0xffffffffu, al, 8 * tig + 4);
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      o[t][0] *= al_a;
      o[t][1] *= al_b;
      o[t][2] *= al_a;
      o[t][3] *= al_b;
    }
    // O^T += V^T P^T. B = P^T (k keys, n heads): (keys 2 tig, 2 tig + 1; head gid) is S's n-tile 0 as it
    // stands, keys + 8 n-tile 1. A = V^T (m dims, k keys): a lane's words j of its 4 keys' pieces, paired.
    // A = V^T: m-tile mt's dims (v_dim) of the lane's 4 keys, as T pairs, paired by byte permutes.
    const float vs[4] = {FP8 ? sv[0].y : 1.f, FP8 ? sv[1].y : 1.f, FP8 ? sv[2].y : 1.f, FP8 ? sv[3].y : 1.f};
    const uint32_t pb0 = pack2<T>(sc[0][0] * vs[0], sc[0][1] * vs[1]), pb1 = pack2<T>(sc[1][0] * vs[2], sc[1][1] * vs[3]);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      uint32_t w[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint4& v = vv[e][mt / (E / 2)];
        if constexpr (FP8) w[e] = e4m3x2_to<T>(word(v, (mt % 8) / 2) >> (16 * (mt % 2)));
        else w[e] = word(v, mt % 4);
      }
      mma16816<T>(o[mt], __byte_perm(w[0], w[1], 0x5410u), __byte_perm(w[0], w[1], 0x7632u),
                  __byte_perm(w[2], w[3], 0x5410u), __byte_perm(w[2], w[3], 0x7632u), pb0, pb1);
    }
    if constexpr (PREFETCH) {
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int i = 0; i < KP; ++i) kv[t][i] = kn[t][i];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
#pragma unroll
        for (int g = 0; g < VG; ++g) vv[e][g] = vn[e][g];
        if constexpr (FP8) sv[e] = svn[e];
      }
    } else if (k0 + kStride < k_stop) {
      load_step(k0 + kStride, kv, vv, sv);
    }
  }

  // The warps meet.
#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) l0 += __shfl_xor_sync(0xffffffffu, l0, off);
  if constexpr (WPR == 1 && !FUSED) {
    // A warp per pair (nsplit is 1 below 4 warps per row): its heads 2 tig and 2 tig + 1 are written as they
    // are, divided by their sums (those of lanes 8 tig and 8 tig + 4).
    const float la = __shfl_sync(0xffffffffu, l0, 8 * tig), lb = __shfl_sync(0xffffffffu, l0, 8 * tig + 4);
    if (!has_row) return;
    T* const op = static_cast<T*>(a.out) + int64_t(row) * a.out_stride + int64_t(h0) * D;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int d = v_dim(mt);
      const float* c = o[mt];
      if (2 * tig < G) *reinterpret_cast<uint32_t*>(op + 2 * tig * D + d) = pack2<T>(c[0] / la, c[2] / la);
      if (2 * tig + 1 < G) *reinterpret_cast<uint32_t*>(op + (2 * tig + 1) * D + d) = pack2<T>(c[1] / lb, c[3] / lb);
    }
    return;
  }
  if (tig == 0) {
    m_s[warp][gid] = m0;
    l_s[warp][gid] = l0;
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int d = v_dim(mt);
    *reinterpret_cast<float2*>(&o_s[warp][2 * tig][d]) = make_float2(o[mt][0], o[mt][2]);
    *reinterpret_cast<float2*>(&o_s[warp][2 * tig + 1][d]) = make_float2(o[mt][1], o[mt][3]);
  }
  __syncthreads();
  // Pair p's warps p * WPR .. + WPR meet, in that order (then the new key); a thread takes 4 dims of a head.
  constexpr int D4 = D / 4, kHeadsPerPass = kDecWarps * 32 / D4;
  const int d = (tid % D4) * 4;
#pragma unroll
  for (int p = 0; p < PAIRS; ++p) {
    int prow, pkvh;
    pair_of(p, prow, pkvh);
    if (prow >= a.num_tokens) break;  // this and every later pair are past the batch
    for (int h = tid / D4; h < G; h += kHeadsPerPass) {
      const float sn = FUSED ? s_new[h] : -INFINITY;
      float M = sn;
#pragma unroll
      for (int w = p * WPR; w < p * WPR + WPR; ++w) M = fmaxf(M, m_s[w][h]);
      float num[4] = {0.f, 0.f, 0.f, 0.f}, den = 0.f;
#pragma unroll
      for (int w = p * WPR; w < p * WPR + WPR; ++w) {
        if (m_s[w][h] == -INFINITY) continue;  // a warp without keys
        const float f = exp2f(m_s[w][h] - M);
        const float4 ov = *reinterpret_cast<const float4*>(&o_s[w][h][d]);
        num[0] = fmaf(f, ov.x, num[0]);
        num[1] = fmaf(f, ov.y, num[1]);
        num[2] = fmaf(f, ov.z, num[2]);
        num[3] = fmaf(f, ov.w, num[3]);
        den = fmaf(f, l_s[w][h], den);
      }
      if (sn != -INFINITY) {
        const float f = exp2f(sn - M);
#pragma unroll
        for (int i = 0; i < 4; ++i) num[i] = fmaf(f, to_f(kv_new[1][d + i]), num[i]);
        den += f;
      }
      const int hq = pkvh * G + h;
      if (a.nsplit == 1) {
        T* op = static_cast<T*>(a.out) + int64_t(prow) * a.out_stride + int64_t(hq) * D + d;
        *reinterpret_cast<uint2*>(op) = make_uint2(pack2<T>(num[0] / den, num[1] / den), pack2<T>(num[2] / den, num[3] / den));
      } else {
        *reinterpret_cast<float4*>(split_out(a, prow, hq, split, D) + d) =
            make_float4(num[0] / den, num[1] / den, num[2] / den, num[3] / den);
        if (d == 0) {
          float* ml = split_ml(a, prow, hq, split, D);
          ml[0] = M;
          ml[1] = den;
        }
      }
    }
  }
}

// ================================================================================================
// Host side
// ================================================================================================
int choose_splits(const AttnBatch& b, const AttnShape& sh, int num_sms) {
  const int group = sh.q_heads / sh.kv_heads;
  const int gsubs = (group + kGMax - 1) / kGMax;
  const int64_t base = int64_t(b.num_tokens) * sh.kv_heads * gsubs;
  if (base <= 0) return 1;
  const int64_t target = int64_t(4) * num_sms;
  int64_t n = (target + base - 1) / base;
  n = std::min<int64_t>(n, (std::max(b.max_ctx_len, 1) + 31) / 32);
  n = std::min<int64_t>(n, kMaxSplits);
  return int(std::max<int64_t>(n, 1));
}

// The decode kernel takes one-query-row batches of 16-bit heads of 64, 128 or 256 dims (an fp8 cache: 128 or 256),
// up to 8 query heads per kv head, 16-byte aligned q rows (QWEN_RT_DECODE_ATTN=rows: the rows kernel instead,
// for comparison; read at every call, so the op tests can set it). Qwen3.8-27B FP8 at 32k tokens, batch 1, H100:
// 78.0 against 68.7 tok/s with an fp8 cache, 76.0 against 74.6 with bf16 (docs/runs/2026-12-08-session31/gpu3).
bool decode_kernel_takes(const AttnBatch& b, const AttnShape& sh, size_t elem_bytes, bool fp8_cache) {
  const char* e = std::getenv("QWEN_RT_DECODE_ATTN");
  const bool off = e && std::strcmp(e, "rows") == 0;
  const int D = sh.head_dim;
  return !off && elem_bytes == 2 && b.max_q_len == 1 && (D == 128 || D == 256 || (D == 64 && !fp8_cache)) &&
         sh.q_heads / sh.kv_heads <= kDecMaxGroup;
}

// The decode kernel's warps per (row, kv head) pair: fewer as the pairs fill the GPU (kDecBlocksPerSm per SM);
// head_dim 256 always 4 (ptxas: the 1 and 2 warp forms spill there).
int decode_warps_per_row(const AttnBatch& b, const AttnShape& sh, int num_sms) {
  if (sh.head_dim > 128) return kDecWarps;
  static const int forced = [] {  // QWEN_RT_DECODE_WPR=1|2|4: a fixed choice, for measurements
    const char* e = std::getenv("QWEN_RT_DECODE_WPR");
    const int v = e ? std::atoi(e) : 0;
    return v == 1 || v == 2 || v == kDecWarps ? v : 0;
  }();
  if (forced) return forced;
  const int64_t pairs = int64_t(b.num_tokens) * sh.kv_heads, blocks = int64_t(kDecBlocksPerSm) * num_sms;
  return pairs >= 4 * blocks ? 1 : pairs >= 3 * int64_t(num_sms) ? 2 : kDecWarps;
}

// Splits for the decode kernel (4 warps per row only): as many as fill kDecBlocksPerSm blocks per SM in one wave
// (QWEN_RT_DECODE_SPLIT_SM=n: n per SM, for measurements), each split at least a granule of keys. Rounded
// down: rounded up, a second, partial wave left most SMs idle. Qwen3-8B's heads, the attention alone
// (tools/attn_decode_study.cu, H200): batch 8 at 4k keys 41 against 58 us per layer (4 splits, not 5),
// at 16k 136 against 192; batch 16 at 4k 75 against 92; batch 32 at 1k 38 against 47; batch 2 and 4 at 4k 2-3%
// slower.
int decode_splits(const AttnBatch& b, const AttnShape& sh, int num_sms) {
  static const int per_sm = [] {
    const char* e = std::getenv("QWEN_RT_DECODE_SPLIT_SM");
    const int v = e ? std::atoi(e) : 0;
    return v > 0 ? v : kDecBlocksPerSm;
  }();
  const int64_t base = int64_t(b.num_tokens) * sh.kv_heads;
  if (base <= 0 || decode_warps_per_row(b, sh, num_sms) != kDecWarps) return 1;
  int64_t n = int64_t(per_sm) * num_sms / base;
  n = std::min<int64_t>(n, (std::max(b.max_ctx_len, 1) + kDecGranule - 1) / kDecGranule);
  n = std::min<int64_t>(n, kMaxSplits);
  return int(std::max<int64_t>(n, 1));
}

// nsplit, or 1 when the workspace cannot hold that many splits' partial outputs.
int usable_splits(const AttnBatch& b, const AttnShape& sh, const AttnWorkspace& ws, int nsplit) {
  const size_t need = size_t(b.num_tokens) * sh.q_heads * nsplit * (sh.head_dim + 2) * 4;
  return nsplit > 1 && (ws.partial == nullptr || ws.bytes < need) ? 1 : nsplit;
}

void check_shape(const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& sh, const Tensor& out) {
  QRT_CHECK(sh.head_dim == 64 || sh.head_dim == 128 || sh.head_dim == 256, "cuda attention: head_dim ",
            sh.head_dim, " is not supported (64, 128, 256)");
  QRT_CHECK(sh.kv_heads > 0 && sh.q_heads % sh.kv_heads == 0, "cuda attention: ", sh.q_heads,
            " query heads are not a multiple of ", sh.kv_heads, " kv heads");
  QRT_CHECK((q.dtype == cache.dtype || cache.fp8()) && out.dtype == q.dtype, "cuda attention: q ",
            dtype_name(q.dtype), ", cache ", dtype_name(cache.dtype), ", out ", dtype_name(out.dtype), " must match");
  QRT_CHECK(!cache.fp8() || (cache.k_scale && cache.v_scale && cache.kv_heads == sh.kv_heads),
            "cuda attention: an fp8 KV cache needs its scales");
  QRT_CHECK(q.cols >= int64_t(sh.q_heads) * sh.head_dim && out.cols >= int64_t(sh.q_heads) * sh.head_dim,
            "cuda attention: q/out have too few columns");
  QRT_CHECK(q.rows >= b.num_tokens && out.rows >= b.num_tokens, "cuda attention: q/out have too few rows");
  QRT_CHECK(b.page_size > 0, "cuda attention: bad page size ", b.page_size);
}

void attn_args(AttnArgs& a, const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& sh,
               Tensor& out) {
  a.q = q.data;
  a.q_stride = q.stride;
  a.kc = cache.k;
  a.vc = cache.v;
  a.host_k = cache.host_k;
  a.host_v = cache.host_v;
  a.host_page0 = cache.host_page0;
  a.k_scale = cache.k_scale;
  a.v_scale = cache.v_scale;
  a.host_k_scale = cache.host_k_scale;
  a.host_v_scale = cache.host_v_scale;
  a.q_start = b.q_start;
  a.ctx_len = b.ctx_len;
  a.page_table = b.page_table;
  a.head_tables = b.head_tables;
  a.max_pages = b.max_pages;
  a.page_size = b.page_size;
  a.kv_heads = sh.kv_heads;
  a.group = sh.q_heads / sh.kv_heads;
  a.scale_log2 = sh.scale * kLog2e;
  a.out = out.data;
  a.out_stride = out.stride;
}

RowsArgs rows_args(const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& sh, Tensor& out,
                   const AttnWorkspace& ws, int nsplit, int gsubs) {
  RowsArgs a;
  attn_args(a, q, cache, b, sh, out);
  a.num_seqs = b.num_seqs;
  a.row_is_seq = b.num_tokens == b.num_seqs && b.max_q_len == 1;
  a.gsubs = gsubs;
  a.q_heads = sh.q_heads;
  a.part = ws.partial;
  a.nsplit = nsplit;
  a.num_tokens = b.num_tokens;
  return a;
}

// a.nsplit > 1: the splits' partial outputs merged into out (granule: that of the kernel that wrote them).
template <typename T>
void launch_combine(const RowsArgs& a, int D, int granule, cudaStream_t st) {
  launch_chained(attn_combine_kernel<T>, unsigned(a.num_tokens * a.q_heads), D, 0, st, a, D, granule);
  check_launch("attention (combine)");
}

template <typename T, typename C, int D>
void run_rows(const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& sh, Tensor& out,
              const AttnWorkspace& ws, int nsplit, cudaStream_t st) {
  const int group = sh.q_heads / sh.kv_heads;
  const RowsArgs a = rows_args(q, cache, b, sh, out, ws, nsplit, (group + kGMax - 1) / kGMax);
  dim3 grid(unsigned(nsplit), unsigned(sh.kv_heads * a.gsubs), unsigned(b.num_tokens));
  auto go = [&](auto gm) {
    constexpr int GM = decltype(gm)::value;
    constexpr size_t smem = rows_smem_bytes<C, D, GM>();
    check(cudaFuncSetAttribute(attn_rows_kernel<T, C, D, GM>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               int(smem)), "attention (smem attribute)");
    launch_chained(attn_rows_kernel<T, C, D, GM>, grid, kRowThreads, smem, st, a);
  };
  if (kRowsGM4 && group <= 4) go(std::integral_constant<int, 4>{});  // heads 4..7 of the 8-wide one would idle
  else go(std::integral_constant<int, kGMax>{});
  check_launch("attention (rows)");
  if (nsplit > 1) launch_combine<T>(a, D, RowCfg<C>::kTile, st);
}

template <typename T, typename C, int D, bool FUSED>
void run_decode(const DecodeArgs& a, const AttnBatch& b, const AttnShape& sh, Tensor& out, const AttnWorkspace& ws,
                int num_sms, cudaStream_t st) {
  const int wpr = decode_warps_per_row(b, sh, num_sms);
  const unsigned blocks = unsigned(ceil_div(int64_t(b.num_tokens) * sh.kv_heads, kDecWarps / wpr));
  if constexpr (!FUSED && D <= 128) {  // the fused kernel and head_dim 256 run at 4 warps per row only
    if (wpr == 1) launch_chained(attn_decode_kernel<T, C, D, 1, false>, blocks, kDecWarps * 32, 0, st, a);
    if (wpr == 2) launch_chained(attn_decode_kernel<T, C, D, 2, false>, blocks, kDecWarps * 32, 0, st, a);
  }
  if (wpr == kDecWarps)
    launch_chained(attn_decode_kernel<T, C, D, kDecWarps, FUSED>,
                   dim3(unsigned(a.nsplit), unsigned(sh.kv_heads), unsigned(b.num_tokens)), kDecWarps * 32, 0, st, a);
  check_launch("attention (decode)");
  if (a.nsplit > 1) launch_combine<T>(a, D, kDecGranule, st);
}

template <typename T, int D, int WARPS, int MT, bool FP8 = false>
void launch_tile(const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& sh, Tensor& out,
                 cudaStream_t st) {
  using Cfg = TileCfg<D, WARPS, MT>;
  const auto kernel = attn_tile_kernel<T, D, WARPS, MT, FP8>;
  TileArgs a;
  attn_args(a, q, cache, b, sh, out);
  a.tokens_per_tile = Cfg::BM / a.group;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Cfg::smem)),
        "attention (smem attribute)");
  // All of the SM's unified memory as shared memory: two 104 KB blocks per SM (an L1 carve-out may not leave room).
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, int(cudaSharedmemCarveoutMaxShared)),
        "attention (carveout attribute)");
  const int tiles = (std::max(b.max_q_len, 1) + a.tokens_per_tile - 1) / a.tokens_per_tile;
  dim3 grid(unsigned(tiles), unsigned(sh.kv_heads), unsigned(b.num_seqs));
  kernel<<<grid, Cfg::kThreads, Cfg::smem, st>>>(a);
  check_launch("attention (tile)");
}

template <typename T, int D, int BN, int WG, int STAGES, int PIPE>
void launch_wgmma(const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& sh, Tensor& out,
                  cudaStream_t st) {
  using Cfg = WgmmaCfg<D, BN, WG, STAGES, PIPE>;
  const auto kernel = attn_wgmma_kernel<T, D, BN, WG, STAGES, PIPE>;
  TileArgs a;
  attn_args(a, q, cache, b, sh, out);
  a.tokens_per_tile = Cfg::BM / a.group;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Cfg::smem)),
        "attention (smem attribute)");
  const int tiles = (std::max(b.max_q_len, 1) + a.tokens_per_tile - 1) / a.tokens_per_tile;
  dim3 grid(unsigned(tiles), unsigned(sh.kv_heads), unsigned(b.num_seqs));
  kernel<<<grid, Cfg::kThreads, Cfg::smem, st>>>(a);
  check_launch("attention (wgmma)");
}

// The prefill kernel for head_dim 64/128: QWEN_RT_PREFILL_ATTN=wgmma, pingpong (the wgmma kernel whose computing
// warpgroups take turns) or mma (read at every call, so the op tests can set it), else kPrefillDefault. The wgmma
// forms run only where this build has an sm_90a image and the device is sm_90; elsewhere the tile kernel (mma).
enum PrefillForm { kFormMma, kFormWgmma, kFormPingPong };
constexpr PrefillForm kPrefillDefault = kFormWgmma;
PrefillForm prefill_form() {
#ifdef QRT_HAVE_SM90A
  const char* e = std::getenv("QWEN_RT_PREFILL_ATTN");
  PrefillForm want = kPrefillDefault;
  if (e && *e)
    want = std::strcmp(e, "wgmma") == 0 ? kFormWgmma : std::strcmp(e, "pingpong") == 0 ? kFormPingPong : kFormMma;
  thread_local int dev = -1;
  thread_local bool sm90 = false;
  int cur = 0;
  if (want == kFormMma || cudaGetDevice(&cur) != cudaSuccess) return kFormMma;
  if (cur != dev) {
    int major = 0, minor = 0;
    sm90 = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, cur) == cudaSuccess &&
           cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, cur) == cudaSuccess && major == 9 &&
           minor == 0;
    dev = cur;
  }
  return sm90 ? want : kFormMma;
#else
  return kFormMma;
#endif
}

// On sm_90a the wgmma kernel: head_dim 64/128 three computing warpgroups, head_dim 256 one (its 128 accumulators
// a thread; Q and three stages of 64 keys fill the shared memory). Else QWEN_RT_TILE=8x1 picks 8 warps of one
// m-tile (the form before 4x2) for head_dim <= 128; head_dim 256 always takes it (two m-tiles of 256-wide
// accumulators do not fit the registers).
template <typename T, int D>
void run_tile(const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& sh, Tensor& out,
              cudaStream_t st) {
  static const bool eight_warps = [] {
    const char* e = std::getenv("QWEN_RT_TILE");
    return e && std::strcmp(e, "8x1") == 0;
  }();
  // An fp8 cache: the tile kernel of 8 warps x 1 m-tile converts K/V as it stages them (the wgmma kernel does not;
  // the 4 x 2 form spilled, ptxas at head_dim 128, with the next tile's chunks in registers).
  if (cache.fp8()) return launch_tile<T, D, 8, 1, true>(q, cache, b, sh, out, st);
  if constexpr (D <= 128) {
    // Three computing warpgroups (192 rows) and a producer warpgroup, 64 keys a tile, 4 stages (H100, session 17:
    // the fastest form of tools/attn_prefill_study.cu, 1.5-2.1x the tile kernel at head_dim 128, 1.5-1.8x at 64).
    switch (prefill_form()) {
      case kFormWgmma: return launch_wgmma<T, D, 64, 3, 4, kPipeProducer>(q, cache, b, sh, out, st);
      case kFormPingPong: return launch_wgmma<T, D, 64, 3, 4, kPipePingPong>(q, cache, b, sh, out, st);
      case kFormMma: break;
    }
    if (!eight_warps) return launch_tile<T, D, 4, 2>(q, cache, b, sh, out, st);
  } else if (prefill_form() != kFormMma) {  // head_dim 256 (ping-pong takes two warpgroups: the producer form)
    return launch_wgmma<T, D, 64, 1, 3, kPipeProducer>(q, cache, b, sh, out, st);
  }
  launch_tile<T, D, 8, 1>(q, cache, b, sh, out, st);
}

template <typename T>
void run_typed(const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& sh, Tensor& out,
               const AttnWorkspace& ws, int num_sms, cudaStream_t st) {
  const int group = sh.q_heads / sh.kv_heads;
  const int es = int(sizeof(T));
  const bool aligned = aligned16(q.data, q.stride * es) && aligned16(out.data, out.stride * es);
  const bool tile = sizeof(T) == 2 && b.max_q_len > 1 && group <= kTileMaxGroup && aligned;
  if (tile) {
    if constexpr (sizeof(T) == 2) {
      switch (sh.head_dim) {
        case 64: run_tile<T, 64>(q, cache, b, sh, out, st); return;
        case 128: run_tile<T, 128>(q, cache, b, sh, out, st); return;
        case 256: run_tile<T, 256>(q, cache, b, sh, out, st); return;
      }
    }
  }
  const bool decode = aligned && decode_kernel_takes(b, sh, sizeof(T), cache.fp8());
  const int nsplit = usable_splits(b, sh, ws, decode ? decode_splits(b, sh, num_sms) : choose_splits(b, sh, num_sms));
  if constexpr (sizeof(T) == 2) {
    if (decode) {
      DecodeArgs a{};
      static_cast<RowsArgs&>(a) = rows_args(q, cache, b, sh, out, ws, nsplit, 1);
      if (cache.fp8()) {
        if (sh.head_dim == 128) run_decode<T, uint8_t, 128, false>(a, b, sh, out, ws, num_sms, st);
        else run_decode<T, uint8_t, 256, false>(a, b, sh, out, ws, num_sms, st);
      } else {
        if (sh.head_dim == 64) run_decode<T, T, 64, false>(a, b, sh, out, ws, num_sms, st);
        else if (sh.head_dim == 128) run_decode<T, T, 128, false>(a, b, sh, out, ws, num_sms, st);
        else run_decode<T, T, 256, false>(a, b, sh, out, ws, num_sms, st);
      }
      return;
    }
  }
  if (cache.fp8()) {  // the rows kernel, reading e4m3
    switch (sh.head_dim) {
      case 64: run_rows<T, uint8_t, 64>(q, cache, b, sh, out, ws, nsplit, st); return;
      case 128: run_rows<T, uint8_t, 128>(q, cache, b, sh, out, ws, nsplit, st); return;
      case 256: run_rows<T, uint8_t, 256>(q, cache, b, sh, out, ws, nsplit, st); return;
    }
  }
  switch (sh.head_dim) {
    case 64: run_rows<T, T, 64>(q, cache, b, sh, out, ws, nsplit, st); return;
    case 128: run_rows<T, T, 128>(q, cache, b, sh, out, ws, nsplit, st); return;
    case 256: run_rows<T, T, 256>(q, cache, b, sh, out, ws, nsplit, st); return;
  }
}

}  // namespace

size_t attn_workspace_bytes(const AttnBatch& b, const AttnShape& sh, int num_sms) {
  if (b.num_tokens <= 0 || sh.kv_heads <= 0 || sh.q_heads % sh.kv_heads != 0) return 0;
  // Either kernel may run (the decode kernel only for 16-bit activations, which this does not know).
  const int nsplit = std::max(choose_splits(b, sh, num_sms),
                              decode_kernel_takes(b, sh, 2, false) ? decode_splits(b, sh, num_sms) : 1);
  if (nsplit <= 1) return 0;
  return size_t(b.num_tokens) * sh.q_heads * nsplit * (sh.head_dim + 2) * 4;
}

bool launch_qkv_attention(const Tensor& qkv, const QkvFinish& fin, const KvLayer& cache, const AttnBatch& b,
                          const AttnShape& sh, Tensor& out, const AttnWorkspace& ws, int num_sms, cudaStream_t st) {
  static const bool separate = [] {
    const char* e = std::getenv("QWEN_RT_DECODE_FINISH");
    return e && std::strcmp(e, "separate") == 0;
  }();
  const int D = sh.head_dim, es = int(dtype_size(qkv.dtype));
  const RopeTable& tab = *fin.table;
  const bool aligned = aligned16(qkv.data, qkv.stride * es) && aligned16(out.data, out.stride * es);
  if (separate || !aligned || D > 128 || !decode_kernel_takes(b, sh, size_t(es), false) || cache.dtype != qkv.dtype ||
      qkv.cols != int64_t(sh.q_heads + 2 * sh.kv_heads) * D || b.kv_rows == nullptr || fin.positions == nullptr ||
      tab.rot_dim <= 0 || tab.rot_dim % 64 != 0 || tab.rot_dim > D ||
      (fin.q_norm && fin.k_norm && fin.q_norm->dtype != fin.k_norm->dtype) ||
      decode_warps_per_row(b, sh, num_sms) != kDecWarps)
    return false;  // the caller runs finish_qkv, then attention
  check_shape(qkv, cache, b, sh, out);
  if (b.num_tokens == 0 || b.num_seqs == 0) return true;
  const int nsplit = usable_splits(b, sh, ws, decode_splits(b, sh, num_sms));
  dispatch_act(qkv.dtype, "attention", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (sizeof(T) == 2) {
      DecodeArgs a{};
      static_cast<RowsArgs&>(a) = rows_args(qkv, cache, b, sh, out, ws, nsplit, 1);
      a.q_norm = fin.q_norm ? fin.q_norm->data : nullptr;
      a.k_norm = fin.k_norm ? fin.k_norm->data : nullptr;
      a.norm_t = fin.q_norm ? fin.q_norm->dtype : (fin.k_norm ? fin.k_norm->dtype : DType::F32);
      a.eps = fin.eps;
      a.zero_centred = fin.zero_centred;
      a.positions = fin.positions;
      a.cos_sin = tab.cos_sin;
      a.rot_dim = tab.rot_dim;
      a.max_pos = tab.max_positions;
      a.kv_rows = b.kv_rows;
      if (D == 64) run_decode<T, T, 64, true>(a, b, sh, out, ws, num_sms, st);
      else run_decode<T, T, 128, true>(a, b, sh, out, ws, num_sms, st);
    }
  });
  return true;
}

void launch_attention(const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& sh, Tensor& out,
                      const AttnWorkspace& ws, int num_sms, cudaStream_t st) {
  check_shape(q, cache, b, sh, out);
  if (b.num_tokens == 0 || b.num_seqs == 0) return;
  dispatch_act(q.dtype, "attention", [&](auto tag) {
    using T = decltype(tag);
    run_typed<T>(q, cache, b, sh, out, ws, num_sms, st);
  });
}

}  // namespace qrt::cuda
