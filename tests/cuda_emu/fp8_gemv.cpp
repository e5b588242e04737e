// fp8.cu's GEMVs (the CUDA-core form at 1 row, the tensor-core form at 2-32; cut out by cut.py) on the host
// emulator, against fp64 on the same e4m3 weights and block scales: Store (+ bias), Add and the gated SiluMul,
// odd N, scale row blocks of 2^shift rows; with QWEN_RT_FP8_GEMV_BLOCKS=1 (a persistent grid where the build has
// one: here 2 SMs) the same bits as with one block per tile, and with QWEN_RT_FP8_GEMV_INFLIGHT=1 (one piece in
// flight per lane at 1 row) the same bits as with four.
#include <random>

#include "emu.h"
#include "backend/ops.h"
#include "core/error.h"

namespace qrt::cuda {
using namespace qrt;
// e4m3 times the scale, one fp32 product each (fp8.cu's dequantize16 and fp8_value, by value).
inline float fp8_value(uint8_t b) { return e4m3_to_float(b); }
inline void dequantize16(const uint4& v, float sc, float (&w)[16]) {
  uint8_t b[16];
  std::memcpy(b, &v, 16);
  for (int i = 0; i < 16; ++i) w[i] = e4m3_to_float(b[i]) * sc;
}
#include "fp8_gemv.inc"
}  // namespace qrt::cuda

using namespace qrt;

template <typename T>
int run_case(int M, int64_t N, int64_t K, int shift, cuda::GemvEpilogue epi, bool bias, std::mt19937& rng) {
  std::uniform_real_distribution<float> U(-1, 1);
  const bool gated = epi == cuda::GemvEpilogue::SiluMul;
  const int64_t W = gated ? 2 * N : N;  // weight rows
  std::vector<uint8_t> w(size_t(W) * K);
  for (auto& b : w) {
    do b = uint8_t(rng() & 0xff); while (std::isnan(e4m3_to_float(b)) || std::fabs(e4m3_to_float(b)) > 64);
  }
  const int64_t srows = ((W - 1) >> shift) + 1, scols = K / 128;
  std::vector<float> sc(size_t(srows) * scols);
  for (auto& x : sc) x = (0.5f + std::fabs(U(rng))) / (64.f * std::sqrt(float(K)));
  std::vector<T> x(size_t(M) * K), bs(N);
  for (auto& v : x) v = from_f<T>(U(rng));
  for (auto& v : bs) v = from_f<T>(U(rng));
  const DType act = std::is_same_v<T, __half> ? DType::F16 : DType::BF16;
  std::vector<T> init(size_t(M) * N);
  for (auto& v : init) v = from_f<T>(U(rng));
  cuda::Linear lw;
  lw.w = Tensor(w.data(), DType::F8E4M3, W, K);
  lw.scale = Tensor(sc.data(), DType::F32, srows, scols);
  lw.scale_row_shift = shift;
  Tensor xt(x.data(), act, M, K), bt(bs.data(), act, 1, N);
  auto run = [&](const char* blocks, const char* inflight = "4") {
    setenv("QWEN_RT_FP8_GEMV_BLOCKS", blocks, 1);
    setenv("QWEN_RT_FP8_GEMV_INFLIGHT", inflight, 1);
    std::vector<T> out = init;
    Tensor ot(out.data(), act, M, N);
    if (!cuda::launch_gemv_fp8(xt, lw, bias ? &bt : nullptr, ot, epi, 32, nullptr)) out.clear();
    return out;
  };
  const std::vector<T> one = run("0"), pers = run("1"), inflight1 = run("0", "1");
  if (one.empty()) {
    std::printf("not taken\n");
    return 1;
  }
  double num = 0, den = 0;
  for (int m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      auto dot = [&](int64_t row) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k)
          s += double(to_f(x[size_t(m) * K + k])) * double(e4m3_to_float(w[size_t(row) * K + k])) *
               double(sc[size_t(row >> shift) * scols + k / 128]);
        return s;
      };
      double want = dot(n);
      if (epi == cuda::GemvEpilogue::Store && bias) want += to_f(bs[n]);
      if (epi == cuda::GemvEpilogue::Add) want += to_f(init[size_t(m) * N + n]);
      if (gated) want = want / (1 + std::exp(-want)) * dot(n + N);
      const double got = to_f(one[size_t(m) * N + n]);
      num += (got - want) * (got - want), den += want * want;
    }
  const double err = std::sqrt(num / den);
  const bool same = std::memcmp(one.data(), pers.data(), one.size() * sizeof(T)) == 0 &&
                    std::memcmp(one.data(), inflight1.data(), one.size() * sizeof(T)) == 0;
  const bool ok = err < 1e-2 && same;
  std::printf("%s M %2d N %4lld K %4lld shift %d epi %d bias %d: rel %.2e persistent %s %s\n",
              std::is_same_v<T, __half> ? "f16 " : "bf16", M, (long long)N, (long long)K, shift, int(epi), int(bias),
              err, same ? "same" : "DIFFERENT", ok ? "ok" : "FAIL");  // (persistent: both switches)
  return ok ? 0 : 1;
}

int main() {
  std::mt19937 rng(5);
  using E = cuda::GemvEpilogue;
  int bad = 0;
  for (int M : {1, 2, 7, 9, 16, 17, 32}) {
    bad += run_case<__nv_bfloat16>(M, 100, 384, 7, E::Store, true, rng);
    bad += run_case<__half>(M, 77, 256, 3, E::Add, false, rng);
    bad += run_case<__nv_bfloat16>(M, 130, 512, 7, E::SiluMul, false, rng);
  }
  std::printf(bad ? "FAIL %d\n" : "ok\n", bad);
  return bad != 0;
}
