// attention.cu's tensor-core decode kernel (cut out by cut.py; through decode_kernel_takes and run_decode, as
// launch_attention runs it) on the host emulator against fp64 attention over the same paged cache: head_dim 64,
// 128 and 256, bf16 / f16 caches and e4m3 caches with per-(row, kv head) scales, pages of 16 and of 8 keys, pages
// in the host tier, 1 / 2 / 4 warps per row and key splits merged by the combine kernel.
#include <random>

#include "emu.h"
#include "backend/ops.h"
#include "core/error.h"

namespace qrt::cuda {
using namespace qrt;
#include "attn_decode.inc"
}  // namespace qrt::cuda

using namespace qrt;

template <typename T>
int run_case(int D, bool fp8, int q_heads, int kv_heads, int page, std::vector<int> ctx, int num_sms,
             std::mt19937& rng) {
  std::uniform_real_distribution<float> U(-1, 1);
  const int S = int(ctx.size()), G = q_heads / kv_heads;
  const int64_t cols = int64_t(kv_heads) * D;
  std::vector<int> pages_of(S);
  int pages = 0, max_pages = 0;
  for (int s = 0; s < S; ++s) pages_of[s] = (ctx[s] + page - 1) / page, pages += pages_of[s];
  for (int s = 0; s < S; ++s) max_pages = std::max(max_pages, pages_of[s]);
  const int host0 = pages / 2;  // pages from host0 on live in the host tier
  std::vector<int32_t> perm(pages);
  for (int i = 0; i < pages; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> table(size_t(S) * max_pages, 0), q_start(S + 1), ctx_len(ctx.begin(), ctx.end());
  for (int s = 0, next = 0; s < S; ++s) {
    q_start[s + 1] = s + 1;
    for (int p = 0; p < pages_of[s]; ++p) table[size_t(s) * max_pages + p] = perm[next++];
  }
  // Device tier pages [0, host0), host tier [host0, pages): rows of cols elements, and (fp8) scales per kv head.
  const int64_t rows_dev = int64_t(host0) * page, rows_host = int64_t(pages - host0) * page;
  const size_t es = fp8 ? 1 : sizeof(T);
  std::vector<unsigned char> kd(rows_dev * cols * es + 16), vd(kd.size());
  std::vector<unsigned char> kh(rows_host * cols * es + 16), vh(kh.size());
  std::vector<float> ksd(rows_dev * kv_heads + 1), vsd(ksd.size()), ksh(rows_host * kv_heads + 1), vsh(ksh.size());
  auto fill = [&](std::vector<unsigned char>& buf, std::vector<float>& sc) {
    if (fp8) {
      for (auto& b : buf) do b = uint8_t(rng() & 0xff); while (std::isnan(e4m3_to_float(b)));
      for (auto& x : sc) x = (0.5f + std::fabs(U(rng))) / 256.f;
    } else {
      T* p = reinterpret_cast<T*>(buf.data());
      for (size_t i = 0; i < buf.size() / sizeof(T); ++i) p[i] = from_f<T>(U(rng));
    }
  };
  fill(kd, ksd), fill(vd, vsd), fill(kh, ksh), fill(vh, vsh);
  // Key j of sequence s, kv head h, element d (dequantized).
  auto elem = [&](bool is_k, int s, int j, int h, int d) -> double {
    const int pg = table[size_t(s) * max_pages + j / page];
    const bool host = pg >= host0;
    const int64_t r = int64_t(host ? pg - host0 : pg) * page + j % page;
    const auto& buf = host ? (is_k ? kh : vh) : (is_k ? kd : vd);
    const size_t i = size_t(r * cols + int64_t(h) * D + d);
    if (!fp8) return to_f(reinterpret_cast<const T*>(buf.data())[i]);
    const auto& sc = host ? (is_k ? ksh : vsh) : (is_k ? ksd : vsd);
    return double(e4m3_to_float(buf[i])) * sc[size_t(r) * kv_heads + h];
  };
  const DType act = std::is_same_v<T, __half> ? DType::F16 : DType::BF16;
  std::vector<T> q(size_t(S) * q_heads * D), out(q.size(), from_f<T>(NAN));
  for (auto& v : q) v = from_f<T>(U(rng));
  Tensor qt(q.data(), act, S, int64_t(q_heads) * D), ot(out.data(), act, S, int64_t(q_heads) * D);
  KvLayer cache;
  cache.k = kd.data(), cache.v = vd.data(), cache.host_k = kh.data(), cache.host_v = vh.data();
  cache.host_page0 = host0;
  cache.dtype = fp8 ? DType::F8E4M3 : act;
  if (fp8) {
    cache.kv_heads = kv_heads;
    cache.k_scale = ksd.data(), cache.v_scale = vsd.data(), cache.host_k_scale = ksh.data();
    cache.host_v_scale = vsh.data();
  }
  AttnBatch b;
  b.num_seqs = S, b.num_tokens = S, b.q_start = q_start.data(), b.ctx_len = ctx_len.data();
  b.page_table = table.data(), b.max_pages = max_pages, b.page_size = page, b.max_q_len = 1;
  b.max_ctx_len = *std::max_element(ctx.begin(), ctx.end());
  AttnShape sh;
  sh.q_heads = q_heads, sh.kv_heads = kv_heads, sh.head_dim = D, sh.scale = 1.0f / std::sqrt(float(D));
  unsetenv("QWEN_RT_DECODE_ATTN");
  if (!cuda::decode_kernel_takes(b, sh, sizeof(T), fp8)) {
    std::printf("not taken\n");
    return 1;
  }
  std::vector<float> part(size_t(S) * q_heads * 64 * (D + 2));
  cuda::AttnWorkspace ws;
  ws.partial = part.data(), ws.bytes = part.size() * 4;
  const int nsplit = cuda::usable_splits(b, sh, ws, cuda::decode_splits(b, sh, num_sms));
  const int wpr = cuda::decode_warps_per_row(b, sh, num_sms);
  cuda::DecodeArgs a{};
  static_cast<cuda::RowsArgs&>(a) = cuda::rows_args(qt, cache, b, sh, ot, ws, nsplit, 1);
  auto go = [&](auto c_tag, auto d_tag) {
    using C = decltype(c_tag);
    constexpr int DD = decltype(d_tag)::value;
    if constexpr (!(std::is_same_v<C, uint8_t> && DD == 64))
      cuda::run_decode<T, C, DD, false>(a, b, sh, ot, ws, num_sms, nullptr);
  };
  auto by_dim = [&](auto c_tag) {
    if (D == 64) go(c_tag, std::integral_constant<int, 64>());
    else if (D == 128) go(c_tag, std::integral_constant<int, 128>());
    else go(c_tag, std::integral_constant<int, 256>());
  };
  if (fp8) by_dim(uint8_t());
  else by_dim(T());

  double num = 0, den = 0;
  for (int s = 0; s < S; ++s)
    for (int h = 0; h < q_heads; ++h) {
      const int kvh = h / G;
      std::vector<double> p(ctx[s]);
      double mx = -1e300, sum = 0;
      for (int j = 0; j < ctx[s]; ++j) {
        double dot = 0;
        for (int d = 0; d < D; ++d)
          dot += double(to_f(q[(size_t(s) * q_heads + h) * D + d])) * elem(true, s, j, kvh, d);
        p[j] = dot / std::sqrt(double(D));
        mx = std::max(mx, p[j]);
      }
      for (auto& x : p) x = std::exp(x - mx), sum += x;
      for (int d = 0; d < D; ++d) {
        double o = 0;
        for (int j = 0; j < ctx[s]; ++j) o += p[j] * elem(false, s, j, kvh, d);
        o /= sum;
        const double got = to_f(out[(size_t(s) * q_heads + h) * D + d]);
        num += (got - o) * (got - o), den += o * o;
      }
    }
  const double err = std::sqrt(num / den);
  const bool ok = err < 1.5e-2;
  std::printf("%s D %3d %s cache, %d/%d heads, pages of %2d, %d rows, %2d SMs: %d warps/row, %2d splits: rel %.2e %s\n",
              std::is_same_v<T, __half> ? "f16 " : "bf16", D, fp8 ? "e4m3" : "16-bit", q_heads, kv_heads, page, S,
              num_sms, wpr, nsplit, err, ok ? "ok" : "FAIL");
  return ok ? 0 : 1;
}

int main() {
  std::mt19937 rng(11);
  int bad = 0;
  for (int sms : {1, 132}) {
    bad += run_case<__nv_bfloat16>(64, false, 8, 2, 16, {1, 40, 300}, sms, rng);
    bad += run_case<__half>(64, false, 4, 2, 16, {3, 70, 16, 1, 129}, sms, rng);  // 10 pairs: a warp a row at 1 SM
    bad += run_case<__half>(128, false, 8, 1, 16, {17, 100, 257}, sms, rng);
    bad += run_case<__nv_bfloat16>(256, false, 6, 1, 8, {1, 40, 333}, sms, rng);
    bad += run_case<__nv_bfloat16>(128, true, 4, 2, 16, {33, 200, 5}, sms, rng);
    bad += run_case<__half>(256, true, 6, 1, 16, {300, 2}, sms, rng);
  }
  std::printf(bad ? "FAIL %d\n" : "ok\n", bad);
  return bad != 0;
}
