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
#include "core/buffer.h"

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
  // Shape of a tensor as a matrix: 1-D tensors are [1, n], a depthwise conv's [c, 1, w] is [c, w].
  // Throws std::invalid_argument if missing.
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

// Where weights come from and how they are stored.
struct WeightSpec {
  WeightFiles* files = nullptr;  // null: random weights (load_format "dummy")
  uint64_t dummy_seed = 0;
  DType dtype = DType::F32;      // storage dtype of matrices and embeddings
};

// Allocates one rank's weights on its backend and fills them from the checkpoint (the rank's slice of a tensor) or
// with random values (dummy: each load draws the next seed, so ranks loading in the same order get slices of the
// same matrices). Gains are fp32; a norm's gain may be folded into the 16-bit matrix it feeds (folds_gains()).
class WeightLoader {
 public:
  static constexpr float kWeightScale = 0.034641016f;  // dummy matrices: uniform with std 0.02 (0.02 * sqrt(3))
  WeightLoader(Backend& be, const WeightSpec& spec, std::vector<Buffer>& storage);
  Backend& backend() const { return be_; }
  DType dtype() const { return spec_.dtype; }
  bool dummy() const { return spec_.files == nullptr; }
  bool has(const std::string& name) const { return spec_.files && spec_.files->has(name); }
  Tensor alloc(DType t, int64_t rows, int64_t cols);  // kept until the model goes
  // dst = rows [r0, r0 + dst.rows) x cols [c0, c0 + dst.cols) of the [rows, cols] tensor name; dummy:
  // fma(scale, uniform(-1, 1), offset).
  void load(const std::string& name, int64_t rows, int64_t cols, int64_t r0, int64_t c0, Tensor dst,
            float dummy_scale = kWeightScale, float dummy_offset = 0.f);
  // Columns [c0, c0 + n) of the vector `name` of `size` values, as fp32 [1, n].
  Tensor vector(const std::string& name, int64_t size, int64_t c0, int64_t n, float dummy_scale, float dummy_offset);
  // Whether norm gains are multiplied into the matrices they feed (a backend's fused norm is faster without one).
  bool folds_gains() const { return folds_; }
  // The gain [1, n] of the norm `name` that feeds w: loaded, or folded into w (then a gain of ones, shared).
  // zero_centred: the gain is 1 + w (Qwen3.5). Dummy gains: 1 (0 when zero-centred).
  Tensor norm_gain(const std::string& name, int64_t n, bool zero_centred, Tensor* w);

 private:
  Backend& be_;
  WeightSpec spec_;
  std::vector<Buffer>& storage_;
  uint64_t counter_ = 0;
  bool folds_ = false;
  std::map<int64_t, Tensor> ones_, staging_;  // by width: unit gains, and the buffer a folded gain is read into
};

}  // namespace qrt
