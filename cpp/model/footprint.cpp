// Checkpoint tensors and per-rank bytes of the Qwen2/Qwen3 dense model (mirrors QwenModel's load and buffers;
// tests compare weights with QwenModel::weight_bytes()).
#include "model/footprint.h"

#include <algorithm>
#include <cmath>

namespace qrt {

void for_each_checkpoint_tensor(const ModelConfig& c, const std::function<void(const CheckpointTensor&)>& fn) {
  const std::string& pre = c.weight_prefix;
  const int64_t H = c.hidden_size, D = c.head_dim, I = c.intermediate_size, V = c.vocab_size;
  const int64_t qn = int64_t(c.num_q_heads) * D, kn = int64_t(c.num_kv_heads) * D;
  fn({pre + "embed_tokens.weight", V, H});
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = pre + "layers." + std::to_string(l) + ".";
    fn({p + "input_layernorm.weight", 1, H});
    fn({p + "post_attention_layernorm.weight", 1, H});
    fn({p + "self_attn.q_proj.weight", qn, H});
    fn({p + "self_attn.k_proj.weight", kn, H});
    fn({p + "self_attn.v_proj.weight", kn, H});
    if (c.attn_bias) {
      fn({p + "self_attn.q_proj.bias", 1, qn});
      fn({p + "self_attn.k_proj.bias", 1, kn});
      fn({p + "self_attn.v_proj.bias", 1, kn});
    }
    if (c.qk_norm) {
      fn({p + "self_attn.q_norm.weight", 1, D});
      fn({p + "self_attn.k_norm.weight", 1, D});
    }
    fn({p + "self_attn.o_proj.weight", H, qn});
    fn({p + "mlp.gate_proj.weight", I, H});
    fn({p + "mlp.up_proj.weight", I, H});
    fn({p + "mlp.down_proj.weight", H, I});
  }
  fn({pre + "norm.weight", 1, H});
  if (!c.tie_embeddings) fn({"lm_head.weight", V, H});
}

Footprint footprint(const ModelConfig& c, const FootprintShape& s) {
  const double n = std::max(1, s.ranks), H = c.hidden_size, D = c.head_dim, L = c.num_layers;
  const double ws = double(dtype_size(s.weights)), as = double(dtype_size(s.act)), f32 = 4;
  // This rank's share (QwenModel's constructor): heads, intermediate columns, padded vocabulary rows.
  const int nr = std::max(1, s.ranks);
  const double q_heads = c.num_q_heads / nr, inter = c.intermediate_size / nr;
  const double kv_heads = c.num_kv_heads % nr == 0 ? c.num_kv_heads / nr : 1;
  const double vocab_pad = std::ceil(double(c.vocab_size) / n);
  const double qn = q_heads * D, kn = kv_heads * D;
  const bool folded = s.folds_gains && s.weights == s.act && (s.weights == DType::BF16 || s.weights == DType::F16);
  Footprint f;
  double layer = (qn + 2 * kn) * H * ws + H * qn * ws + 3 * inter * H * ws;  // qkv, o, gate|up, down
  if (!folded) layer += 2 * H * f32;                                          // the two norm gains
  if (c.attn_bias) layer += (qn + 2 * kn) * f32;
  if (c.qk_norm) layer += 2 * D * f32;
  f.weights = vocab_pad * H * ws + L * layer;
  f.weights += folded ? 3 * H * f32 : H * f32;  // unit gain + two staging gains, or the final norm's gain
  if (!c.tie_embeddings) f.weights += vocab_pad * H * ws;
  const double T = s.max_tokens, S = s.max_seqs;
  f.workspace = (4 * std::max(T, S) + (S + 1) + S + S * double(s.max_pages_per_seq) + S) * 4  // metadata
                + T * (2 * H + (qn + 2 * kn) + qn + 3 * inter) * as + 2 * S * H * as    // activations
                + S * n * vocab_pad * f32 + (nr > 1 ? n * S * vocab_pad * f32 : 0);    // logits
  f.rope_position = double(c.rot_dim()) * f32;
  f.kv_page = L * 2 * double(s.page_size) * kn * double(dtype_size(s.kv));
  return f;
}

}  // namespace qrt
