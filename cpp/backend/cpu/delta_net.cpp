// Gated DeltaNet on the CPU (fp32): the causal conv and the gated delta rule, token by token (the reference).
#include <cmath>
#include <vector>

#include "backend/cpu/cpu_kernels.h"
#include "core/error.h"

namespace qrt::cpu {

namespace {

int q_len(const AttnBatch& b, int s) { return b.q_start[s + 1] - b.q_start[s]; }
// Whether sequence s starts this step at position 0 (its state starts from zeros).
bool starts_fresh(const AttnBatch& b, int s) { return b.ctx_len[s] - q_len(b, s) == 0; }

float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch's, beta 1, threshold 20
float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// x *= 1 / sqrt(sum(x^2) + 1e-6) * scale.
void l2_normalise(float* x, int n, float scale) {
  float ss = 0.f;
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss + 1e-6f) * scale;
  for (int i = 0; i < n; ++i) x[i] *= inv;
}

}  // namespace

void causal_conv1d(const Tensor& x, const Tensor& w, const AttnBatch& b, const DeltaNetShape& s, StateLayer& st,
                   Tensor& out, ThreadPool& pool) {
  const int K = s.conv_kernel, H = K - 1;
  const int64_t C = s.conv_cols();
  QRT_CHECK(x.cols == C && out.cols == C && w.rows == C && w.cols == K, "cpu causal_conv1d: shape mismatch");
  std::vector<float> wf(size_t(C) * K);
  for (int64_t c = 0; c < C; ++c) load_row_f32(w, c, wf.data() + c * K);
  pool.for_dynamic(b.num_seqs, b.num_seqs > 1, [&](int64_t si, int) {
    const int sq = int(si), n = q_len(b, sq), r0 = b.q_start[sq];
    // The window: H positions of history, then this step's n inputs.
    std::vector<float> in(size_t(H + n) * C, 0.f);
    Tensor hist(static_cast<char*>(st.conv) + size_t(b.slots[sq]) * H * C * dtype_size(st.conv_dtype),
                st.conv_dtype, H, C);
    if (!starts_fresh(b, sq))
      for (int j = 0; j < H; ++j) load_row_f32(hist, j, in.data() + size_t(j) * C);
    for (int i = 0; i < n; ++i) load_row_f32(x, r0 + i, in.data() + size_t(H + i) * C);
    std::vector<float> o(static_cast<size_t>(C));
    const int keep = b.keep ? b.keep[sq] : -1;
    for (int i = 0; i < n; ++i) {
      for (int64_t c = 0; c < C; ++c) {
        float acc = 0.f;
        for (int j = 0; j < K; ++j) acc += wf[size_t(c) * K + j] * in[size_t(i + j) * C + c];
        o[size_t(c)] = acc * sigmoid(acc);
      }
      store_row_f32(o.data(), out, r0 + i);
      if (keep >= 0 && i + 1 < n) {  // the history after row i: inputs i + 1 .. i + H of the window
        Tensor kept(static_cast<char*>(st.conv) + size_t(keep + i) * H * C * dtype_size(st.conv_dtype),
                    st.conv_dtype, H, C);
        for (int j = 0; j < H; ++j) store_row_f32(in.data() + size_t(i + 1 + j) * C, kept, j);
      }
    }
    for (int j = 0; j < H; ++j) store_row_f32(in.data() + size_t(n + j) * C, hist, j);
  });
}

void gated_delta_rule(const Tensor& qkv, const Tensor& a, const Tensor& bt, const Tensor& a_log,
                      const Tensor& dt_bias, const AttnBatch& b, const DeltaNetShape& s, StateLayer& st, Tensor& out,
                      ThreadPool& pool) {
  const int dk = s.k_dim, dv = s.v_dim, Hv = s.v_heads, group = s.v_heads / s.k_heads;
  QRT_CHECK(qkv.cols == s.conv_cols() && out.cols == s.v_cols() && a.cols == Hv && bt.cols == Hv,
            "cpu gated_delta_rule: shape mismatch");
  const float scale = 1.0f / std::sqrt(float(dk));
  const size_t state_elems = size_t(dk) * dv;
  pool.for_dynamic(int64_t(b.num_seqs) * Hv, b.num_seqs * Hv > 1, [&](int64_t job, int) {
    const int sq = int(job / Hv), h = int(job % Hv), kh = h / group, n = q_len(b, sq), r0 = b.q_start[sq];
    float* S = st.recurrent + (size_t(b.slots[sq]) * Hv + h) * state_elems;  // [dk, dv]
    if (starts_fresh(b, sq)) std::fill(S, S + state_elems, 0.f);
    const float A = -std::exp(load_f32(a_log, 0, h)), bias = load_f32(dt_bias, 0, h);
    std::vector<float> q(dk), k(dk), v(dv), row(size_t(qkv.cols)), delta(dv), o(dv);
    for (int i = 0; i < n; ++i) {
      const int64_t r = r0 + i;
      load_row_f32(qkv, r, row.data());
      std::copy_n(row.data() + int64_t(kh) * dk, dk, q.data());
      std::copy_n(row.data() + s.qk_cols() + int64_t(kh) * dk, dk, k.data());
      std::copy_n(row.data() + 2 * s.qk_cols() + int64_t(h) * dv, dv, v.data());
      l2_normalise(q.data(), dk, scale);
      l2_normalise(k.data(), dk, 1.0f);
      const float decay = std::exp(A * softplus(load_f32(a, r, h) + bias));
      const float beta = sigmoid(load_f32(bt, r, h));
      for (size_t e = 0; e < state_elems; ++e) S[e] *= decay;
      std::fill(delta.begin(), delta.end(), 0.f);
      for (int x = 0; x < dk; ++x)
        for (int y = 0; y < dv; ++y) delta[y] += S[size_t(x) * dv + y] * k[x];
      for (int y = 0; y < dv; ++y) delta[y] = (v[y] - delta[y]) * beta;
      std::fill(o.begin(), o.end(), 0.f);
      for (int x = 0; x < dk; ++x)
        for (int y = 0; y < dv; ++y) {
          float& e = S[size_t(x) * dv + y];
          e += k[x] * delta[y];
          o[y] += e * q[x];
        }
      float* dst = out.ptr<float>() + r * out.stride + int64_t(h) * dv;
      std::copy(o.begin(), o.end(), dst);
      if (b.keep && b.keep[sq] >= 0 && i + 1 < n)
        std::copy(S, S + state_elems, st.recurrent + (size_t(b.keep[sq] + i) * Hv + h) * state_elems);
    }
  });
}

}  // namespace qrt::cpu
