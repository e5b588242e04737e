// Kernels of the CPU backend (fp32 compute). Internal to cpp/backend/cpu/.
#pragma once
#include <cstdint>
#include <cstring>
#include <vector>

#include "backend/ops.h"

namespace qrt::cpu {

// Row r of a weight/activation tensor converted to fp32 into dst (cols elements).
void load_row_f32(const Tensor& t, int64_t r, float* dst);
// Element (r, c) as fp32.
float load_f32(const Tensor& t, int64_t r, int64_t c);
void store_row_f32(const float* src, Tensor& t, int64_t r);

// out[M,N] = x[M,K] @ w[N,K]^T (+ bias). x F32; w F32/F16/BF16. Each output element is computed by the
// same sequence of operations whatever M, N or the thread count (batch invariance).
void gemm(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out, int threads);

void attention(const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& s,
               Tensor& out, int threads);

void sample(const Tensor& logits, const std::vector<SampleRow>& rows, SampleResult& out, int threads);

}  // namespace qrt::cpu
