// Buffer: memory owned through a Backend's allocator; freed when the Buffer dies.
#pragma once
#include <cstddef>
#include <utility>

#include "backend/ops.h"

namespace qrt {

class Buffer {
 public:
  Buffer() = default;
  Buffer(Backend* be, size_t bytes) : be_(be), bytes_(bytes), ptr_(bytes ? be->alloc(bytes) : nullptr) {}
  struct Zeroed {};
  Buffer(Backend* be, size_t bytes, Zeroed) : be_(be), bytes_(bytes), ptr_(bytes ? be->alloc_zeroed(bytes) : nullptr) {}
  ~Buffer() { reset(); }
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      reset();
      std::swap(be_, o.be_);
      std::swap(bytes_, o.bytes_);
      std::swap(ptr_, o.ptr_);
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void reset() {
    if (ptr_) be_->release(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  template <typename T> T* as() const { return static_cast<T*>(ptr_); }
  Tensor tensor(DType t, int64_t rows, int64_t cols) const { return Tensor(ptr_, t, rows, cols); }

 private:
  Backend* be_ = nullptr;
  size_t bytes_ = 0;
  void* ptr_ = nullptr;
};

}  // namespace qrt
