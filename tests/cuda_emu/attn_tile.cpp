// attention.cu's tile kernel (tensor cores, mma.sync and ldmatrix; cut out by cut.py, launched by its launch_tile)
// on the host emulator against fp64 causal attention over the same paged cache: head_dim 64, 128 and 256, 4 x 2
// and 8 x 1 warps, 16-bit caches and e4m3 caches with per-(row, kv head) scales (converted as staged), pages in
// the host tier, GQA groups, prompts continuing cached tokens.
#include "emu.h"
#include "backend/ops.h"
#include "core/error.h"
#include "paged_attention.h"

namespace qrt::cuda {
using namespace qrt;
#include "attn_tile.inc"
}  // namespace qrt::cuda

using namespace qrt;

template <typename T, int D, int WARPS, int MT, bool FP8>
int run_case(int q_heads, int kv_heads, int page, std::vector<int> q_lens, std::vector<int> ctx, std::mt19937& rng) {
  PagedAttention<T> c(D, FP8, q_heads, kv_heads, page, q_lens, ctx, rng);
  cuda::launch_tile<T, D, WARPS, MT, FP8>(c.qt, c.cache, c.b, c.sh, c.ot, nullptr);
  const double err = c.rel_err();
  const bool ok = err < 1.5e-2;
  std::printf("%s D %3d %dx%d warps %s cache, %d/%d heads, pages of %2d, %d sequences: rel %.2e %s\n",
              std::is_same_v<T, __half> ? "f16 " : "bf16", D, WARPS, MT, FP8 ? "e4m3" : "16-bit", q_heads, kv_heads,
              page, int(ctx.size()), err, ok ? "ok" : "FAIL");
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
