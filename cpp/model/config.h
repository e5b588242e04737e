// ModelConfig: what the forward pass needs to know about a checkpoint. Filled by Python from config.json.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace qrt {

struct ModelConfig {
  std::string arch;            // "qwen2" | "qwen3" | "qwen3_5" (hybrid: Gated DeltaNet + gated attention)
  int vocab_size = 0;
  int hidden_size = 0;
  int num_layers = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int intermediate_size = 0;
  float rms_eps = 1e-6f;
  bool tie_embeddings = false;
  bool attn_bias = false;      // q/k/v bias (Qwen2)
  bool qk_norm = false;        // per-head RMSNorm on q and k (Qwen3, Qwen3.5)
  bool zero_centred_norms = false;  // every RMSNorm gain but the DeltaNet output's is 1 + w (Qwen3.5)
  bool attn_output_gate = false;    // q_proj gives, per head, head_dim rows of q then head_dim of a sigmoid gate
  // Layer plan: layer_types[i] is "full_attention" or "linear_attention" (Gated DeltaNet); empty: all attention.
  std::vector<std::string> layer_types;
  // Gated DeltaNet layers (linear_attention).
  int linear_k_heads = 0;
  int linear_v_heads = 0;
  int linear_k_dim = 0;
  int linear_v_dim = 0;
  int linear_conv_kernel = 0;
  int max_position_embeddings = 0;
  // Multi-token prediction (Qwen3.5's `mtp.*`: fc, one full-attention decoder layer, norms; the model's embedding and
  // LM head): the layers loaded, for speculative decoding (0: none, or speculation off).
  int mtp_layers = 0;
  // RoPE, resolved by Python (default or yarn): inverse frequencies for the rotated dims, and the
  // factor cos/sin are multiplied by.
  std::vector<float> rope_inv_freq;  // rot_dim / 2 values
  float rope_attention_factor = 1.0f;
  std::string weight_prefix = "model.";  // tensors are <prefix>layers.N..., lm_head.weight at top level
  // FP8 linears (decoder projections only: embeddings, LM head, norms and convs never are). fp8_scales: "" (none),
  // "block" (Qwen's FP8 checkpoints, or quantized at load: one scale per 128 x 128 block), "channel" (one per output
  // row: compressed-tensors FP8 dynamic) or "tensor" (one per matrix). A checkpoint's FP8 linear keeps its F8_E4M3
  // `weight` and its scales in `<module>.<fp8_scale_name>`; fp8_online: the checkpoint's weights are 16/32-bit
  // and are quantized block-wise at load (also dummy weights). fp8_skip: linear modules kept unquantized (checkpoint
  // names without ".weight", as linear_modules lists them).
  std::string fp8_scales;
  std::string fp8_scale_name = "weight_scale_inv";
  bool fp8_online = false;
  std::vector<std::string> fp8_skip;

  int rot_dim() const { return int(rope_inv_freq.size()) * 2; }
  bool is_delta_net(int layer) const {
    return !layer_types.empty() && layer_types[size_t(layer)] == "linear_attention";
  }
  int num_delta_net_layers() const {
    int n = 0;
    for (int l = 0; l < num_layers; ++l) n += is_delta_net(l);
    return n;
  }
  int num_attention_layers() const { return num_layers - num_delta_net_layers(); }
  int num_kv_layers() const { return num_attention_layers() + mtp_layers; }  // the KV cache's: the MTP layer's last
  // Whether the linear module (checkpoint name without ".weight") is stored as FP8.
  bool fp8(const std::string& module) const {
    if (fp8_scales.empty()) return false;
    for (const std::string& m : fp8_skip)
      if (m == module) return false;
    return true;
  }
  int q_size() const { return num_q_heads * head_dim; }
  int kv_size() const { return num_kv_heads * head_dim; }
};

// Validates a config; throws std::invalid_argument naming the first bad field.
void validate(const ModelConfig& c);

}  // namespace qrt
