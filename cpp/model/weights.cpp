#include "model/weights.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "backend/random.h"
#include "core/error.h"

namespace qrt {

WeightFiles::WeightFiles(const std::vector<TensorSource>& tensors, bool check_finite) : check_finite_(check_finite) {
  for (const auto& t : tensors) index_[t.name] = t;
}

namespace {

// Index of the first of n values whose exponent bits are all ones (NaN or inf), or n; copies the values to dst
// on the way unless it is null. Blocks of 1024 are tested with a branch-free OR (vectorized): one streaming pass.
template <typename U>
int64_t first_nonfinite(const U* __restrict p, U* __restrict dst, int64_t n, U exponent) {
  for (int64_t b = 0; b < n; b += 1024) {
    const int64_t e = std::min<int64_t>(n, b + 1024);
    U any = 0;
    if (dst) {
      for (int64_t i = b; i < e; ++i) {
        const U x = p[i];
        dst[i] = x;
        any |= U((x & exponent) == exponent);
      }
    } else {
      for (int64_t i = b; i < e; ++i) any |= U((p[i] & exponent) == exponent);
    }
    if (any)
      for (int64_t i = b; i < e; ++i)
        if ((p[i] & exponent) == exponent) return i;
  }
  return n;
}

}  // namespace

void WeightFiles::check_finite(const TensorSource& t, const char* src, DType dtype, int64_t n, int64_t row,
                               int64_t col, char* host_dst) const {
  if (!check_finite_) return;
  int64_t at = n;
  using u16 = uint16_t;
  using u32 = uint32_t;
  if (dtype == DType::F32)
    at = first_nonfinite(reinterpret_cast<const u32*>(src), reinterpret_cast<u32*>(host_dst), n, u32(0x7f800000u));
  else if (dtype == DType::BF16)
    at = first_nonfinite(reinterpret_cast<const u16*>(src), reinterpret_cast<u16*>(host_dst), n, u16(0x7f80u));
  else if (dtype == DType::F16)
    at = first_nonfinite(reinterpret_cast<const u16*>(src), reinterpret_cast<u16*>(host_dst), n, u16(0x7c00u));
  else if (dtype == DType::F8E4M3)  // e4m3fn has no inf; NaN is S.1111.111
    at = first_nonfinite(reinterpret_cast<const uint8_t*>(src), reinterpret_cast<uint8_t*>(host_dst), n,
                         uint8_t(0x7fu));
  else if (host_dst)
    std::memcpy(host_dst, src, size_t(n) * dtype_size(dtype));
  if (at == n) return;
  const int64_t cols = t.shape.empty() ? 1 : t.shape.back();
  const int64_t flat = row * cols + col + at;
  QRT_CHECK_ARG(false, "tensor '", t.name, "' holds a NaN or inf (element ", flat, " of ", t.dtype, " ", t.nbytes,
                " bytes in ", t.path, "); Generator(check_weights=False) loads it anyway");
}

WeightFiles::~WeightFiles() {
  for (auto& [path, m] : maps_)
    if (m.base) munmap(m.base, m.size);
}

const TensorSource& WeightFiles::find(const std::string& name) const {
  auto it = index_.find(name);
  QRT_CHECK_ARG(it != index_.end(), "checkpoint is missing tensor '", name, "'");
  return it->second;
}

const char* WeightFiles::data_of(const TensorSource& t) {
  std::lock_guard<std::mutex> lock(maps_mu_);  // the ranks load their shards at once
  auto it = maps_.find(t.path);
  if (it == maps_.end()) {
    // Non-blocking: a FIFO under a weight file's name must not hang the open; only a regular file is mapped.
    const int fd = open(t.path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    QRT_CHECK_ARG(fd >= 0, "cannot open weight file ", t.path);
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      close(fd);
      QRT_CHECK_ARG(false, "weight file ", t.path, " is not a readable regular file");
    }
    void* base = mmap(nullptr, size_t(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    QRT_CHECK(base != MAP_FAILED, "cannot map weight file ", t.path);
    it = maps_.emplace(t.path, Mapping{base, size_t(st.st_size)}).first;
  }
  QRT_CHECK_ARG(t.offset >= 0 && size_t(t.offset + t.nbytes) <= it->second.size, "tensor '", t.name,
                "' lies beyond the end of ", t.path);
  return static_cast<const char*>(it->second.base) + t.offset;
}

void WeightFiles::check(const std::string& name, int64_t full_rows, int64_t full_cols) const {
  const TensorSource& t = find(name);
  int64_t rows = 1, cols = 1;
  if (t.shape.size() == 1) {
    cols = t.shape[0];
  } else if (t.shape.size() == 2) {
    rows = t.shape[0];
    cols = t.shape[1];
  } else if (t.shape.size() == 3 && t.shape[1] == 1) {  // a depthwise conv's [channels, 1, width]
    rows = t.shape[0];
    cols = t.shape[2];
  }
  auto shape_str = [&] {
    std::string s = "[";
    for (size_t i = 0; i < t.shape.size(); ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
    return s + "]";
  };
  QRT_CHECK_ARG((t.shape.size() <= 2 || (t.shape.size() == 3 && t.shape[1] == 1)) && rows == full_rows && cols == full_cols, "tensor '", name,
                "' has shape ", shape_str(), ", expected [", full_rows, ", ", full_cols, "]");
  DType st;
  try {
    st = parse_dtype(t.dtype);
  } catch (const std::invalid_argument&) {
    throw std::invalid_argument(str_cat("tensor '", name, "' has unsupported dtype ", t.dtype));
  }
  QRT_CHECK_ARG(st != DType::I32, "tensor '", name, "' has non-float dtype ", t.dtype);
  const int64_t esz = int64_t(dtype_size(st));
  QRT_CHECK_ARG(t.nbytes == rows * cols * esz, "tensor '", name, "' has ", t.nbytes, " bytes, expected ",
                rows * cols * esz);
}

void WeightFiles::read(Backend& be, const std::string& name, int64_t full_rows, int64_t full_cols,
                       int64_t r0, int64_t c0, Tensor& dst) {
  check(name, full_rows, full_cols);
  const TensorSource& t = find(name);
  const int64_t cols = full_cols;
  const DType st = parse_dtype(t.dtype);
  const int64_t esz = int64_t(dtype_size(st));
  const char* src = data_of(t);
  const int64_t dst_esz = int64_t(dtype_size(dst.dtype));
  if (st == dst.dtype && c0 == 0 && dst.cols == cols && dst.contiguous()) {  // straight copy of whole rows
    if (check_finite_ && be.host_memory()) {  // checked as it is copied: one pass
      check_finite(t, src + r0 * cols * esz, st, dst.rows * cols, r0, 0, static_cast<char*>(dst.data));
      return;
    }
    // In pieces of 4 MiB, each checked while it is in cache.
    const int64_t piece = std::max<int64_t>(1, (int64_t(4) << 20) / std::max<int64_t>(1, cols * esz));
    for (int64_t r = 0; r < dst.rows; r += piece) {
      const int64_t n = std::min(piece, dst.rows - r);
      const char* from = src + (r0 + r) * cols * esz;
      check_finite(t, from, st, n * cols, r0 + r, 0);
      be.upload(static_cast<char*>(dst.data) + r * cols * esz, from, size_t(n * cols * esz));
    }
    return;
  }
  // Convert in chunks of rows on the host, then upload each chunk.
  const int64_t chunk = std::max<int64_t>(1, (int64_t(16) << 20) / std::max<int64_t>(1, dst.cols * 4));
  std::vector<char> buf(size_t(std::min(chunk, dst.rows) * dst.cols * dst_esz));
  for (int64_t r = 0; r < dst.rows; r += chunk) {
    const int64_t n = std::min(chunk, dst.rows - r);
    for (int64_t i = 0; i < n; ++i) {
      const char* from = src + ((r0 + r + i) * cols + c0) * esz;
      check_finite(t, from, st, dst.cols, r0 + r + i, c0);
      convert_host(from, st, buf.data() + i * dst.cols * dst_esz, dst.dtype, size_t(dst.cols));
    }
    if (dst.contiguous()) {
      be.upload(static_cast<char*>(dst.data) + r * dst.cols * dst_esz, buf.data(), size_t(n * dst.cols * dst_esz));
    } else {
      for (int64_t i = 0; i < n; ++i)
        be.upload(static_cast<char*>(dst.data) + (r + i) * dst.stride * dst_esz, buf.data() + i * dst.cols * dst_esz,
                  size_t(dst.cols * dst_esz));
    }
  }
}

namespace {

// The shape of the scales beside a checkpoint's FP8 matrix [rows, cols], by the config's format.
std::pair<int64_t, int64_t> scale_shape(const ModelConfig& c, int64_t rows, int64_t cols) {
  const int64_t B = kFp8Block;
  if (c.fp8_scales == "channel") return {rows, 1};
  if (c.fp8_scales == "tensor") return {1, 1};
  return {(rows + B - 1) / B, (cols + B - 1) / B};
}

}  // namespace

void WeightFiles::check_scales(const std::string& name, int64_t rows, int64_t cols) const {
  QRT_CHECK_ARG(has(name), "checkpoint is missing tensor '", name, "' (the scales of an FP8 weight)");
  const TensorSource& t = find(name);
  // One scale per row may come as [rows] as well as [rows, 1].
  if (!(t.shape.size() == 1 && t.shape[0] == rows * cols)) check(name, rows, cols);
  QRT_CHECK_ARG(t.dtype == "F32" || t.dtype == "BF16" || t.dtype == "F16", "FP8 scales '", name, "' have dtype ",
                t.dtype, " (expected F32, BF16 or F16)");
  QRT_CHECK_ARG(t.nbytes == rows * cols * int64_t(dtype_size(parse_dtype(t.dtype))), "FP8 scales '", name, "' have ",
                t.nbytes, " bytes for ", rows * cols, " values");
}

std::vector<float> WeightFiles::read_scales(const std::string& name, int64_t rows, int64_t cols) {
  check_scales(name, rows, cols);
  const TensorSource& t = find(name);
  std::vector<float> v(size_t(rows * cols));
  convert_host(data_of(t), parse_dtype(t.dtype), v.data(), DType::F32, v.size());
  for (size_t i = 0; i < v.size(); ++i)
    QRT_CHECK_ARG(std::isfinite(v[i]) && v[i] >= 0.f, "FP8 scales '", name, "' hold ", v[i], " at element ", i,
                  " (scales must be finite and not negative)");
  return v;
}

double LinearLayout::bytes(const LinearSpec& s, DType dtype) const {
  if (!fp8) return double(s.out) * double(s.in) * double(dtype_size(dtype));
  return double(s.out) * double(s.in) + double(scale_rows) * double(scale_cols) * 4;
}

LinearLayout linear_layout(const LinearSpec& s, const ModelConfig& c) {
  QRT_CHECK(!s.parts.empty() && s.out > 0 && s.in > 0, "linear_layout: an empty linear");
  const std::string& name = s.parts[0].module;
  LinearLayout L;
  L.fp8 = c.fp8(name);
  for (const LinearPart& p : s.parts)
    QRT_CHECK_ARG(c.fp8(p.module) == L.fp8, "linear '", name, "' is fused with '", p.module, "', but only one of ",
                  "them is FP8 (modules_to_not_convert / ignore must name both or neither)");
  if (!L.fp8) return L;
  const bool channel = c.fp8_scales == "channel", tensor = c.fp8_scales == "tensor";
  QRT_CHECK_ARG(channel || tensor || c.fp8_scales == "block", "unknown FP8 scale format '", c.fp8_scales, "'");
  const int64_t B = kFp8Block, cols = s.parts[0].cols;
  if (!channel && !tensor)
    QRT_CHECK_ARG(s.c0 % B == 0 && (s.in % B == 0 || s.c0 + s.in == cols), "FP8 layer '", name,
                  "': tensor_parallel_size ", s.ranks, " splits its 128-column scale blocks (", cols,
                  " columns, ", s.in, " per rank; each rank's share must be a multiple of 128)");
  int64_t bs = B;  // rows per scale row: a power of two dividing 128, every part's start, length and first row
  for (const LinearPart& p : s.parts) {  // pieces start at dst + i n and r0 + i step
    bs = std::gcd(std::gcd(bs, p.dst), p.n);
    bs = channel ? 1 : std::gcd(std::gcd(bs, p.r0), p.count > 1 ? p.step : 0);
  }
  while ((int64_t(1) << L.row_shift) > bs) --L.row_shift;
  L.scale_rows = s.out >> L.row_shift;
  L.scale_cols = (s.in + B - 1) / B;
  return L;
}

void check_linear(const WeightFiles& files, const ModelConfig& c, const std::string& module, int64_t rows,
                  int64_t cols) {
  const std::string w = module + ".weight";
  files.check(w, rows, cols);
  const std::string& dt = files.find(w).dtype;
  const bool stored_fp8 = dt == "F8_E4M3";
  if (!c.fp8(module) || c.fp8_online) {
    QRT_CHECK_ARG(!stored_fp8, "tensor '", w, "' is F8_E4M3, but ",
                  c.fp8_scales.empty() || c.fp8_online ? "config.json has no FP8 quantization_config"
                                                       : "the quantization_config keeps this module unquantized "
                                                         "(modules_to_not_convert / ignore)");
    return;
  }
  QRT_CHECK_ARG(stored_fp8, "tensor '", w, "' is ", dt, ", but the quantization_config makes it FP8 (F8_E4M3 ",
                "with scales; modules_to_not_convert / ignore name the modules kept in higher precision)");
  const auto [sr, sc] = scale_shape(c, rows, cols);
  files.check_scales(module + "." + c.fp8_scale_name, sr, sc);
}

WeightLoader::WeightLoader(Backend& be, const WeightSpec& spec, const ModelConfig& cfg, std::vector<Buffer>& storage)
    : be_(be), spec_(spec), cfg_(cfg), storage_(storage) {
  folds_ = be.folds_norm_gains() && spec.dtype == be.act_dtype() && (spec.dtype == DType::BF16 || spec.dtype == DType::F16);
}

Tensor WeightLoader::alloc(DType t, int64_t rows, int64_t cols) {
  storage_.emplace_back(&be_, size_t(rows) * size_t(cols) * dtype_size(t));
  return storage_.back().tensor(t, rows, cols);
}

void WeightLoader::load(const std::string& name, int64_t rows, int64_t cols, int64_t r0, int64_t c0, Tensor dst,
                        float dummy_scale, float dummy_offset) {
  if (spec_.files) spec_.files->read(be_, name, rows, cols, r0, c0, dst);
  else be_.fill_random(dst, hash3(spec_.dummy_seed, counter_++, 0), dummy_scale, dummy_offset, r0, c0);
}

Tensor WeightLoader::vector(const std::string& name, int64_t size, int64_t c0, int64_t n, float dummy_scale,
                            float dummy_offset) {
  Tensor t = alloc(DType::F32, 1, n);
  load(name, 1, size, 0, c0, t, dummy_scale, dummy_offset);
  return t;
}

Tensor WeightLoader::staging(int which, DType t, int64_t rows, int64_t cols) {
  const size_t need = size_t(rows) * size_t(cols) * dtype_size(t);
  if (scratch_[which].bytes() < need) scratch_[which] = Buffer(&be_, need);
  return scratch_[which].tensor(t, rows, cols);
}

Linear WeightLoader::linear(const LinearSpec& s) {
  const LinearLayout L = linear_layout(s, cfg_);
  Linear lin;
  if (!L.fp8) {
    lin.w = alloc(dtype(), s.out, s.in);
    for (const LinearPart& part : s.parts)
      for (int64_t i = 0; i < part.count; ++i) {
        const LinearPart p = part.piece(i);
        load(p.module + ".weight", p.rows, p.cols, p.r0, s.c0, lin.w.row_slice(p.dst, p.n));
      }
    return lin;
  }
  lin.w = alloc(DType::F8E4M3, s.out, s.in);
  lin.scale = alloc(DType::F32, L.scale_rows, L.scale_cols);
  lin.scale_row_shift = L.row_shift;
  std::vector<float> grid(size_t(L.scale_rows * L.scale_cols));
  for (const LinearPart& part : s.parts)
    for (int64_t i = 0; i < part.count; ++i) {
      if (dummy() || cfg_.fp8_online) quantize_fp8(part.piece(i), s, L, lin, grid);
      else read_fp8(part.piece(i), s, L, lin, grid);
    }
  be_.upload(lin.scale.data, grid.data(), grid.size() * 4);
  return lin;
}

void WeightLoader::read_fp8(const LinearPart& p, const LinearSpec& s, const LinearLayout& L, Linear& lin,
                            std::vector<float>& grid) {
  const std::string w = p.module + ".weight";
  QRT_CHECK_ARG(spec_.files->find(w).dtype == "F8_E4M3", "tensor '", w, "' is ", spec_.files->find(w).dtype,
                ", but the quantization_config makes it FP8");
  Tensor dst = lin.w.row_slice(p.dst, p.n);
  spec_.files->read(be_, w, p.rows, p.cols, p.r0, s.c0, dst);
  const auto [sr, sc] = scale_shape(cfg_, p.rows, p.cols);
  const std::vector<float> src = spec_.files->read_scales(p.module + "." + cfg_.fp8_scale_name, sr, sc);
  const int sh = L.row_shift;
  const int64_t B = kFp8Block;
  for (int64_t i = p.dst >> sh; i < (p.dst + p.n) >> sh; ++i) {
    const int64_t row = p.r0 + (i << sh) - p.dst;  // the checkpoint row of the fused scale row i
    for (int64_t j = 0; j < L.scale_cols; ++j)
      grid[size_t(i * L.scale_cols + j)] = cfg_.fp8_scales == "channel" ? src[size_t(row)]
                                           : cfg_.fp8_scales == "tensor" ? src[0]
                                                                         : src[size_t(row / B * sc + s.c0 / B + j)];
  }
}

void WeightLoader::quantize_fp8(const LinearPart& p, const LinearSpec& s, const LinearLayout& L, Linear& lin,
                                std::vector<float>& grid) {
  const std::string w = p.module + ".weight";
  const int64_t B = kFp8Block, K = s.in, sh = L.row_shift;
  const uint64_t seed = hash3(spec_.dummy_seed, counter_++, 0);
  // The whole 128-row blocks of the checkpoint matrix that hold the part's rows, some at a time.
  const int64_t first = p.r0 / B * B, last = std::min(p.rows, (p.r0 + p.n + B - 1) / B * B);
  const int64_t chunk = std::max<int64_t>(B, (int64_t(32) << 20) / std::max<int64_t>(1, K * 4) / B * B);
  std::vector<float> host;
  for (int64_t a = first; a < last; a += chunk) {
    const int64_t b = std::min(last, a + chunk), m = b - a;
    Tensor src = staging(0, DType::F32, m, K), q = staging(1, DType::F8E4M3, m, K);
    Tensor sc = staging(2, DType::F32, (m + B - 1) / B, L.scale_cols);
    if (spec_.files) spec_.files->read(be_, w, p.rows, p.cols, a, s.c0, src);
    else be_.fill_random(src, seed, kWeightScale, 0.f, a, s.c0);
    be_.quantize_fp8(src, q, sc);
    const int64_t lo = std::max(a, p.r0), hi = std::min(b, p.r0 + p.n);
    if (hi <= lo) continue;
    be_.copy(lin.w.row_slice(p.dst + lo - p.r0, hi - lo).data, q.row_slice(lo - a, hi - lo).data, size_t((hi - lo) * K));
    host.resize(size_t(sc.numel()));
    be_.download(host.data(), sc.data, host.size() * 4);
    for (int64_t i = (p.dst + lo - p.r0) >> sh; i <= (p.dst + hi - p.r0 - 1) >> sh; ++i) {
      const int64_t row = p.r0 + (i << sh) - p.dst;
      for (int64_t j = 0; j < L.scale_cols; ++j)
        grid[size_t(i * L.scale_cols + j)] = host[size_t((row - a) / B * L.scale_cols + j)];
    }
  }
}

Tensor WeightLoader::norm_gain(const std::string& name, int64_t n, bool zero_centred, const std::vector<Linear*>& ws,
                               bool* folded) {
  const float dummy = zero_centred ? 0.f : 1.f;
  bool fold = folds_ && !ws.empty();
  for (const Linear* l : ws) fold = fold && !l->fp8();
  if (folded) *folded = fold;
  if (!fold) return vector(name, n, 0, n, 0.f, dummy);
  Tensor& g = staging_[n];
  if (g.empty()) g = alloc(DType::F32, 1, n);
  load(name, 1, n, 0, 0, g, 0.f, dummy);
  for (Linear* l : ws) be_.scale_columns(l->w, g, zero_centred);
  Tensor& one = ones_[n];
  if (one.empty()) {
    one = alloc(DType::F32, 1, n);
    be_.fill_random(one, 0, 0.f, 1.0f, 0, 0);  // exactly 1: fma(0, u, 1)
  }
  return one;
}

}  // namespace qrt
