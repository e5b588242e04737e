// The layer kinds of a Qwen decoder (gated or plain attention, Gated DeltaNet, SwiGLU MLP) and what they share:
// a rank's shard of the heads, the step as a layer sees it, the residual stream's tensor-parallel add.
#pragma once
#include <string>

#include "dist/comm.h"
#include "kv/kv_cache.h"
#include "kv/state_cache.h"
#include "model/config.h"
#include "model/weights.h"

namespace qrt {

// This rank's share of every layer (tensor parallelism): heads and columns [x0, x0 + x) of each kind.
struct Shard {
  int rank = 0, ranks = 1;
  int q_heads = 0, q_head0 = 0;
  int kv_heads = 0, kv_head0 = 0;  // replicated (one per rank) when ranks outnumber the KV heads
  int inter = 0, inter0 = 0;
  DeltaNetShape delta;             // this rank's DeltaNet heads
  int k_head0 = 0, v_head0 = 0;
  Shard(const ModelConfig& c, int rank, int ranks);  // throws std::invalid_argument when heads do not divide
};

// Scratch rows of one step, sized by the model for its largest step ([max_tokens, cols] each).
struct Workspace {
  Tensor h;                 // [T, hidden] a norm's output
  Tensor qkv, attn;         // attention: q|k|v(|gate) and the attention's output
  Tensor proj, conv, core;  // DeltaNet: in_proj (qkv|z|b|a), the conv's output, the rule's output
  Tensor gate_up, act;      // MLP
};

// Sparse decode in a step (ops.h SparseAttention): the rule, whether a sequence of the step may select (it has more
// pages than the budget; else every list is the sequence's own and selection is skipped), and select_pages' scratch
// and output (backend memory, reused by every attention layer).
struct SparseStep {
  SparseAttention rule;
  bool select = false;
  float* scores = nullptr;
  int32_t* pages = nullptr;
  int32_t* keys = nullptr;
};

// A step as a layer sees it (backend memory): the batch, positions, the residual stream [T, hidden] it adds to.
struct LayerStep {
  Backend& be;
  Comm& comm;
  const AttnBatch& batch;
  const int32_t* positions;
  const RopeTable& rope;
  int rows;                 // T
  Tensor residual;          // [T, hidden]
  Workspace ws;             // row slices [0, T)
  const SparseStep* sparse = nullptr;  // null: every sequence attends to all of its pages
};

// residual += x @ w^T for a row-parallel w: rank 0 adds its share, the others put theirs in place, then the ranks
// sum (one rank: just the add).
void add_to_residual(LayerStep& s, const Tensor& x, const Linear& w);

// An RMSNorm whose gain is loaded, or folded into the matrices it feeds (WeightLoader::norm_gain).
struct NormGain {
  Tensor w;
  bool folded = false;
  RmsNorm norm(float eps, bool zero_centred) const { return RmsNorm{w, eps, zero_centred && !folded, folded}; }
};

// Self-attention: q|k|v projection (+ bias, Qwen2), per-head q/k norm (Qwen3, 3.5), RoPE, paged attention, an
// optional sigmoid output gate (Qwen3.5: rows q | k | v | gate of the fused projection), o_proj.
struct AttentionLayer {
  Linear qkv, o;
  Tensor bias, q_norm, k_norm;
  // The linears as loaded (prefix: "<weights>layers.N.self_attn."); model/footprint.cpp sizes them from these.
  static LinearSpec qkv_spec(const std::string& prefix, const ModelConfig& c, const Shard& sh);
  static LinearSpec o_spec(const std::string& prefix, const ModelConfig& c, const Shard& sh);
  void load(WeightLoader& ld, const std::string& prefix, const ModelConfig& c, const Shard& sh);
  // residual += attention(norm(residual)), writing this step's K/V into cache.
  void forward(LayerStep& s, const RmsNorm& norm, const ModelConfig& c, const Shard& sh, KvLayer cache) const;
  static int64_t proj_cols(const ModelConfig& c, const Shard& sh);  // columns of the fused projection
};

// Gated DeltaNet: fused in_proj (q|k|v | z | b | a), causal conv + SiLU, the gated delta rule over the slot's
// state, gated RMSNorm times silu(z), out_proj. Where in_proj_b/a are stored unlike in_proj_qkv/z (Qwen's FP8
// checkpoints keep them bf16), b|a is a linear of its own (in_proj_ba) writing the same columns of the output.
struct DeltaNetLayer {
  Linear in_proj, in_proj_ba, out;  // in_proj_ba empty when fused into in_proj
  Tensor conv_w, a_log, dt_bias, norm_w;
  // prefix: "<weights>layers.N.linear_attn.". fuses_ba: whether b|a are rows of in_proj (the same storage).
  static bool fuses_ba(const std::string& prefix, const ModelConfig& c);
  static LinearSpec in_proj_spec(const std::string& prefix, const ModelConfig& c, const Shard& sh);
  static LinearSpec ba_spec(const std::string& prefix, const ModelConfig& c, const Shard& sh);  // when not fused
  static LinearSpec out_spec(const std::string& prefix, const ModelConfig& c, const Shard& sh);
  void load(WeightLoader& ld, const std::string& prefix, const ModelConfig& c, const Shard& sh);
  void forward(LayerStep& s, const RmsNorm& norm, const ModelConfig& c, const Shard& sh, StateLayer state) const;
  static int64_t proj_cols(const Shard& sh) { return sh.delta.conv_cols() + sh.delta.v_cols() + 2 * sh.delta.v_heads; }
};

// SwiGLU: down(silu(gate(x)) * up(x)), gate|up fused.
struct Mlp {
  Linear gate_up, down;
  static LinearSpec gate_up_spec(const std::string& prefix, const ModelConfig& c, const Shard& sh);
  static LinearSpec down_spec(const std::string& prefix, const ModelConfig& c, const Shard& sh);
  void load(WeightLoader& ld, const std::string& prefix, const ModelConfig& c, const Shard& sh);
  void forward(LayerStep& s, const RmsNorm& norm) const;
};

// One decoder layer: residual += mixer(input_norm(residual)); residual += mlp(post_norm(residual)). The mixer is
// attention or DeltaNet by the model's plan; cache_index counts the layers of its kind (its KV or state layer).
struct DecoderLayer {
  bool delta_net = false;
  int cache_index = 0;
  NormGain input_norm, post_norm;
  AttentionLayer attention;
  DeltaNetLayer delta;
  Mlp mlp;
};

}  // namespace qrt
