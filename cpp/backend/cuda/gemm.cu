#include "backend/cuda/gemm.cuh"

#include <cstdio>
#include <cstdlib>
#include <string>

#include "backend/cuda/cuda_common.cuh"

namespace qrt::cuda {
namespace {

void lt_check(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(str_cat("cuda linear: ", what, " failed: ", cublasLtGetStatusString(st), " (",
                                     int(st), ")"));
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::F32: return CUDA_R_32F;
    case DType::F16: return CUDA_R_16F;
    case DType::BF16: return CUDA_R_16BF;
    default: throw std::runtime_error(str_cat("cuda linear: unsupported dtype ", dtype_name(t)));
  }
}

// Largest power of two (<= 256) dividing the address and the row pitch.
int alignment(const void* p, int64_t ld_bytes) {
  uint64_t v = uint64_t(reinterpret_cast<uintptr_t>(p)) | uint64_t(ld_bytes) | 256u;
  return int(v & (~v + 1));
}

}  // namespace

void LtGemm::destroy(Plan& p) noexcept {
  if (p.a) cublasLtMatrixLayoutDestroy(p.a);
  if (p.b) cublasLtMatrixLayoutDestroy(p.b);
  if (p.c) cublasLtMatrixLayoutDestroy(p.c);
  if (p.op) cublasLtMatmulDescDestroy(p.op);
  p = Plan{};
}

LtGemm::~LtGemm() {
  for (auto& kv : plans_) destroy(kv.second);
  if (workspace_) cudaFree(workspace_);
  if (handle_) cublasLtDestroy(handle_);
}

void LtGemm::init(size_t workspace_bytes) {
  lt_check(cublasLtCreate(&handle_), "cublasLtCreate");
  ws_bytes_ = workspace_bytes;
  check(cudaMalloc(&workspace_, ws_bytes_), "cuBLASLt workspace");
}

template <typename Build>
LtGemm::Plan& LtGemm::plan(const Key& k, Build&& build) {
  auto it = plans_.find(k);
  if (it != plans_.end()) return it->second;
  if (plans_.size() >= kMaxPlans) {  // every prefill token count is a shape: start over rather than grow for ever
    for (auto& kv : plans_) destroy(kv.second);
    plans_.clear();
  }
  Plan& p = plans_[k];
  try {
    build(p);
  } catch (...) {  // no half-built plan stays to be found by the next call of this shape
    destroy(p);
    plans_.erase(k);
    throw;
  }
  return p;
}

void LtGemm::build_plan(Plan& p, DType t, int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t ldw, int64_t ldo,
                        int al_x, int al_w, int al_o, int bias_t, DType out_t) {
  const cudaDataType_t ct = cuda_type(t);
  lt_check(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  lt_check(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)), "set transa");
  lt_check(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)), "set transb");
  if (bias_t >= 0) {
    const cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bt = cuda_type(DType(bias_t));
    lt_check(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof(ep)), "set epilogue");
    lt_check(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)),
             "set bias type");
  }
  // Column-major view: out^T [N, M] = (w [K, N])^T * x^T [K, M].
  lt_check(cublasLtMatrixLayoutCreate(&p.a, ct, uint64_t(K), uint64_t(N), ldw), "layout w");
  lt_check(cublasLtMatrixLayoutCreate(&p.b, ct, uint64_t(K), uint64_t(M), ldx), "layout x");
  lt_check(cublasLtMatrixLayoutCreate(&p.c, cuda_type(out_t), uint64_t(N), uint64_t(M), ldo), "layout out");
  find_algo(p, al_w, al_x, al_o);
}

void LtGemm::find_algo(Plan& p, int al_a, int al_b, int al_c) {
  cublasLtMatmulPreference_t pref = nullptr;
  lt_check(cublasLtMatmulPreferenceCreate(&pref), "preference");
  uint64_t ws = ws_bytes_;
  uint32_t aa = uint32_t(al_a), ab = uint32_t(al_b), ac = uint32_t(al_c);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa, sizeof(aa));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab, sizeof(ab));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac, sizeof(ac));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ac, sizeof(ac));
  cublasLtMatmulHeuristicResult_t res{};
  int found = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(handle_, p.op, p.a, p.b, p.c, p.c, pref, 1, &res, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  p.ok = st == CUBLAS_STATUS_SUCCESS && found > 0;
  if (p.ok) p.algo = res.algo;
  static const bool verbose = [] {
    const char* e = std::getenv("QWEN_RT_GEMM_VERBOSE");
    return e && *e == '1';
  }();
  if (verbose && !p.ok)  // why cuBLASLt declined a plan
    std::fprintf(stderr, "cuBLASLt declined a plan: heuristic status %d (%s), %d algorithms\n", int(st),
                 cublasLtGetStatusName(st), found);
}

bool LtGemm::run(DType t, int64_t M, int64_t N, int64_t K, const void* x, int64_t ldx, const void* w, int64_t ldw,
                 void* out, int64_t ldo, const void* bias, DType bias_t, cudaStream_t s, DType out_t,
                 bool accumulate) {
  if (M == 0 || N == 0) return true;
  const int64_t es = int64_t(dtype_size(t));
  const int al_x = alignment(x, ldx * es), al_w = alignment(w, ldw * es),
            al_o = alignment(out, ldo * int64_t(dtype_size(out_t)));
  const bool want_bias = bias && reinterpret_cast<uintptr_t>(bias) % 16 == 0;
  const int bt = want_bias ? int(bias_t) : -1;
  Key k{int(t), M, N, K, ldx, ldw, ldo, al_x, al_w, al_o, bt, int(out_t)};
  auto build = [&](int bias_type) {
    return [&, bias_type](Plan& q) { build_plan(q, t, M, N, K, ldx, ldw, ldo, al_x, al_w, al_o, bias_type, out_t); };
  };
  Plan* p = &plan(k, build(bt));
  bool bias_done = want_bias;
  if (!p->ok && want_bias) {
    std::get<10>(k) = -1;
    p = &plan(k, build(-1));
    bias_done = false;
  }
  QRT_CHECK(p->ok, "cuda linear: cuBLASLt has no algorithm for M=", M, " N=", N, " K=", K, " dtype ",
            dtype_name(t));
  if (bias_done)
    lt_check(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)),
             "set bias");
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  lt_check(cublasLtMatmul(handle_, p->op, &alpha, w, p->a, x, p->b, &beta, out, p->c, out, p->c, &p->algo,
                          workspace_, ws_bytes_, s),
           "cublasLtMatmul");
  return bias_done || !bias;
}

}  // namespace qrt::cuda
