#include "model/weights.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
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

WeightLoader::WeightLoader(Backend& be, const WeightSpec& spec, std::vector<Buffer>& storage)
    : be_(be), spec_(spec), storage_(storage) {
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

Tensor WeightLoader::norm_gain(const std::string& name, int64_t n, bool zero_centred, Tensor* w) {
  const float dummy = zero_centred ? 0.f : 1.f;
  if (!folds_ || !w) return vector(name, n, 0, n, 0.f, dummy);
  Tensor& g = staging_[n];
  if (g.empty()) g = alloc(DType::F32, 1, n);
  load(name, 1, n, 0, 0, g, 0.f, dummy);
  be_.scale_columns(*w, g, zero_centred);
  Tensor& one = ones_[n];
  if (one.empty()) {
    one = alloc(DType::F32, 1, n);
    be_.fill_random(one, 0, 0.f, 1.0f, 0, 0);  // exactly 1: fma(0, u, 1)
  }
  return one;
}

}  // namespace qrt
