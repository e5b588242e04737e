// cuBLASLt GEMM for linear(): out[M,N] = x[M,K] @ w[N,K]^T (+ bias), fp32 accumulation.
// Internal to cpp/backend/cuda/.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <tuple>

#include "core/dtype.h"

namespace qrt::cuda {

class LtGemm {
 public:
  LtGemm() = default;
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;
  void init(size_t workspace_bytes);  // on the current device
  // All three matrices of dtype t (F32: plain fp32 SGEMM, no TF32). bias: [N] of dtype bias_t, or null.
  // Returns false when bias was requested but no epilogue algorithm exists (the caller adds it).
  // out_t: dtype of out (t, or F32 for fp32 results such as logits). accumulate: out += the product.
  bool run(DType t, int64_t M, int64_t N, int64_t K, const void* x, int64_t ldx, const void* w, int64_t ldw,
           void* out, int64_t ldo, const void* bias, DType bias_t, cudaStream_t s, DType out_t,
           bool accumulate = false);

 private:
  using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, int, int, int>;
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
    bool ok = false;
  };
  // The plan of k, built by build(Plan&) (its descriptors, then find_algo) on first use (gemm.cu).
  template <typename Build>
  Plan& plan(const Key& k, Build&& build);
  void build_plan(Plan& p, DType t, int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t ldw, int64_t ldo,
                  int al_x, int al_w, int al_o, int bias_t, DType out_t);
  void find_algo(Plan& p, int al_a, int al_b, int al_c);
  static void destroy(Plan& p) noexcept;

  // Plans are host objects, read when a GEMM is enqueued (or captured): any may go once its call returned.
  static constexpr size_t kMaxPlans = 1024;
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t ws_bytes_ = 0;
  std::map<Key, Plan> plans_;
};

}  // namespace qrt::cuda
