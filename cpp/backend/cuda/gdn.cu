// Gated DeltaNet and gated attention on CUDA: sigmoid_mul, gated_rms_norm, causal_conv1d (per-slot conv state)
// and the gated delta rule (per-slot fp32 recurrent state). Contracts: ops.h. All math in fp32; every value a
// sequence gets is computed by the same operations in the same order whatever its batch mates (batch invariance).
#include <algorithm>

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

template <typename T, int DK>
__global__ void __launch_bounds__(kDeltaWarps * 32) gated_delta_rule_kernel(
    const T* qkv, int64_t qkv_stride, const void* a, DType at, int64_t as, const void* b, DType bt, int64_t bs,
    const void* a_log, const void* dt_bias, DType wt, const int32_t* q_start, const int32_t* ctx_len,
    const int32_t* slots, const int32_t* keep, float* state, T* out, int64_t os, int k_heads, int v_heads, int dv) {
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
  const float scale = 1.0f / sqrtf(float(DK));
  grid_wait();
  const int r0 = q_start[seq], n = q_start[seq + 1] - r0;
  const int slot = slots[seq];
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
      float q_in[QK], k_in[QK], ssq = 0.f, ssk = 0.f;
#pragma unroll
      for (int j = 0; j < QK; ++j) {
        const int e = lane + 32 * j;
        q_in[j] = e < DK ? to_f(row[q_col + e]) : 0.f;
        k_in[j] = e < DK ? to_f(row[k_col + e]) : 0.f;
        ssq += q_in[j] * q_in[j];
        ssk += k_in[j] * k_in[j];
      }
      ssq = warp_sum(ssq);
      ssk = warp_sum(ssk);
      const float iq = 1.0f / sqrtf(ssq + 1e-6f) * scale, ik = 1.0f / sqrtf(ssk + 1e-6f);
#pragma unroll
      for (int j = 0; j < QK; ++j) {
        const int e = lane + 32 * j;
        if (e < DK) {
          q_s[t][e / R][e % R] = q_in[j] * iq;
          k_s[t][e / R][e % R] = k_in[j] * ik;
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

void launch_gated_delta_rule(const Tensor& qkv, const Tensor& a, const Tensor& bt, const Tensor& a_log,
                             const Tensor& dt_bias, const AttnBatch& b, const DeltaNetShape& sh, StateLayer& st,
                             Tensor& out, cudaStream_t s) {
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
                     b.slots, b.keep, st.recurrent, out.ptr<T>(), out.stride, hk, hv, dv);
    };
    if (dk == 16) go(gated_delta_rule_kernel<T, 16>);
    else if (dk == 32) go(gated_delta_rule_kernel<T, 32>);
    else if (dk == 64) go(gated_delta_rule_kernel<T, 64>);
    else if (dk == 128) go(gated_delta_rule_kernel<T, 128>);
    else go(gated_delta_rule_kernel<T, 256>);
  });
  check_launch("gated_delta_rule");
}

}  // namespace qrt::cuda
