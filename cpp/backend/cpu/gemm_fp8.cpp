// FP8 weights on the CPU: y = x @ (w * scale)^T in fp32 with e4m3 weights and their block scales (ops.h Linear),
// each block of weight rows dequantized into a thread's scratch just before the fp32 GEMM (gemm.cpp) multiplies it
// (never the whole matrix); and Backend::quantize_fp8, the block quantization of Qwen's FP8 checkpoints.
// A dequantized weight is the fp32 product w * scale, rounded once: exactly the matrix a framework gets by
// dequantizing, so the products are those of the float32 path on that matrix (the same for every M and thread
// count: batch invariance).
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/cpu_kernels.h"
#include "core/error.h"

namespace qrt::cpu {
namespace {

constexpr int kLanes = 16;
constexpr int64_t kRowsPerBlock = 32;  // weight rows dequantized at a time (decode; prefill 8x)

// Row r of w dequantized into dst (K floats): w[r, k] * scale[r >> shift, k / 128], each an fp32 product.
void dequantize_row(const Linear& lw, int64_t r, float* dst) {
  const Tensor& w = lw.w;
  const int64_t K = w.cols;
  const uint8_t* src = w.ptr<uint8_t>() + r * w.stride;
  const float* s = lw.scale.ptr<float>() + (r >> lw.scale_row_shift) * lw.scale.stride;
  for (int64_t k0 = 0; k0 < K; k0 += kFp8Block) {
    const int64_t k1 = std::min<int64_t>(K, k0 + kFp8Block);
    const float sc = s[k0 / kFp8Block], sc256 = sc * 256.0f;  // f8x16_over_256's 2^-8 back, exactly
    int64_t k = k0;
    for (; k + kLanes <= k1; k += kLanes) {
      const v16f v = f8x16_over_256(src + k) * sc256;
      std::memcpy(dst + k, &v, 64);
    }
    for (; k < k1; ++k) dst[k] = f8e4m3_to_f32(src[k]) * sc;
  }
}

}  // namespace

void check_fp8_linear(const Linear& lw, const char* op) {
  const Tensor& w = lw.w;
  QRT_CHECK(w.dtype == DType::F8E4M3 && lw.scale.dtype == DType::F32, op, ": FP8 weights must be float8_e4m3 with ",
            "float32 scales, got ", dtype_name(w.dtype), " and ", dtype_name(lw.scale.dtype));
  QRT_CHECK(lw.scale_row_shift >= 0 && lw.scale_row_shift <= 7, op, ": scale_row_shift ", lw.scale_row_shift,
            " is not in [0, 7]");
  const int64_t rows = ((w.rows - 1) >> lw.scale_row_shift) + 1, cols = (w.cols + kFp8Block - 1) / kFp8Block;
  QRT_CHECK(lw.scale.rows >= rows && lw.scale.cols >= cols, op, ": FP8 scales [", lw.scale.rows, ", ",
            lw.scale.cols, "] for weights [", w.rows, ", ", w.cols, "] need [", rows, ", ", cols, "]");
}

void gemm_fp8(const Tensor& x, const Linear& lw, const Tensor* bias, Tensor& out, ThreadPool& pool, bool accumulate) {
  const Tensor& w = lw.w;
  QRT_CHECK(x.dtype == DType::F32 && out.dtype == DType::F32, "cpu linear: activations must be float32");
  QRT_CHECK(x.cols == w.cols && out.rows == x.rows && out.cols == w.rows, "cpu linear: shape mismatch x[", x.rows,
            ",", x.cols, "] w[", w.rows, ",", w.cols, "] out[", out.rows, ",", out.cols, "]");
  check_fp8_linear(lw, "cpu linear");
  const int64_t M = x.rows, N = w.rows, K = x.cols;
  if (M == 0 || N == 0) return;
  // Prefill packs x once per block (gemm_packed): larger blocks there, but at least 4 per thread where N allows.
  const int64_t per_thread = ((N + 4 * pool.size() - 1) / (4 * pool.size()) + kRowsPerBlock - 1) / kRowsPerBlock *
                             kRowsPerBlock;
  const int64_t block = M >= 24 ? std::clamp(per_thread, kRowsPerBlock, 8 * kRowsPerBlock) : kRowsPerBlock;
  const int64_t nblocks = (N + block - 1) / block;
  pool.for_dynamic(nblocks, M * N * K > (1 << 16), [&](int64_t nb, int) {
    thread_local ThreadPool serial(1);
    thread_local std::vector<float> wide;
    const int64_t n0 = nb * block, n1 = std::min(N, n0 + block);
    wide.resize(size_t((n1 - n0) * K));
    for (int64_t n = n0; n < n1; ++n) dequantize_row(lw, n, wide.data() + (n - n0) * K);
    const Tensor wt(wide.data(), DType::F32, n1 - n0, K);
    Tensor ot(out.ptr<float>() + n0, DType::F32, M, n1 - n0, out.stride);
    Tensor bt;
    if (bias)
      bt = Tensor(static_cast<char*>(bias->data) + n0 * int64_t(dtype_size(bias->dtype)), bias->dtype, 1, n1 - n0);
    gemm(x, wt, bias ? &bt : nullptr, ot, serial, accumulate);
  });
}

void quantize_fp8(const Tensor& src, Tensor& q, Tensor& scale, ThreadPool& pool) {
  const int64_t R = src.rows, C = src.cols, B = kFp8Block;
  const int64_t br = (R + B - 1) / B, bc = (C + B - 1) / B;
  QRT_CHECK(q.dtype == DType::F8E4M3 && q.rows == R && q.cols == C, "cpu quantize_fp8: q must be float8_e4m3 [", R,
            ", ", C, "]");
  QRT_CHECK(scale.dtype == DType::F32 && scale.rows == br && scale.cols == bc, "cpu quantize_fp8: scale must be ",
            "float32 [", br, ", ", bc, "]");
  pool.for_static(br, R * C > (1 << 16), [&](int64_t bi) {
    const int64_t r0 = bi * B, r1 = std::min(R, r0 + B);
    std::vector<float> rows(size_t((r1 - r0) * C));
    for (int64_t r = r0; r < r1; ++r) load_row_f32(src, r, rows.data() + (r - r0) * C);
    for (int64_t bj = 0; bj < bc; ++bj) {
      const int64_t c0 = bj * B, c1 = std::min(C, c0 + B);
      float amax = 0.f;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(rows[size_t((r - r0) * C + c)]));
      const float s = amax > 0.f ? amax / 448.0f : 1.0f;
      scale.ptr<float>()[bi * scale.stride + bj] = s;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c)
          q.ptr<uint8_t>()[r * q.stride + c] = f32_to_f8e4m3(rows[size_t((r - r0) * C + c)] / s);
    }
  });
}

}  // namespace qrt::cpu
