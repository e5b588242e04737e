// An attention case for the emulated attention kernels (attn_decode.cpp, attn_tile.cpp): random q and a paged K/V
// cache (pages shuffled, the second half of them in the host tier; 16-bit, or e4m3 with per-(row, kv head)
// scales), the AttnBatch and AttnShape that describe it, and the fp64 causal attention the kernels' output is
// checked against. Sequence s has q_lens[s] query rows, the last of its ctx[s] keys.
#pragma once
#include <random>

#include "emu.h"
#include "backend/ops.h"

template <typename T>
struct PagedAttention {
  int D, G, q_heads, kv_heads, page, max_pages = 0, host0 = 0;
  bool fp8;
  int64_t cols;
  std::vector<int> q_lens, ctx;
  std::vector<int32_t> table, q_start, ctx_len;
  std::vector<unsigned char> kd, vd, kh, vh;  // K and V of the device tier, then of the host tier
  std::vector<float> ksd, vsd, ksh, vsh;      // their scales (fp8)
  std::vector<T> q, out;
  qrt::Tensor qt, ot;
  qrt::KvLayer cache;
  qrt::AttnBatch b;
  qrt::AttnShape sh;

  PagedAttention(int D_, bool fp8_, int q_heads_, int kv_heads_, int page_, std::vector<int> q_lens_,
                 std::vector<int> ctx_, std::mt19937& rng)
      : D(D_), G(q_heads_ / kv_heads_), q_heads(q_heads_), kv_heads(kv_heads_), page(page_), fp8(fp8_),
        cols(int64_t(kv_heads_) * D_), q_lens(std::move(q_lens_)), ctx(std::move(ctx_)) {
    std::uniform_real_distribution<float> U(-1, 1);
    const int S = int(ctx.size());
    std::vector<int> pages_of(S);
    int pages = 0;
    for (int s = 0; s < S; ++s) {
      pages_of[s] = (ctx[s] + page - 1) / page;
      pages += pages_of[s];
      max_pages = std::max(max_pages, pages_of[s]);
    }
    host0 = pages / 2;  // pages from host0 on live in the host tier
    std::vector<int32_t> perm(pages);
    for (int i = 0; i < pages; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    table.assign(size_t(S) * max_pages, 0);
    q_start.assign(S + 1, 0);
    ctx_len.assign(ctx.begin(), ctx.end());
    for (int s = 0, next = 0; s < S; ++s) {
      q_start[s + 1] = q_start[s] + q_lens[s];
      for (int p = 0; p < pages_of[s]; ++p) table[size_t(s) * max_pages + p] = perm[next++];
    }
    const int64_t rows_dev = int64_t(host0) * page, rows_host = int64_t(pages - host0) * page;
    const size_t es = fp8 ? 1 : sizeof(T);
    kd.resize(rows_dev * cols * es + 16), vd.resize(kd.size());
    kh.resize(rows_host * cols * es + 16), vh.resize(kh.size());
    ksd.resize(rows_dev * kv_heads + 1), vsd.resize(ksd.size()), ksh.resize(rows_host * kv_heads + 1);
    vsh.resize(ksh.size());
    auto fill = [&](std::vector<unsigned char>& buf, std::vector<float>& sc) {
      if (fp8) {
        for (auto& x : buf) do x = uint8_t(rng() & 0xff); while (std::isnan(e4m3_to_float(x)));
        for (auto& x : sc) x = (0.5f + std::fabs(U(rng))) / 256.f;
      } else {
        T* p = reinterpret_cast<T*>(buf.data());
        for (size_t i = 0; i < buf.size() / sizeof(T); ++i) p[i] = from_f<T>(U(rng));
      }
    };
    fill(kd, ksd), fill(vd, vsd), fill(kh, ksh), fill(vh, vsh);
    const int rows = q_start[S];
    const qrt::DType act = std::is_same_v<T, __half> ? qrt::DType::F16 : qrt::DType::BF16;
    q.resize(size_t(rows) * q_heads * D);
    for (auto& v : q) v = from_f<T>(U(rng));
    out.assign(q.size(), from_f<T>(NAN));
    qt = qrt::Tensor(q.data(), act, rows, int64_t(q_heads) * D);
    ot = qrt::Tensor(out.data(), act, rows, int64_t(q_heads) * D);
    cache.k = kd.data(), cache.v = vd.data(), cache.host_k = kh.data(), cache.host_v = vh.data();
    cache.host_page0 = host0;
    cache.dtype = fp8 ? qrt::DType::F8E4M3 : act;
    if (fp8) {
      cache.kv_heads = kv_heads;
      cache.k_scale = ksd.data(), cache.v_scale = vsd.data(), cache.host_k_scale = ksh.data();
      cache.host_v_scale = vsh.data();
    }
    b.num_seqs = S, b.num_tokens = rows, b.q_start = q_start.data(), b.ctx_len = ctx_len.data();
    b.page_table = table.data(), b.max_pages = max_pages, b.page_size = page;
    b.max_q_len = *std::max_element(q_lens.begin(), q_lens.end());
    b.max_ctx_len = *std::max_element(ctx.begin(), ctx.end());
    sh.q_heads = q_heads, sh.kv_heads = kv_heads, sh.head_dim = D, sh.scale = 1.0f / std::sqrt(float(D));
  }

  // Key j of sequence s, kv head h, element d, dequantized.
  double elem(bool is_k, int s, int j, int h, int d) const {
    const int pg = table[size_t(s) * max_pages + j / page];
    const bool host = pg >= host0;
    const int64_t r = int64_t(host ? pg - host0 : pg) * page + j % page;
    const auto& buf = host ? (is_k ? kh : vh) : (is_k ? kd : vd);
    const size_t i = size_t(r * cols + int64_t(h) * D + d);
    if (!fp8) return to_f(reinterpret_cast<const T*>(buf.data())[i]);
    const auto& sc = host ? (is_k ? ksh : vsh) : (is_k ? ksd : vsd);
    return double(e4m3_to_float(buf[i])) * sc[size_t(r) * kv_heads + h];
  }

  // The output's error relative to fp64 causal attention (each row sees the keys up to its own position).
  double rel_err() const {
    double num = 0, den = 0;
    for (int s = 0; s < int(ctx.size()); ++s)
      for (int t = 0; t < q_lens[s]; ++t) {
        const int row = q_start[s] + t, n_keys = ctx[s] - q_lens[s] + t + 1;
        for (int h = 0; h < q_heads; ++h) {
          std::vector<double> p(n_keys);
          double mx = -1e300, sum = 0;
          for (int j = 0; j < n_keys; ++j) {
            double dot = 0;
            for (int d = 0; d < D; ++d)
              dot += double(to_f(q[(size_t(row) * q_heads + h) * D + d])) * elem(true, s, j, h / G, d);
            p[j] = dot / std::sqrt(double(D));
            mx = std::max(mx, p[j]);
          }
          for (auto& x : p) x = std::exp(x - mx), sum += x;
          for (int d = 0; d < D; ++d) {
            double o = 0;
            for (int j = 0; j < n_keys; ++j) o += p[j] * elem(false, s, j, h / G, d);
            o /= sum;
            const double got = to_f(out[(size_t(row) * q_heads + h) * D + d]);
            num += (got - o) * (got - o), den += o * o;
          }
        }
      }
    return std::sqrt(num / den);
  }
};
