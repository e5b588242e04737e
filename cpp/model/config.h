// ModelConfig: what the forward pass needs to know about a checkpoint. Filled by Python from config.json.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace qrt {

struct ModelConfig {
  std::string arch;            // "qwen2" | "qwen3"
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
  bool qk_norm = false;        // per-head RMSNorm on q and k (Qwen3)
  int max_position_embeddings = 0;
  // RoPE, resolved by Python (default or yarn): inverse frequencies for the rotated dims, and the
  // factor cos/sin are multiplied by.
  std::vector<float> rope_inv_freq;  // rot_dim / 2 values
  float rope_attention_factor = 1.0f;
  std::string weight_prefix = "model.";  // tensors are <prefix>layers.N..., lm_head.weight at top level

  int rot_dim() const { return int(rope_inv_freq.size()) * 2; }
  int q_size() const { return num_q_heads * head_dim; }
  int kv_size() const { return num_kv_heads * head_dim; }
};

// Validates a config; throws std::invalid_argument naming the first bad field.
void validate(const ModelConfig& c);

}  // namespace qrt
