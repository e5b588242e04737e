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
#include "model/config.h"

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
  // Throws std::invalid_argument unless the named tensor is there, [rows, cols] (or [rows * cols]), F32/BF16/F16.
  void check_scales(const std::string& name, int64_t rows, int64_t cols) const;
  // The whole named tensor of [rows, cols] as fp32 on the host: FP8 scales. Throws std::invalid_argument naming it
  // when it is missing, mis-shaped, not a 16/32-bit float, or holds a NaN, an inf or a negative value.
  std::vector<float> read_scales(const std::string& name, int64_t rows, int64_t cols);

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
  DType dtype = DType::F32;      // storage dtype of matrices and embeddings (FP8 linears: ModelConfig::fp8)
};

// A linear as a layer loads it: parts of checkpoint matrices stacked into one matrix [out, in] (q|k|v, gate|up),
// each part rows [r0, r0 + n) of `module`.weight [rows, cols] at rows [dst, dst + n); every part gives the columns
// [c0, c0 + in) (a rank's share of a row-parallel layer; else all of them). ranks: the tensor-parallel size, for
// messages.
// count > 1: that many pieces of n rows, piece i from checkpoint row r0 + i * step to row dst + i * n (the q rows
// of a gated q_proj, head by head).
struct LinearPart {
  std::string module;  // checkpoint name without ".weight"
  int64_t rows = 0, cols = 0, r0 = 0, n = 0, dst = 0, count = 1, step = 0;
  LinearPart piece(int64_t i) const { return {module, rows, cols, r0 + i * step, n, dst + i * n, 1, 0}; }
};
struct LinearSpec {
  std::vector<LinearPart> parts;
  int64_t out = 0, c0 = 0, in = 0;
  int ranks = 1;
  void add(const std::string& module, int64_t rows, int64_t cols, int64_t r0, int64_t n, int64_t count = 1,
           int64_t step = 0) {
    parts.push_back({module, rows, cols, r0, n, out, count, step});
    out += n * count;
  }
};

// How a linear is stored: FP8 (every part's module FP8 by the config) or not, and the FP8 scale grid: the largest
// power-of-two row block (at most 128) within which every fused row maps to one checkpoint scale row (parts and
// a rank's rows need not start at multiples of 128), and column blocks of 128 from the rank's first column.
// Throws std::invalid_argument naming the layer when its parts differ in storage, or when block scales would be
// split by the rank's columns (tensor parallelism must cut a row-parallel FP8 layer at multiples of 128 columns).
struct LinearLayout {
  bool fp8 = false;
  int row_shift = 7;
  int64_t scale_rows = 0, scale_cols = 0;
  double bytes(const LinearSpec& s, DType dtype) const;  // what WeightLoader::linear allocates
};
LinearLayout linear_layout(const LinearSpec& s, const ModelConfig& c);

// Checks before loading that a linear module's checkpoint tensors are what the config says (std::invalid_argument
// naming the tensor): `<module>.weight` of [rows, cols], F8_E4M3 with a scale tensor of the format's shape where
// the module is FP8 (not quantized at load), else not F8_E4M3.
void check_linear(const WeightFiles& files, const ModelConfig& c, const std::string& module, int64_t rows,
                  int64_t cols);

// Allocates one rank's weights on its backend and fills them from the checkpoint (the rank's slice of a tensor) or
// with random values (dummy: each load draws the next seed, so ranks loading in the same order get slices of the
// same matrices). Gains are fp32; a norm's gain may be folded into the 16-bit matrix it feeds (folds_gains()).
class WeightLoader {
 public:
  static constexpr float kWeightScale = 0.034641016f;  // dummy matrices: uniform with std 0.02 (0.02 * sqrt(3))
  WeightLoader(Backend& be, const WeightSpec& spec, const ModelConfig& cfg, std::vector<Buffer>& storage);
  Backend& backend() const { return be_; }
  DType dtype() const { return spec_.dtype; }
  bool dummy() const { return spec_.files == nullptr; }
  bool has(const std::string& name) const { return spec_.files && spec_.files->has(name); }
  Tensor alloc(DType t, int64_t rows, int64_t cols);  // kept until the model goes
  // dst = rows [r0, r0 + dst.rows) x cols [c0, c0 + dst.cols) of the [rows, cols] tensor name; dummy:
  // fma(scale, uniform(-1, 1), offset).
  void load(const std::string& name, int64_t rows, int64_t cols, int64_t r0, int64_t c0, Tensor dst,
            float dummy_scale = kWeightScale, float dummy_offset = 0.f);
  // A (fused) linear: FP8 with its scale grid (linear_layout) where the config makes its modules FP8 (read from
  // the checkpoint, or quantized block-wise at load from its weights or dummy ones: the blocks of the whole
  // checkpoint matrix, so a rank's share equals that rows' share of the unsharded model), else in dtype().
  Linear linear(const LinearSpec& spec);
  // Columns [c0, c0 + n) of the vector `name` of `size` values, as fp32 [1, n].
  Tensor vector(const std::string& name, int64_t size, int64_t c0, int64_t n, float dummy_scale, float dummy_offset);
  // Whether norm gains are multiplied into the matrices they feed (a backend's fused norm is faster without one).
  bool folds_gains() const { return folds_; }
  // The gain [1, n] of the norm `name` that feeds the linears ws: loaded, or folded into them (then a gain of ones,
  // shared). Folded only where folds_gains() and no linear of ws is FP8 (a gain multiplied into FP8 values would
  // need requantizing: not exact). zero_centred: the gain is 1 + w (Qwen3.5). Dummy gains: 1 (0 when zero-centred).
  // Returns whether it folded through *folded.
  Tensor norm_gain(const std::string& name, int64_t n, bool zero_centred, const std::vector<Linear*>& ws,
                   bool* folded);

 private:
  // FP8 parts: rows [r0, r0 + n) of the checkpoint's F8_E4M3 matrix and their scales into grid (host, the
  // layout's [scale_rows, scale_cols]); or quantized at load.
  void read_fp8(const LinearPart& p, const LinearSpec& s, const LinearLayout& L, Linear& lin, std::vector<float>& grid);
  void quantize_fp8(const LinearPart& p, const LinearSpec& s, const LinearLayout& L, Linear& lin,
                    std::vector<float>& grid);
  Tensor staging(int which, DType t, int64_t rows, int64_t cols);  // scratch of the loader, freed with it
  Backend& be_;
  WeightSpec spec_;
  const ModelConfig& cfg_;
  std::vector<Buffer>& storage_;
  Buffer scratch_[3];
  uint64_t counter_ = 0;
  bool folds_ = false;
  std::map<int64_t, Tensor> ones_, staging_;  // by width: unit gains, and the buffer a folded gain is read into
};

}  // namespace qrt
