// The CPU backend: the reference every other backend is tested against. fp32 activations.

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <unistd.h>
#include <mutex>
#include <string>
#include <unordered_map>

#include "backend/cpu/cpu_kernels.h"
#include "backend/random.h"
#include "core/error.h"

namespace qrt {
namespace cpu {

float load_f32(const Tensor& t, int64_t r, int64_t c) {
  const int64_t i = r * t.stride + c;
  switch (t.dtype) {
    case DType::F32: return t.ptr<float>()[i];
    case DType::BF16: return bf16_to_f32(t.ptr<uint16_t>()[i]);
    case DType::F16: return f16_to_f32(t.ptr<uint16_t>()[i]);
    case DType::F8E4M3: return f8e4m3_to_f32(t.ptr<uint8_t>()[i]);
    default: throw std::runtime_error("load_f32: not a float tensor");
  }
}

void load_row_f32(const Tensor& t, int64_t r, float* dst) {
  const char* src = static_cast<const char*>(t.data) + r * t.stride * int64_t(dtype_size(t.dtype));
  convert_host(src, t.dtype, dst, DType::F32, size_t(t.cols));
}

void store_row_f32(const float* src, Tensor& t, int64_t r) {
  char* dst = static_cast<char*>(t.data) + r * t.stride * int64_t(dtype_size(t.dtype));
  convert_host(src, DType::F32, dst, t.dtype, size_t(t.cols));
}

namespace {

float* row(const Tensor& t, int64_t r) { return t.ptr<float>() + r * t.stride; }

void check_f32(const Tensor& t, const char* op) {
  QRT_CHECK(t.dtype == DType::F32, "cpu ", op, ": activations must be float32, got ", dtype_name(t.dtype));
}

// A norm's gains as fp32 (1 + w when zero-centred), converted once per call.
std::vector<float> norm_gains(const Tensor& w, bool zc) {
  std::vector<float> g(size_t(w.cols));
  load_row_f32(w, 0, g.data());
  if (zc)
    for (float& v : g) v = 1.0f + v;
  return g;
}

// out = x * rsqrt(mean(x^2) + eps) * g. The squares are summed in 16 lanes, then lane_sum, then the elements
// past the last 16 (the same order for every row).
void rms_row(const float* x, int64_t n, const float* g, float eps, float* out) {
  v16f acc{};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v16f v;
    std::memcpy(&v, x + i, 64);
    acc += v * v;
  }
  float ss = lane_sum(acc);
  for (; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss / float(n) + eps);
  for (i = 0; i < n; ++i) out[i] = x[i] * inv * g[i];
}

}  // namespace

class CpuBackend final : public Backend {
 public:
  CpuBackend(int threads, DType kv_dtype) : pool_(threads > 0 ? threads : available_cores()), kv_dtype_(kv_dtype) {
    QRT_CHECK(kv_dtype == DType::F32 || kv_dtype == DType::BF16 || kv_dtype == DType::F16,
              "cpu: KV cache of ", dtype_name(kv_dtype), " (float32, bfloat16 or float16)");
  }
  std::string name() const override { return "cpu"; }
  DType act_dtype() const override { return DType::F32; }
  DType kv_dtype() const override { return kv_dtype_; }

  void* alloc(size_t bytes) override {
    const size_t n = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, n ? n : 64);
    QRT_CHECK(p, "cpu: out of memory allocating ", bytes, " bytes");
    return p;
  }
  // Large zeroed blocks (the KV pool) come straight from the OS: its pages are zero and are committed when
  // first written, so a pool sized for long contexts costs neither start-up time nor memory until used (a
  // memset of it took ~10 s and 3.5 GB at the start of a 100M model's Generator).
  void* alloc_zeroed(size_t bytes) override {
    if (bytes < (size_t(1) << 20)) return Backend::alloc_zeroed(bytes);
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    QRT_CHECK(p != MAP_FAILED, "cpu: out of memory allocating ", bytes, " bytes");
    std::lock_guard<std::mutex> lk(mapped_mu_);
    mapped_[p] = bytes;
    return p;
  }
  void release(void* p) noexcept override {
    {
      std::lock_guard<std::mutex> lk(mapped_mu_);
      if (auto it = mapped_.find(p); it != mapped_.end()) {
        munmap(p, it->second);
        mapped_.erase(it);
        return;
      }
    }
    std::free(p);
  }
  void upload(void* dst, const void* src, size_t n) override { std::memcpy(dst, src, n); }
  bool host_memory() const override { return true; }
  void download(void* dst, const void* src, size_t n) override { std::memcpy(dst, src, n); }
  void fill_zero(void* p, size_t n) override { std::memset(p, 0, n); }
  void copy(void* dst, const void* src, size_t n) override { std::memmove(dst, src, n); }
  void synchronize() override {}
  void memory_info(size_t* free_b, size_t* total_b) override {
    // Line by line (some lines have no unit); without MemAvailable (old kernels, some containers) the pages the
    // system reports free.
    std::ifstream f("/proc/meminfo");
    std::string line;
    size_t avail = 0, total = 0;
    while (std::getline(f, line)) {
      unsigned long long kb = 0;
      if (std::sscanf(line.c_str(), "MemAvailable: %llu", &kb) == 1) avail = size_t(kb) * 1024;
      if (std::sscanf(line.c_str(), "MemTotal: %llu", &kb) == 1) total = size_t(kb) * 1024;
    }
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    if (avail == 0) avail = size_t(sysconf(_SC_AVPHYS_PAGES)) * page;
    if (total == 0) total = size_t(sysconf(_SC_PHYS_PAGES)) * page;
    *free_b = avail;
    *total_b = total;
  }

  void fill_random(Tensor& t, uint64_t seed, float scale, float offset, int64_t row0, int64_t col0) override {
    std::vector<float> buf(t.cols);
    for (int64_t r = 0; r < t.rows; ++r) {
      for (int64_t c = 0; c < t.cols; ++c)
        buf[c] = std::fma(scale, std::fma(2.0f, uniform01(seed, uint64_t(row0 + r), uint64_t(col0 + c)), -1.0f), offset);
      store_row_f32(buf.data(), t, r);
    }
  }
  void convert(const Tensor& src, Tensor& dst) override {
    QRT_CHECK(src.rows == dst.rows && src.cols == dst.cols, "cpu convert: shape mismatch");
    std::vector<float> buf(src.cols);
    for (int64_t r = 0; r < src.rows; ++r) {
      load_row_f32(src, r, buf.data());
      store_row_f32(buf.data(), dst, r);
    }
  }

  void embedding(const int32_t* ids, const Tensor& table, Tensor& out) override {
    check_f32(out, "embedding");
    for (int64_t i = 0; i < out.rows; ++i) {
      if (ids[i] >= 0 && ids[i] < table.rows) load_row_f32(table, ids[i], row(out, i));
      else std::memset(row(out, i), 0, size_t(out.cols) * 4);
    }
  }
  void rms_norm(const Tensor& x, const Tensor& w, float eps, bool zc, Tensor& out) override {
    check_f32(x, "rms_norm");
    const std::vector<float> g = norm_gains(w, zc);
    pool_.for_static(x.rows, x.rows > 8, [&](int64_t r) { rms_row(row(x, r), x.cols, g.data(), eps, row(out, r)); });
  }
  void add_rms_norm(Tensor& res, const Tensor& x, const Tensor& w, float eps, bool zc, Tensor& out) override {
    check_f32(x, "add_rms_norm");
    const std::vector<float> g = norm_gains(w, zc);
    pool_.for_static(x.rows, x.rows > 8, [&](int64_t r) {
      float* rr = row(res, r);
      const float* xr = row(x, r);
      for (int64_t i = 0; i < x.cols; ++i) rr[i] += xr[i];
      rms_row(rr, x.cols, g.data(), eps, row(out, r));
    });
  }
  void head_rms_norm(Tensor& x, int hd, const Tensor& w, float eps, bool zc) override {
    check_f32(x, "head_rms_norm");
    const int64_t heads = x.cols / hd;
    const std::vector<float> g = norm_gains(w, zc);
    pool_.for_static(x.rows, x.rows > 8, [&](int64_t r) {
      for (int64_t h = 0; h < heads; ++h) {
        float* p = row(x, r) + h * hd;
        rms_row(p, hd, g.data(), eps, p);
      }
    });
  }
  void rope(Tensor& x, int hd, const int32_t* positions, const RopeTable& tab) override {
    check_f32(x, "rope");
    const int64_t heads = x.cols / hd;
    const int half = tab.rot_dim / 2;
    for (int64_t r = 0; r < x.rows; ++r)
      QRT_CHECK(positions[r] >= 0 && positions[r] < tab.max_positions, "rope: position ", positions[r],
                " outside the table");
    pool_.for_static(x.rows, x.rows > 8, [&](int64_t r) {
      const float* cs = tab.cos_sin + int64_t(positions[r]) * tab.rot_dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* p = row(x, r) + h * hd;
        for (int i = 0; i < half; ++i) {
          const float a = p[i], b = p[i + half], c = cs[i], s = cs[half + i];
          p[i] = a * c - b * s;
          p[i + half] = b * c + a * s;
        }
      }
    });
  }
  void linear(const Tensor& x, const Linear& w, const Tensor* bias, Tensor& out) override {
    if (w.fp8()) cpu::gemm_fp8(x, w, bias, out, pool_);
    else cpu::gemm(x, w.w, bias, out, pool_);
  }
  void linear_add(const Tensor& x, const Linear& w, Tensor& out) override {
    if (w.fp8()) cpu::gemm_fp8(x, w, nullptr, out, pool_, /*accumulate=*/true);
    else cpu::gemm(x, w.w, nullptr, out, pool_, /*accumulate=*/true);
  }
  void quantize_fp8(const Tensor& src, Tensor& q, Tensor& scale) override { cpu::quantize_fp8(src, q, scale, pool_); }
  void silu_mul(const Tensor& gu, Tensor& out) override {
    check_f32(gu, "silu_mul");
    const int64_t I = out.cols;
    pool_.for_static(out.rows, out.rows > 8, [&](int64_t r) {
      const float* g = row(gu, r);
      float* o = row(out, r);
      // silu(g) = g * sigmoid(g), sigmoid from e = exp(-|g|) (exp_lanes takes x <= 0): 1 / (1 + e), or e / (1 + e).
      // 16 lanes with AVX-512, else 8 (GCC scalarizes 16-lane selects without AVX-512); the same values.
#if defined(__AVX512F__)
      using VF = v16f;
      using VI = v16i;
#else
      using VF = v8f;
      using VI = v8i;
#endif
      constexpr int64_t W = sizeof(VF) / sizeof(float);
      int64_t i = 0;
      for (; i + W <= I; i += W) {
        VF x, up;
        std::memcpy(&x, g + i, sizeof x);
        std::memcpy(&up, g + I + i, sizeof up);
        const VF e = exp_lanes<VF, VI>(x < 0 ? x : -x);
        const VF sig = (x < 0 ? e : VF{} + 1.0f) / (e + 1.0f);
        const VF y = x * sig * up;
        std::memcpy(o + i, &y, sizeof y);
      }
      for (; i < I; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * g[I + i];
    });
  }
  void write_kv(const Tensor& k, const Tensor& v, const AttnBatch& b, KvLayer& cache) override {
    check_f32(k, "write_kv");
    check_f32(v, "write_kv");
    const int64_t cols = k.cols;
    if (cache.fp8()) {
      QRT_CHECK(cache.kv_heads > 0 && cols % cache.kv_heads == 0 && cache.k_scale && cache.v_scale,
                "cpu write_kv: an fp8 KV cache needs its scales");
      for (int64_t r = 0; r < k.rows; ++r) {
        const int64_t at = b.kv_rows[r];
        quantize_kv_row(row(k, r), cols, cache.kv_heads, static_cast<uint8_t*>(cache.k) + at * cols,
                        cache.k_scale + at * cache.kv_heads);
        quantize_kv_row(row(v, r), cols, cache.kv_heads, static_cast<uint8_t*>(cache.v) + at * cols,
                        cache.v_scale + at * cache.kv_heads);
      }
      return;
    }
    Tensor kc(cache.k, cache.dtype, 0, cols), vc(cache.v, cache.dtype, 0, cols);  // rows by kv_rows
    for (int64_t r = 0; r < k.rows; ++r) {
      store_row_f32(row(k, r), kc, b.kv_rows[r]);
      store_row_f32(row(v, r), vc, b.kv_rows[r]);
    }
  }
  void attention(const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& s,
                 Tensor& out) override {
    cpu::attention(q, cache, b, s, out, pool_);
  }
  void summarize_pages(const KvLayer& cache, const AttnBatch& b, int kv_cols) override {
    cpu::summarize_pages(cache, b, kv_cols, pool_);
  }
  void select_pages(const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& s,
                    const SparseAttention& sp, float* scores, int32_t* pages, int32_t* keys) override {
    check_f32(q, "select_pages");
    cpu::select_pages(q, cache, b, s, sp, scores, pages, keys, pool_);
  }
  void sigmoid_mul(Tensor& x, const Tensor& gate) override {
    check_f32(x, "sigmoid_mul");
    pool_.for_static(x.rows, x.rows > 8, [&](int64_t r) {
      float* o = row(x, r);
      const float* g = row(gate, r);
      for (int64_t i = 0; i < x.cols; ++i) o[i] *= 1.0f / (1.0f + std::exp(-g[i]));
    });
  }
  void causal_conv1d(const Tensor& x, const Tensor& w, const AttnBatch& b, const DeltaNetShape& s, StateLayer& st,
                     Tensor& out) override {
    check_f32(x, "causal_conv1d");
    cpu::causal_conv1d(x, w, b, s, st, out, pool_);
  }
  void gated_delta_rule(const Tensor& qkv, const Tensor& a, const Tensor& bt, const Tensor& a_log,
                        const Tensor& dt_bias, const AttnBatch& b, const DeltaNetShape& s, StateLayer& st,
                        Tensor& out) override {
    check_f32(qkv, "gated_delta_rule");
    check_f32(out, "gated_delta_rule");
    cpu::gated_delta_rule(qkv, a, bt, a_log, dt_bias, b, s, st, out, pool_);
  }
  // rms_row per head with gain w, then times silu(z) (the product rounded as transformers' fp32 path).
  void gated_rms_norm(Tensor& x, const Tensor& z, const Tensor& w, float eps, int hd) override {
    check_f32(x, "gated_rms_norm");
    const std::vector<float> g = norm_gains(w, false);
    const int64_t heads = x.cols / hd;
    pool_.for_static(x.rows, x.rows > 8, [&](int64_t r) {
      for (int64_t h = 0; h < heads; ++h) {
        float* p = row(x, r) + h * hd;
        const float* zr = row(z, r) + h * hd;
        rms_row(p, hd, g.data(), eps, p);
        for (int i = 0; i < hd; ++i) p[i] *= zr[i] / (1.0f + std::exp(-zr[i]));
      }
    });
  }
  void gather_rows(const Tensor& x, const int32_t* rows, Tensor& out) override {
    const size_t rb = size_t(x.cols) * dtype_size(x.dtype);
    for (int64_t i = 0; i < out.rows; ++i)
      std::memcpy(static_cast<char*>(out.data) + i * out.stride * dtype_size(out.dtype),
                  static_cast<const char*>(x.data) + rows[i] * x.stride * dtype_size(x.dtype), rb);
  }
  void add(Tensor& x, const Tensor& y) override {
    check_f32(x, "add");
    for (int64_t r = 0; r < x.rows; ++r) {
      float* a = row(x, r);
      const float* b = row(y, r);
      for (int64_t i = 0; i < x.cols; ++i) a[i] += b[i];
    }
  }
  void fill_tokens(int32_t* ids, const int32_t* src_index, const int32_t* src, int n) override {
    for (int i = 0; i < n; ++i)
      if (src_index[i] >= 0) ids[i] = src[src_index[i]];
  }
  void sample(const Tensor& logits, const std::vector<SampleRow>& rows, SampleResult& out) override {
    cpu::sample(logits, rows, out, pool_);
  }

 private:
  ThreadPool pool_;
  const DType kv_dtype_;
  std::mutex mapped_mu_;
  std::unordered_map<void*, size_t> mapped_;  // alloc_zeroed's blocks from mmap, by address
};

}  // namespace cpu

int cpu_cores() { return cpu::available_cores(); }

std::unique_ptr<Backend> make_cpu_backend(int num_threads, DType kv_dtype) {
  return std::make_unique<cpu::CpuBackend>(num_threads, kv_dtype);
}

}  // namespace qrt
