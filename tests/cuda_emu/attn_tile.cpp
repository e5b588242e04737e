// attention.cu's tile kernel (tensor cores, mma.sync and ldmatrix; cut out by cut.py, launched by its launch_tile)
// on the host emulator against fp64 causal attention over the same paged cache: head_dim 64, 128 and 256, 4 x 2
// and 8 x 1 warps, 16-bit caches and e4m3 caches with per-(row, kv head) scales (converted as staged), pages in
// the host tier, GQA groups, prompts continuing cached tokens.
#include <random>

#include "emu.h"
#include "backend/ops.h"
#include "core/error.h"

namespace qrt::cuda {
using namespace qrt;
#include "attn_tile.inc"
}  // namespace qrt::cuda

using namespace qrt;

template <typename T, int D, int WARPS, int MT, bool FP8>
int run_case(int q_heads, int kv_heads, int page, std::vector<int> q_lens, std::vector<int> ctx, std::mt19937& rng) {
  std::uniform_real_distribution<float> U(-1, 1);
  const int S = int(ctx.size()), G = q_heads / kv_heads;
  const int64_t cols = int64_t(kv_heads) * D;
  std::vector<int> pages_of(S);
  int pages = 0, max_pages = 0, rows = 0, max_q = 0;
  for (int s = 0; s < S; ++s) pages_of[s] = (ctx[s] + page - 1) / page, pages += pages_of[s];
  for (int s = 0; s < S; ++s) max_pages = std::max(max_pages, pages_of[s]), rows += q_lens[s];
  for (int s = 0; s < S; ++s) max_q = std::max(max_q, q_lens[s]);
  const int host0 = pages / 2;  // pages from host0 on live in the host tier
  std::vector<int32_t> perm(pages);
  for (int i = 0; i < pages; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> table(size_t(S) * max_pages, 0), q_start(S + 1, 0), ctx_len(ctx.begin(), ctx.end());
  for (int s = 0, next = 0; s < S; ++s) {
    q_start[s + 1] = q_start[s] + q_lens[s];
    for (int p = 0; p < pages_of[s]; ++p) table[size_t(s) * max_pages + p] = perm[next++];
  }
  const int64_t rows_dev = int64_t(host0) * page, rows_host = int64_t(pages - host0) * page;
  const size_t es = FP8 ? 1 : sizeof(T);
  std::vector<unsigned char> kd(rows_dev * cols * es + 16), vd(kd.size());
  std::vector<unsigned char> kh(rows_host * cols * es + 16), vh(kh.size());
  std::vector<float> ksd(rows_dev * kv_heads + 1), vsd(ksd.size()), ksh(rows_host * kv_heads + 1), vsh(ksh.size());
  auto fill = [&](std::vector<unsigned char>& buf, std::vector<float>& sc) {
    if (FP8) {
      for (auto& b : buf) do b = uint8_t(rng() & 0xff); while (std::isnan(e4m3_to_float(b)));
      for (auto& x : sc) x = (0.5f + std::fabs(U(rng))) / 256.f;
    } else {
      T* p = reinterpret_cast<T*>(buf.data());
      for (size_t i = 0; i < buf.size() / sizeof(T); ++i) p[i] = from_f<T>(U(rng));
    }
  };
  fill(kd, ksd), fill(vd, vsd), fill(kh, ksh), fill(vh, vsh);
  auto elem = [&](bool is_k, int s, int j, int h, int d) -> double {  // key j of sequence s, kv head h, dequantized
    const int pg = table[size_t(s) * max_pages + j / page];
    const bool host = pg >= host0;
    const int64_t r = int64_t(host ? pg - host0 : pg) * page + j % page;
    const auto& buf = host ? (is_k ? kh : vh) : (is_k ? kd : vd);
    const size_t i = size_t(r * cols + int64_t(h) * D + d);
    if (!FP8) return to_f(reinterpret_cast<const T*>(buf.data())[i]);
    const auto& sc = host ? (is_k ? ksh : vsh) : (is_k ? ksd : vsd);
    return double(e4m3_to_float(buf[i])) * sc[size_t(r) * kv_heads + h];
  };
  const DType act = std::is_same_v<T, __half> ? DType::F16 : DType::BF16;
  std::vector<T> q(size_t(rows) * q_heads * D), out(q.size(), from_f<T>(NAN));
  for (auto& v : q) v = from_f<T>(U(rng));
  Tensor qt(q.data(), act, rows, int64_t(q_heads) * D), ot(out.data(), act, rows, int64_t(q_heads) * D);
  KvLayer cache;
  cache.k = kd.data(), cache.v = vd.data(), cache.host_k = kh.data(), cache.host_v = vh.data();
  cache.host_page0 = host0;
  cache.dtype = FP8 ? DType::F8E4M3 : act;
  if (FP8) {
    cache.kv_heads = kv_heads;
    cache.k_scale = ksd.data(), cache.v_scale = vsd.data(), cache.host_k_scale = ksh.data();
    cache.host_v_scale = vsh.data();
  }
  AttnBatch b;
  b.num_seqs = S, b.num_tokens = rows, b.q_start = q_start.data(), b.ctx_len = ctx_len.data();
  b.page_table = table.data(), b.max_pages = max_pages, b.page_size = page, b.max_q_len = max_q;
  b.max_ctx_len = *std::max_element(ctx.begin(), ctx.end());
  AttnShape sh;
  sh.q_heads = q_heads, sh.kv_heads = kv_heads, sh.head_dim = D, sh.scale = 1.0f / std::sqrt(float(D));
  cuda::launch_tile<T, D, WARPS, MT, FP8>(qt, cache, b, sh, ot, nullptr);

  double num = 0, den = 0;
  for (int s = 0; s < S; ++s)
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
  const double err = std::sqrt(num / den);
  const bool ok = err < 1.5e-2;
  std::printf("%s D %3d %dx%d warps %s cache, %d/%d heads, pages of %2d, %d sequences: rel %.2e %s\n",
              std::is_same_v<T, __half> ? "f16 " : "bf16", D, WARPS, MT, FP8 ? "e4m3" : "16-bit", q_heads, kv_heads,
              page, S, err, ok ? "ok" : "FAIL");
  return ok ? 0 : 1;
}

int main() {
  std::mt19937 rng(13);
  int bad = 0;
  bad += run_case<__nv_bfloat16, 64, 4, 2, false>(8, 2, 16, {70, 5}, {70, 200}, rng);
  bad += run_case<__half, 128, 8, 1, false>(4, 1, 16, {33, 1}, {100, 17}, rng);
  bad += run_case<__nv_bfloat16, 128, 4, 2, false>(6, 2, 8, {40}, {140}, rng);
  bad += run_case<__nv_bfloat16, 256, 8, 1, false>(6, 1, 16, {21, 3}, {90, 40}, rng);
  bad += run_case<__half, 128, 8, 1, true>(4, 2, 16, {30, 2}, {80, 50}, rng);
  bad += run_case<__nv_bfloat16, 256, 8, 1, true>(6, 1, 16, {17}, {100}, rng);
  std::printf(bad ? "FAIL %d\n" : "ok\n", bad);
  return bad != 0;
}
