#include "model/qwen.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "backend/random.h"
#include "core/error.h"

namespace qrt {

void validate(const ModelConfig& c) {
  QRT_CHECK_ARG(c.arch == "qwen2" || c.arch == "qwen3", "unsupported model architecture '", c.arch, "'");
  QRT_CHECK_ARG(c.vocab_size > 0 && c.hidden_size > 0 && c.num_layers > 0 && c.intermediate_size > 0,
                "config: vocab_size, hidden_size, num_hidden_layers and intermediate_size must be positive");
  QRT_CHECK_ARG(c.num_q_heads > 0 && c.num_kv_heads > 0 && c.num_q_heads % c.num_kv_heads == 0,
                "config: num_attention_heads (", c.num_q_heads, ") must be a multiple of num_key_value_heads (",
                c.num_kv_heads, ")");
  QRT_CHECK_ARG(c.head_dim > 0 && c.head_dim % 2 == 0, "config: head_dim must be positive and even");
  QRT_CHECK_ARG(c.rot_dim() > 0 && c.rot_dim() <= c.head_dim, "config: bad rotary dimension ", c.rot_dim());
  QRT_CHECK_ARG(c.max_position_embeddings > 0, "config: max_position_embeddings must be positive");
  const int64_t int_max = 0x7fffffff;  // the rows and columns below are int
  QRT_CHECK_ARG(int64_t(c.num_q_heads) * c.head_dim <= int_max && 2 * int64_t(c.intermediate_size) <= int_max,
                "config: num_attention_heads x head_dim and 2 x intermediate_size must be below 2^31");
}

QwenModel::QwenModel(const ModelConfig& cfg, Backend& be, Comm& comm, const WeightSpec& ws, const Limits& lim,
                     const Progress& progress)
    : cfg_(cfg), be_(be), comm_(comm), ws_(ws), lim_(lim) {
  validate(cfg_);
  const int n = comm.size(), r = comm.rank();
  QRT_CHECK_ARG(be.supports_head_dim(cfg_.head_dim), "head_dim ", cfg_.head_dim, " is not supported by the ",
                be.name(), " backend (64, 128 or 256)");
  QRT_CHECK_ARG(cfg_.num_q_heads % n == 0, "tensor_parallel_size ", n, " does not divide the ", cfg_.num_q_heads,
                " attention heads");
  QRT_CHECK_ARG(cfg_.intermediate_size % n == 0, "tensor_parallel_size ", n, " does not divide intermediate_size ",
                cfg_.intermediate_size);
  q_heads_ = cfg_.num_q_heads / n;
  q_head0_ = r * q_heads_;
  if (cfg_.num_kv_heads % n == 0) {
    kv_heads_ = cfg_.num_kv_heads / n;
    kv_head0_ = r * kv_heads_;
  } else {
    QRT_CHECK_ARG(n % cfg_.num_kv_heads == 0, "tensor_parallel_size ", n, " and ", cfg_.num_kv_heads,
                  " KV heads: one must divide the other");
    kv_heads_ = 1;  // replicated: several ranks share one KV head
    kv_head0_ = r * cfg_.num_kv_heads / n;
  }
  inter_ = cfg_.intermediate_size / n;
  inter0_ = r * inter_;
  vocab_pad_ = (cfg_.vocab_size + n - 1) / n;
  vocab0_ = r * vocab_pad_;
  vocab_rows_ = std::max(0, std::min(vocab_pad_, cfg_.vocab_size - vocab0_));
  load_weights(progress);
  build_rope_table();

  const DType act = be_.act_dtype();
  const int T = lim_.max_tokens, S = lim_.max_seqs, H = cfg_.hidden_size, D = cfg_.head_dim;
  const int64_t meta = 4 * int64_t(std::max(T, S)) + (S + 1) + S + int64_t(S) * lim_.max_pages_per_seq + S;
  meta_ = alloc_tensor(DType::I32, 1, meta);
  residual_ = alloc_tensor(act, T, H);
  hidden_ = alloc_tensor(act, T, H);
  qkv_ = alloc_tensor(act, T, int64_t(q_heads_ + 2 * kv_heads_) * D);
  attn_ = alloc_tensor(act, T, int64_t(q_heads_) * D);
  gate_up_ = alloc_tensor(act, T, 2 * int64_t(inter_));
  act_ = alloc_tensor(act, T, inter_);
  sel_res_ = alloc_tensor(act, S, H);
  sel_h_ = alloc_tensor(act, S, H);
  // Logits: this rank's shard [S, vocab_pad_]; with several ranks, gathered then laid out as [S, n * vocab_pad_].
  logits_ = alloc_tensor(DType::F32, S, int64_t(n) * vocab_pad_);
  if (n > 1) logits_gathered_ = alloc_tensor(DType::F32, int64_t(n) * S, vocab_pad_);
}

Tensor QwenModel::alloc_tensor(DType t, int64_t rows, int64_t cols) {
  storage_.emplace_back(&be_, size_t(rows) * size_t(cols) * dtype_size(t));
  return storage_.back().tensor(t, rows, cols);
}

// Loads rows [r0, r0 + dst.rows) x cols [c0, c0 + dst.cols) of a [rows, cols] checkpoint tensor into dst,
// or fills dst with random values for dummy weights.
void QwenModel::load(const std::string& name, int64_t rows, int64_t cols, int64_t r0, int64_t c0, Tensor dst,
                     float dummy_scale, float dummy_offset) {
  if (ws_.files) {
    ws_.files->read(be_, name, rows, cols, r0, c0, dst);
  } else {
    be_.fill_random(dst, hash3(ws_.dummy_seed, dummy_counter_++, 0), dummy_scale, dummy_offset, r0, c0);
  }
}

void QwenModel::load_weights(const Progress& progress) {
  const std::string& pre = cfg_.weight_prefix;
  const int H = cfg_.hidden_size, D = cfg_.head_dim, V = cfg_.vocab_size, I = cfg_.intermediate_size;
  const int Hq = cfg_.num_q_heads, Hkv = cfg_.num_kv_heads;
  const DType wt = ws_.dtype, nt = DType::F32;
  const float ws = 0.02f * std::sqrt(3.0f);  // uniform with std 0.02, like transformers' init
  const float norm_one = 1.0f;

  // Vocab-parallel: this rank holds rows [vocab0_, vocab0_ + vocab_rows_) of the embedding (and LM head),
  // padded with zero rows to vocab_pad_.
  auto load_vocab_shard = [&](const std::string& name) {
    Tensor t = alloc_tensor(wt, vocab_pad_, H);
    be_.fill_zero(t.data, t.nbytes());
    if (vocab_rows_ > 0) load(name, V, H, vocab0_, 0, t.row_slice(0, vocab_rows_), ws, 0.f);
    return t;
  };
  embed_ = load_vocab_shard(pre + "embed_tokens.weight");
  // 16-bit weights on a backend that wants it: each norm's gain is multiplied into the columns of the
  // matrix it feeds, and the norm keeps a gain of ones (RmsNorm::unit_gain). Gains loaded for folding go
  // through two staging tensors, not kept. (Load order stays that of the checkpoint walk: dummy weights
  // draw their seeds in that order.)
  gains_folded_ = be_.folds_norm_gains() && wt == be_.act_dtype() && (wt == DType::BF16 || wt == DType::F16);
  Tensor staged[2];
  if (gains_folded_) {
    unit_gain_ = alloc_tensor(nt, 1, H);
    be_.fill_random(unit_gain_, 0, 0.f, 1.0f, 0, 0);  // exactly 1: fma(0, u, 1)
    for (Tensor& t : staged) t = alloc_tensor(nt, 1, H);
  }
  auto load_gain = [&](const std::string& name, int stage) {
    Tensor g = gains_folded_ ? staged[stage] : alloc_tensor(nt, 1, H);
    load(name, 1, H, 0, 0, g, 0.f, norm_one);
    return g;
  };
  // The norm with gain g that feeds w: g itself, or the unit gain once g is folded into w.
  auto fold = [&](const Tensor& g, Tensor& w) {
    if (!gains_folded_) return g;
    be_.scale_columns(w, g, false);
    return unit_gain_;
  };
  layers_.resize(cfg_.num_layers);
  for (int l = 0; l < cfg_.num_layers; ++l) {
    if (progress) progress("loading weights", l, cfg_.num_layers);
    Layer& L = layers_[l];
    const std::string p = pre + "layers." + std::to_string(l) + ".";
    const Tensor input_gain = load_gain(p + "input_layernorm.weight", 0);
    const Tensor post_gain = load_gain(p + "post_attention_layernorm.weight", 1);
    const int qn = q_heads_ * D, kn = kv_heads_ * D;
    L.qkv.w = alloc_tensor(wt, qn + 2 * kn, H);
    load(p + "self_attn.q_proj.weight", int64_t(Hq) * D, H, int64_t(q_head0_) * D, 0, L.qkv.w.row_slice(0, qn), ws, 0.f);
    load(p + "self_attn.k_proj.weight", int64_t(Hkv) * D, H, int64_t(kv_head0_) * D, 0, L.qkv.w.row_slice(qn, kn), ws, 0.f);
    load(p + "self_attn.v_proj.weight", int64_t(Hkv) * D, H, int64_t(kv_head0_) * D, 0,
         L.qkv.w.row_slice(qn + kn, kn), ws, 0.f);
    if (cfg_.attn_bias) {
      L.qkv_bias = alloc_tensor(nt, 1, qn + 2 * kn);
      load(p + "self_attn.q_proj.bias", 1, int64_t(Hq) * D, 0, int64_t(q_head0_) * D, L.qkv_bias.col_slice(0, qn), ws, 0.f);
      load(p + "self_attn.k_proj.bias", 1, int64_t(Hkv) * D, 0, int64_t(kv_head0_) * D, L.qkv_bias.col_slice(qn, kn), ws, 0.f);
      load(p + "self_attn.v_proj.bias", 1, int64_t(Hkv) * D, 0, int64_t(kv_head0_) * D,
           L.qkv_bias.col_slice(qn + kn, kn), ws, 0.f);
    }
    if (cfg_.qk_norm) {
      L.q_norm = alloc_tensor(nt, 1, D);
      load(p + "self_attn.q_norm.weight", 1, D, 0, 0, L.q_norm, 0.f, norm_one);
      L.k_norm = alloc_tensor(nt, 1, D);
      load(p + "self_attn.k_norm.weight", 1, D, 0, 0, L.k_norm, 0.f, norm_one);
    }
    L.o.w = alloc_tensor(wt, H, qn);
    load(p + "self_attn.o_proj.weight", H, int64_t(Hq) * D, 0, int64_t(q_head0_) * D, L.o.w, ws, 0.f);
    L.gate_up.w = alloc_tensor(wt, 2 * int64_t(inter_), H);
    load(p + "mlp.gate_proj.weight", I, H, inter0_, 0, L.gate_up.w.row_slice(0, inter_), ws, 0.f);
    load(p + "mlp.up_proj.weight", I, H, inter0_, 0, L.gate_up.w.row_slice(inter_, inter_), ws, 0.f);
    L.down.w = alloc_tensor(wt, H, inter_);
    load(p + "mlp.down_proj.weight", H, I, 0, inter0_, L.down.w, ws, 0.f);
    L.input_norm = fold(input_gain, L.qkv.w);
    L.post_norm = fold(post_gain, L.gate_up.w);
  }
  const Tensor final_gain = load_gain(pre + "norm.weight", 0);
  if (cfg_.tie_embeddings) {  // the LM head is the embedding table: the gain stays in the norm
    lm_head_.w = embed_;
    final_norm_ = final_gain;  // (staged[0] is not reused after this)
  } else {
    lm_head_.w = load_vocab_shard("lm_head.weight");
    final_norm_ = fold(final_gain, lm_head_.w);
  }
  weight_bytes_ = 0;
  for (const auto& b : storage_) weight_bytes_ += b.bytes();
  be_.synchronize();
  if (progress) progress("loading weights", cfg_.num_layers, cfg_.num_layers);
}

void QwenModel::build_rope_table() {
  const int rot = cfg_.rot_dim(), half = rot / 2;
  const int P = lim_.max_positions > 0 ? std::min(lim_.max_positions, cfg_.max_position_embeddings)
                                        : cfg_.max_position_embeddings;
  std::vector<float> tab(size_t(P) * rot);
  for (int p = 0; p < P; ++p)
    for (int i = 0; i < half; ++i) {
      const float ang = float(p) * cfg_.rope_inv_freq[i];  // fp32 product, as transformers computes it
      tab[size_t(p) * rot + i] = std::cos(ang) * cfg_.rope_attention_factor;
      tab[size_t(p) * rot + half + i] = std::sin(ang) * cfg_.rope_attention_factor;
    }
  rope_table_ = alloc_tensor(DType::F32, P, rot);
  be_.upload(rope_table_.data, tab.data(), tab.size() * 4);
  rope_ = RopeTable{rope_table_.ptr<float>(), rot, P};
}

int QwenModel::graph_bucket(int n, int max_n) {
  static const int buckets[] = {1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512};
  for (int b : buckets)
    if (b >= n) return std::min(b, max_n);
  return -1;
}

// Page-table columns of a graph-replayed step of n columns: a power of two from 16, at most max_n. Short
// contexts neither upload nor plan attention splits for every page of max_model_len, and a context growing
// by one page does not need a new graph. (QWEN_RT_GRAPH_PAGES=all: always max_n, for comparison.)
int QwenModel::graph_pages(int n, int max_n) {
  static const bool all = [] {
    const char* e = std::getenv("QWEN_RT_GRAPH_PAGES");
    return e && std::strcmp(e, "all") == 0;
  }();
  int p = 16;
  while (p < n && p < max_n) p *= 2;
  return all ? max_n : std::min(p, max_n);
}

AttnBatch QwenModel::upload_meta(const StepInput& s, const int32_t* sampled, KvCache& kv, int rows, int max_pages,
                                  int max_ctx) {
  const int T = s.num_tokens(), S = s.num_seqs(), R = int(s.logit_rows.size());
  const bool pad = rows > T;  // decode-only: T == S == R, padded to `rows` one-token sequences
  const int SS = pad ? rows : S, RR = pad ? rows : R;
  std::vector<int32_t> meta;
  meta.reserve(size_t(4 * rows + 2 * SS + 1 + SS * max_pages + RR));
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
  const size_t o_qs = put(s.q_start, SS + 1, [](int i) { return i; });
  const size_t o_ctx = put(s.ctx_len, SS, [](int) { return 1; });
  size_t o_pt = meta.size();
  for (int i = 0; i < SS; ++i)
    for (int j = 0; j < max_pages; ++j)
      meta.push_back(i < S && j < s.max_pages ? s.page_table[size_t(i) * s.max_pages + j] : 0);
  const size_t o_lr = put(s.logit_rows, RR, [](int i) { return i; });
  QRT_CHECK(int64_t(meta.size()) <= meta_.cols, "step metadata exceeds its buffer");
  be_.upload(meta_.data, meta.data(), meta.size() * 4);
  int32_t* m = meta_.ptr<int32_t>();
  // Tokens sampled by the step before, still in device memory, take their places.
  if (std::any_of(s.token_src.begin(), s.token_src.end(), [](int32_t i) { return i >= 0; })) {
    QRT_CHECK(sampled && vocab0_ == 0, "step input refers to sampled tokens it was not given");
    be_.fill_tokens(m + o_tok, m + o_src, sampled, rows);
  }
  d_tokens_ = m + o_tok;
  d_positions_ = m + o_pos;
  d_logit_rows_ = m + o_lr;
  AttnBatch b;
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
  return b;
}

Tensor QwenModel::forward(const StepInput& s, KvCache& kv, const int32_t* sampled) {
  const int T = s.num_tokens(), S = s.num_seqs(), R = int(s.logit_rows.size());
  QRT_CHECK(T > 0 && T <= lim_.max_tokens && S <= lim_.max_seqs && R <= lim_.max_seqs &&
                s.max_pages <= lim_.max_pages_per_seq,
            "step exceeds the model's limits");
  const bool decode = s.max_q_len == 1 && T == S && R == S;
  const int bucket = graph_bucket(S, std::min(lim_.max_seqs, lim_.max_tokens));
  if (lim_.graphs && be_.supports_graphs() && decode && bucket >= S) {
    // Fixed shapes for the graph: padded rows, and page-table columns whose pages bound every context.
    const int pages = graph_pages(s.max_pages, lim_.max_pages_per_seq);
    AttnBatch b = upload_meta(s, sampled, kv, bucket, pages, pages * kv.page_size());
    const std::pair<int, int> key{bucket, pages};
    auto it = graphs_.find(key);
    if (it == graphs_.end()) {
      be_.begin_capture();
      try {
        body(b, bucket, bucket, kv);
      } catch (...) {
        be_.abort_capture();  // leave the stream usable; the step fails with the body's error
        throw;
      }
      it = graphs_.emplace(key, be_.end_capture()).first;
    }
    be_.replay(it->second);
    return logits_view(R);
  }
  AttnBatch b = upload_meta(s, sampled, kv, T, s.max_pages, s.max_ctx_len);
  body(b, T, R, kv);
  return logits_view(R);
}

Tensor QwenModel::logits_view(int rows) const {
  // Padded vocab columns of the last shard are left out of the view.
  return Tensor(logits_.data, DType::F32, rows, cfg_.vocab_size, logits_.cols);
}

void QwenModel::body(const AttnBatch& b, int T, int R, KvCache& kv) {
  const int D = cfg_.head_dim, n = comm_.size();
  const float eps = cfg_.rms_eps;
  const AttnShape shape{q_heads_, kv_heads_, D, 1.0f / std::sqrt(float(D))};
  Tensor res = residual_.row_slice(0, T), h = hidden_.row_slice(0, T), qkv = qkv_.row_slice(0, T),
         attn = attn_.row_slice(0, T), gu = gate_up_.row_slice(0, T), act = act_.row_slice(0, T);
  // A row-parallel linear's output joins the residual stream: rank 0 adds its share to the residual, the
  // other ranks put theirs in place of it, and the ranks sum (one rank: just the add).
  auto add_to_residual = [&](const Tensor& x, const Linear& w) {
    if (comm_.rank() == 0) be_.linear_add(x, w, res);
    else be_.linear(x, w, nullptr, res);
    if (n > 1) comm_.all_reduce_sum(res);
  };

  be_.embedding(d_tokens_, embed_, res);
  if (n > 1) comm_.all_reduce_sum(res);
  for (int l = 0; l < cfg_.num_layers; ++l) {
    const Layer& L = layers_[l];
    be_.norm_linear(res, RmsNorm{L.input_norm, eps, false, gains_folded_}, L.qkv, cfg_.attn_bias ? &L.qkv_bias : nullptr, h, qkv);
    KvLayer cache = kv.layer(l);
    be_.qkv_attention(qkv, shape, cfg_.qk_norm ? &L.q_norm : nullptr, cfg_.qk_norm ? &L.k_norm : nullptr, eps, false,
                      d_positions_, rope_, b, cache, attn);
    add_to_residual(attn, L.o);
    be_.norm_linear_silu_mul(res, RmsNorm{L.post_norm, eps, false, gains_folded_}, L.gate_up, h, gu, act);
    add_to_residual(act, L.down);
  }
  // Only the rows that sample need the final norm and the LM head.
  if (R == 0) return;
  Tensor sr = sel_res_.row_slice(0, R), sh = sel_h_.row_slice(0, R);
  be_.gather_rows(res, d_logit_rows_, sr);
  const RmsNorm final_norm{final_norm_, eps, false, gains_folded_ && !cfg_.tie_embeddings};
  if (n == 1) {
    Tensor logits = logits_.row_slice(0, R);
    be_.norm_linear(sr, final_norm, lm_head_, nullptr, sh, logits);
    return;
  }
  // Vocab-parallel LM head: each rank's [R, vocab_pad_] shard, gathered, then placed side by side.
  Tensor local = logits_gathered_.row_slice(int64_t(comm_.rank()) * R, R);
  be_.norm_linear(sr, final_norm, lm_head_, nullptr, sh, local);
  Tensor gathered = logits_gathered_.row_slice(0, int64_t(n) * R);
  comm_.all_gather_rows(local, gathered);
  for (int r = 0; r < n; ++r) {
    Tensor dst = logits_.row_slice(0, R).col_slice(int64_t(r) * vocab_pad_, vocab_pad_);
    be_.convert(gathered.row_slice(int64_t(r) * R, R), dst);
  }
}

}  // namespace qrt
