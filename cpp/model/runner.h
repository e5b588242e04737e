// StepRunner: what a model's step needs besides its layers. It uploads the step's metadata (tokens, positions, KV
// rows, the ragged batch, logit rows, state slots: one int32 buffer) and runs the forward pass, replaying it from a
// CUDA graph for uniform steps (decode, verification of speculative drafts: q tokens per sequence, and MTP draft
// passes), captured the first time each shape occurs (forward kind x batch bucket x page-table columns x q; a
// verification or draft shape the second time).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <tuple>

#include "backend/ops.h"
#include "core/buffer.h"
#include "kv/kv_cache.h"
#include "kv/state_cache.h"
#include "model/step.h"

namespace qrt {

// A step as the forward pass sees it: device pointers into the uploaded metadata.
struct StepMeta {
  AttnBatch batch;
  const int32_t* tokens = nullptr;      // [rows] embedding ids (minus the rank's vocab shard start)
  const int32_t* positions = nullptr;   // [rows]
  const int32_t* logit_rows = nullptr;  // [logit rows]
  int rows = 0;                         // the step's tokens, or (graphs) its padded bucket
};

class StepRunner {
 public:
  // vocab0: the first embedding row of this rank's shard; graphs: replay uniform steps when the backend can.
  StepRunner(Backend& be, int max_tokens, int max_seqs, int max_pages_per_seq, int max_logit_rows, int vocab0,
             bool graphs);
  // Runs forward(meta, logit_rows) for step s: from a graph for a uniform step that fits a bucket, else directly.
  // sampled: the backend's sampled_tokens() of the step before, where s.token_src points.
  // forward_kind tells apart the forward passes a model runs (its layers: 0; MTP draft passes: others), whose
  // graphs differ for the same shape.
  void run(const StepInput& s, const int32_t* sampled, KvCache& kv, StateCache* state,
           const std::function<void(const StepMeta&, int logit_rows)>& forward, int forward_kind = 0);
  // The rows run() runs s with: its tokens, or a graph's padded bucket.
  int padded_rows(const StepInput& s) const;

 private:
  // Uploads s padded to `rows` rows (rows > s's tokens: a uniform step padded with q-token sequences on the scratch
  // row and slot) and max_pages page-table columns.
  StepMeta upload(const StepInput& s, const int32_t* sampled, KvCache& kv, StateCache* state, int rows,
                  int max_pages, int max_ctx);
  static int graph_bucket(int n, int max_n);
  static int graph_pages(int n, int max_n);

  static constexpr int kGraphMaxQ = 5;  // tokens per sequence of a graph-replayed step (k + 1 at k = 4 drafts)
  // (forward kind, batch bucket, page-table columns, tokens per sequence, keeps DeltaNet states per row)
  using GraphKey = std::tuple<int, int, int, int, bool>;
  // The graph bucket of s (-1: s runs without a graph).
  int graph_bucket(const StepInput& s) const;

  Backend& be_;
  int max_tokens_, max_seqs_, max_pages_per_seq_, max_logit_rows_, vocab0_;
  bool graphs_on_;
  Buffer meta_;
  int64_t meta_ints_;
  std::map<GraphKey, int> graphs_;  // -> captured graph
  std::set<GraphKey> warmed_;       // verification and draft shapes run once without a graph
};

}  // namespace qrt
