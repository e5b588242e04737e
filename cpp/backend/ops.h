// Backend: every op of the forward pass and of sampling, one declaration each.
// Implementations: cpu/ (the reference, fp32 compute) and cuda/ (bf16/fp16/fp32, stream-ordered).
//
// Contracts shared by all ops:
// - Pointers and Tensor views refer to the backend's own memory (host for CPU, device for CUDA),
//   except where a parameter says "host".
// - Ops are ordered on the backend's compute stream; nothing waits unless the op says so.
// - Activations have the backend's activation dtype (CPU: F32); weights may be F32, F16 or BF16
//   (F8E4M3 with block scales where Linear::scale is set) and are converted inside the op. FP8 weights multiply
//   as their dequantized values w * scale (an fp32 product), exactly so with F32 activations; with 16-bit
//   activations a backend may round them to the activations' dtype first.
#pragma once
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/tensor.h"

// For the few rules the CUDA kernels apply as the host does (one definition for both).
#if defined(__CUDACC__)
#define QRT_HOST_DEVICE __host__ __device__
#else
#define QRT_HOST_DEVICE
#endif

namespace qrt {

// FP8 weights are quantized in blocks of kFp8Block columns (and, in checkpoints, rows).
constexpr int kFp8Block = 128;

// A weight matrix [out, in] (row-major, as stored by transformers) for y = x @ w^T.
// FP8 (w F8E4M3, scale set): element (r, c) is the fp32 product w[r, c] * scale[r >> scale_row_shift, c / 128];
// scale is fp32 [ceil(out / 2^scale_row_shift), ceil(in / 128)]. A shift below 7 lets the parts of a fused matrix
// (or a rank's rows) that do not start at multiples of 128 keep their checkpoint blocks' scales (model/weights.h).
struct Linear {
  Tensor w;
  Tensor scale;  // empty unless FP8
  int scale_row_shift = 7;
  bool fp8() const { return !scale.empty(); }
};

// An RMSNorm applied to a linear's input rows: rmsnorm(x) * (zero_centred ? 1 + w : w), as rms_norm.
// unit_gain: w is all ones because the model folded the gain into the weights the norm feeds
// (Backend::scale_columns); a backend may then skip the multiply.
struct RmsNorm {
  Tensor w;  // [1, cols]
  float eps = 1e-6f;
  bool zero_centred = false;
  bool unit_gain = false;
};

// RoPE: the table holds, for each position p, rot_dim/2 cosines then rot_dim/2 sines (fp32),
// already multiplied by the attention factor of yarn. Rotation is rotate-half (non-interleaved)
// over the first rot_dim elements of each head; the rest pass through (partial rotary).
struct RopeTable {
  const float* cos_sin = nullptr;  // [max_positions, rot_dim]
  int rot_dim = 0;
  int max_positions = 0;
};

// Sparse decode's staging area (with a host tier; kv/kv_cache.h sizes it): device frames [first, first + slots)
// hold, per kv head, that head's K and V rows (and fp8 scales) of host pages select_pages chose, so that a page
// chosen again is read from device memory. Of each frame, head h's columns belong to head h's slot of that number:
// heads stage independently. After select_pages writes a selecting list, each of its entries in the host tier is
// served from the slot holding that page for its (layer, head); a page no slot holds takes the slot the clock hand
// reaches first among those no list read this call (it is copied there), or, none left, is read in place. Every
// backend makes the same choices in the same order (lists in sequence order, entries in list order). The frames'
// contents never change while staged: a page's move into a host frame clears that frame's map entries (KvCache::move).
struct KvStaging {
  int first = 0, slots = 0;   // 0 slots: off
  int32_t* map = nullptr;     // [host frames][map_stride], column map_col + h: slot + 1 of (frame, this layer, h), or 0
  int map_stride = 0, map_col = 0;
  int32_t* slot_page = nullptr;  // [kv_heads][slots]: host frame (tier index) + 1 a slot holds, or 0
  uint32_t* used = nullptr;      // [kv_heads][slots]: the call that last read the slot
  uint32_t* clock = nullptr;     // [kv_heads][2]: the hand (next slot to look at), the calls so far
  // [kv_heads][3] running counts: list entries read from a slot, pages copied into slots, entries read in place.
  // Kept in device memory (counts) and written through to host memory (counts_host, Backend::alloc_host_tier).
  int64_t* counts = nullptr;
  int64_t* counts_host = nullptr;
};

// K/V storage of one attention layer: rows are cache slots (page * page_size + offset),
// columns kv_heads * head_dim, both K and V in the KV dtype.
// FP8 (dtype F8E4M3): each row's head_dim values x of one kv head are stored as e4m3(x / s), rounded to nearest
// even, with their own scale s = amax|x| / 448 in fp32 (1 where all are zero) at k_scale[row * kv_heads + head]
// (V: v_scale); attention reads the fp32 product q8 * s. A scale per (row, head), not per head of the layer: a
// request's K/V, and so its output, do not depend on what other requests wrote before it.
struct KvLayer {
  void* k = nullptr;
  void* v = nullptr;
  DType dtype = DType::F32;
  // Sparse decode's page summaries (null when off): rows 2 p and 2 p + 1 hold, per column, the min and the max of
  // the keys page p holds so far ([2 * (pages + 1), kv_cols] in summary_dtype; summarize_pages keeps them).
  void* summary = nullptr;
  DType summary_dtype = DType::F32;  // the KV dtype, or (FP8) the activations' dtype, rounded outward
  // Host tier (Generator(kv_offload_memory)): pages from host_page0 on are rows (page - host_page0) * page_size of
  // host_k and host_v, host memory the kernels read directly (Backend::alloc_host_tier). New K/V go to the device
  // tier only: a step writes no host page. Summaries cover the pages of both tiers.
  void* host_k = nullptr;
  void* host_v = nullptr;
  int host_page0 = 0x7fffffff;
  // FP8 only: the scales of each tier, [rows, kv_heads] fp32, rows as k and v (host_*: as host_k and host_v).
  int kv_heads = 0;
  float* k_scale = nullptr;
  float* v_scale = nullptr;
  float* host_k_scale = nullptr;
  float* host_v_scale = nullptr;
  KvStaging staging;
  bool fp8() const { return dtype == DType::F8E4M3; }
};

// One copy of copy_segments.
struct CopySegment {
  void* dst;
  const void* src;
  size_t bytes;
};

// A ragged batch as attention sees it. Sequence s owns query rows [q_start[s], q_start[s+1]);
// after this step its cache holds ctx_len[s] tokens, the last q_len of which are this step's.
// Query row i of s sits at position ctx_len[s] - q_len + i and attends to cache positions [0, that].
struct AttnBatch {
  int num_seqs = 0;
  int num_tokens = 0;
  const int32_t* q_start = nullptr;     // [num_seqs + 1]
  const int32_t* ctx_len = nullptr;     // [num_seqs]
  const int32_t* page_table = nullptr;  // [num_seqs, max_pages] page ids
  const int32_t* kv_rows = nullptr;     // [num_tokens] cache row where each new token's K/V goes
  int max_pages = 0;
  int page_size = 0;
  int max_q_len = 0;    // host-side maxima, for launch shapes
  int max_ctx_len = 0;
  const int32_t* slots = nullptr;       // [num_seqs] state slot of each sequence (models with DeltaNet layers)
  // DeltaNet ops, speculative verification: where non-null and keep[s] >= 0, the state after each row r of sequence
  // s but its last also goes to slot keep[s] + r (the state to roll back to when the tokens after r are rejected).
  const int32_t* keep = nullptr;        // [num_seqs]
  // Attention only: each (sequence, kv head) has a page list of its own (select_pages' output): page_table is
  // [num_seqs, kv_heads, max_pages] and ctx_len [num_seqs, kv_heads], the keys of that list; a query row's causal
  // mask counts within it. (The rows' positions are unchanged: RoPE is in the cached keys.)
  bool head_tables = false;
};

// Sparse decode (Quest-style page selection): a sequence that decodes one token with more than budget_pages
// pages attends, per kv head, to its first sink_pages, its last window_pages (the current page among them) and
// the budget_pages - sink_pages - window_pages others that score highest, where a page's score for kv head h is
// the largest over h's query heads of sum_c max(q_c min_c, q_c max_c) (an upper bound of q . k over its keys;
// ties: the earlier page). Other sequences, and one of at most budget_pages pages, attend to every page.
struct SparseAttention {
  int budget_pages = 0;  // 0: off
  int sink_pages = 0;
  int window_pages = 1;  // >= 1, and sink_pages + window_pages < budget_pages
  QRT_HOST_DEVICE bool selects(int ctx_len, int q_len, int page_size) const {
    return budget_pages > 0 && q_len == 1 && (ctx_len + page_size - 1) / page_size > budget_pages;
  }
};

// Gated DeltaNet sizes on one rank: key heads, value heads (a multiple of the key heads: value head j reads key
// head j / (v_heads / k_heads)), their dims, and the width of the causal conv.
struct DeltaNetShape {
  int k_heads = 0;
  int v_heads = 0;
  int k_dim = 0;
  int v_dim = 0;
  int conv_kernel = 0;
  int64_t qk_cols() const { return int64_t(k_heads) * k_dim; }   // q (and k) columns
  int64_t v_cols() const { return int64_t(v_heads) * v_dim; }
  int64_t conv_cols() const { return 2 * qk_cols() + v_cols(); }  // conv channels: q | k | v
};

// The state of one DeltaNet layer for every slot (kv/state_cache.h sizes it). A slot's state is that after the
// tokens of its sequence so far. conv: [slots, conv_kernel - 1, conv_cols] in conv_dtype, the conv inputs of the
// last conv_kernel - 1 positions, oldest first; recurrent: S [slots, v_heads, k_dim, v_dim], fp32.
struct StateLayer {
  void* conv = nullptr;
  float* recurrent = nullptr;
  DType conv_dtype = DType::F32;
};

struct AttnShape {
  int q_heads = 0;
  int kv_heads = 0;
  int head_dim = 0;
  float scale = 1.0f;  // softmax scale, usually 1/sqrt(head_dim)
};

// Sampling parameters of one row (one sequence) of a logits matrix. Host memory.
struct SampleRow {
  float temperature = 1.0f;  // 0: greedy (argmax)
  int top_k = 0;             // 0: off
  float top_p = 1.0f;        // 1: off
  float min_p = 0.0f;        // 0: off
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  uint64_t seed = 0;
  int64_t draw = 0;          // index of this token among the request's generated tokens
  int num_logprobs = 0;      // top-N logprobs to return (0: none)
  // Token history for penalties: repetition uses prompt + output, presence/frequency output only.
  std::vector<int32_t> seen_tokens;     // distinct tokens of prompt + output
  std::vector<int32_t> output_tokens;   // distinct tokens of output
  std::vector<int32_t> output_counts;   // occurrences of each output_tokens entry
  std::vector<int32_t> banned_tokens;   // logits forced to -inf (e.g. eos before min_tokens)
};

struct SampleResult {
  std::vector<int32_t> tokens;          // [rows]
  std::vector<float> logprobs;          // [rows] logprob of the chosen token (raw logits); NaN: non-finite row
  std::vector<int32_t> top_ids;         // [rows * max_n] top-N by raw logprob, best first
  std::vector<float> top_logprobs;      // [rows * max_n]
  int max_n = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;   // "cpu" or "cuda:N"
  virtual DType act_dtype() const = 0;    // dtype of activations
  virtual DType kv_dtype() const { return act_dtype(); }  // dtype of the KV cache
  // Attention head sizes the backend's kernels take.
  virtual bool supports_head_dim(int head_dim) const { return head_dim > 0; }
  // Gated DeltaNet sizes its kernels take.
  virtual bool supports_delta_net(const DeltaNetShape& s) const { return s.k_dim > 0 && s.conv_kernel >= 2; }

  // Memory. alloc throws std::runtime_error naming the size when memory runs out.
  virtual void* alloc(size_t bytes) = 0;
  // alloc, zero-filled (in stream order).
  virtual void* alloc_zeroed(size_t bytes) {
    void* p = alloc(bytes);
    try {
      fill_zero(p, bytes);
    } catch (...) {
      release(p);
      throw;
    }
    return p;
  }
  // Never throws: called from destructors, also after a device fault (what cannot be freed then is left).
  virtual void release(void* p) noexcept = 0;
  // Host memory the backend's kernels read and write directly (the KV cache's host tier; CUDA: pinned and mapped),
  // zero-filled; copy() takes it as either end. Throws std::invalid_argument when the system will not give (pin) it.
  virtual void* alloc_host_tier(size_t bytes) { return alloc_zeroed(bytes); }
  virtual void release_host_tier(void* p) noexcept { release(p); }
  // Stream-ordered copy from host memory; host_src may be reused once upload returns.
  virtual void upload(void* dst, const void* host_src, size_t bytes) = 0;
  // Whether backend memory is host memory the host may write directly (upload is a memcpy).
  virtual bool host_memory() const { return false; }
  virtual void download(void* host_dst, const void* src, size_t bytes) = 0;  // waits for prior ops
  virtual void fill_zero(void* p, size_t bytes) = 0;
  // Stream-ordered copy within the backend's memory (and the host tier).
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  // Stream-ordered copies (host-side list) that may run at once: no segment overlaps another's destination.
  virtual void copy_segments(const std::vector<CopySegment>& segs) {
    for (const CopySegment& s : segs) copy(s.dst, s.src, s.bytes);
  }
  // A step's KV page moves (kv/tiers.h PageMoves), called before every step of a model with a host tier (also with
  // none: the call marks where the step's work begins): copy_segments(out), then copy_segments(in). beside: they
  // may run beside the work enqueued since the previous call (on a stream of their own) instead of after it; the
  // work enqueued after them still waits for them.
  virtual void move_pages(const std::vector<CopySegment>& out, const std::vector<CopySegment>& in, bool beside) {
    (void)beside;
    if (!out.empty()) copy_segments(out);
    if (!in.empty()) copy_segments(in);
  }
  virtual void synchronize() = 0;
  // Free and total memory of the device, for sizing the KV pool.
  virtual void memory_info(size_t* free_bytes, size_t* total_bytes) = 0;

  // Fills t with deterministic pseudo-random values: element (r, c) of t is
  // fma(scale, fma(2, uniform01(seed, row0 + r, col0 + c), -1), offset), so a shard of a matrix gets
  // exactly the values of the whole matrix at its place.
  virtual void fill_random(Tensor& t, uint64_t seed, float scale, float offset, int64_t row0, int64_t col0) = 0;
  // Converts src into dst (same shape, any float dtypes).
  virtual void convert(const Tensor& src, Tensor& dst) = 0;
  // FP8 block quantization (Linear's format, one scale per 128 x 128 block): for each block of src (any float
  // dtype) s = amax / 448 in fp32 (1 where the block is all zeros), q = e4m3(src / s) rounded to nearest even
  // (saturating at +-448). q F8E4M3 like src; scale fp32 [ceil(rows / 128), ceil(cols / 128)].
  virtual void quantize_fp8(const Tensor& src, Tensor& q, Tensor& scale) {
    (void)src, (void)q, (void)scale, unsupported("quantize_fp8");
  }
  // Whether a model should fold RMSNorm gains into the 16-bit weights that follow them (scale_columns,
  // then RmsNorm::unit_gain): true where the fused norm_linear is faster without a gain.
  virtual bool folds_norm_gains() const { return false; }
  // In place: w[r, c] *= (zero_centred ? 1 + gain[c] : gain[c]), rounded to w's dtype; gain [1, w.cols] fp32.
  virtual void scale_columns(Tensor& w, const Tensor& gain, bool zero_centred) {
    (void)w, (void)gain, (void)zero_centred;
    throw std::runtime_error(name() + " backend: scale_columns is not supported");
  }

  // out[i] = table[ids[i]] converted to out's dtype; ids outside [0, table.rows) give zero rows
  // (a vocab-parallel shard looks up shifted ids and the ranks' rows are summed).
  virtual void embedding(const int32_t* ids, const Tensor& table, Tensor& out) = 0;
  // out = rmsnorm(x) * (zero_centred ? 1 + w : w).
  virtual void rms_norm(const Tensor& x, const Tensor& w, float eps, bool zero_centred, Tensor& out) = 0;
  // residual += x; out = rmsnorm(residual) * w. (Fused residual add.)
  virtual void add_rms_norm(Tensor& residual, const Tensor& x, const Tensor& w, float eps,
                            bool zero_centred, Tensor& out) = 0;
  // In place: each head_dim group of every row of x is RMS-normalized with w [1, head_dim].
  virtual void head_rms_norm(Tensor& x, int head_dim, const Tensor& w, float eps, bool zero_centred) = 0;
  // In place rotary embedding of every head of x (cols = heads * head_dim) at positions[row].
  virtual void rope(Tensor& x, int head_dim, const int32_t* positions, const RopeTable& table) = 0;
  // out = x @ w^T (+ bias [1, out]); out has x's dtype or F32 (logits) and may be a strided view.
  // With BF16 weights the products are of bf16 values (x rounded to bf16), accumulated in fp32, on every
  // backend; F32 and F16 weights with F32 activations are exact fp32.
  virtual void linear(const Tensor& x, const Linear& w, const Tensor* bias, Tensor& out) = 0;
  // out += x @ w^T: a residual connection (out has x's dtype). The sum is that of linear into a tensor of
  // out's dtype followed by add (a fused backend may skip that rounding of the product).
  virtual void linear_add(const Tensor& x, const Linear& w, Tensor& out) = 0;
  // out = rms_norm(x) @ w^T (+ bias): the norm that feeds a linear. h [rows, in] (x's dtype) is scratch for
  // the default composition (rms_norm into h, then linear); a fused backend normalizes inside the product
  // (the values may differ by the rounding of h) and leaves h untouched.
  virtual void norm_linear(const Tensor& x, const RmsNorm& norm, const Linear& w, const Tensor* bias, Tensor& h,
                           Tensor& out) {
    rms_norm(x, norm.w, norm.eps, norm.zero_centred, h);
    linear(h, w, bias, out);
  }
  // out = silu(gate) * up, where gate = gate_up[:, :I] and up = gate_up[:, I:], I = out.cols.
  virtual void silu_mul(const Tensor& gate_up, Tensor& out) = 0;
  // The MLP's first half: out = silu_mul(x @ gate_up^T), gate_up [2 I, in] with I = out.cols.
  // gate_up_out [rows, 2 I] (x's dtype) is scratch for the default composition; a fused backend may
  // leave it untouched (values equal to the composition's).
  virtual void linear_silu_mul(const Tensor& x, const Linear& gate_up, Tensor& gate_up_out, Tensor& out) {
    linear(x, gate_up, nullptr, gate_up_out);
    silu_mul(gate_up_out, out);
  }
  // linear_silu_mul of rms_norm(x), with norm_linear's scratch h and contract.
  virtual void norm_linear_silu_mul(const Tensor& x, const RmsNorm& norm, const Linear& gate_up, Tensor& h,
                                    Tensor& gate_up_out, Tensor& out) {
    rms_norm(x, norm.w, norm.eps, norm.zero_centred, h);
    linear_silu_mul(h, gate_up, gate_up_out, out);
  }
  // One layer's q|k|v projection output qkv (cols = (q_heads + 2 * kv_heads) * head_dim): in place,
  // RMS-normalizes every q and k head with q_norm / k_norm (when not null), rotates q and k at
  // positions[row], then writes k and v into the cache at batch.kv_rows. The default composes the
  // single ops; a backend may fuse them (the values may then differ by the skipped roundings).
  virtual void finish_qkv(Tensor& qkv, const AttnShape& s, const Tensor* q_norm, const Tensor* k_norm, float eps,
                          bool zero_centred, const int32_t* positions, const RopeTable& table, const AttnBatch& batch,
                          KvLayer& cache) {
    const int64_t qn = int64_t(s.q_heads) * s.head_dim, kn = int64_t(s.kv_heads) * s.head_dim;
    Tensor q = qkv.col_slice(0, qn), k = qkv.col_slice(qn, kn), v = qkv.col_slice(qn + kn, kn);
    if (q_norm) head_rms_norm(q, s.head_dim, *q_norm, eps, zero_centred);
    if (k_norm) head_rms_norm(k, s.head_dim, *k_norm, eps, zero_centred);
    rope(q, s.head_dim, positions, table);
    rope(k, s.head_dim, positions, table);
    write_kv(k, v, batch, cache);
  }
  // finish_qkv, then the attention of qkv's q columns into out: a layer's attention from its q|k|v
  // projection. A backend may fuse them for some batches (qkv's columns are then left as they were; the
  // values may differ by the skipped roundings).
  virtual void qkv_attention(Tensor& qkv, const AttnShape& s, const Tensor* q_norm, const Tensor* k_norm, float eps,
                             bool zero_centred, const int32_t* positions, const RopeTable& table,
                             const AttnBatch& batch, KvLayer& cache, Tensor& out) {
    finish_qkv(qkv, s, q_norm, k_norm, eps, zero_centred, positions, table, batch, cache);
    attention(qkv.col_slice(0, int64_t(s.q_heads) * s.head_dim), cache, batch, s, out);
  }
  // Writes this step's k and v rows (cols = kv_heads * head_dim) into the cache at batch.kv_rows.
  virtual void write_kv(const Tensor& k, const Tensor& v, const AttnBatch& batch, KvLayer& cache) = 0;
  // Causal paged attention of q (cols = q_heads * head_dim) over the cache; out like q.
  // K/V of this step must already be written.
  virtual void attention(const Tensor& q, const KvLayer& cache, const AttnBatch& batch,
                         const AttnShape& shape, Tensor& out) = 0;
  // Sparse decode. summarize_pages: after write_kv, every page this step wrote a key into gets its summary
  // (cache.summary) over the keys it holds: rows page * page_size .. the step's last row in it.
  virtual void summarize_pages(const KvLayer& cache, const AttnBatch& batch, int kv_cols) {
    (void)cache, (void)batch, (void)kv_cols, unsupported("summarize_pages");
  }
  // The page list of every (sequence, kv head) of batch (shared tables) for attention with head_tables: pages
  // [num_seqs, kv_heads, batch.max_pages] and keys [num_seqs, kv_heads] (backend memory), by SparseAttention's
  // rule from q (this step's rows after norm and RoPE) and the summaries; a sequence it does not select for gets
  // its own list and ctx_len for every head. scores: scratch of num_seqs * kv_heads * max_pages floats.
  virtual void select_pages(const Tensor& q, const KvLayer& cache, const AttnBatch& batch, const AttnShape& shape,
                            const SparseAttention& sparse, float* scores, int32_t* pages, int32_t* keys) {
    (void)q, (void)cache, (void)batch, (void)shape, (void)sparse, (void)scores, (void)pages, (void)keys;
    unsupported("select_pages");
  }
  // In place: x *= sigmoid(gate) (same shape): the output gate of a gated attention layer.
  virtual void sigmoid_mul(Tensor& x, const Tensor& gate) { (void)x, (void)gate, unsupported("sigmoid_mul"); }

  // Gated DeltaNet. Sequence s of batch owns rows [q_start[s], q_start[s + 1]) and state slot slots[s]; its first
  // row sits at position ctx_len[s] - q_len: where that is 0 its state starts from zeros (the slot's is not read),
  // else from the slot's. Each op leaves the slot holding the state after the sequence's last row.
  // 1. The depthwise causal conv of the q|k|v channels, then SiLU: x [T, conv_cols] (any row stride), w
  //    [conv_cols, conv_kernel] (column conv_kernel - 1 multiplies the current token), out [T, conv_cols].
  virtual void causal_conv1d(const Tensor& x, const Tensor& w, const AttnBatch& batch, const DeltaNetShape& s,
                             StateLayer& state, Tensor& out) {
    (void)x, (void)w, (void)batch, (void)s, (void)state, (void)out, unsupported("causal_conv1d");
  }
  // 2. The gated delta rule over the conv's output qkv [T, conv_cols] (q | k | v), with a and b [T, v_heads] (any
  //    row stride), a_log and dt_bias [1, v_heads] fp32. Per token and value head, in fp32: q and k L2-normalised
  //    (eps 1e-6), q *= k_dim^-0.5; g = -exp(a_log) * softplus(a + dt_bias); beta = sigmoid(b); S *= exp(g);
  //    S += k ((v - S^T k) * beta)^T; o = S^T q. out [T, v_cols]: o of each value head.
  virtual void gated_delta_rule(const Tensor& qkv, const Tensor& a, const Tensor& b, const Tensor& a_log,
                                const Tensor& dt_bias, const AttnBatch& batch, const DeltaNetShape& s,
                                StateLayer& state, Tensor& out) {
    (void)qkv, (void)a, (void)b, (void)a_log, (void)dt_bias, (void)batch, (void)s, (void)state, (void)out;
    unsupported("gated_delta_rule");
  }
  // 3. In place: every head_dim group of x is RMS-normalised, times w [1, head_dim] (plain, not 1 + w), times
  //    silu(z) (z like x, any row stride).
  virtual void gated_rms_norm(Tensor& x, const Tensor& z, const Tensor& w, float eps, int head_dim) {
    (void)x, (void)z, (void)w, (void)eps, (void)head_dim, unsupported("gated_rms_norm");
  }

  // out[i] = x[rows[i]].
  virtual void gather_rows(const Tensor& x, const int32_t* rows, Tensor& out) = 0;
  // In place: x += y (elementwise, same shape).
  virtual void add(Tensor& x, const Tensor& y) = 0;
  // ids[i] = src[src_index[i]] where src_index[i] >= 0 (n entries; int32, backend memory): a step's input
  // tokens that the step before sampled, taken from sampled_tokens() without a round trip to the host.
  virtual void fill_tokens(int32_t* ids, const int32_t* src_index, const int32_t* src, int n) = 0;
  // Samples one token per row of logits ([rows, vocab], F32) with rows[i]'s parameters.
  // Waits for the result. Random draws depend only on (seed, draw, token id), so a request's
  // tokens do not depend on the batch it runs in.
  virtual void sample(const Tensor& logits, const std::vector<SampleRow>& rows, SampleResult& out) = 0;
  // sample() in two halves, so that the host can launch the next step before this one's tokens are known:
  // sample_start enqueues the sampling and returns; sample_finish waits (at most timeout_s, then throws
  // std::runtime_error) and fills out. At most two samplings are started and not finished; they finish in
  // order. Until the next sample_start, sampled_tokens() holds the last started sampling's token of each
  // row (backend memory, for fill_tokens). The defaults run sample() at once.
  virtual void sample_start(const Tensor& logits, const std::vector<SampleRow>& rows) {
    SampleResult& r = results_[started_++ & 1];
    sample(logits, rows, r);
  }
  virtual void sample_finish(SampleResult& out, double timeout_s) {
    (void)timeout_s;
    out = results_[finished_++ & 1];
  }
  virtual const int32_t* sampled_tokens() const { return results_[(started_ - 1) & 1].tokens.data(); }
  // Takes the device scratch that sampling `rows` rows of `vocab` logits may need (penalties, banned tokens)
  // now: the engine calls it before the KV pool takes what memory is left, so no step allocates it later.
  virtual void reserve_sampling(int rows, int vocab) { (void)rows, (void)vocab; }

  // Graphs (CUDA): ops issued between begin_capture and end_capture are recorded, not run;
  // replay runs them again with the same pointers. Backends without graphs return -1.
  virtual bool supports_graphs() const { return false; }
  virtual void begin_capture() {}
  virtual int end_capture() { return -1; }
  // Ends a capture that failed midway: nothing is kept, the stream is usable again, no error is left behind.
  virtual void abort_capture() noexcept {}
  virtual void replay(int graph) { (void)graph; }
  // Destroys every graph (one still running is freed when it completes). Before a communicator is destroyed:
  // NCCL waits for the graphs that captured its collectives.
  virtual void drop_graphs() noexcept {}

 protected:
  [[noreturn]] void unsupported(const char* op) const {
    throw std::runtime_error(name() + " backend: " + op + " is not supported");
  }

 private:
  SampleResult results_[2];  // the default sample_start's results
  uint64_t started_ = 0, finished_ = 0;
};

// kv_dtype: F32, or BF16 / F16 (16-bit weights: half the KV bytes; attention reads them as fp32).
std::unique_ptr<Backend> make_cpu_backend(int num_threads, DType kv_dtype = DType::F32);
// Cores this process may run on (its CPU affinity): the CPU backends' default thread count.
int cpu_cores();
// Loads the CUDA backend plugin; throws std::runtime_error with the reason if it cannot.
// act_dtype: BF16, F16 or F32 (the exactness mode).
std::unique_ptr<Backend> make_cuda_backend(int device, DType act_dtype);
// Number of CUDA devices usable by the plugin (0 when the plugin or the driver is missing).
int cuda_device_count();
// Why no CUDA device is usable ("" when one is): the build has no plugin, it cannot load, or the driver fails.
std::string cuda_unavailable_reason();
// Folders that may hold the plugin's libraries (pip's nvidia-* packages), searched when the plugin first loads.
void set_cuda_library_dirs(const std::vector<std::string>& dirs);

}  // namespace qrt

// Sampling semantics (both backends, per row):
//  1. logprobs = log_softmax(raw logits): the chosen token's and the top num_logprobs are reported.
//  2. x = raw; banned tokens -> -inf.
//  3. repetition_penalty r: for t in seen_tokens, x[t] = x[t] > 0 ? x[t] / r : x[t] * r.
//  4. for t in output_tokens with count c: x[t] -= c * frequency_penalty + presence_penalty.
//  5. temperature == 0: token = argmax x (lowest id on ties); done.
//  6. x /= temperature; keep the top_k largest (all with the k-th value); then, on softmax of the
//     kept, the smallest prefix in descending order whose mass reaches top_p; then those with
//     p >= min_p * p_max.
//  7. token = argmax over kept of x[t] - log(-log(uniform01(seed, draw, t))) (Gumbel-max).
// Any logits give a token in [0, vocab): after steps 2-6 a NaN counts as -inf; where the kept maximum is +inf,
// top_p keeps the +inf tokens (all the mass) and the lowest id of them wins; where it is -inf, the first kept.
// A row whose log_softmax is undefined (a NaN or +inf logit, or every logit -inf) has logprob NaN: the caller's
// sign of non-finite logits (SampleResult::logprobs is never NaN otherwise).
