// Tensor: a non-owning 2-D view [rows, cols] with a row stride, in a backend's memory.
// Every op works on such views; heads are a parameter of the op, not a dimension of the view.
#pragma once
#include <cstdint>

#include "core/dtype.h"

namespace qrt {

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::F32;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t stride = 0;  // elements between the starts of consecutive rows

  Tensor() = default;
  Tensor(void* d, DType t, int64_t r, int64_t c) : data(d), dtype(t), rows(r), cols(c), stride(c) {}
  Tensor(void* d, DType t, int64_t r, int64_t c, int64_t s) : data(d), dtype(t), rows(r), cols(c), stride(s) {}

  bool empty() const { return data == nullptr; }
  int64_t numel() const { return rows * cols; }
  size_t nbytes() const { return size_t(rows) * size_t(cols) * dtype_size(dtype); }
  bool contiguous() const { return stride == cols; }
  template <typename T> T* ptr() const { return static_cast<T*>(data); }
  // Rows [r0, r0 + n).
  Tensor row_slice(int64_t r0, int64_t n) const {
    return {static_cast<char*>(data) + r0 * stride * int64_t(dtype_size(dtype)), dtype, n, cols, stride};
  }
  // Columns [c0, c0 + n) of every row (a strided view).
  Tensor col_slice(int64_t c0, int64_t n) const {
    return {static_cast<char*>(data) + c0 * int64_t(dtype_size(dtype)), dtype, rows, n, stride};
  }
};

}  // namespace qrt
