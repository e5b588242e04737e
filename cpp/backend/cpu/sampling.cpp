// Sampling on the CPU, with the semantics stated in ops.h.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "backend/cpu/cpu_kernels.h"
#include "backend/random.h"
#include "core/error.h"

namespace qrt::cpu {
namespace {

// max, first argmax and log-sum-exp of a row in one place.
struct RowStats {
  float max;
  int32_t argmax;
  float lse;
};

RowStats row_stats(const float* raw, int64_t V) {
  RowStats st{-INFINITY, 0, 0.f};
  // The maximum in 16 lanes (NaN is never greater, as in a scalar scan), then its first position.
  const int64_t vv = V / 16 * 16;
  v16f mx = v16f{} - INFINITY;
  for (int64_t i = 0; i < vv; i += 16) {
    v16f x;
    std::memcpy(&x, raw + i, 64);
    mx = x > mx ? x : mx;
  }
  float lanes_mx[16];
  std::memcpy(lanes_mx, &mx, 64);
  for (float l : lanes_mx) st.max = l > st.max ? l : st.max;
  for (int64_t i = vv; i < V; ++i) st.max = raw[i] > st.max ? raw[i] : st.max;
  if (st.max > -INFINITY)
    for (int64_t i = 0; i < V; ++i)
      if (raw[i] == st.max) {
        st.argmax = int32_t(i);
        break;
      }
  v16f acc{};
  for (int64_t i = 0; i < vv; i += 16) {
    v16f x;
    std::memcpy(&x, raw + i, 64);
    acc += exp16(x - st.max);
  }
  double se = 0.0;
  float lanes[16];
  std::memcpy(lanes, &acc, 64);
  for (float l : lanes) se += l;
  for (int64_t i = vv; i < V; ++i) se += std::exp(raw[i] - st.max);
  st.lse = st.max + float(std::log(se));
  return st;
}

void sample_row(const float* raw, int64_t V, const SampleRow& p, int max_n, int32_t* tok_out,
                float* lp_out, int32_t* top_ids, float* top_lps) {
  // 1. raw logprobs (undefined, NaN, when the row holds a NaN or +inf, or only -inf: ops.h)
  const RowStats st = row_stats(raw, V);
  const float lse = st.lse;
  const bool defined = std::isfinite(lse);
  if (max_n > 0 && p.num_logprobs > 0) {
    const int n = std::min<int64_t>(p.num_logprobs, V);
    std::vector<int32_t> idx(V);
    std::iota(idx.begin(), idx.end(), 0);
    auto val = [&](int32_t i) { return std::isnan(raw[i]) ? -INFINITY : raw[i]; };  // a strict weak order
    auto better = [&](int32_t a, int32_t b) { return val(a) > val(b) || (val(a) == val(b) && a < b); };
    std::partial_sort(idx.begin(), idx.begin() + n, idx.end(), better);
    for (int i = 0; i < max_n; ++i) {
      top_ids[i] = i < n ? idx[i] : -1;
      top_lps[i] = i < n ? raw[idx[i]] - lse : -INFINITY;
    }
  }
  const bool plain = p.banned_tokens.empty() && p.repetition_penalty == 1.0f && p.presence_penalty == 0.0f &&
                     p.frequency_penalty == 0.0f;
  if (plain && p.temperature == 0.0f) {  // greedy on the raw logits: the first maximum
    *tok_out = st.argmax;
    *lp_out = defined ? raw[st.argmax] - lse : NAN;
    return;
  }
  // 2-4. banned tokens and penalties
  std::vector<float> x(raw, raw + V);
  for (int32_t t : p.banned_tokens)
    if (t >= 0 && t < V) x[t] = -INFINITY;
  if (p.repetition_penalty != 1.0f)
    for (int32_t t : p.seen_tokens)
      if (t >= 0 && t < V) x[t] = x[t] > 0 ? x[t] / p.repetition_penalty : x[t] * p.repetition_penalty;
  if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f)
    for (size_t i = 0; i < p.output_tokens.size(); ++i) {
      const int32_t t = p.output_tokens[i];
      if (t >= 0 && t < V) x[t] -= float(p.output_counts[i]) * p.frequency_penalty + p.presence_penalty;
    }
  int32_t tok = 0;
  if (p.temperature != 0.0f) {
    const float inv_t = 1.0f / p.temperature;
    for (auto& v : x) v *= inv_t;
  }
  for (auto& v : x)  // NaN (a NaN logit, or inf - inf from a penalty) is never chosen
    if (std::isnan(v)) v = -INFINITY;
  if (p.temperature == 0.0f) {  // 5. greedy
    for (int64_t i = 1; i < V; ++i)
      if (x[i] > x[tok]) tok = int32_t(i);
  } else {
    // 6. top_k, top_p, min_p (the temperature is applied above)
    std::vector<int32_t> kept;
    if (p.top_k > 0 && p.top_k < V) {
      std::vector<float> tmp(x);
      std::nth_element(tmp.begin(), tmp.begin() + (p.top_k - 1), tmp.end(), std::greater<float>());
      const float thr = tmp[p.top_k - 1];
      for (int64_t i = 0; i < V; ++i)
        if (x[i] >= thr) kept.push_back(int32_t(i));
    } else {
      kept.resize(V);
      std::iota(kept.begin(), kept.end(), 0);
    }
    if (p.top_p < 1.0f) {
      std::sort(kept.begin(), kept.end(),
                [&](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
      const float kmx = x[kept[0]];  // kept holds top_k >= 1 tokens, or all
      size_t n = 0;
      if (kmx == INFINITY) {  // the +inf values hold all the mass
        while (n < kept.size() && x[kept[n]] == INFINITY) ++n;
      } else if (kmx == -INFINITY) {  // no mass at all: every kept token stays (the draw takes the first)
        n = kept.size();
      } else {
        double z = 0.0;
        for (int32_t t : kept) z += std::exp(double(x[t] - kmx));
        double cum = 0.0;
        while (n < kept.size()) {
          cum += std::exp(double(x[kept[n]] - kmx)) / z;
          ++n;
          if (cum >= p.top_p) break;
        }
      }
      kept.resize(n);
    }
    float kmx = -INFINITY;
    for (int32_t t : kept) kmx = std::max(kmx, x[t]);
    const float floor = p.min_p > 0.0f ? kmx + std::log(p.min_p) : -INFINITY;
    // 7. Gumbel-max over the kept tokens
    float best = -INFINITY;
    tok = -1;
    for (int32_t t : kept) {
      if (x[t] < floor || x[t] == -INFINITY) continue;
      const float g = x[t] - std::log(-std::log(uniform01(p.seed, uint64_t(p.draw), uint64_t(t))));
      if (g > best || tok < 0) { best = g; tok = t; }
    }
    if (tok < 0) tok = kept.empty() ? 0 : kept[0];
  }
  *tok_out = tok;
  *lp_out = defined ? raw[tok] - lse : NAN;
}

}  // namespace

void sample(const Tensor& logits, const std::vector<SampleRow>& rows, SampleResult& out, ThreadPool& pool) {
  QRT_CHECK(logits.dtype == DType::F32, "cpu sample: logits must be float32");
  const int64_t R = logits.rows, V = logits.cols;
  QRT_CHECK(int64_t(rows.size()) == R, "cpu sample: ", rows.size(), " parameter rows for ", R, " logit rows");
  int max_n = 0;
  for (auto& r : rows) max_n = std::max(max_n, r.num_logprobs);
  out.max_n = max_n;
  out.tokens.assign(R, 0);
  out.logprobs.assign(R, 0.f);
  out.top_ids.assign(R * max_n, -1);
  out.top_logprobs.assign(R * max_n, -INFINITY);
  pool.for_dynamic(R, true, [&](int64_t r, int) {
    sample_row(logits.ptr<float>() + r * logits.stride, V, rows[r], max_n, &out.tokens[r], &out.logprobs[r],
               out.top_ids.data() + r * max_n, out.top_logprobs.data() + r * max_n);
  });
}

}  // namespace qrt::cpu
