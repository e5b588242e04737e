#include "model/runner.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/error.h"

namespace qrt {

StepRunner::StepRunner(Backend& be, int max_tokens, int max_seqs, int max_pages_per_seq, int max_logit_rows,
                       int vocab0, bool graphs)
    : be_(be), max_tokens_(max_tokens), max_seqs_(max_seqs), max_pages_per_seq_(max_pages_per_seq),
      max_logit_rows_(max_logit_rows), vocab0_(vocab0), graphs_on_(graphs && be.supports_graphs()) {
  const int T = max_tokens, S = max_seqs;
  meta_ints_ = 4 * int64_t(std::max(T, S)) + (S + 1) + 3 * S + int64_t(S) * max_pages_per_seq + max_logit_rows;
  meta_ = Buffer(&be, size_t(meta_ints_) * 4);
}

int StepRunner::graph_bucket(int n, int max_n) {
  static const int buckets[] = {1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512};
  for (int b : buckets)
    if (b >= n) return std::min(b, max_n);
  return -1;
}

// Page-table columns of a graph-replayed step of n columns: a power of two from 16, at most max_n. Short
// contexts neither upload nor plan attention splits for every page of max_model_len, and a context growing
// by one page does not need a new graph. (QWEN_RT_GRAPH_PAGES=all: always max_n, for comparison.)
int StepRunner::graph_pages(int n, int max_n) {
  static const bool all = [] {
    const char* e = std::getenv("QWEN_RT_GRAPH_PAGES");
    return e && std::strcmp(e, "all") == 0;
  }();
  int p = 16;
  while (p < n && p < max_n) p *= 2;
  return all ? max_n : std::min(p, max_n);
}

StepMeta StepRunner::upload(const StepInput& s, const int32_t* sampled, KvCache& kv, StateCache* state, int rows,
                            int max_pages, int max_ctx) {
  const int T = s.num_tokens(), S = s.num_seqs(), R = int(s.logit_rows.size());
  // A uniform step (q tokens per sequence, every row sampling: T == S q == R) padded to `rows` rows of q-token
  // sequences.
  const bool pad = rows > T;
  const int q = pad ? T / S : 1;
  const int SS = pad ? rows / q : S, RR = pad ? rows : R;
  std::vector<int32_t> meta;
  meta.reserve(size_t(4 * rows + 3 * SS + 1 + SS * max_pages + RR));
  auto put = [&](const std::vector<int32_t>& v, int n, auto pad_value) {
    const size_t off = meta.size();
    meta.insert(meta.end(), v.begin(), v.end());
    for (int i = int(v.size()); i < n; ++i) meta.push_back(pad_value(i));
    return off;
  };
  const int scratch = kv.scratch_row();
  const size_t o_tok = put(s.tokens, rows, [](int) { return 0; });
  if (vocab0_ != 0)  // this rank's embedding shard starts at vocab0_: other ids look up zero rows
    for (int i = 0; i < rows; ++i) meta[o_tok + i] -= vocab0_;
  const size_t o_src = put(s.token_src, rows, [](int) { return -1; });
  const size_t o_pos = put(s.positions, rows, [](int) { return 0; });
  const size_t o_kvr = put(s.kv_rows, rows, [&](int) { return scratch; });
  const size_t o_qs = put(s.q_start, SS + 1, [&](int i) { return i * q; });
  const size_t o_ctx = put(s.ctx_len, SS, [&](int) { return q; });
  size_t o_pt = meta.size();
  for (int i = 0; i < SS; ++i)
    for (int j = 0; j < max_pages; ++j)
      meta.push_back(i < S && j < s.max_pages ? s.page_table[size_t(i) * s.max_pages + j] : 0);
  const size_t o_lr = put(s.logit_rows, RR, [](int i) { return i; });
  // Padded rows (and models without DeltaNet layers) use the scratch slot.
  const int scratch_slot = state ? state->scratch_slot() : 0;
  const size_t o_sl = put(s.slots, SS, [&](int) { return scratch_slot; });
  const size_t o_keep = s.keep.empty() ? 0 : put(s.keep, SS, [](int) { return -1; });
  QRT_CHECK(int64_t(meta.size()) <= meta_ints_, "step metadata exceeds its buffer");
  be_.upload(meta_.data(), meta.data(), meta.size() * 4);
  int32_t* m = meta_.as<int32_t>();
  // Tokens sampled by the step before, still in device memory, take their places.
  if (std::any_of(s.token_src.begin(), s.token_src.end(), [](int32_t i) { return i >= 0; })) {
    QRT_CHECK(sampled && vocab0_ == 0, "step input refers to sampled tokens it was not given");
    be_.fill_tokens(m + o_tok, m + o_src, sampled, rows);
  }
  StepMeta out;
  out.tokens = m + o_tok;
  out.positions = m + o_pos;
  out.logit_rows = m + o_lr;
  out.rows = rows;
  AttnBatch& b = out.batch;
  b.num_seqs = SS;
  b.num_tokens = rows;
  b.q_start = m + o_qs;
  b.ctx_len = m + o_ctx;
  b.page_table = m + o_pt;
  b.kv_rows = m + o_kvr;
  b.max_pages = max_pages;
  b.page_size = kv.page_size();
  b.max_q_len = s.max_q_len;
  b.max_ctx_len = max_ctx;
  b.slots = m + o_sl;
  if (!s.keep.empty()) b.keep = m + o_keep;
  return out;
}

int StepRunner::graph_bucket(const StepInput& s) const {
  // Uniform steps replay graphs: q tokens per sequence, every row sampling (decode: q = 1; verification of
  // speculative drafts: q = k + 1; draft passes: q = 1).
  const int T = s.num_tokens(), S = s.num_seqs(), R = int(s.logit_rows.size()), q = s.max_q_len;
  if (!graphs_on_ || S == 0 || q < 1 || q > kGraphMaxQ || T != S * q || R != T) return -1;
  const int bucket = graph_bucket(S, std::min(max_seqs_, max_tokens_ / q));
  return bucket >= S && bucket * q <= max_logit_rows_ ? bucket : -1;
}

int StepRunner::padded_rows(const StepInput& s) const {
  const int bucket = graph_bucket(s);
  return bucket > 0 ? bucket * s.max_q_len : s.num_tokens();
}

void StepRunner::run(const StepInput& s, const int32_t* sampled, KvCache& kv, StateCache* state,
                     const std::function<void(const StepMeta&, int)>& forward, int forward_kind) {
  const int bucket = graph_bucket(s);
  if (bucket > 0) {
    // Fixed shapes for the graph: padded rows, and page-table columns whose pages bound every context.
    const int q = s.max_q_len, pages = graph_pages(s.max_pages, max_pages_per_seq_);
    const StepMeta meta = upload(s, sampled, kv, state, bucket * q, pages, pages * kv.page_size());
    const GraphKey key{forward_kind, bucket, pages, q, !s.keep.empty()};
    auto it = graphs_.find(key);
    if (it == graphs_.end()) {
      // A verification or draft shape runs once without a graph first: its workspaces grow outside a capture.
      if ((q > 1 || forward_kind != 0) && warmed_.insert(key).second) return forward(meta, bucket * q);
      be_.begin_capture();
      try {
        forward(meta, bucket * q);
      } catch (...) {
        be_.abort_capture();  // leave the stream usable; the step fails with the forward's error
        throw;
      }
      it = graphs_.emplace(key, be_.end_capture()).first;
    }
    be_.replay(it->second);
    return;
  }
  forward(upload(s, sampled, kv, state, s.num_tokens(), s.max_pages, s.max_ctx_len), int(s.logit_rows.size()));
}

}  // namespace qrt
