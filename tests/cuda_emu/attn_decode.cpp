// attention.cu's tensor-core decode kernel (cut out by cut.py; through decode_kernel_takes and run_decode, as
// launch_attention runs it) on the host emulator against fp64 attention over the same paged cache: head_dim 64,
// 128 and 256, bf16 / f16 caches and e4m3 caches with per-(row, kv head) scales, pages of 16 and of 8 keys, pages
// in the host tier, 1 / 2 / 4 warps per row and key splits merged by the combine kernel.
#include "emu.h"
#include "backend/ops.h"
#include "core/error.h"
#include "paged_attention.h"

namespace qrt::cuda {
using namespace qrt;
#include "attn_decode.inc"
}  // namespace qrt::cuda

using namespace qrt;

template <typename T>
int run_case(int D, bool fp8, int q_heads, int kv_heads, int page, std::vector<int> ctx, int num_sms,
             std::mt19937& rng) {
  const int S = int(ctx.size());
  PagedAttention<T> c(D, fp8, q_heads, kv_heads, page, std::vector<int>(S, 1), ctx, rng);
  const AttnBatch& b = c.b;
  const AttnShape& sh = c.sh;
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
  static_cast<cuda::RowsArgs&>(a) = cuda::rows_args(c.qt, c.cache, b, sh, c.ot, ws, nsplit, 1);
  auto go = [&](auto c_tag, auto d_tag) {
    using C = decltype(c_tag);
    constexpr int DD = decltype(d_tag)::value;
    if constexpr (!(std::is_same_v<C, uint8_t> && DD == 64))
      cuda::run_decode<T, C, DD, false>(a, b, sh, c.ot, ws, num_sms, nullptr);
  };
  auto by_dim = [&](auto c_tag) {
    if (D == 64) go(c_tag, std::integral_constant<int, 64>());
    else if (D == 128) go(c_tag, std::integral_constant<int, 128>());
    else go(c_tag, std::integral_constant<int, 256>());
  };
  if (fp8) by_dim(uint8_t());
  else by_dim(T());

  const double err = c.rel_err();
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
