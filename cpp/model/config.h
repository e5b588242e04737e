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
  // RoPE, resolved by Python (default or yarn): inverse frequencies for the rotated dims, and the
  // factor cos/sin are multiplied by.
  std::vector<float> rope_inv_freq;  // rot_dim / 2 values
  float rope_attention_factor = 1.0f;
  std::string weight_prefix = "model.";  // tensors are <prefix>layers.N..., lm_head.weight at top level

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
  int q_size() const { return num_q_heads * head_dim; }
  int kv_size() const { return num_kv_heads * head_dim; }
};

// Validates a config; throws std::invalid_argument naming the first bad field.
void validate(const ModelConfig& c);

}  // namespace qrt
