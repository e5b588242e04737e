// Checkpoint tensors and per-rank bytes of a Qwen model, dense or hybrid (mirrors QwenModel's load and buffers;
// tests compare weights with QwenModel::weight_bytes()).
#include "model/footprint.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "kv/kv_cache.h"
#include "kv/state_cache.h"
#include "model/layers.h"

namespace qrt {

void for_each_checkpoint_tensor(const ModelConfig& c, const std::function<void(const CheckpointTensor&)>& fn) {
  const std::string& pre = c.weight_prefix;
  const int64_t H = c.hidden_size, D = c.head_dim, I = c.intermediate_size, V = c.vocab_size;
  const int64_t qn = int64_t(c.num_q_heads) * D, kn = int64_t(c.num_kv_heads) * D;
  const int64_t conv = 2 * int64_t(c.linear_k_heads) * c.linear_k_dim + int64_t(c.linear_v_heads) * c.linear_v_dim;
  const int64_t Hv = c.linear_v_heads, vn = Hv * c.linear_v_dim;
  auto attention = [&](const std::string& p) {
    fn({p + "self_attn.q_proj.weight", qn * (c.attn_output_gate ? 2 : 1), H, true});
    fn({p + "self_attn.k_proj.weight", kn, H, true});
    fn({p + "self_attn.v_proj.weight", kn, H, true});
    if (c.attn_bias) {
      fn({p + "self_attn.q_proj.bias", 1, qn});
      fn({p + "self_attn.k_proj.bias", 1, kn});
      fn({p + "self_attn.v_proj.bias", 1, kn});
    }
    if (c.qk_norm) {
      fn({p + "self_attn.q_norm.weight", 1, D});
      fn({p + "self_attn.k_norm.weight", 1, D});
    }
    fn({p + "self_attn.o_proj.weight", H, qn, true});
  };
  auto mlp = [&](const std::string& p) {
    fn({p + "mlp.gate_proj.weight", I, H, true});
    fn({p + "mlp.up_proj.weight", I, H, true});
    fn({p + "mlp.down_proj.weight", H, I, true});
  };
  fn({pre + "embed_tokens.weight", V, H});
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = pre + "layers." + std::to_string(l) + ".";
    fn({p + "input_layernorm.weight", 1, H});
    fn({p + "post_attention_layernorm.weight", 1, H});
    if (c.is_delta_net(l)) {
      const std::string a = p + "linear_attn.";
      fn({a + "in_proj_qkv.weight", conv, H, true});
      fn({a + "in_proj_z.weight", vn, H, true});
      fn({a + "in_proj_b.weight", Hv, H, true});
      fn({a + "in_proj_a.weight", Hv, H, true});
      fn({a + "conv1d.weight", conv, c.linear_conv_kernel});
      fn({a + "A_log", 1, Hv});
      fn({a + "dt_bias", 1, Hv});
      fn({a + "norm.weight", 1, c.linear_v_dim});
      fn({a + "out_proj.weight", H, vn, true});
    } else {
      attention(p);
    }
    mlp(p);
  }
  fn({pre + "norm.weight", 1, H});
  if (!c.tie_embeddings) fn({"lm_head.weight", V, H});
  for (int l = 0; l < c.mtp_layers; ++l) {  // QwenModel::load_mtp
    if (l == 0) {
      fn({"mtp.pre_fc_norm_embedding.weight", 1, H});
      fn({"mtp.pre_fc_norm_hidden.weight", 1, H});
      fn({"mtp.fc.weight", H, 2 * H, true});
      fn({"mtp.norm.weight", 1, H});
    }
    const std::string p = "mtp.layers." + std::to_string(l) + ".";
    fn({p + "input_layernorm.weight", 1, H});
    fn({p + "post_attention_layernorm.weight", 1, H});
    attention(p);
    mlp(p);
  }
}

Footprint footprint(const ModelConfig& c, const FootprintShape& s) {
  const int nr = std::max(1, s.ranks);
  const Shard sh(c, 0, nr);  // every rank's share is the same size
  const double n = nr, H = c.hidden_size, D = c.head_dim;
  const double ws = double(dtype_size(s.weights)), as = double(dtype_size(s.act)), f32 = 4;
  const double vocab_pad = std::ceil(double(c.vocab_size) / n);
  const double qn = double(sh.q_heads) * D, kn = double(sh.kv_heads) * D, inter = sh.inter;
  const bool folds = s.folds_gains && s.weights == s.act && (s.weights == DType::BF16 || s.weights == DType::F16);
  const DeltaNetShape& d = sh.delta;
  const double attn_proj = c.num_attention_layers() ? double(AttentionLayer::proj_cols(c, sh)) : 0;
  const double delta_proj = c.num_delta_net_layers() ? double(DeltaNetLayer::proj_cols(sh)) : 0;
  Footprint f;
  // Weights (QwenModel::load_weights, model/layers.cpp): each linear as WeightLoader::linear allocates it.
  auto bytes = [&](const LinearSpec& sp) { return linear_layout(sp, c).bytes(sp, s.weights); };
  auto fp8 = [&](const LinearSpec& sp) { return linear_layout(sp, c).fp8; };
  bool any_fold = false;
  auto gain = [&](bool foldable) {  // a norm's gain: none once folded into the linears it feeds
    if (folds && foldable) return any_fold = true, 0.0;
    return H * f32;
  };
  // One decoder layer (p: "<prefix>layers.N."); layers differ only where fp8_skip names their modules.
  auto layer = [&](const std::string& p, bool delta_net) {
    double b = 0;
    bool fold_in;
    if (delta_net) {
      const std::string a = p + "linear_attn.";
      const LinearSpec in = DeltaNetLayer::in_proj_spec(a, c, sh);
      b += bytes(in) + bytes(DeltaNetLayer::out_spec(a, c, sh));
      fold_in = !fp8(in);
      if (!DeltaNetLayer::fuses_ba(a, c)) {
        const LinearSpec ba = DeltaNetLayer::ba_spec(a, c, sh);
        b += bytes(ba);
        fold_in = fold_in && !fp8(ba);
      }
      b += double(d.conv_cols()) * d.conv_kernel * as + (2.0 * d.v_heads + d.v_dim) * f32;  // conv; A_log, dt_bias, norm
    } else {
      const std::string a = p + "self_attn.";
      const LinearSpec qkv = AttentionLayer::qkv_spec(a, c, sh);
      b += bytes(qkv) + bytes(AttentionLayer::o_spec(a, c, sh));
      if (c.attn_bias) b += (qn + 2 * kn) * f32;
      if (c.qk_norm) b += 2 * D * f32;
      fold_in = !fp8(qkv);
    }
    const LinearSpec gate_up = Mlp::gate_up_spec(p + "mlp.", c, sh);
    b += bytes(gate_up) + bytes(Mlp::down_spec(p + "mlp.", c, sh));
    return b + gain(fold_in) + gain(!fp8(gate_up));
  };
  // The layers fp8_skip names one by one; the others by kind, from one of each (a config of 2^31 layers stays cheap).
  const std::string layers = c.weight_prefix + "layers.";
  std::set<int64_t> listed;
  for (const std::string& m : c.fp8_skip)
    if (m.compare(0, layers.size(), layers) == 0) {
      const int64_t l = std::atoll(m.c_str() + layers.size());
      if (l >= 0 && l < c.num_layers) listed.insert(l);
    }
  double weights = 0, listed_delta = 0;
  for (int64_t l : listed) {
    weights += layer(layers + std::to_string(l) + ".", c.is_delta_net(int(l)));
    listed_delta += c.is_delta_net(int(l));
  }
  const double other_delta = c.num_delta_net_layers() - listed_delta;
  const double other_attention = double(c.num_layers) - double(listed.size()) - other_delta;
  if (other_delta > 0) weights += other_delta * layer(layers + "?.", true);
  if (other_attention > 0) weights += other_attention * layer(layers + "?.", false);
  for (int l = 0; l < c.mtp_layers; ++l) {  // QwenModel::load_mtp: fc (replicated), norms, a full-attention layer
    LinearSpec fc;
    fc.in = 2 * int64_t(H);
    fc.add("mtp.fc", int64_t(H), 2 * int64_t(H), 0, int64_t(H));
    weights += (l == 0 ? bytes(fc) + 3 * H * f32 : 0) + layer("mtp.layers." + std::to_string(l) + ".", false);
  }
  weights += vocab_pad * H * ws * (c.tie_embeddings ? 1 : 2);  // embedding (and LM head)
  weights += gain(!c.tie_embeddings);                           // the final norm: folds into an untied LM head
  if (any_fold) weights += 2 * H * f32;                          // folding keeps a unit gain and a staging gain
  f.weights = weights;
  // Workspace (QwenModel's constructor).
  const double T = s.max_tokens, S = s.max_seqs, LR = std::max(s.max_seqs, s.max_logit_rows);
  double rows = 2 * H + 3 * inter;  // residual, norm output, gate|up, act
  if (c.num_attention_layers()) rows += attn_proj + qn;
  if (c.num_delta_net_layers()) rows += delta_proj + double(d.conv_cols()) + double(d.v_cols());
  f.workspace = (4 * std::max(T, S) + (S + 1) + 2 * S + S * double(s.max_pages_per_seq) + S) * 4  // metadata
                + T * rows * as + 2 * LR * H * as                                               // activations
                + LR * n * vocab_pad * f32 + (nr > 1 ? n * LR * vocab_pad * f32 : 0);          // logits
  f.rope_position = double(c.rot_dim()) * f32;
  KvFormat kvf;  // K and V rows of a page (with FP8 scales), and its two summary rows
  kvf.layers = c.num_kv_layers();
  kvf.page_size = s.page_size;
  kvf.kv_heads = sh.kv_heads;
  kvf.head_dim = c.head_dim;
  kvf.dtype = s.kv;
  kvf.summaries = s.sparse;
  kvf.summary_dtype = KvFormat::summary_dtype_for(s.kv, s.act);
  f.kv_page = double(kvf.page_bytes());
  f.kv_host_page = double(kvf.host_page_bytes());
  if (c.mtp_layers) f.workspace += T * (2 * H + H) * as;  // the MTP head's input [T, 2H] and hidden rows [T, H]
  if (c.mtp_layers) f.workspace += T * H * as;           // the final norm's rows (the MTP head's input)
  if (s.sparse && c.num_attention_layers()) {  // scores and page lists [S, kv heads, columns], keys [S, kv heads]
    const double lists = S * double(sh.kv_heads);
    f.select_page = lists * 8;
    f.workspace += f.select_page * double(s.max_pages_per_seq) + lists * 4;
  }
  if (c.num_delta_net_layers())
    f.state_slot = double(StateCache::bytes_per_slot(c.num_delta_net_layers(), d, s.act));
  return f;
}

}  // namespace qrt
