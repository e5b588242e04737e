// Weight files: memory-mapped safetensors tensors, read by name into backend memory, whole or as one
// rank's slice. Python reads the headers and hands over where each tensor lies.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend/ops.h"

namespace qrt {

struct TensorSource {
  std::string name;
  std::string path;     // safetensors file
  int64_t offset = 0;   // absolute byte offset of the data
  int64_t nbytes = 0;
  std::string dtype;    // safetensors name: F32, BF16, F16, F8_E4M3
  std::vector<int64_t> shape;
};

// Progress of a long step: (what, done, total).
using Progress = std::function<void(const std::string&, int64_t, int64_t)>;

class WeightFiles {
 public:
  // check_finite: read() refuses a tensor holding NaN or inf (std::invalid_argument naming it).
  explicit WeightFiles(const std::vector<TensorSource>& tensors, bool check_finite = false);
  ~WeightFiles();
  bool has(const std::string& name) const { return index_.count(name) > 0; }
  // Shape of a tensor as a matrix: 1-D tensors are [1, n]. Throws std::invalid_argument if missing.
  const TensorSource& find(const std::string& name) const;
  // Throws std::invalid_argument unless the named tensor is there, a float of [full_rows, full_cols] (1-D: [1, n]).
  void check(const std::string& name, int64_t full_rows, int64_t full_cols) const;
  // Copies rows [r0, r0 + dst.rows) and cols [c0, c0 + dst.cols) of the named tensor into dst
  // (backend memory, any float dtype), converting the dtype. Checks the full shape first.
  void read(Backend& be, const std::string& name, int64_t full_rows, int64_t full_cols, int64_t r0,
            int64_t c0, Tensor& dst);

 private:
  struct Mapping { void* base = nullptr; size_t size = 0; };
  const char* data_of(const TensorSource& t);  // maps t's file on first use; safe from every rank's thread
  // With check_finite: throws naming the tensor and the element when n values of dtype at src hold a NaN or inf
  // (the first is at row `row`, column `col` of the tensor). host_dst (may be null): where the values are copied
  // on the way (host memory), one pass over them instead of two.
  void check_finite(const TensorSource& t, const char* src, DType dtype, int64_t n, int64_t row, int64_t col,
                    char* host_dst = nullptr) const;
  bool check_finite_ = false;
  std::map<std::string, TensorSource> index_;
  std::mutex maps_mu_;
  std::map<std::string, Mapping> maps_;
};

}  // namespace qrt
