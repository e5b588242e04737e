#include "model/weights.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "backend/random.h"
#include "core/error.h"

namespace qrt {

WeightFiles::WeightFiles(const std::vector<TensorSource>& tensors) {
  for (const auto& t : tensors) index_[t.name] = t;
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
    const int fd = open(t.path.c_str(), O_RDONLY);
    QRT_CHECK_ARG(fd >= 0, "cannot open weight file ", t.path);
    struct stat st;
    if (fstat(fd, &st) != 0) {
      close(fd);
      QRT_CHECK_ARG(false, "cannot read the size of weight file ", t.path);
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

void WeightFiles::read(Backend& be, const std::string& name, int64_t full_rows, int64_t full_cols,
                       int64_t r0, int64_t c0, Tensor& dst) {
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
  const char* src = data_of(t);
  const int64_t dst_esz = int64_t(dtype_size(dst.dtype));
  if (st == dst.dtype && c0 == 0 && dst.cols == cols && dst.contiguous()) {  // straight copy of whole rows
    be.upload(dst.data, src + r0 * cols * esz, size_t(dst.rows * cols * esz));
    return;
  }
  // Convert in chunks of rows on the host, then upload each chunk.
  const int64_t chunk = std::max<int64_t>(1, (int64_t(16) << 20) / std::max<int64_t>(1, dst.cols * 4));
  std::vector<char> buf(size_t(std::min(chunk, dst.rows) * dst.cols * dst_esz));
  for (int64_t r = 0; r < dst.rows; r += chunk) {
    const int64_t n = std::min(chunk, dst.rows - r);
    for (int64_t i = 0; i < n; ++i)
      convert_host(src + ((r0 + r + i) * cols + c0) * esz, st, buf.data() + i * dst.cols * dst_esz, dst.dtype,
                   size_t(dst.cols));
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
