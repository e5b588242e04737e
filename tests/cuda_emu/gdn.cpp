// gdn.cu's gated delta rule (cut out by cut.py) on the host emulator against an fp64 recurrence on the same
// inputs: the token loop and the chunked form (sequences of 64+ rows, 16-bit), fresh and continued states, a
// short sequence beside long ones; windows of one chunk slot give the same bits as one window, and a sequence
// left to the token loop gets the same bits whichever form its batch mates take.
#include <random>

#include "emu.h"
#include "backend/ops.h"
#include "core/error.h"

namespace qrt::cuda {
using namespace qrt;
#include "gdn.inc"
}  // namespace qrt::cuda

using namespace qrt;

struct Run {
  std::vector<float> out, state;
};

template <typename T>
int run_case(int hk, int hv, int dk, int dv, std::vector<int> q_lens, std::vector<int> starts, std::mt19937& rng) {
  std::uniform_real_distribution<float> U(0, 1);
  auto uni = [&](float lo, float hi) { return lo + (hi - lo) * U(rng); };
  const int S = int(q_lens.size()), slots_n = S + 1;
  std::vector<int32_t> q_start{0}, ctx, slots(S);
  for (int s = 0; s < S; ++s) q_start.push_back(q_start.back() + q_lens[s]), ctx.push_back(starts[s] + q_lens[s]);
  for (int s = 0; s < S; ++s) slots[s] = (s + 1) % slots_n;
  const int rows = q_start.back();
  const int64_t C = 2 * int64_t(hk) * dk + int64_t(hv) * dv;
  std::vector<T> qkv(rows * C), a(rows * hv), b(rows * hv);
  for (auto& v : qkv) v = from_f<T>(uni(-0.3f, 1.5f));
  for (auto& v : a) v = from_f<T>(uni(-2, 2));
  for (auto& v : b) v = from_f<T>(uni(-3, 3));
  std::vector<float> a_log(hv), dt_bias(hv), state0(size_t(slots_n) * hv * dk * dv);
  for (auto& v : a_log) v = uni(-3, 0.5f);
  for (auto& v : dt_bias) v = uni(-2, 0);
  for (auto& v : state0) v = uni(-0.5f, 0.5f);
  const DType act = std::is_same_v<T, __half> ? DType::F16 : DType::BF16;

  auto run = [&](const char* form, const char* window) {
    if (form) setenv("QWEN_RT_DELTA_RULE", form, 1); else unsetenv("QWEN_RT_DELTA_RULE");
    if (window) setenv("QWEN_RT_DELTA_RULE_WINDOW", window, 1); else unsetenv("QWEN_RT_DELTA_RULE_WINDOW");
    Run r;
    r.state = state0;
    std::vector<T> out(rows * int64_t(hv) * dv, from_f<T>(NAN));
    Tensor qt(qkv.data(), act, rows, C), at(a.data(), act, rows, hv), bt(b.data(), act, rows, hv);
    Tensor lt(a_log.data(), DType::F32, 1, hv), dtt(dt_bias.data(), DType::F32, 1, hv);
    Tensor ot(out.data(), act, rows, int64_t(hv) * dv);
    AttnBatch bat;
    bat.num_seqs = S;
    bat.num_tokens = rows;
    bat.q_start = q_start.data();
    bat.ctx_len = ctx.data();
    bat.slots = slots.data();
    bat.max_q_len = *std::max_element(q_lens.begin(), q_lens.end());
    DeltaNetShape sh;
    sh.k_heads = hk, sh.v_heads = hv, sh.k_dim = dk, sh.v_dim = dv, sh.conv_kernel = 4;
    StateLayer st;
    st.recurrent = r.state.data();
    const cuda::DeltaRulePlan plan = cuda::plan_delta_rule(qt, bat, sh, ot);
    std::vector<unsigned char> scratch(plan.scratch_bytes + 16);
    cuda::launch_gated_delta_rule(qt, at, bt, lt, dtt, bat, sh, st, ot, plan, scratch.data(), nullptr);
    for (auto& v : out) r.out.push_back(to_f(v));
    return r;
  };
  const Run chunked = run(nullptr, nullptr), loop = run("loop", nullptr), one = run(nullptr, "1");

  int bad = 0;
  for (int s = 0; s < S; ++s) {
    // fp64 recurrence: S <- decay S; delta = beta (v - S^T k); S <- S + k delta^T; o = S^T q.
    double on = 0, od = 0, ol = 0, sn = 0, sd = 0, sl = 0;
    for (int h = 0; h < hv; ++h) {
      const int kh = h / (hv / hk);
      std::vector<double> St(size_t(dk) * dv, 0.0);
      const size_t base = (size_t(slots[s]) * hv + h) * dk * dv;
      if (starts[s] > 0)
        for (size_t i = 0; i < St.size(); ++i) St[i] = state0[base + i];
      const double A = -std::exp(double(a_log[h]));
      for (int r = q_start[s]; r < q_start[s + 1]; ++r) {
        std::vector<double> q(dk), k(dk);
        double nq = 0, nk = 0;
        for (int d = 0; d < dk; ++d) {
          q[d] = to_f(qkv[r * C + int64_t(kh) * dk + d]);
          k[d] = to_f(qkv[r * C + int64_t(hk) * dk + int64_t(kh) * dk + d]);
          nq += q[d] * q[d], nk += k[d] * k[d];
        }
        for (int d = 0; d < dk; ++d) q[d] /= std::sqrt(nq + 1e-6) * std::sqrt(double(dk)), k[d] /= std::sqrt(nk + 1e-6);
        const double x = double(to_f(a[r * hv + h])) + dt_bias[h];
        const double decay = std::exp(A * (x > 20 ? x : std::log1p(std::exp(x))));
        const double beta = 1 / (1 + std::exp(-double(to_f(b[r * hv + h]))));
        for (auto& v : St) v *= decay;
        for (int y = 0; y < dv; ++y) {
          double kv = 0;
          for (int d = 0; d < dk; ++d) kv += St[size_t(d) * dv + y] * k[d];
          const double delta = beta * (double(to_f(qkv[r * C + 2 * int64_t(hk) * dk + int64_t(h) * dv + y])) - kv);
          double o = 0;
          for (int d = 0; d < dk; ++d) St[size_t(d) * dv + y] += k[d] * delta, o += St[size_t(d) * dv + y] * q[d];
          const size_t i = size_t(r) * hv * dv + size_t(h) * dv + y;
          on += (chunked.out[i] - o) * (chunked.out[i] - o), ol += (loop.out[i] - o) * (loop.out[i] - o), od += o * o;
        }
      }
      for (size_t i = 0; i < St.size(); ++i) {
        const double c = chunked.state[base + i], l = loop.state[base + i];
        sn += (c - St[i]) * (c - St[i]), sl += (l - St[i]) * (l - St[i]), sd += St[i] * St[i];
      }
    }
    const bool long_seq = q_lens[s] >= 64;
    const double eo = std::sqrt(on / od), es = std::sqrt(sn / sd), lo = std::sqrt(ol / od), ls = std::sqrt(sl / sd);
    const double tol = std::is_same_v<T, __half> ? 4e-3 : 2e-2;
    bool ok = eo < tol && es < tol && lo < tol && ls < 1e-5;
    if (!long_seq) {  // the token loop in both runs: the same bits
      const size_t o0 = size_t(q_start[s]) * hv * dv, o1 = size_t(q_start[s + 1]) * hv * dv;
      ok = ok && std::equal(chunked.out.begin() + o0, chunked.out.begin() + o1, loop.out.begin() + o0) && es == ls;
    }
    std::printf("%s hk %d hv %d dk %3d dv %3d seq %d (%3d rows from %2d): chunked out %.2e state %.2e, loop out "
                "%.2e state %.2e %s\n", std::is_same_v<T, __half> ? "f16 " : "bf16", hk, hv, dk, dv, s, q_lens[s],
                starts[s], eo, es, lo, ls, ok ? "ok" : "FAIL");
    bad += !ok;
  }
  const bool same = chunked.out == one.out && chunked.state == one.state;
  std::printf("windows of one chunk slot: %s\n", same ? "same bits" : "DIFFERENT");
  return bad + !same;
}

int main() {
  std::mt19937 rng(7);
  int bad = 0;
  bad += run_case<__nv_bfloat16>(1, 2, 128, 64, {150, 10, 70}, {0, 5, 33}, rng);
  bad += run_case<__half>(2, 2, 64, 32, {64, 129, 3}, {7, 0, 0}, rng);
  std::printf(bad ? "FAIL %d\n" : "ok\n", bad);
  return bad != 0;
}
