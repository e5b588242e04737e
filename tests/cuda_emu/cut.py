"""Cuts the kernels the host emulator runs (tests/cuda_emu/*.cpp) out of the CUDA sources as they are, into
<out>/<harness>.inc: fp8_gemv (fp8.cu's GEMVs and their host side, with cuda_common.cuh's GemvEpilogue); gdn
(gdn.cu's gated delta rule, the token loop and the chunked form, with their host side); attn_decode (attention.cu's
tensor-core decode kernel, the split combine and their host side); attn_tile (attention.cu's prefill tile kernel and
launch_tile, its <<<>>> launch as an emulated one); sparse (sparse.cu's page lists and staging kernels, beside
cpu/sparse.cpp's stage_pages).
Usage: python cut.py <cpp/backend/cuda> <out>."""
import sys
from pathlib import Path

RING = ("extern __shared__ uint4 ring[];", "uint4* ring = reinterpret_cast<uint4*>(emu::blk->smem.data());")
TILE_SMEM = ("extern __shared__ __align__(16) unsigned char smem_raw[];",
             "unsigned char* smem_raw = emu::blk->smem.data();")
TILE_LAUNCH = ("kernel<<<grid, Cfg::kThreads, Cfg::smem, st>>>(a);",
               "launch_chained(kernel, grid, Cfg::kThreads, Cfg::smem, st, a);")
GDN_SMEM = ("extern __shared__ __align__(16) unsigned char gdn_smem[];",
            "unsigned char* gdn_smem = emu::blk->smem.data();")


def cut(text: str, start: str, end: str) -> str:
    """text from the start marker up to (not including) the end marker after it."""
    a = text.index(start)
    return text[a:text.index(end, a)]


def sources(src: Path) -> dict[str, str]:
    c = (src / "cuda_common.cuh").read_text()
    f = (src / "fp8.cu").read_text()
    g = (src / "gdn.cu").read_text()
    a = (src / "attention.cu").read_text()
    sp = (src / "sparse.cu").read_text()
    cpu = (src.parent / "cpu" / "sparse.cpp").read_text()
    return {
        "sparse": ("namespace cuda {\nnamespace {\n" +
                   cut(sp, "constexpr int kSummaryThreads", "// x rounded toward -inf") +
                   cut(sp, "struct SelectArgs {", "// Grid (page blocks, kv heads, sequences)") +
                   cut(sp, "// A score as an unsigned key", "}  // namespace\n") +
                   "}  // namespace\n}  // namespace cuda\nnamespace cpu {\n" +
                   cut(cpu, "void stage_pages(", "}  // namespace qrt::cpu") + "}  // namespace cpu\n"),
        "fp8_gemv": (cut(c, "enum class GemvEpilogue", "// Whether norm_linear GEMVs") +
                     cut(f, "constexpr int kThreads = 256;", "__device__ __forceinline__ float fp8_value") +
                     cut(f, "// U: pieces in flight per lane and weight row",
                         "// Rows [n0, n0 + dst.rows) of w dequantized") +
                     cut(f, "bool gemv_fp8_mma(const Tensor& x", "void launch_dequantize_fp8(")),
        "gdn": (cut(c, "struct DeltaRulePlan {", "DeltaRulePlan plan_delta_rule(") + "namespace {\n" +
                cut(g, "__device__ __forceinline__ float sigmoid", "// Whether the element ranges") +
                cut(g, "// ---- gated delta rule ----", "}  // namespace\n") + "}  // namespace\n" +
                cut(g, "DeltaRulePlan plan_delta_rule(", "}  // namespace qrt::cuda")),
        "attn_decode": (cut(c, "struct AttnWorkspace {", "size_t attn_workspace_bytes(") + "namespace {\n" +
                        cut(a, "constexpr int kRowThreads = 128;", "__device__ __forceinline__ float2 load2(") +
                        cut(a, "// What both attention kernels read", "// T: q and out; C: the cache's elements") +
                        cut(a, "// nsplit > 1: block (row, query head) merges", "// ====") +
                        cut(a, "constexpr int kDecWarps = 4;", "// ====") +
                        cut(a, "// The decode kernel takes one-query-row", "void check_shape(") +
                        cut(a, "void attn_args(", "template <typename T, typename C, int D>\nvoid run_rows(") +
                        cut(a, "template <typename T, typename C, int D, bool FUSED>\nvoid run_decode(",
                            "template <typename T, int D, int WARPS, int MT, bool FP8 = false>") + "}  // namespace\n"),
        "attn_tile": (cut(c, "struct AttnWorkspace {", "size_t attn_workspace_bytes(") + "namespace {\n" +
                      cut(a, "constexpr int kRowThreads = 128;", "__device__ __forceinline__ float2 load2(") +
                      cut(a, "// What both attention kernels read", "struct RowsArgs : AttnArgs {") +
                      cut(a, "template <int D, int WARPS, int MT> struct TileCfg",
                          "__device__ __forceinline__ void ldsm_x4(") +
                      cut(a, "// c[mt][n] += a[mt] b[0..1]", "#include \"backend/cuda/attention_sm90.cuh\"") +
                      cut(a, "void attn_args(", "RowsArgs rows_args(") +
                      cut(a, "template <typename T, int D, int WARPS, int MT, bool FP8 = false>\nvoid launch_tile(",
                          "template <typename T, int D, int BN, int WG, int STAGES, int PIPE>") + "}  // namespace\n"),
    }


if __name__ == "__main__":
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    for name, body in sources(Path(sys.argv[1])).items():
        for old, new in (RING, GDN_SMEM, TILE_SMEM, TILE_LAUNCH):
            body = body.replace(old, new)
        (out / f"{name}.inc").write_text(body)
