// FP8 weights on CUDA (fp8.cu): the W8A16 GEMV, row-block dequantization for the GEMM, block quantization.
// Internal to cpp/backend/cuda/.
#pragma once
#include <cuda_runtime.h>

#include "backend/cuda/cuda_common.cuh"

namespace qrt::cuda {

// Throws std::runtime_error unless lw is FP8 with float32 scales covering it (ops.h Linear).
void check_fp8_linear(const Linear& lw);
// The FP8 GEMV (x F32/F16/BF16, at most max_rows rows unless QWEN_RT_GEMV_ROWS sets it) with launch_gemv's
// epilogues (no norm); returns false (nothing launched) for shapes it does not take (K not a multiple of 16,
// unaligned rows, more rows).
bool launch_gemv_fp8(const Tensor& x, const Linear& lw, const Tensor* bias, Tensor& out, GemvEpilogue epi,
                     int max_rows, cudaStream_t s);
// The rows the FP8 GEMV should take for x and lw: 32 in its tensor-core form (16-bit x, K a multiple of 128), else
// 4 where the W8A8 GEMM (w8a8) takes more rows, else 8.
int gemv_fp8_rows(const Tensor& x, const Linear& lw, bool w8a8);
// dst (an activation dtype) = rows [n0, n0 + dst.rows) of lw dequantized (fp32 products, then rounded).
void launch_dequantize_fp8(const Linear& lw, int64_t n0, Tensor& dst, cudaStream_t s);
// Backend::quantize_fp8 (src F32/F16/BF16).
void launch_quantize_fp8(const Tensor& src, Tensor& q, Tensor& scale, cudaStream_t s);
// The W8A8 GEMM's activations: x [M, K] (16-bit) into e4m3 q [M, K] (row pitch K) with one fp32 scale per row and
// 128 columns (amax / 448), scale[m * s_row + g * s_group] for column group g.
void launch_quantize_rows_fp8(const Tensor& x, uint8_t* q, float* scale, int64_t s_row, int64_t s_group,
                              cudaStream_t s);
// dst = src^T, fp32, dense [src.cols, src.rows].
void launch_transpose_scales(const Tensor& src, float* dst, cudaStream_t s);

}  // namespace qrt::cuda
