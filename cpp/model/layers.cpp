#include "model/layers.h"

#include <array>
#include <cmath>
#include <utility>

#include "core/error.h"

namespace qrt {

Shard::Shard(const ModelConfig& c, int r, int n) : rank(r), ranks(n) {
  QRT_CHECK_ARG(c.num_q_heads % n == 0, "tensor_parallel_size ", n, " does not divide the ", c.num_q_heads,
                " attention heads");
  QRT_CHECK_ARG(c.intermediate_size % n == 0, "tensor_parallel_size ", n, " does not divide intermediate_size ",
                c.intermediate_size);
  q_heads = c.num_q_heads / n;
  q_head0 = r * q_heads;
  if (c.num_kv_heads % n == 0) {
    kv_heads = c.num_kv_heads / n;
    kv_head0 = r * kv_heads;
  } else {
    QRT_CHECK_ARG(n % c.num_kv_heads == 0, "tensor_parallel_size ", n, " and ", c.num_kv_heads,
                  " KV heads: one must divide the other");
    kv_heads = 1;  // replicated: several ranks share one KV head
    kv_head0 = r * c.num_kv_heads / n;
  }
  inter = c.intermediate_size / n;
  inter0 = r * inter;
  if (c.num_delta_net_layers() > 0) {
    QRT_CHECK_ARG(c.linear_k_heads % n == 0 && c.linear_v_heads % n == 0, "tensor_parallel_size ", n,
                  " does not divide the DeltaNet heads (", c.linear_k_heads, " key, ", c.linear_v_heads, " value)");
    delta = DeltaNetShape{c.linear_k_heads / n, c.linear_v_heads / n, c.linear_k_dim, c.linear_v_dim,
                          c.linear_conv_kernel};
    k_head0 = r * delta.k_heads;
    v_head0 = r * delta.v_heads;
  }
}

void add_to_residual(LayerStep& s, const Tensor& x, const Linear& w) {
  if (s.comm.rank() == 0) s.be.linear_add(x, w, s.residual);
  else s.be.linear(x, w, nullptr, s.residual);
  if (s.comm.size() > 1) s.comm.all_reduce_sum(s.residual);
}

// --- attention ------------------------------------------------------------------------------------------------

int64_t AttentionLayer::proj_cols(const ModelConfig& c, const Shard& sh) {
  return int64_t(sh.q_heads * (c.attn_output_gate ? 2 : 1) + 2 * sh.kv_heads) * c.head_dim;
}

LinearSpec AttentionLayer::qkv_spec(const std::string& p, const ModelConfig& c, const Shard& sh) {
  const int64_t H = c.hidden_size, D = c.head_dim, qn = int64_t(sh.q_heads) * D, kn = int64_t(sh.kv_heads) * D;
  const int64_t q_rows = int64_t(c.num_q_heads) * D * (c.attn_output_gate ? 2 : 1), kv_rows = int64_t(c.num_kv_heads) * D;
  LinearSpec s;
  s.in = H;
  s.ranks = sh.ranks;
  if (c.attn_output_gate) {  // q_proj rows per head: D of q, then D of the gate; ours: q | k | v | gate
    s.add(p + "q_proj", q_rows, H, int64_t(sh.q_head0) * 2 * D, D, sh.q_heads, 2 * D);
  } else {
    s.add(p + "q_proj", q_rows, H, int64_t(sh.q_head0) * D, qn);
  }
  s.add(p + "k_proj", kv_rows, H, int64_t(sh.kv_head0) * D, kn);
  s.add(p + "v_proj", kv_rows, H, int64_t(sh.kv_head0) * D, kn);
  if (c.attn_output_gate)
    s.add(p + "q_proj", q_rows, H, int64_t(sh.q_head0) * 2 * D + D, D, sh.q_heads, 2 * D);
  return s;
}

LinearSpec AttentionLayer::o_spec(const std::string& p, const ModelConfig& c, const Shard& sh) {
  const int64_t H = c.hidden_size, qn = int64_t(sh.q_heads) * c.head_dim;
  LinearSpec s;
  s.c0 = int64_t(sh.q_head0) * c.head_dim;
  s.in = qn;
  s.ranks = sh.ranks;
  s.add(p + "o_proj", H, int64_t(c.num_q_heads) * c.head_dim, 0, H);
  return s;
}

void AttentionLayer::load(WeightLoader& ld, const std::string& p, const ModelConfig& c, const Shard& sh) {
  const int64_t D = c.head_dim, qn = int64_t(sh.q_heads) * D, kn = int64_t(sh.kv_heads) * D;
  const int64_t q_rows = int64_t(c.num_q_heads) * D * (c.attn_output_gate ? 2 : 1), kv_rows = int64_t(c.num_kv_heads) * D;
  qkv = ld.linear(qkv_spec(p, c, sh));
  if (c.attn_bias) {
    bias = ld.alloc(DType::F32, 1, qn + 2 * kn);
    const float sc = WeightLoader::kWeightScale;
    ld.load(p + "q_proj.bias", 1, q_rows, 0, int64_t(sh.q_head0) * D, bias.col_slice(0, qn), sc);
    ld.load(p + "k_proj.bias", 1, kv_rows, 0, int64_t(sh.kv_head0) * D, bias.col_slice(qn, kn), sc);
    ld.load(p + "v_proj.bias", 1, kv_rows, 0, int64_t(sh.kv_head0) * D, bias.col_slice(qn + kn, kn), sc);
  }
  if (c.qk_norm) {
    const float dummy = c.zero_centred_norms ? 0.f : 1.f;
    q_norm = ld.vector(p + "q_norm.weight", D, 0, D, 0.f, dummy);
    k_norm = ld.vector(p + "k_norm.weight", D, 0, D, 0.f, dummy);
  }
  o = ld.linear(o_spec(p, c, sh));
}

void AttentionLayer::forward(LayerStep& s, const RmsNorm& norm, const ModelConfig& c, const Shard& sh,
                             KvLayer cache) const {
  const int D = c.head_dim;
  const int64_t qn = int64_t(sh.q_heads) * D, kn = int64_t(sh.kv_heads) * D;
  const AttnShape shape{sh.q_heads, sh.kv_heads, D, 1.0f / std::sqrt(float(D))};
  Tensor proj = s.ws.qkv, out = s.ws.attn;
  s.be.norm_linear(s.residual, norm, qkv, c.attn_bias ? &bias : nullptr, s.ws.h, proj);
  Tensor q_k_v = c.attn_output_gate ? proj.col_slice(0, qn + 2 * kn) : proj;
  const Tensor* qn_w = c.qk_norm ? &q_norm : nullptr;
  const Tensor* kn_w = c.qk_norm ? &k_norm : nullptr;
  if (!s.sparse) {
    s.be.qkv_attention(q_k_v, shape, qn_w, kn_w, c.rms_eps, c.zero_centred_norms, s.positions, s.rope, s.batch, cache,
                       out);
  } else {  // the pages' summaries are kept every step; the step's decode rows select their pages where they may
    s.be.finish_qkv(q_k_v, shape, qn_w, kn_w, c.rms_eps, c.zero_centred_norms, s.positions, s.rope, s.batch, cache);
    s.be.summarize_pages(cache, s.batch, int(kn));
    const Tensor q = q_k_v.col_slice(0, qn);
    if (s.sparse->select) {
      const SparseStep& sp = *s.sparse;
      s.be.select_pages(q, cache, s.batch, shape, sp.rule, sp.scores, sp.pages, sp.keys);
      AttnBatch b = s.batch;
      b.page_table = sp.pages;
      b.ctx_len = sp.keys;
      b.head_tables = true;
      s.be.attention(q, cache, b, shape, out);
    } else {
      s.be.attention(q, cache, s.batch, shape, out);
    }
  }
  if (c.attn_output_gate) s.be.sigmoid_mul(out, proj.col_slice(qn + 2 * kn, qn));
  add_to_residual(s, out, o);
}

// --- Gated DeltaNet --------------------------------------------------------------------------------------------

bool DeltaNetLayer::fuses_ba(const std::string& p, const ModelConfig& c) {
  return c.fp8(p + "in_proj_qkv") == c.fp8(p + "in_proj_b");
}

namespace {

// This rank's rows of a [q of every key head | k | v] tensor (in_proj_qkv's rows, conv1d's channels): (first row,
// rows) of the q, k and v parts, in the order this rank stores them.
std::array<std::pair<int64_t, int64_t>, 3> qkv_rows(const ModelConfig& c, const Shard& sh) {
  const DeltaNetShape& d = sh.delta;
  const int64_t qk_all = int64_t(c.linear_k_heads) * d.k_dim;
  return {{{int64_t(sh.k_head0) * d.k_dim, d.qk_cols()},
           {qk_all + int64_t(sh.k_head0) * d.k_dim, d.qk_cols()},
           {2 * qk_all + int64_t(sh.v_head0) * d.v_dim, d.v_cols()}}};
}

int64_t qkv_rows_all(const ModelConfig& c) {
  return 2 * int64_t(c.linear_k_heads) * c.linear_k_dim + int64_t(c.linear_v_heads) * c.linear_v_dim;
}

// This rank's rows of in_proj_b, then of in_proj_a.
void add_ba(LinearSpec& s, const std::string& p, const ModelConfig& c, const Shard& sh) {
  s.add(p + "in_proj_b", c.linear_v_heads, c.hidden_size, sh.v_head0, sh.delta.v_heads);
  s.add(p + "in_proj_a", c.linear_v_heads, c.hidden_size, sh.v_head0, sh.delta.v_heads);
}

}  // namespace

LinearSpec DeltaNetLayer::in_proj_spec(const std::string& p, const ModelConfig& c, const Shard& sh) {
  const int64_t H = c.hidden_size, Hv = c.linear_v_heads, dv = sh.delta.v_dim;
  LinearSpec s;
  s.in = H;
  s.ranks = sh.ranks;
  for (const auto& [r0, n] : qkv_rows(c, sh)) s.add(p + "in_proj_qkv", qkv_rows_all(c), H, r0, n);
  s.add(p + "in_proj_z", Hv * dv, H, sh.v_head0 * dv, sh.delta.v_cols());
  if (fuses_ba(p, c)) add_ba(s, p, c, sh);
  return s;
}

LinearSpec DeltaNetLayer::ba_spec(const std::string& p, const ModelConfig& c, const Shard& sh) {
  LinearSpec s;
  s.in = c.hidden_size;
  s.ranks = sh.ranks;
  add_ba(s, p, c, sh);
  return s;
}

LinearSpec DeltaNetLayer::out_spec(const std::string& p, const ModelConfig& c, const Shard& sh) {
  LinearSpec s;
  s.c0 = int64_t(sh.v_head0) * sh.delta.v_dim;
  s.in = sh.delta.v_cols();
  s.ranks = sh.ranks;
  s.add(p + "out_proj", c.hidden_size, int64_t(c.linear_v_heads) * c.linear_v_dim, 0, c.hidden_size);
  return s;
}

void DeltaNetLayer::load(WeightLoader& ld, const std::string& p, const ModelConfig& c, const Shard& sh) {
  const DeltaNetShape& d = sh.delta;
  const int64_t dv = d.v_dim, K = d.conv_kernel, Hv = c.linear_v_heads;
  in_proj = ld.linear(in_proj_spec(p, c, sh));
  in_proj_ba = fuses_ba(p, c) ? Linear{} : ld.linear(ba_spec(p, c, sh));
  conv_w = ld.alloc(ld.backend().act_dtype(), d.conv_cols(), K);
  int64_t row = 0;  // the conv's channels are in_proj_qkv's rows
  for (const auto& [r0, n] : qkv_rows(c, sh)) {
    ld.load(p + "conv1d.weight", qkv_rows_all(c), K, r0, 0, conv_w.row_slice(row, n));
    row += n;
  }
  a_log = ld.vector(p + "A_log", Hv, sh.v_head0, d.v_heads, 1.0f, 0.f);
  dt_bias = ld.vector(p + "dt_bias", Hv, sh.v_head0, d.v_heads, 0.f, 1.0f);
  norm_w = ld.vector(p + "norm.weight", dv, 0, dv, 0.f, 1.0f);
  out = ld.linear(out_spec(p, c, sh));
}

void DeltaNetLayer::forward(LayerStep& s, const RmsNorm& norm, const ModelConfig& c, const Shard& sh,
                            StateLayer state) const {
  const DeltaNetShape& d = sh.delta;
  const int64_t cc = d.conv_cols(), vn = d.v_cols();
  Tensor proj = s.ws.proj, conv = s.ws.conv, core = s.ws.core;
  if (in_proj_ba.w.empty()) {
    s.be.norm_linear(s.residual, norm, in_proj, nullptr, s.ws.h, proj);
  } else {  // q|k|v | z, then b | a into the columns after them
    // One of the two is FP8, so the norm's gain is not folded (WeightLoader::norm_gain) and no backend fuses it into
    // either product: norm_linear's composition, with the norm computed once for both.
    Tensor main = proj.col_slice(0, cc + vn), ba = proj.col_slice(cc + vn, 2 * int64_t(d.v_heads));
    s.be.rms_norm(s.residual, norm.w, norm.eps, norm.zero_centred, s.ws.h);
    s.be.linear(s.ws.h, in_proj, nullptr, main);
    s.be.linear(s.ws.h, in_proj_ba, nullptr, ba);
  }
  s.be.causal_conv1d(proj.col_slice(0, cc), conv_w, s.batch, d, state, conv);
  s.be.gated_delta_rule(conv, proj.col_slice(cc + vn + d.v_heads, d.v_heads), proj.col_slice(cc + vn, d.v_heads),
                        a_log, dt_bias, s.batch, d, state, core);
  s.be.gated_rms_norm(core, proj.col_slice(cc, vn), norm_w, c.rms_eps, d.v_dim);
  add_to_residual(s, core, out);
}

// --- MLP -------------------------------------------------------------------------------------------------------

LinearSpec Mlp::gate_up_spec(const std::string& p, const ModelConfig& c, const Shard& sh) {
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  LinearSpec s;
  s.in = H;
  s.ranks = sh.ranks;
  s.add(p + "gate_proj", I, H, sh.inter0, sh.inter);
  s.add(p + "up_proj", I, H, sh.inter0, sh.inter);
  return s;
}

LinearSpec Mlp::down_spec(const std::string& p, const ModelConfig& c, const Shard& sh) {
  LinearSpec s;
  s.c0 = sh.inter0;
  s.in = sh.inter;
  s.ranks = sh.ranks;
  s.add(p + "down_proj", c.hidden_size, c.intermediate_size, 0, c.hidden_size);
  return s;
}

void Mlp::load(WeightLoader& ld, const std::string& p, const ModelConfig& c, const Shard& sh) {
  gate_up = ld.linear(gate_up_spec(p, c, sh));
  down = ld.linear(down_spec(p, c, sh));
}

void Mlp::forward(LayerStep& s, const RmsNorm& norm) const {
  s.be.norm_linear_silu_mul(s.residual, norm, gate_up, s.ws.h, s.ws.gate_up, s.ws.act);
  add_to_residual(s, s.ws.act, down);
}

}  // namespace qrt
