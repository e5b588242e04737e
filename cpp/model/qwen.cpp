#include "model/qwen.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "backend/random.h"
#include "core/error.h"

namespace qrt {

void validate(const ModelConfig& c) {
  QRT_CHECK_ARG(c.arch == "qwen2" || c.arch == "qwen3" || c.arch == "qwen3_5", "unsupported model architecture '",
                c.arch, "'");
  QRT_CHECK_ARG(c.vocab_size > 0 && c.hidden_size > 0 && c.num_layers > 0 && c.intermediate_size > 0,
                "config: vocab_size, hidden_size, num_hidden_layers and intermediate_size must be positive");
  QRT_CHECK_ARG(c.num_q_heads > 0 && c.num_kv_heads > 0 && c.num_q_heads % c.num_kv_heads == 0,
                "config: num_attention_heads (", c.num_q_heads, ") must be a multiple of num_key_value_heads (",
                c.num_kv_heads, ")");
  QRT_CHECK_ARG(c.head_dim > 0 && c.head_dim % 2 == 0, "config: head_dim must be positive and even");
  QRT_CHECK_ARG(c.rot_dim() > 0 && c.rot_dim() <= c.head_dim, "config: bad rotary dimension ", c.rot_dim());
  QRT_CHECK_ARG(c.max_position_embeddings > 0, "config: max_position_embeddings must be positive");
  QRT_CHECK_ARG(c.layer_types.empty() || int(c.layer_types.size()) == c.num_layers, "config: layer_types has ",
                c.layer_types.size(), " entries for ", c.num_layers, " layers");
  for (const std::string& t : c.layer_types)
    QRT_CHECK_ARG(t == "full_attention" || t == "linear_attention", "config: layer type '", t,
                  "' is not supported (full_attention, linear_attention)");
  if (c.num_delta_net_layers() > 0) {
    QRT_CHECK_ARG(c.linear_k_heads > 0 && c.linear_v_heads > 0 && c.linear_v_heads % c.linear_k_heads == 0,
                  "config: linear_num_value_heads (", c.linear_v_heads, ") must be a positive multiple of ",
                  "linear_num_key_heads (", c.linear_k_heads, ")");
    QRT_CHECK_ARG(c.linear_k_dim > 0 && c.linear_v_dim > 0, "config: linear_key_head_dim and linear_value_head_dim ",
                  "must be positive");
    QRT_CHECK_ARG(c.linear_conv_kernel >= 2 && c.linear_conv_kernel <= 8, "config: linear_conv_kernel_dim ",
                  c.linear_conv_kernel, " is not supported (2 to 8)");
  }
  QRT_CHECK_ARG(c.fp8_scales.empty() || c.fp8_scales == "block" || c.fp8_scales == "channel" ||
                    c.fp8_scales == "tensor",
                "config: FP8 scale format '", c.fp8_scales, "' is not supported (block, channel, tensor)");
  QRT_CHECK_ARG(!c.fp8_online || c.fp8_scales == "block", "config: FP8 quantization at load uses block scales");
  const int64_t int_max = 0x7fffffff;  // the rows and columns below are int
  QRT_CHECK_ARG(int64_t(c.num_q_heads) * c.head_dim <= int_max && 2 * int64_t(c.intermediate_size) <= int_max,
                "config: num_attention_heads x head_dim and 2 x intermediate_size must be below 2^31");
}

QwenModel::QwenModel(const ModelConfig& cfg, Backend& be, Comm& comm, const WeightSpec& ws, const Limits& lim,
                     const Progress& progress)
    : cfg_((validate(cfg), cfg)), be_(be), comm_(comm), ws_(ws), lim_(lim), shard_(cfg_, comm.rank(), comm.size()) {
  const int n = comm.size(), r = comm.rank();
  QRT_CHECK_ARG(be.supports_head_dim(cfg_.head_dim), "head_dim ", cfg_.head_dim, " is not supported by the ",
                be.name(), " backend (64, 128 or 256)");
  QRT_CHECK_ARG(cfg_.num_delta_net_layers() == 0 || be.supports_delta_net(shard_.delta), "Gated DeltaNet layers of ",
                "key head dim ", cfg_.linear_k_dim, " and conv width ", cfg_.linear_conv_kernel, " are not supported by ",
                "the ", be.name(), " backend (CUDA: key head dims 16 to 256 in powers of two, conv widths 2 to 4)");
  vocab_pad_ = (cfg_.vocab_size + n - 1) / n;
  vocab0_ = r * vocab_pad_;
  vocab_rows_ = std::max(0, std::min(vocab_pad_, cfg_.vocab_size - vocab0_));
  load_weights(progress);
  build_rope_table();

  const DType act = be_.act_dtype();
  const int T = lim_.max_tokens, S = lim_.max_seqs, H = cfg_.hidden_size, D = cfg_.head_dim, LR = logit_rows();
  runner_ = std::make_unique<StepRunner>(be_, T, S, lim_.max_pages_per_seq, LR, vocab0_, lim_.graphs);
  residual_ = alloc_tensor(act, T, H);
  ws_full_.h = alloc_tensor(act, T, H);
  const bool delta = cfg_.num_delta_net_layers() > 0, attention = cfg_.num_attention_layers() > 0;
  if (attention) {
    ws_full_.qkv = alloc_tensor(act, T, AttentionLayer::proj_cols(cfg_, shard_));
    ws_full_.attn = alloc_tensor(act, T, int64_t(shard_.q_heads) * D);
  }
  if (delta) {
    ws_full_.proj = alloc_tensor(act, T, DeltaNetLayer::proj_cols(shard_));
    ws_full_.conv = alloc_tensor(act, T, shard_.delta.conv_cols());
    ws_full_.core = alloc_tensor(act, T, shard_.delta.v_cols());
  }
  ws_full_.gate_up = alloc_tensor(act, T, 2 * int64_t(shard_.inter));
  ws_full_.act = alloc_tensor(act, T, shard_.inter);
  if (lim_.sparse.budget_pages > 0 && attention) {
    const int64_t lists = int64_t(S) * shard_.kv_heads;
    sparse_scores_ = alloc_tensor(DType::F32, lists, lim_.max_pages_per_seq);
    sparse_pages_ = alloc_tensor(DType::I32, lists, lim_.max_pages_per_seq);
    sparse_keys_ = alloc_tensor(DType::I32, 1, lists);
  }
  if (cfg_.mtp_layers) {
    hidden_ = alloc_tensor(act, T, H);
    mtp_in_ = alloc_tensor(act, T, 2 * int64_t(H));
    mtp_hidden_ = alloc_tensor(act, T, H);
    hidden_rows_ = alloc_tensor(DType::I32, 1, T);
  }
  sel_res_ = alloc_tensor(act, LR, H);
  sel_h_ = alloc_tensor(act, LR, H);
  // Logits: this rank's shard [LR, vocab_pad_]; with several ranks, gathered then laid out as [LR, n * vocab_pad_].
  logits_ = alloc_tensor(DType::F32, LR, int64_t(n) * vocab_pad_);
  if (n > 1) logits_gathered_ = alloc_tensor(DType::F32, int64_t(n) * LR, vocab_pad_);
}

Tensor QwenModel::alloc_tensor(DType t, int64_t rows, int64_t cols) {
  storage_.emplace_back(&be_, size_t(rows) * size_t(cols) * dtype_size(t));
  return storage_.back().tensor(t, rows, cols);
}

void QwenModel::load_weights(const Progress& progress) {
  const std::string& pre = cfg_.weight_prefix;
  const int H = cfg_.hidden_size, V = cfg_.vocab_size;
  const bool zc = cfg_.zero_centred_norms;
  WeightLoader ld(be_, ws_, cfg_, storage_);
  // Vocab-parallel: this rank holds rows [vocab0_, vocab0_ + vocab_rows_) of the embedding (and LM head),
  // padded with zero rows to vocab_pad_.
  auto load_vocab_shard = [&](const std::string& name) {
    Tensor t = ld.alloc(ws_.dtype, vocab_pad_, H);
    be_.fill_zero(t.data, t.nbytes());
    if (vocab_rows_ > 0) ld.load(name, V, H, vocab0_, 0, t.row_slice(0, vocab_rows_));
    return t;
  };
  // A norm that feeds ws: its gain, or a unit gain once the gain is folded into them (16-bit weights on a backend
  // whose fused norm is faster without one; never FP8 ones).
  auto norm = [&](const std::string& name, const std::vector<Linear*>& ws) {
    NormGain g;
    g.w = ld.norm_gain(name, H, zc, ws, &g.folded);
    return g;
  };
  embed_ = load_vocab_shard(pre + "embed_tokens.weight");
  layers_.resize(cfg_.num_layers);
  int attention_layers = 0, delta_layers = 0;
  for (int l = 0; l < cfg_.num_layers; ++l) {
    if (progress) progress("loading weights", l, cfg_.num_layers);
    DecoderLayer& L = layers_[l];
    const std::string p = pre + "layers." + std::to_string(l) + ".";
    L.delta_net = cfg_.is_delta_net(l);
    L.cache_index = L.delta_net ? delta_layers++ : attention_layers++;
    std::vector<Linear*> mixer_in;
    if (L.delta_net) {
      L.delta.load(ld, p + "linear_attn.", cfg_, shard_);
      mixer_in = {&L.delta.in_proj};
      if (!L.delta.in_proj_ba.w.empty()) mixer_in.push_back(&L.delta.in_proj_ba);
    } else {
      L.attention.load(ld, p + "self_attn.", cfg_, shard_);
      mixer_in = {&L.attention.qkv};
    }
    L.mlp.load(ld, p + "mlp.", cfg_, shard_);
    L.input_norm = norm(p + "input_layernorm.weight", mixer_in);
    L.post_norm = norm(p + "post_attention_layernorm.weight", {&L.mlp.gate_up});
  }
  // The LM head is the embedding table (tied), or the final norm's rows are the MTP head's input: the gain stays in
  // the norm.
  if (cfg_.tie_embeddings) {
    lm_head_.w = embed_;
  } else {
    lm_head_.w = load_vocab_shard("lm_head.weight");
  }
  final_norm_ = norm(pre + "norm.weight", cfg_.tie_embeddings || cfg_.mtp_layers ? std::vector<Linear*>{}
                                                                                  : std::vector<Linear*>{&lm_head_});
  if (cfg_.mtp_layers) load_mtp(ld, norm);
  weight_bytes_ = 0;
  for (const auto& b : storage_) weight_bytes_ += b.bytes();
  be_.synchronize();
  if (progress) progress("loading weights", cfg_.num_layers, cfg_.num_layers);
}

void QwenModel::load_mtp(WeightLoader& ld,
                         const std::function<NormGain(const std::string&, const std::vector<Linear*>&)>& norm) {
  QRT_CHECK_ARG(cfg_.mtp_layers == 1, "an MTP head of ", cfg_.mtp_layers, " layers is not supported (1)");
  const int64_t H = cfg_.hidden_size;
  mtp_ = std::make_unique<MtpHead>();
  mtp_->embedding_norm = norm("mtp.pre_fc_norm_embedding.weight", {});
  mtp_->hidden_norm = norm("mtp.pre_fc_norm_hidden.weight", {});
  LinearSpec fc;
  fc.in = 2 * H;
  fc.add("mtp.fc", H, 2 * H, 0, H);
  mtp_->fc = ld.linear(fc);
  DecoderLayer& L = mtp_->layer;
  const std::string p = "mtp.layers.0.";
  L.cache_index = cfg_.num_attention_layers();
  L.attention.load(ld, p + "self_attn.", cfg_, shard_);
  L.mlp.load(ld, p + "mlp.", cfg_, shard_);
  L.input_norm = norm(p + "input_layernorm.weight", {&L.attention.qkv});
  L.post_norm = norm(p + "post_attention_layernorm.weight", {&L.mlp.gate_up});
  mtp_->norm = norm("mtp.norm.weight", {});
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

Tensor QwenModel::forward(const StepInput& s, KvCache& kv, StateCache* state, const int32_t* sampled) {
  const int T = s.num_tokens(), S = s.num_seqs(), R = int(s.logit_rows.size());
  QRT_CHECK(T > 0 && T <= lim_.max_tokens && S <= lim_.max_seqs && R <= logit_rows() &&
                s.max_pages <= lim_.max_pages_per_seq,
            "step exceeds the model's limits");
  QRT_CHECK(cfg_.num_delta_net_layers() == 0 || (state && int(s.slots.size()) == S),
            "a step of a model with DeltaNet layers needs its state cache and each sequence's slot");
  runner_->run(s, sampled, kv, state, [&](const StepMeta& meta, int rows) { body(meta, rows, kv, state); });
  return logits_view(R);
}

Tensor QwenModel::logits_view(int rows) const {
  // Padded vocab columns of the last shard are left out of the view.
  return Tensor(logits_.data, DType::F32, rows, cfg_.vocab_size, logits_.cols);
}

void QwenModel::body(const StepMeta& meta, int R, KvCache& kv, StateCache* state) {
  const AttnBatch& b = meta.batch;
  const int n = comm_.size(), T = meta.rows;
  const float eps = cfg_.rms_eps;
  const bool zc = cfg_.zero_centred_norms;
  Tensor res = residual_.row_slice(0, T);
  const Workspace& w = ws_full_;
  auto rows = [T](const Tensor& t) { return t.empty() ? t : t.row_slice(0, T); };
  LayerStep step{be_, comm_, b, meta.positions, rope_, T, res,
                 Workspace{rows(w.h), rows(w.qkv), rows(w.attn), rows(w.proj), rows(w.conv), rows(w.core),
                           rows(w.gate_up), rows(w.act)}};
  SparseStep sparse;
  if (!sparse_pages_.empty()) {
    sparse.rule = lim_.sparse;
    sparse.select = b.max_pages > lim_.sparse.budget_pages;  // a graph's pages bound every context it replays
    sparse.scores = sparse_scores_.ptr<float>();
    sparse.pages = sparse_pages_.ptr<int32_t>();
    sparse.keys = sparse_keys_.ptr<int32_t>();
    step.sparse = &sparse;
  }
  be_.embedding(meta.tokens, embed_, res);
  if (n > 1) comm_.all_reduce_sum(res);
  for (const DecoderLayer& L : layers_) {
    if (L.delta_net) L.delta.forward(step, L.input_norm.norm(eps, zc), cfg_, shard_, state->layer(L.cache_index));
    else L.attention.forward(step, L.input_norm.norm(eps, zc), cfg_, shard_, kv.layer(L.cache_index));
    L.mlp.forward(step, L.post_norm.norm(eps, zc));
  }
  Tensor sh = sel_h_.row_slice(0, std::max(R, 1));
  if (mtp_) {  // every row's final-norm state: the MTP head's input
    Tensor hid = hidden_.row_slice(0, T);
    be_.rms_norm(res, final_norm_.w, eps, zc, hid);
    if (R == 0) return;
    sh = sh.row_slice(0, R);
    be_.gather_rows(hid, meta.logit_rows, sh);
    lm_head(sh, R);
    return;
  }
  // Only the rows that sample need the final norm and the LM head.
  if (R == 0) return;
  Tensor sr = sel_res_.row_slice(0, R);
  sh = sh.row_slice(0, R);
  be_.gather_rows(res, meta.logit_rows, sr);
  const RmsNorm final_norm = final_norm_.norm(eps, zc);
  if (n == 1) {
    Tensor logits = logits_.row_slice(0, R);
    be_.norm_linear(sr, final_norm, lm_head_, nullptr, sh, logits);
    return;
  }
  // Vocab-parallel LM head: each rank's [R, vocab_pad_] shard, gathered, then placed side by side.
  Tensor local = logits_gathered_.row_slice(int64_t(comm_.rank()) * R, R);
  be_.norm_linear(sr, final_norm, lm_head_, nullptr, sh, local);
  gather_logits(R);
}

void QwenModel::lm_head(const Tensor& rows, int R) {
  const int n = comm_.size();
  if (n == 1) {
    Tensor logits = logits_.row_slice(0, R);
    be_.linear(rows, lm_head_, nullptr, logits);
    return;
  }
  Tensor local = logits_gathered_.row_slice(int64_t(comm_.rank()) * R, R);
  be_.linear(rows, lm_head_, nullptr, local);
  gather_logits(R);
}

void QwenModel::gather_logits(int R) {
  const int n = comm_.size();
  Tensor local = logits_gathered_.row_slice(int64_t(comm_.rank()) * R, R);
  Tensor gathered = logits_gathered_.row_slice(0, int64_t(n) * R);
  comm_.all_gather_rows(local, gathered);
  for (int r = 0; r < n; ++r) {
    Tensor dst = logits_.row_slice(0, R).col_slice(int64_t(r) * vocab_pad_, vocab_pad_);
    be_.convert(gathered.row_slice(int64_t(r) * R, R), dst);
  }
}

Tensor QwenModel::draft(const StepInput& s, const std::vector<int32_t>& hidden_rows, bool from_draft, KvCache& kv) {
  QRT_CHECK(mtp_, "draft: the model has no MTP head");
  const int T = s.num_tokens(), R = int(s.logit_rows.size());
  QRT_CHECK(T > 0 && T <= lim_.max_tokens && R <= logit_rows() && s.num_seqs() <= lim_.max_seqs &&
                s.max_pages <= lim_.max_pages_per_seq && int(hidden_rows.size()) == T,
            "draft step exceeds the model's limits");
  // The hidden rows of the step's rows as the runner pads them (padded rows read row 0).
  std::vector<int32_t> rows(size_t(runner_->padded_rows(s)), 0);
  std::copy(hidden_rows.begin(), hidden_rows.end(), rows.begin());
  be_.upload(hidden_rows_.data, rows.data(), rows.size() * 4);
  runner_->run(s, nullptr, kv, nullptr, [&](const StepMeta& meta, int r) { draft_body(meta, r, from_draft, kv); },
               from_draft ? 2 : 1);
  return logits_view(R);
}

void QwenModel::draft_body(const StepMeta& meta, int R, bool from_draft, KvCache& kv) {
  const AttnBatch& b = meta.batch;
  const int T = meta.rows, n = comm_.size();
  const int64_t H = cfg_.hidden_size;
  const float eps = cfg_.rms_eps;
  const bool zc = cfg_.zero_centred_norms;
  Tensor res = residual_.row_slice(0, T), in = mtp_in_.row_slice(0, T);
  Tensor e = in.col_slice(0, H), g = in.col_slice(H, H);
  be_.embedding(meta.tokens, embed_, res);
  if (n > 1) comm_.all_reduce_sum(res);
  be_.rms_norm(res, mtp_->embedding_norm.w, eps, zc, e);
  Tensor picked = ws_full_.h.row_slice(0, T);
  be_.gather_rows(from_draft ? mtp_hidden_ : hidden_, hidden_rows_.ptr<int32_t>(), picked);
  be_.rms_norm(picked, mtp_->hidden_norm.w, eps, zc, g);
  be_.linear(in, mtp_->fc, nullptr, res);
  const Workspace& w = ws_full_;
  auto rows = [T](const Tensor& t) { return t.empty() ? t : t.row_slice(0, T); };
  LayerStep step{be_, comm_, b, meta.positions, rope_, T, res,
                 Workspace{rows(w.h), rows(w.qkv), rows(w.attn), rows(w.proj), rows(w.conv), rows(w.core),
                           rows(w.gate_up), rows(w.act)}};
  const DecoderLayer& L = mtp_->layer;
  L.attention.forward(step, L.input_norm.norm(eps, zc), cfg_, shard_, kv.layer(L.cache_index));
  L.mlp.forward(step, L.post_norm.norm(eps, zc));
  Tensor out = mtp_hidden_.row_slice(0, T);
  be_.rms_norm(res, mtp_->norm.w, eps, zc, out);
  if (R > 0) {
    Tensor sh = sel_h_.row_slice(0, R);
    be_.gather_rows(out, meta.logit_rows, sh);
    lm_head(sh, R);
  }
}

}  // namespace qrt
