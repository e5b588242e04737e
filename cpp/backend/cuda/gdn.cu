// Gated DeltaNet and gated attention on CUDA: sigmoid_mul, gated_rms_norm, causal_conv1d (per-slot conv state)
// and the gated delta rule (per-slot fp32 recurrent state: a token loop, and for 16-bit prefill a chunked form on
// tensor cores). Contracts: ops.h. Math in fp32 (the chunked form: 16-bit tensor-core operands, fp32 sums); every
// value a sequence gets is computed by the same operations in the same order whatever its batch mates.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "backend/cuda/cuda_common.cuh"

namespace qrt::cuda {
namespace {

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
// torch's softplus (beta 1, threshold 20), as the CPU backend.
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// Whether the element ranges of two tensors overlap (an op called in place).
bool overlaps(const Tensor& a, const Tensor& b) {
  if (a.rows == 0 || b.rows == 0) return false;
  auto end = [](const Tensor& t) {
    return static_cast<const char*>(t.data) + ((t.rows - 1) * t.stride + t.cols) * int64_t(dtype_size(t.dtype));
  };
  return static_cast<const char*>(a.data) < end(b) && static_cast<const char*>(b.data) < end(a);
}

// ---- sigmoid_mul: x *= sigmoid(gate), one block per row ---------------------------------------------------
template <typename T>
__global__ void sigmoid_mul_kernel(T* x, int64_t xs, const T* gate, int64_t gs, int64_t cols) {
  grid_release();
  grid_wait();
  const int64_t r = blockIdx.x;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    x[r * xs + c] = from_f<T>(to_f(x[r * xs + c]) * sigmoid(to_f(gate[r * gs + c])));
}

// ---- gated_rms_norm: one warp per (row, head), in place -----------------------------------------------------
// x = rmsnorm(x) * w * silu(z) per head of hd elements (the CPU's order of operations).
template <typename T>
__global__ void gated_rms_norm_kernel(T* x, int64_t xs, const T* z, int64_t zs, int64_t rows, int heads, int hd,
                                      const void* w, DType wt, float eps) {
  grid_release();
  grid_wait();
  const int64_t task = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (task >= rows * heads) return;
  const int lane = threadIdx.x & 31;
  const int64_t r = task / heads;
  const int h = int(task % heads);
  T* p = x + r * xs + int64_t(h) * hd;
  const T* zp = z + r * zs + int64_t(h) * hd;
  const float inv = warp_inv_rms(p, hd, eps);
  for (int i = lane; i < hd; i += 32) {
    const float zi = to_f(zp[i]);
    p[i] = from_f<T>(to_f(p[i]) * inv * load_any(w, wt, i) * (zi * sigmoid(zi)));
  }
}

// ---- causal_conv1d ------------------------------------------------------------------------------------------
// Block (channel tile, sequence), threads (channel, token group): thread (c, g) owns channel c of the sequence
// over the g-th contiguous part of its tokens, with the K-input window in registers. The threads that read the
// slot's old history (the groups starting within the first K - 1 tokens, and group 0 for the new history) all
// read before the block barrier; group 0 writes the new history after it. A channel of a sequence lives in one
// block only, so no other block touches its history. In place (out over x) only one group runs: each thread
// reads a token's input before it writes that token's output.
constexpr int kConvThreads = 256;
constexpr int kConvUnroll = 4;  // tokens whose inputs are loaded together

template <typename T, int K>
__global__ void __launch_bounds__(kConvThreads) causal_conv1d_kernel(
    const T* x, int64_t xs, const void* w, DType wt, int64_t ws, void* conv, DType ct, const int32_t* q_start,
    const int32_t* ctx_len, const int32_t* slots, const int32_t* keep, T* out, int64_t os, int64_t C) {
  constexpr int H = K - 1;  // history length
  grid_release();
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool active = c < C;
  float wc[K];  // weights: read before grid_wait
#pragma unroll
  for (int j = 0; j < K; ++j) wc[j] = active ? load_any(w, wt, c * ws + j) : 0.f;
  grid_wait();
  const int seq = blockIdx.y;
  const int r0 = q_start[seq], n = q_start[seq + 1] - r0;
  const int slot = slots[seq];
  const bool fresh = ctx_len[seq] - n == 0 || slot < 0;  // history of zeros
  const int64_t hist = int64_t(slot < 0 ? 0 : slot) * H * C + c;  // element (j, c) of the slot's history: + j * C
  // Input at token position p of the sequence's window (p < 0: the history).
  auto input = [&](int p) -> float {
    if (!active) return 0.f;
    if (p >= 0) return to_f(x[(r0 + p) * xs + c]);
    return fresh ? 0.f : load_any(conv, ct, hist + int64_t(H + p) * C);
  };
  const int groups = blockDim.y, per = (n + groups - 1) / groups;
  const int t0 = min(n, int(threadIdx.y) * per), t1 = min(n, t0 + per);
  float win[K];
#pragma unroll
  for (int j = 0; j < H; ++j) win[j] = input(t0 - H + j);
  float last[H > 0 ? H : 1];  // group 0: the new history, the window's last H inputs
  if (threadIdx.y == 0) {
#pragma unroll
    for (int j = 0; j < H; ++j) last[j] = input(n - H + j);
  }
  for (int t = t0; t < t1; t += kConvUnroll) {
    float in[kConvUnroll];
#pragma unroll
    for (int u = 0; u < kConvUnroll; ++u) in[u] = t + u < t1 ? input(t + u) : 0.f;
#pragma unroll
    for (int u = 0; u < kConvUnroll; ++u) {
      if (t + u >= t1) break;
      win[H] = in[u];
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < K; ++j) acc += wc[j] * win[j];
      if (active) out[(r0 + t + u) * os + c] = from_f<T>(acc * sigmoid(acc));
#pragma unroll
      for (int j = 0; j < H; ++j) win[j] = win[j + 1];
    }
  }
  __syncthreads();  // every read of the old history is done
  const int kept = keep ? keep[seq] : -1;
  if (threadIdx.y == 0 && active && kept >= 0) {  // the history after each row but the last (ops.h AttnBatch::keep)
    for (int i = 0; i + 1 < n; ++i)
#pragma unroll
      for (int j = 0; j < H; ++j)
        store_any(conv, ct, int64_t(kept + i) * H * C + c + int64_t(j) * C, input(i + 1 - H + j));
  }
  if (threadIdx.y == 0 && active && slot >= 0) {
#pragma unroll
    for (int j = 0; j < H; ++j) store_any(conv, ct, hist + int64_t(j) * C, last[j]);
  }
}

// ---- gated delta rule ---------------------------------------------------------------------------------------
// Whether a sequence of n rows on state slot `slot` goes through in chunks (gdn_chunk_*, below) rather than the
// token loop: chunk_min rows or more (the call's plan) and a slot to carry the state between chunk windows.
__host__ __device__ __forceinline__ bool chunked(int n, int slot, int chunk_min) { return n >= chunk_min && slot >= 0; }


// Block (column tile, value head, sequence) of 4 warps. A state column y (S[:, y], k_dim rows) is held in
// registers by kParts adjacent lanes: part p holds the R = k_dim / kParts rows [p R, (p + 1) R). The column sums
// (S^T k, S^T q) are the parts' partial sums added by two butterfly shuffles: a fixed order (column_sum).
// Tokens go through in rounds of TC: the block stages their L2-normalised q and k, v of its columns, decay and
// beta in shared memory (a warp per token; q and k as [part][R + kPad]: a part's rows read 16 bytes at a time,
// the 4 parts on distinct banks), then every warp applies them one token after another. The state is
// read once (after grid_wait) and written once; decode is a round of one token. A lane sums its rows in kChains
// interleaved partial sums (row i into chain i % kChains).
constexpr int kParts = 4;
constexpr int kColsPerWarp = 32 / kParts;
constexpr int kDeltaWarps = 4;
constexpr int kDeltaCols = kColsPerWarp * kDeltaWarps;  // state columns of a block

constexpr int kChains = 4;  // independent partial sums per lane (a shorter dependency chain per token)
constexpr int kPad = 4;     // floats after each part's rows of staged q and k

// The column sum of a lane's kChains partial sums and its kParts - 1 partners' (all kParts lanes get it): the
// chains in order, then two butterfly shuffles; the same order for every column, token and batch.
__device__ __forceinline__ float column_sum(const float (&chain)[kChains]) {
  float v = (chain[0] + chain[1]) + (chain[2] + chain[3]);
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  return v;
}

// A token's q and k of one key head (columns q_col and k_col of its row), L2-normalised and q times 1 / sqrt(DK),
// by one warp: lane holds elements lane + 32 j (zeros past DK). Both forms of the delta rule take them from here.
template <typename T, int DK, int QK>
__device__ __forceinline__ void normalised_qk(const T* row, int64_t q_col, int64_t k_col, float (&q)[QK],
                                              float (&k)[QK]) {
  const int lane = threadIdx.x & 31;
  float ssq = 0.f, ssk = 0.f;
#pragma unroll
  for (int j = 0; j < QK; ++j) {
    const int e = lane + 32 * j;
    q[j] = e < DK ? to_f(row[q_col + e]) : 0.f;
    k[j] = e < DK ? to_f(row[k_col + e]) : 0.f;
    ssq += q[j] * q[j];
    ssk += k[j] * k[j];
  }
  const float iq = 1.0f / sqrtf(warp_sum(ssq) + 1e-6f) * (1.0f / sqrtf(float(DK)));
  const float ik = 1.0f / sqrtf(warp_sum(ssk) + 1e-6f);
#pragma unroll
  for (int j = 0; j < QK; ++j) q[j] *= iq, k[j] *= ik;
}

template <typename T, int DK>
__global__ void __launch_bounds__(kDeltaWarps * 32) gated_delta_rule_kernel(
    const T* qkv, int64_t qkv_stride, const void* a, DType at, int64_t as, const void* b, DType bt, int64_t bs,
    const void* a_log, const void* dt_bias, DType wt, const int32_t* q_start, const int32_t* ctx_len,
    const int32_t* slots, const int32_t* keep, float* state, T* out, int64_t os, int k_heads, int v_heads, int dv,
    int chunk_min) {
  constexpr int R = DK / kParts;            // state rows per lane
  constexpr int TC = DK >= 32 ? 2048 / DK : 64;  // tokens per round (at most 32 KiB of shared memory)
  constexpr int QK = (DK + 31) / 32;             // q / k elements per lane when staging
  static_assert(R % 4 == 0, "a part's rows are read as float4");
  __shared__ __align__(16) float q_s[TC][kParts][R + kPad], k_s[TC][kParts][R + kPad];
  __shared__ float v_s[TC][kDeltaCols], decay_s[TC], beta_s[TC];
  grid_release();
  const int tile = blockIdx.x, h = blockIdx.y, seq = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int part = lane % kParts;
  const int col = warp * kColsPerWarp + lane / kParts;  // column within the tile
  const int y = tile * kDeltaCols + col;
  const bool active = y < dv;
  const float A = -expf(load_any(a_log, wt, h)), bias = load_any(dt_bias, wt, h);  // weights: before grid_wait
  grid_wait();
  const int r0 = q_start[seq], n = q_start[seq + 1] - r0;
  const int slot = slots[seq];
  if (chunked(n, slot, chunk_min)) return;  // gdn_chunk_* take it
  const bool fresh = ctx_len[seq] - n == 0 || slot < 0;  // the state starts from zeros
  float* S = state + (int64_t(slot < 0 ? 0 : slot) * v_heads + h) * int64_t(DK) * dv + y;  // S[x][y] at + x * dv
  const int kept = keep ? keep[seq] : -1;  // the state after each row but the last also goes to kept + row
  float st[R];
#pragma unroll
  for (int i = 0; i < R; ++i) st[i] = fresh || !active ? 0.f : S[int64_t(part * R + i) * dv];
  const int kh = h / (v_heads / k_heads);
  const int64_t qk_cols = int64_t(k_heads) * DK;
  const int64_t q_col = int64_t(kh) * DK, k_col = qk_cols + q_col, v_col = 2 * qk_cols + int64_t(h) * dv;
  for (int base = 0; base < n; base += TC) {
    const int m = min(TC, n - base);
    __syncthreads();  // the previous round's values are used up
    for (int t = warp; t < m; t += kDeltaWarps) {
      const int64_t r = r0 + base + t;
      const T* row = qkv + r * qkv_stride;
      float q_in[QK], k_in[QK];
      normalised_qk<T, DK>(row, q_col, k_col, q_in, k_in);
#pragma unroll
      for (int j = 0; j < QK; ++j) {
        const int e = lane + 32 * j;
        if (e < DK) {
          q_s[t][e / R][e % R] = q_in[j];
          k_s[t][e / R][e % R] = k_in[j];
        }
      }
      if (lane < kDeltaCols) {
        const int yy = tile * kDeltaCols + lane;
        v_s[t][lane] = yy < dv ? to_f(row[v_col + yy]) : 0.f;
      }
      if (lane == 0) {
        decay_s[t] = expf(A * softplus(load_any(a, at, r * as + h) + bias));
        beta_s[t] = sigmoid(load_any(b, bt, r * bs + h));
      }
    }
    __syncthreads();
    for (int t = 0; t < m; ++t) {
      const float decay = decay_s[t], beta = beta_s[t];
      const float4* k4 = reinterpret_cast<const float4*>(k_s[t][part]);
      const float4* q4 = reinterpret_cast<const float4*>(q_s[t][part]);
      float kv[kChains] = {};  // (S^T k)[y] after the decay; row i into chain i % kChains
#pragma unroll
      for (int i = 0; i < R; i += 4) {
        const float4 k = k4[i / 4];
        st[i] *= decay, st[i + 1] *= decay, st[i + 2] *= decay, st[i + 3] *= decay;
        kv[0] += st[i] * k.x, kv[1] += st[i + 1] * k.y, kv[2] += st[i + 2] * k.z, kv[3] += st[i + 3] * k.w;
      }
      const float kv_sum = column_sum(kv);
      const float delta = (v_s[t][col] - kv_sum) * beta;
      float o[kChains] = {};
#pragma unroll
      for (int i = 0; i < R; i += 4) {
        const float4 k = k4[i / 4], q = q4[i / 4];
        st[i] += k.x * delta, st[i + 1] += k.y * delta, st[i + 2] += k.z * delta, st[i + 3] += k.w * delta;
        o[0] += st[i] * q.x, o[1] += st[i + 1] * q.y, o[2] += st[i + 2] * q.z, o[3] += st[i + 3] * q.w;
      }
      const float o_sum = column_sum(o);
      if (part == 0 && active) out[(r0 + base + t) * os + int64_t(h) * dv + y] = from_f<T>(o_sum);
      if (kept >= 0 && active && base + t + 1 < n) {
        float* K = state + (int64_t(kept + base + t) * v_heads + h) * int64_t(DK) * dv + y;
#pragma unroll
        for (int i = 0; i < R; ++i) K[int64_t(part * R + i) * dv] = st[i];
      }
    }
  }
  if (active && slot >= 0) {
#pragma unroll
    for (int i = 0; i < R; ++i) S[int64_t(part * R + i) * dv] = st[i];
  }
}
static_assert(kParts == 4 && kChains == 4, "column_sum adds 4 chains and shuffles across 4 lanes");

// ---- gated delta rule in chunks (16-bit prefill) ------------------------------------------------------------
// A chunked sequence (chunked() above) goes through in chunks of kChunk tokens in the WY form, on tensor cores.
// Within a chunk, with tokens i and j, G_i the sum of the log decays up to and with token i, S0 the state before
// the chunk, q and k normalised as the token loop does:
//   A_ij = beta_i e^(G_i - G_j) k_i.k_j (j < i),  T = (I + A)^-1,
//   W = T diag(beta e^G) K,  U = T diag(beta) V,  P_ij = e^(G_i - G_j) q_i.k_j (j <= i),
//   u = U - W S0 (the chunk's deltas),  o = diag(e^G) Q S0 + P u,  S = e^(G_last) S0 + (diag(e^(G_last - G)) K)^T u.
// gdn_chunk_prep computes every chunk's W, U, P, e^G Q and e^(G_last - G) K at once (a block per chunk and value
// head; A and T in fp32); gdn_chunk_state then walks a sequence's chunks in order (a block per 32 state columns of
// a value head) with the state in fp32 mma accumulators. Every exponent is <= 0. Tensor-core operands are T (S0
// and u are rounded to T for their products), every sum is fp32. Chunks count from the sequence's first row of the
// call, so its output does not depend on its batch mates; it does depend on where its rows of a step begin (as
// chunked prefill already makes the GEMMs do).
// The call's chunked sequences' chunks, in sequence order, are its chunk slots; the prep output (a record per
// slot and value head) lives in scratch for a window of slots at a time, the state passing through its slot
// (fp32) between windows, so the bits do not depend on the window.
constexpr int kChunk = 64;
constexpr int kChunkWarps = 4;  // warp w takes the chunk's rows [16 w, 16 w + 16)
constexpr int kChunkPad = 8;    // T elements after each row staged in shared memory: conflict-free fragment reads

__host__ __device__ __forceinline__ size_t align16(size_t n) { return (n + 15) / 16 * 16; }

// Byte offsets in a (chunk slot, value head) record: W [kChunk][dk] T, e^G Q [kChunk][dk] T, (e^(G_last - G) K)^T
// [dk][kChunk] T, P [kChunk][kChunk] T, U [kChunk][dv] fp32, e^G_last fp32.
struct ChunkRecord {
  size_t w, qg, kd, p, u, gl, bytes;
};
__host__ __device__ __forceinline__ ChunkRecord chunk_record(int dk, int dv) {
  ChunkRecord r;
  r.w = 0;
  r.qg = r.w + size_t(kChunk) * dk * 2;
  r.kd = r.qg + size_t(kChunk) * dk * 2;
  r.p = r.kd + size_t(dk) * kChunk * 2;
  r.u = r.p + size_t(kChunk) * kChunk * 2;
  r.gl = r.u + size_t(kChunk) * dv * 4;
  r.bytes = r.gl + 16;
  return r;
}

// gdn_chunk_prep's shared memory (bytes from its start): q, k [kChunk][dk + pad] T; v [kChunk][dv + pad] T; A and
// T [kChunk][kChunk + 1] fp32; the block-row products [16][3 * 16 + 1] fp32; T diag(beta e^G) and T diag(beta)
// [kChunk][kChunk + pad] T; G, e^G and beta [kChunk] fp32.
struct PrepSmem {
  size_t q, k, v, a, t, m, tb, tu, g, eg, beta, bytes;
};
__host__ __device__ __forceinline__ PrepSmem prep_smem(int dk, int dv) {
  PrepSmem s;
  size_t o = 0;
  s.q = o, o += align16(size_t(kChunk) * (dk + kChunkPad) * 2);
  s.k = o, o += align16(size_t(kChunk) * (dk + kChunkPad) * 2);
  s.v = o, o += align16(size_t(kChunk) * (dv + kChunkPad) * 2);
  s.a = o, o += align16(size_t(kChunk) * (kChunk + 1) * 4);
  s.t = o, o += align16(size_t(kChunk) * (kChunk + 1) * 4);
  s.m = o, o += align16(size_t(16) * (3 * 16 + 1) * 4);
  s.tb = o, o += align16(size_t(kChunk) * (kChunk + kChunkPad) * 2);
  s.tu = o, o += align16(size_t(kChunk) * (kChunk + kChunkPad) * 2);
  s.g = o, o += align16(kChunk * 4);
  s.eg = o, o += align16(kChunk * 4);
  s.beta = o, o += align16(kChunk * 4);
  s.bytes = o;
  return s;
}

// Chunk slot c of the call as (sequence, its chunk); false past the last.
__device__ __forceinline__ bool find_chunk(int64_t c, const int32_t* q_start, const int32_t* slots, int num_seqs,
                                           int chunk_min, int& seq, int& chunk) {
  for (int s = 0; s < num_seqs; ++s) {
    const int n = q_start[s + 1] - q_start[s];
    if (!chunked(n, slots[s], chunk_min)) continue;
    const int64_t m = (n + kChunk - 1) / kChunk;
    if (c < m) {
      seq = s;
      chunk = int(c);
      return true;
    }
    c -= m;
  }
  return false;
}

// mma m16n8k16 fragments (lane 4 g + t). A: 16 x 16 at (m0, k0) of a row-major matrix, leading dimension ld.
template <typename T>
__device__ __forceinline__ void frag_a(const T* s, int64_t ld, int m0, int k0, uint32_t (&a)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const T* p = s + (m0 + g) * ld + k0 + 2 * t;
  a[0] = *reinterpret_cast<const uint32_t*>(p);
  a[1] = *reinterpret_cast<const uint32_t*>(p + 8 * ld);
  a[2] = *reinterpret_cast<const uint32_t*>(p + 8);
  a[3] = *reinterpret_cast<const uint32_t*>(p + 8 * ld + 8);
}
// B: 16 x 8 at (k0, n0) of a matrix stored [n][k] (k contiguous), leading dimension ld.
template <typename T>
__device__ __forceinline__ void frag_b(const T* s, int64_t ld, int k0, int n0, uint32_t (&b)[2]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const T* p = s + (n0 + g) * ld + k0 + 2 * t;
  b[0] = *reinterpret_cast<const uint32_t*>(p);
  b[1] = *reinterpret_cast<const uint32_t*>(p + 8);
}
// B of a matrix stored [k][n] (n contiguous): each register from two 16-bit reads.
template <typename T>
__device__ __forceinline__ void frag_b_kn(const T* s, int64_t ld, int k0, int n0, uint32_t (&b)[2]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const uint16_t* p = reinterpret_cast<const uint16_t*>(s) + (k0 + 2 * t) * ld + n0 + g;
  b[0] = uint32_t(p[0]) | uint32_t(p[ld]) << 16;
  b[1] = uint32_t(p[8 * ld]) | uint32_t(p[9 * ld]) << 16;
}
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  mma16816<T>(c, a[0], a[1], a[2], a[3], b[0], b[1]);
}

// Block (window slot, value head), kChunkWarps warps: the chunk's record (above).
template <typename T, int DK>
__global__ void __launch_bounds__(kChunkWarps * 32) gdn_chunk_prep_kernel(
    const T* qkv, int64_t qkv_stride, const void* a, DType at, int64_t as, const void* b, DType bt, int64_t bs,
    const void* a_log, const void* dt_bias, DType wt, const int32_t* q_start, const int32_t* slots, int num_seqs,
    int chunk_min, int64_t slot0, unsigned char* scratch, int k_heads, int v_heads, int dv) {
  extern __shared__ __align__(16) unsigned char gdn_smem[];
  constexpr int QK = (DK + 31) / 32;
  constexpr int LK = DK + kChunkPad, LT = kChunk + kChunkPad, LA = kChunk + 1, LM = 3 * 16 + 1;
  grid_release();
  const int h = blockIdx.y;
  const float A = -expf(load_any(a_log, wt, h)), bias = load_any(dt_bias, wt, h);  // weights: before grid_wait
  grid_wait();
  int seq, chunk;
  if (!find_chunk(slot0 + blockIdx.x, q_start, slots, num_seqs, chunk_min, seq, chunk)) return;
  const PrepSmem L = prep_smem(DK, dv);
  T* q_s = reinterpret_cast<T*>(gdn_smem + L.q);
  T* k_s = reinterpret_cast<T*>(gdn_smem + L.k);
  T* v_s = reinterpret_cast<T*>(gdn_smem + L.v);
  float* a_s = reinterpret_cast<float*>(gdn_smem + L.a);
  float* t_s = reinterpret_cast<float*>(gdn_smem + L.t);
  float* m_s = reinterpret_cast<float*>(gdn_smem + L.m);
  T* tb_s = reinterpret_cast<T*>(gdn_smem + L.tb);
  T* tu_s = reinterpret_cast<T*>(gdn_smem + L.tu);
  float* g_s = reinterpret_cast<float*>(gdn_smem + L.g);
  float* eg_s = reinterpret_cast<float*>(gdn_smem + L.eg);
  float* beta_s = reinterpret_cast<float*>(gdn_smem + L.beta);
  const int LV = dv + kChunkPad;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int r0 = q_start[seq] + chunk * kChunk, m = min(kChunk, q_start[seq + 1] - r0);
  const int kh = h / (v_heads / k_heads);
  const int64_t qk_cols = int64_t(k_heads) * DK;
  const int64_t q_col = int64_t(kh) * DK, k_col = qk_cols + q_col, v_col = 2 * qk_cols + int64_t(h) * dv;

  // 1. The chunk's rows: q and k normalised, v, log decay and beta; zeros (and no decay) past its last row.
  for (int i = warp; i < kChunk; i += kChunkWarps) {
    const int64_t r = r0 + i;
    float qn[QK] = {}, kn[QK] = {};
    if (i < m) normalised_qk<T, DK>(qkv + r * qkv_stride, q_col, k_col, qn, kn);
#pragma unroll
    for (int j = 0; j < QK; ++j) {
      const int e = lane + 32 * j;
      if (e < DK) q_s[i * LK + e] = from_f<T>(qn[j]), k_s[i * LK + e] = from_f<T>(kn[j]);
    }
    for (int y = lane; y < dv; y += 32) v_s[i * LV + y] = i < m ? qkv[r * qkv_stride + v_col + y] : from_f<T>(0.f);
    if (lane == 0) {
      g_s[i] = i < m ? A * softplus(load_any(a, at, r * as + h) + bias) : 0.f;
      beta_s[i] = i < m ? sigmoid(load_any(b, bt, r * bs + h)) : 0.f;
    }
  }
  for (int e = threadIdx.x; e < kChunk * LA; e += blockDim.x) t_s[e] = 0.f;
  __syncthreads();
  // 2. G: the log decays' inclusive prefix sums (warp 0, a fixed order), and e^G.
  if (warp == 0) {
    float lo = g_s[lane], hi = g_s[lane + 32];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float l = __shfl_up_sync(0xffffffffu, lo, o), u = __shfl_up_sync(0xffffffffu, hi, o);
      if (lane >= o) lo += l, hi += u;
    }
    hi += __shfl_sync(0xffffffffu, lo, 31);
    g_s[lane] = lo, g_s[lane + 32] = hi;
    eg_s[lane] = expf(lo), eg_s[lane + 32] = expf(hi);
  }
  __syncthreads();
  const ChunkRecord R = chunk_record(DK, dv);
  unsigned char* rec = scratch + (size_t(blockIdx.x) * v_heads + h) * R.bytes;
  const int i0 = 16 * warp;
  // 3. K K^T and Q K^T for the warp's rows: A (fp32, shared) and P (T, the record).
  {
    float kk[kChunk / 8][4] = {}, qk[kChunk / 8][4] = {};
#pragma unroll
    for (int d0 = 0; d0 < DK; d0 += 16) {
      uint32_t ka[4], qa[4], kb[2];
      frag_a(k_s, LK, i0, d0, ka);
      frag_a(q_s, LK, i0, d0, qa);
#pragma unroll
      for (int nt = 0; nt < kChunk / 8; ++nt) {
        frag_b(k_s, LK, d0, 8 * nt, kb);
        mma<T>(kk[nt], ka, kb);
        mma<T>(qk[nt], qa, kb);
      }
    }
    T* P = reinterpret_cast<T*>(rec + R.p);
#pragma unroll
    for (int nt = 0; nt < kChunk / 8; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = i0 + g + 8 * hh;
        float pv[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int j = 8 * nt + 2 * t + c;
          const float d = expf(min(g_s[i] - g_s[j], 0.f));
          a_s[i * LA + j] = j < i ? beta_s[i] * d * kk[nt][2 * hh + c] : 0.f;
          pv[c] = j <= i ? d * qk[nt][2 * hh + c] : 0.f;
        }
        *reinterpret_cast<uint32_t*>(P + i * kChunk + 8 * nt + 2 * t) = pack2<T>(pv[0], pv[1]);
      }
  }
  __syncthreads();
  // 4. T = (I + A)^-1, unit lower triangular, fp32: the 16 x 16 diagonal blocks by forward substitution (a thread a
  // column), then block row by block row, T_(bi, j) = -T_(bi, bi) sum_(j <= k < bi) A_(bi, k) T_(k, j).
  if (threadIdx.x < kChunk) {
    const int c = threadIdx.x, end = (c / 16 + 1) * 16;
    t_s[c * LA + c] = 1.f;
    for (int i = c + 1; i < end; ++i) {
      float s = 0.f;
      for (int j = c; j < i; ++j) s += a_s[i * LA + j] * t_s[j * LA + c];
      t_s[i * LA + c] = -s;
    }
  }
  __syncthreads();
  for (int bi = 1; bi < kChunk / 16; ++bi) {
    const int b0 = 16 * bi;
    for (int e = threadIdx.x; e < bi * 256; e += blockDim.x) {
      const int j = e / 256, r = e / 16 % 16, c = e % 16;
      float s = 0.f;
      for (int q = 16 * j; q < b0; ++q) s += a_s[(b0 + r) * LA + q] * t_s[q * LA + 16 * j + c];
      m_s[r * LM + 16 * j + c] = s;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < bi * 256; e += blockDim.x) {
      const int j = e / 256, r = e / 16 % 16, c = e % 16;
      float s = 0.f;
      for (int q = 0; q <= r; ++q) s += t_s[(b0 + r) * LA + b0 + q] * m_s[q * LM + 16 * j + c];
      t_s[(b0 + r) * LA + 16 * j + c] = -s;
    }
    __syncthreads();
  }
  // 5. T diag(beta e^G) and T diag(beta), rounded to T.
  for (int e = threadIdx.x; e < kChunk * kChunk; e += blockDim.x) {
    const int i = e / kChunk, j = e % kChunk;
    const float x = t_s[i * LA + j] * beta_s[j];
    tu_s[i * LT + j] = from_f<T>(x);
    tb_s[i * LT + j] = from_f<T>(x * eg_s[j]);
  }
  __syncthreads();
  // 6. W = T diag(beta e^G) K and U = T diag(beta) V for the warp's rows (T is lower triangular: k-tiles <= warp).
  {
    uint32_t ta[kChunkWarps][4], ua[kChunkWarps][4], bf[2];
#pragma unroll
    for (int kt = 0; kt < kChunkWarps; ++kt)
      if (kt <= warp) frag_a(tb_s, LT, i0, 16 * kt, ta[kt]), frag_a(tu_s, LT, i0, 16 * kt, ua[kt]);
    T* W = reinterpret_cast<T*>(rec + R.w);
#pragma unroll 4
    for (int n0 = 0; n0 < DK; n0 += 8) {
      float c[4] = {};
#pragma unroll
      for (int kt = 0; kt < kChunkWarps; ++kt)
        if (kt <= warp) frag_b_kn(k_s, LK, 16 * kt, n0, bf), mma<T>(c, ta[kt], bf);
      *reinterpret_cast<uint32_t*>(W + (i0 + g) * DK + n0 + 2 * t) = pack2<T>(c[0], c[1]);
      *reinterpret_cast<uint32_t*>(W + (i0 + g + 8) * DK + n0 + 2 * t) = pack2<T>(c[2], c[3]);
    }
    float* U = reinterpret_cast<float*>(rec + R.u);
    for (int n0 = 0; n0 < dv; n0 += 8) {
      float c[4] = {};
#pragma unroll
      for (int kt = 0; kt < kChunkWarps; ++kt)
        if (kt <= warp) frag_b_kn(v_s, LV, 16 * kt, n0, bf), mma<T>(c, ua[kt], bf);
      *reinterpret_cast<float2*>(U + (i0 + g) * dv + n0 + 2 * t) = make_float2(c[0], c[1]);
      *reinterpret_cast<float2*>(U + (i0 + g + 8) * dv + n0 + 2 * t) = make_float2(c[2], c[3]);
    }
  }
  // 7. e^G Q, (e^(G_last - G) K)^T and e^G_last.
  T* QG = reinterpret_cast<T*>(rec + R.qg);
  T* KD = reinterpret_cast<T*>(rec + R.kd);
  const float g_last = g_s[kChunk - 1];
  for (int e = threadIdx.x; e < kChunk * DK; e += blockDim.x) {
    const int i = e / DK, d = e % DK;
    QG[e] = from_f<T>(to_f(q_s[i * LK + d]) * eg_s[i]);
  }
  {  // a thread keeps one token j (the block's threads are a multiple of kChunk): its decay to the chunk's end once
    static_assert(kChunkWarps * 32 % kChunk == 0, "a thread's tokens j of (e^(G_last - G) K)^T are one");
    const int j = threadIdx.x % kChunk;
    const float decay = expf(g_last - g_s[j]);
    for (int d = threadIdx.x / kChunk; d < DK; d += kChunkWarps * 32 / kChunk)
      KD[d * kChunk + j] = from_f<T>(to_f(k_s[j * LK + d]) * decay);
  }
  if (threadIdx.x == 0) *reinterpret_cast<float*>(rec + R.gl) = eg_s[kChunk - 1];
}

// Block (32-column tile, value head, sequence), kChunkWarps warps: the sequence's chunks in the window [slot0,
// slot0 + window) in order. Warp w holds state rows [16 MT w, 16 MT (w + 1)) of the tile's columns (fp32, mma
// accumulator layout) and takes the chunk's rows [16 w, 16 w + 16) of u and o.
template <typename T, int DK>
__global__ void __launch_bounds__(kChunkWarps * 32) gdn_chunk_state_kernel(
    const int32_t* q_start, const int32_t* ctx_len, const int32_t* slots, int num_seqs, int chunk_min, int64_t slot0,
    int64_t window, const unsigned char* scratch, float* state, T* out, int64_t os, int v_heads, int dv) {
  constexpr int MT = DK / (16 * kChunkWarps);
  constexpr int LK = DK + kChunkPad, LT = kChunk + kChunkPad;
  static_assert(MT >= 1, "a warp holds 16 state rows or more");
  __shared__ __align__(16) T s_s[32 * LK];  // S0^T of the tile, rounded to T
  __shared__ __align__(16) T u_s[32 * LT];  // u^T
  grid_release();
  grid_wait();
  const int y0 = 32 * blockIdx.x, h = blockIdx.y, seq = blockIdx.z;
  const int n = q_start[seq + 1] - q_start[seq], slot = slots[seq];
  if (!chunked(n, slot, chunk_min)) return;
  int64_t first = 0;  // the sequence's first chunk slot
  for (int s = 0; s < seq; ++s) {
    const int ns = q_start[s + 1] - q_start[s];
    if (chunked(ns, slots[s], chunk_min)) first += (ns + kChunk - 1) / kChunk;
  }
  const int64_t c0 = max(first, slot0), c1 = min(first + (n + kChunk - 1) / kChunk, slot0 + window);
  if (c0 >= c1) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int i0 = 16 * warp;
  float* S = state + (int64_t(slot) * v_heads + h) * int64_t(DK) * dv + y0;  // S[x][y0 + y] at x * dv + y
  const bool fresh = c0 == first && ctx_len[seq] - n == 0;
  // The state: [row tile][column tile][element], row 16 (MT warp + mt) + g + 8 (e / 2), column 8 nt + 2 t + e % 2.
  float st[MT][4][4];
  auto each_state = [&](auto f) {  // f(row, column of the tile, its element)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          f(16 * (MT * warp + mt) + g + 8 * (e >> 1), 8 * nt + 2 * t + (e & 1), st[mt][nt][e]);
  };
  uint32_t af[4], bf[2];
  // acc += A B over k-tiles [0, k_end) for the warp's 16 rows from m0 of A (row-major T, leading dimension lda) and
  // the tile's 32 columns of B (staged as B^T [32][ldb]).
  auto product = [&](float(&acc)[4][4], const T* A, int lda, int m0, int k_end, const T* Bt, int ldb) {
#pragma unroll
    for (int k0 = 0; k0 < k_end; k0 += 16) {
      frag_a(A, lda, m0, k0, af);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) frag_b(Bt, ldb, k0, 8 * nt, bf), mma<T>(acc[nt], af, bf);
    }
  };
  each_state([&](int x, int y, float& v) { v = fresh ? 0.f : S[int64_t(x) * dv + y]; });
  const ChunkRecord R = chunk_record(DK, dv);
  for (int64_t c = c0; c < c1; ++c) {
    const unsigned char* rec = scratch + (size_t(c - slot0) * v_heads + h) * R.bytes;
    const int row0 = q_start[seq] + int(c - first) * kChunk, m = min(kChunk, n - int(c - first) * kChunk);
    // a. S0^T, rounded to T.
    each_state([&](int x, int y, float& v) { s_s[y * LK + x] = from_f<T>(v); });
    __syncthreads();
    // b. u = U - W S0 (the warp's rows), to shared memory as u^T.
    {
      const T* W = reinterpret_cast<const T*>(rec + R.w);
      const float* U = reinterpret_cast<const float*>(rec + R.u);
      float acc[4][4] = {};
      product(acc, W, DK, i0, DK, s_s, LK);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = i0 + g + 8 * (e >> 1), y = 8 * nt + 2 * t + (e & 1);
          u_s[y * LT + i] = from_f<T>(U[i * dv + y0 + y] - acc[nt][e]);
        }
    }
    __syncthreads();
    // c. o = e^G Q S0 + P u (P is lower triangular: k-tiles <= warp), the chunk's rows only.
    {
      const T* QG = reinterpret_cast<const T*>(rec + R.qg);
      const T* P = reinterpret_cast<const T*>(rec + R.p);
      float acc[4][4] = {};
      product(acc, QG, DK, i0, DK, s_s, LK);
      product(acc, P, kChunk, i0, i0 + 16, u_s, LT);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int i = i0 + g + 8 * hh;
          if (i < m)
            *reinterpret_cast<uint32_t*>(out + (row0 + i) * os + int64_t(h) * dv + y0 + 8 * nt + 2 * t) =
                pack2<T>(acc[nt][2 * hh], acc[nt][2 * hh + 1]);
        }
    }
    // d. S = e^G_last S0 + (e^(G_last - G) K)^T u.
    {
      const float gl = *reinterpret_cast<const float*>(rec + R.gl);
      const T* KD = reinterpret_cast<const T*>(rec + R.kd);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) st[mt][nt][e] *= gl;
        product(st[mt], KD, kChunk, 16 * (MT * warp + mt), kChunk, u_s, LT);
      }
    }
    __syncthreads();  // s_s and u_s are free for the next chunk
  }
  each_state([&](int x, int y, float& v) { S[int64_t(x) * dv + y] = v; });
}

}  // namespace

void launch_sigmoid_mul(Tensor& x, const Tensor& gate, cudaStream_t s) {
  check_act(x, "sigmoid_mul");
  QRT_CHECK(gate.dtype == x.dtype && gate.rows == x.rows && gate.cols == x.cols, "cuda sigmoid_mul: gate [",
            gate.rows, ",", gate.cols, "] ", dtype_name(gate.dtype), " for x [", x.rows, ",", x.cols, "] ",
            dtype_name(x.dtype));
  if (x.rows == 0 || x.cols == 0) return;
  const unsigned threads = x.cols >= 1024 ? 256 : x.cols >= 256 ? 128 : 64;
  dispatch_act(x.dtype, "sigmoid_mul", [&](auto tag) {
    using T = decltype(tag);
    launch_chained(sigmoid_mul_kernel<T>, unsigned(x.rows), threads, 0, s, x.ptr<T>(), x.stride, gate.ptr<T>(),
                   gate.stride, x.cols);
  });
  check_launch("sigmoid_mul");
}

void launch_gated_rms_norm(Tensor& x, const Tensor& z, const Tensor& w, float eps, int hd, cudaStream_t s) {
  check_act(x, "gated_rms_norm");
  QRT_CHECK(hd > 0 && x.cols % hd == 0, "cuda gated_rms_norm: ", x.cols, " columns are not heads of ", hd);
  QRT_CHECK(z.dtype == x.dtype && z.rows == x.rows && z.cols == x.cols, "cuda gated_rms_norm: z [", z.rows, ",",
            z.cols, "] ", dtype_name(z.dtype), " for x [", x.rows, ",", x.cols, "] ", dtype_name(x.dtype));
  QRT_CHECK(is_float_dtype(w.dtype) && w.cols >= hd, "cuda gated_rms_norm: weight of ", w.cols,
            " columns for heads of ", hd);
  const int heads = int(x.cols / hd);
  const int64_t tasks = x.rows * heads;
  if (tasks == 0) return;
  dispatch_act(x.dtype, "gated_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    launch_chained(gated_rms_norm_kernel<T>, ceil_div(tasks, 8), 256, 0, s, x.ptr<T>(), x.stride, z.ptr<T>(),
                   z.stride, x.rows, heads, hd, w.data, w.dtype, eps);
  });
  check_launch("gated_rms_norm");
}

void launch_causal_conv1d(const Tensor& x, const Tensor& w, const AttnBatch& b, const DeltaNetShape& sh,
                          StateLayer& st, Tensor& out, cudaStream_t s) {
  check_act(x, "causal_conv1d");
  const int K = sh.conv_kernel;
  const int64_t C = sh.conv_cols();
  QRT_CHECK(x.cols == C && out.cols == C && out.rows == x.rows && out.dtype == x.dtype,
            "cuda causal_conv1d: x [", x.rows, ",", x.cols, "] and out [", out.rows, ",", out.cols, "] for ", C,
            " conv channels");
  QRT_CHECK(w.rows == C && w.cols == K && is_float_dtype(w.dtype), "cuda causal_conv1d: weight [", w.rows, ",",
            w.cols, "] for ", C, " channels of kernel ", K);
  QRT_CHECK(K >= 2 && K <= 4, "cuda causal_conv1d: conv kernel ", K, " (2 to 4 are built)");
  QRT_CHECK(st.conv && is_float_dtype(st.conv_dtype), "cuda causal_conv1d: no conv state");
  QRT_CHECK(b.slots && b.q_start && b.ctx_len, "cuda causal_conv1d: the batch has no state slots");
  QRT_CHECK(b.num_seqs <= 65535, "cuda causal_conv1d: ", b.num_seqs, " sequences (at most 65535)");
  if (b.num_seqs == 0 || C == 0) return;
  // Token groups per block: 8 for prefill (a channel's tokens split 8 ways), 1 for decode and in place. The
  // arithmetic of a token does not depend on the grouping.
  const int groups = b.max_q_len >= 32 && !overlaps(x, out) ? 8 : 1;
  const dim3 block(kConvThreads / groups, groups);
  const dim3 grid(ceil_div(C, block.x), unsigned(b.num_seqs));
  dispatch_act(x.dtype, "causal_conv1d", [&](auto tag) {
    using T = decltype(tag);
    auto go = [&](auto kernel) {
      launch_chained(kernel, grid, block, 0, s, x.ptr<T>(), x.stride, w.data, w.dtype, w.stride, st.conv,
                     st.conv_dtype, b.q_start, b.ctx_len, b.slots, b.keep, out.ptr<T>(), out.stride, C);
    };
    if (K == 2) go(causal_conv1d_kernel<T, 2>);
    else if (K == 3) go(causal_conv1d_kernel<T, 3>);
    else go(causal_conv1d_kernel<T, 4>);
  });
  check_launch("causal_conv1d");
}

DeltaRulePlan plan_delta_rule(const Tensor& qkv, const AttnBatch& b, const DeltaNetShape& sh, const Tensor& out) {
  DeltaRulePlan p;
  const char* form = std::getenv("QWEN_RT_DELTA_RULE");
  if (form && std::strcmp(form, "loop") == 0) return p;
  const int dk = sh.k_dim, dv = sh.v_dim;
  const bool half = qkv.dtype == DType::BF16 || qkv.dtype == DType::F16;
  if (!half || b.keep || b.max_q_len < kChunk || !(dk == 64 || dk == 128) || dv % 32 != 0 || dv > 128 ||
      out.stride % 2 != 0 || reinterpret_cast<uintptr_t>(out.data) % 4 != 0)
    return p;
  int dev = 0, optin = 0;
  check(cudaGetDevice(&dev), "gated_delta_rule");
  check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev), "gated_delta_rule");
  if (size_t(optin) < prep_smem(dk, dv).bytes) return p;
  p.chunk_min = kChunk;
  p.slots = qkv.rows / kChunk + b.num_seqs;  // at least the chunks: n rows make at most n / kChunk + 1
  const int64_t per_slot = int64_t(chunk_record(dk, dv).bytes) * sh.v_heads;
  int64_t window = std::max<int64_t>(1, (int64_t(256) << 20) / per_slot);
  if (const char* w = std::getenv("QWEN_RT_DELTA_RULE_WINDOW")) window = std::max(1, std::atoi(w));
  p.window = std::min(window, p.slots);
  p.scratch_bytes = size_t(p.window * per_slot);
  return p;
}

void launch_gated_delta_rule(const Tensor& qkv, const Tensor& a, const Tensor& bt, const Tensor& a_log,
                             const Tensor& dt_bias, const AttnBatch& b, const DeltaNetShape& sh, StateLayer& st,
                             Tensor& out, const DeltaRulePlan& plan, void* scratch, cudaStream_t s) {
  check_act(qkv, "gated_delta_rule");
  const int dk = sh.k_dim, dv = sh.v_dim, hk = sh.k_heads, hv = sh.v_heads;
  QRT_CHECK(hk > 0 && hv > 0 && hv % hk == 0 && dv > 0, "cuda gated_delta_rule: ", hv, " value heads over ", hk,
            " key heads of ", dk, " x ", dv);
  QRT_CHECK(dk == 16 || dk == 32 || dk == 64 || dk == 128 || dk == 256, "cuda gated_delta_rule: key head dim ", dk,
            " (16, 32, 64, 128 or 256 are built)");
  QRT_CHECK(qkv.cols == sh.conv_cols() && out.cols == sh.v_cols() && out.rows == qkv.rows && out.dtype == qkv.dtype,
            "cuda gated_delta_rule: qkv [", qkv.rows, ",", qkv.cols, "] and out [", out.rows, ",", out.cols,
            "] for ", hk, " key heads of ", dk, " and ", hv, " value heads of ", dv);
  QRT_CHECK(a.rows == qkv.rows && bt.rows == qkv.rows && a.cols == hv && bt.cols == hv && is_float_dtype(a.dtype) &&
                is_float_dtype(bt.dtype),
            "cuda gated_delta_rule: a [", a.rows, ",", a.cols, "] and b [", bt.rows, ",", bt.cols, "] for ",
            qkv.rows, " rows of ", hv, " value heads");
  QRT_CHECK(is_float_dtype(a_log.dtype) && a_log.dtype == dt_bias.dtype && a_log.cols >= hv && dt_bias.cols >= hv,
            "cuda gated_delta_rule: a_log and dt_bias must be [1, ", hv, "] of one float dtype");
  QRT_CHECK(st.recurrent, "cuda gated_delta_rule: no recurrent state");
  QRT_CHECK(b.slots && b.q_start && b.ctx_len, "cuda gated_delta_rule: the batch has no state slots");
  QRT_CHECK(b.num_seqs <= 65535 && hv <= 65535, "cuda gated_delta_rule: ", b.num_seqs, " sequences of ", hv,
            " value heads (at most 65535 each)");
  if (b.num_seqs == 0) return;
  const dim3 grid(ceil_div(dv, kDeltaCols), unsigned(hv), unsigned(b.num_seqs));
  dispatch_act(qkv.dtype, "gated_delta_rule", [&](auto tag) {
    using T = decltype(tag);
    auto go = [&](auto kernel) {
      launch_chained(kernel, grid, kDeltaWarps * 32, 0, s, qkv.ptr<T>(), qkv.stride, a.data, a.dtype, a.stride,
                     bt.data, bt.dtype, bt.stride, a_log.data, dt_bias.data, a_log.dtype, b.q_start, b.ctx_len,
                     b.slots, b.keep, st.recurrent, out.ptr<T>(), out.stride, hk, hv, dv, plan.chunk_min);
    };
    if (dk == 16) go(gated_delta_rule_kernel<T, 16>);
    else if (dk == 32) go(gated_delta_rule_kernel<T, 32>);
    else if (dk == 64) go(gated_delta_rule_kernel<T, 64>);
    else if (dk == 128) go(gated_delta_rule_kernel<T, 128>);
    else go(gated_delta_rule_kernel<T, 256>);
  });
  check_launch("gated_delta_rule");
  if (plan.chunk_min == DeltaRulePlan::kNone) return;
  QRT_CHECK(scratch && plan.window > 0, "cuda gated_delta_rule: no scratch for the chunked form");
  auto chunks = [&](auto tag, auto dk_tag) {
    using T = decltype(tag);
    constexpr int DK = decltype(dk_tag)::value;
    if constexpr (std::is_same_v<T, float>) {
      return;  // plan_delta_rule chunks 16-bit activations only
    } else {
      const size_t smem = prep_smem(DK, dv).bytes;
      check(cudaFuncSetAttribute(gdn_chunk_prep_kernel<T, DK>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 int(smem)), "gated_delta_rule");
      auto* scr = static_cast<unsigned char*>(scratch);
      for (int64_t slot0 = 0; slot0 < plan.slots; slot0 += plan.window) {
        launch_chained(gdn_chunk_prep_kernel<T, DK>, dim3(unsigned(plan.window), unsigned(hv)), kChunkWarps * 32,
                       smem, s, qkv.ptr<T>(), qkv.stride, a.data, a.dtype, a.stride, bt.data, bt.dtype, bt.stride,
                       a_log.data, dt_bias.data, a_log.dtype, b.q_start, b.slots, b.num_seqs, plan.chunk_min, slot0,
                       scr, hk, hv, dv);
        launch_chained(gdn_chunk_state_kernel<T, DK>, dim3(unsigned(dv / 32), unsigned(hv), unsigned(b.num_seqs)),
                       kChunkWarps * 32, 0, s, b.q_start, b.ctx_len, b.slots, b.num_seqs, plan.chunk_min, slot0,
                       plan.window, static_cast<const unsigned char*>(scr), st.recurrent, out.ptr<T>(), out.stride,
                       hv, dv);
      }
    }
  };
  dispatch_act(qkv.dtype, "gated_delta_rule", [&](auto tag) {
    if (dk == 64) chunks(tag, std::integral_constant<int, 64>());
    else chunks(tag, std::integral_constant<int, 128>());
  });
  check_launch("gated_delta_rule chunks");
}

}  // namespace qrt::cuda
