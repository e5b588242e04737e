// What a model needs before it runs, from its config alone: the checkpoint tensors it reads (checked before any is
// read) and the bytes each rank allocates (checked against the device before anything is allocated).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "model/config.h"

namespace qrt {

// A checkpoint tensor and its full shape as a matrix (1-D tensors: [1, n]).
struct CheckpointTensor {
  std::string name;
  int64_t rows, cols;
  bool linear = false;  // a decoder projection's weight (`<module>.weight`): FP8 where the config says (check_linear)
};

// Calls fn with every tensor QwenModel::load_weights reads, in its order (one at a time: a config of 2^31 layers
// is checked against a checkpoint of a few without listing them all).
void for_each_checkpoint_tensor(const ModelConfig& c, const std::function<void(const CheckpointTensor&)>& fn);

// Bytes one rank of `ranks` allocates, as QwenModel and KvCache allocate them (doubles: a hostile config's
// products overflow no integer here).
struct Footprint {
  double weights = 0;        // QwenModel::weight_bytes()
  double workspace = 0;      // a full step's activations, logits and metadata
  double rope_position = 0;  // the RoPE table, per position
  double kv_page = 0;        // one page of every attention layer's K and V (a device frame: with its summaries)
  double kv_host_page = 0;   // the same in the host tier (no summaries)
  double state_slot = 0;     // one slot's DeltaNet state (hybrid models)
  double select_page = 0;    // sparse decode: select_pages' scratch per page-table column (in workspace too)
};

struct FootprintShape {
  int ranks = 1;
  DType weights = DType::F32, act = DType::F32, kv = DType::F32;
  bool folds_gains = false;  // the backend folds 16-bit norm gains into the matrices (Backend::folds_norm_gains)
  int max_tokens = 0, max_seqs = 0, max_pages_per_seq = 0;
  int page_size = 16;
  bool sparse = false;       // sparse decode: page summaries in the KV cache, select_pages' scratch
  int max_logit_rows = 0;    // rows of a step that sample (Limits::max_logit_rows)
};

Footprint footprint(const ModelConfig& c, const FootprintShape& s);

}  // namespace qrt
