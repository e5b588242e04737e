// A Qwen model (Qwen2, Qwen3, Qwen3.5 hybrid) on one tensor-parallel rank: the embedding, a plan of decoder
// layers (model/layers.h), the final norm and the LM head; the forward pass over a ragged batch.
#pragma once
#include <algorithm>
#include <functional>
#include <utility>
#include <memory>
#include <vector>

#include "core/buffer.h"
#include "dist/comm.h"
#include "kv/kv_cache.h"
#include "kv/state_cache.h"
#include "model/config.h"
#include "model/layers.h"
#include "model/runner.h"
#include "model/step.h"
#include "model/weights.h"

namespace qrt {

struct Limits {
  int max_tokens = 0;       // rows of one step (max_num_batched_tokens)
  int max_seqs = 0;         // sequences of one step (max_batch_size)
  int max_pages_per_seq = 0;
  int max_positions = 0;    // positions a request reaches (max_model_len; 0: max_position_embeddings): the RoPE table
  bool graphs = false;      // replay decode steps from captured graphs (when the backend has them)
  SparseAttention sparse;   // sparse decode (off: budget_pages 0); the KV cache then keeps page summaries
  int max_logit_rows = 0;   // rows of one step that sample (0: max_seqs; more with speculation: a row per draft token)
};

// The multi-token-prediction head (Qwen3.5 `mtp.*`): fc over [embedding_norm(embed(token)) | hidden_norm(hidden)],
// a full-attention decoder layer with K/V of its own (the KV cache's last layer), a norm; the model's LM head.
struct MtpHead {
  NormGain embedding_norm, hidden_norm, norm;
  Linear fc;  // [H, 2H], the same on every rank
  DecoderLayer layer;
};

class QwenModel {
 public:
  QwenModel(const ModelConfig& cfg, Backend& be, Comm& comm, const WeightSpec& ws, const Limits& lim,
            const Progress& progress);
  // Runs one step; returns logits [logit_rows, vocab] (F32, backend memory), valid until the next call.
  // kv must have been built with kv_cols() columns for the attention layers, state (null when the model has no
  // DeltaNet layer) with delta_net_shape() for the DeltaNet layers. sampled: the backend's sampled_tokens() of the
  // step before, where step.token_src points (may be null when no token_src is set).
  Tensor forward(const StepInput& step, KvCache& kv, StateCache* state, const int32_t* sampled = nullptr);
  // With an MTP head (cfg.mtp_layers): one of its passes, over the rows of `step` (decode-like rows or chunks,
  // with their KV rows and page tables; no state): row i joins step.tokens[i], the token that follows position
  // step.positions[i], with the final-norm hidden state of row hidden_rows[i] of the last forward (from_draft: of
  // the last draft's rows) and writes the MTP layer's K/V of that position. Returns the logits of step.logit_rows,
  // as forward. The pass's own hidden rows stay for the next draft (from_draft).
  Tensor draft(const StepInput& step, const std::vector<int32_t>& hidden_rows, bool from_draft, KvCache& kv);
  int kv_cols() const { return shard_.kv_heads * cfg_.head_dim; }  // this rank's K (or V) columns per token
  const DeltaNetShape& delta_net_shape() const { return shard_.delta; }
  size_t weight_bytes() const { return weight_bytes_; }

 private:
  Tensor alloc_tensor(DType t, int64_t rows, int64_t cols);
  void load_weights(const Progress& progress);
  void build_rope_table();
  // The forward pass over a step's uploaded metadata (meta.rows rows, the first logit_rows of meta.logit_rows).
  void body(const StepMeta& meta, int logit_rows, KvCache& kv, StateCache* state);
  // A draft pass's layers (draft()), the step's rows as meta gives them.
  void draft_body(const StepMeta& meta, int logit_rows, bool from_draft, KvCache& kv);
  void load_mtp(WeightLoader& ld, const std::function<NormGain(const std::string&, const std::vector<Linear*>&)>& norm);
  // logits rows [0, R) = lm_head(rows) for rows [R, hidden] already final-normed, vocab-parallel across ranks.
  void lm_head(const Tensor& rows, int R);
  void gather_logits(int R);  // every rank's [R, vocab_pad_] shard in logits_gathered_, side by side in logits_
  int logit_rows() const { return std::max(lim_.max_seqs, lim_.max_logit_rows); }

  ModelConfig cfg_;
  Backend& be_;
  Comm& comm_;
  WeightSpec ws_;
  Limits lim_;
  Shard shard_;
  int vocab0_, vocab_rows_, vocab_pad_;  // vocab-parallel shard: first row, rows held, rows per rank
  std::vector<Buffer> storage_;
  size_t weight_bytes_ = 0;
  Tensor embed_;
  NormGain final_norm_;
  Linear lm_head_;
  std::vector<DecoderLayer> layers_;
  Tensor rope_table_;
  RopeTable rope_;
  std::unique_ptr<StepRunner> runner_;  // metadata upload and decode graphs
  // Workspace.
  Tensor residual_, sel_res_, sel_h_, logits_;
  Tensor sparse_scores_, sparse_pages_, sparse_keys_;  // select_pages' scratch and output (sparse decode)
  // MTP: the head, the last forward's final-norm rows [T, H], the draft's input [T, 2H] and hidden rows [T, H].
  std::unique_ptr<MtpHead> mtp_;
  Tensor hidden_, mtp_in_, mtp_hidden_, hidden_rows_;
  Workspace ws_full_;  // [max_tokens, ...] each
  Tensor logits_gathered_;  // [ranks * max_seqs, vocab_pad_]: every rank's shard, rank-major
  Tensor logits_view(int rows) const;
};

}  // namespace qrt
