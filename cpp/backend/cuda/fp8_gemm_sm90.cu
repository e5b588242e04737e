// W8A8 FP8 GEMM on Hopper with CUTLASS's blockwise-scaled warp-specialized kernel (headers from pip's
// nvidia-cutlass at build time; cmake/cuda.cmake defines QRT_HAVE_CUTLASS where it finds them and the build has an
// sm_90a image): out [M, N] (+)= (x8 * x_scale) @ (w8 * w_scale)^T, x8 e4m3 [M, K] with a scale per row and 128
// columns, w8 e4m3 [N, K] (row stride ldw) with a scale per 128 x 128 block, fp32 accumulation in the tensor cores
// with the block scales applied per 128-deep K slice, bf16 or fp16 out.
#include "backend/cuda/cuda_common.cuh"

#if defined(QRT_HAVE_CUTLASS) && defined(QRT_HAVE_SM90A)
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/numeric_types.h"

namespace qrt::cuda {
namespace {

using namespace cute;

// x is CUTLASS's A (row-major [M, K]), w its B (column-major [K, N]: w's rows), out D (row-major [M, N]), and C the
// same tensor when the product adds into it. Scales: A's per (row, 128 columns), B's per 128 x 128 block, both
// stored with the M (N) index fastest, as the Hopper kernel takes them.
template <typename Out>
struct BlockFp8Gemm {
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 16, kAlignD = 8;  // elements: 16 bytes
  using TileShape = Shape<_128, _128, _128>;
  using ClusterShape = Shape<_1, _1, _1>;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Out, LayoutD, kAlignD, Out, LayoutD, kAlignD,
      cutlass::epilogue::TmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<Out, float, Out, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cute::tuple<LayoutA, LayoutSFA>, kAlignAB,
      ElementB, cute::tuple<LayoutB, LayoutSFB>, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

template <typename Out>
bool run(int64_t M, int64_t N, int64_t K, const void* x8, const float* x_scale, int64_t scale_rows, const void* w8,
         int64_t ldw,
         const float* w_scale, void* out, int64_t ldo, bool accumulate, void* workspace, size_t ws_bytes,
         cudaStream_t st) {
  using G = BlockFp8Gemm<Out>;
  using Gemm = typename G::Gemm;
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  using StrideD = typename Gemm::GemmKernel::StrideD;
  const int m = int(M), n = int(N), k = int(K);
  StrideA sa{};  // (M, K, L): row stride K
  get<0>(sa) = int64_t(K);
  StrideB sb{};  // (N, K, L): w's row stride
  get<0>(sb) = ldw;
  StrideD sd{};  // (M, N, L): out's row stride
  get<0>(sd) = ldo;
  const auto problem = make_shape(m, n, k, 1);
  const auto scale_a_shape = make_shape(int(scale_rows), n, k, 1);  // the scales' row count: a 16-byte TMA stride
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {static_cast<const typename G::ElementA*>(x8), sa, static_cast<const typename G::ElementB*>(w8), sb, x_scale,
       G::ScaleConfig::tile_atom_to_shape_SFA(scale_a_shape), w_scale, G::ScaleConfig::tile_atom_to_shape_SFB(problem)},
      {{1.0f, accumulate ? 1.0f : 0.0f}, static_cast<const Out*>(out), sd, static_cast<Out*>(out), sd}};
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return false;
  if (Gemm::get_workspace_size(args) > ws_bytes) return false;
  if (gemm.initialize(args, workspace, st) != cutlass::Status::kSuccess) return false;
  return gemm.run(st) == cutlass::Status::kSuccess;
}

}  // namespace

bool launch_fp8_block_gemm(int64_t M, int64_t N, int64_t K, const void* x8, const float* x_scale, int64_t scale_rows,
                           const void* w8, int64_t ldw, const float* w_scale_t, void* out, int64_t ldo, DType out_t,
                           bool accumulate, void* workspace, size_t ws_bytes, cudaStream_t st) {
  if (scale_rows < M || scale_rows % 4 != 0) return false;
  if (out_t == DType::BF16)
    return run<cutlass::bfloat16_t>(M, N, K, x8, x_scale, scale_rows, w8, ldw, w_scale_t, out, ldo, accumulate,
                                    workspace, ws_bytes, st);
  if (out_t == DType::F16)
    return run<cutlass::half_t>(M, N, K, x8, x_scale, scale_rows, w8, ldw, w_scale_t, out, ldo, accumulate, workspace,
                                ws_bytes, st);
  return false;
}

}  // namespace qrt::cuda

#else  // no CUTLASS (or no sm_90a image) in this build: the caller takes another path

namespace qrt::cuda {
bool launch_fp8_block_gemm(int64_t, int64_t, int64_t, const void*, const float*, int64_t, const void*, int64_t,
                           const float*, void*, int64_t, DType, bool, void*, size_t, cudaStream_t) {
  return false;
}
}  // namespace qrt::cuda

#endif
