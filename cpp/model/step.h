// StepInput: one step of a ragged batch as the scheduler plans it and every rank's model runs it (host memory).
#pragma once
#include <cstdint>
#include <vector>

namespace qrt {

// Built once by the scheduler, read by every rank.
struct StepInput {
  std::vector<int32_t> tokens;      // [T]
  std::vector<int32_t> token_src;   // [T] -1, or the row of the previous step's sampling whose token this is
  std::vector<int32_t> positions;   // [T]
  std::vector<int32_t> kv_rows;     // [T] cache row of each token: page * page_size + offset
  std::vector<int32_t> q_start;     // [S + 1]
  std::vector<int32_t> ctx_len;     // [S]
  std::vector<int32_t> page_table;  // [S, max_pages]
  std::vector<int32_t> logit_rows;  // [R] rows of the step whose next token is sampled
  std::vector<int32_t> slots;       // [S] each sequence's slot (its DeltaNet state)
  std::vector<int32_t> keep;        // [S] or empty: where the state after each row is kept (ops.h AttnBatch::keep)
  int max_pages = 0;
  int max_q_len = 0;
  int max_ctx_len = 0;
  int num_tokens() const { return int(tokens.size()); }
  int num_seqs() const { return int(ctx_len.size()); }
};

}  // namespace qrt
