// KvCache: one rank's storage for every page of every attention layer (kv/pages.h: which pages hold what).
#pragma once
#include <cstdint>
#include <vector>

#include "core/buffer.h"
#include "kv/pages.h"

namespace qrt {

// Layout: for layer l, K rows then V rows, each [(num_pages + 1) * page_size, kv_cols] of dtype.
// The extra page is scratch: padded rows of a graph-replayed step write there.
class KvCache {
 public:
  KvCache(Backend& be, int num_layers, int num_pages, int page_size, int kv_cols, DType dtype);
  KvLayer layer(int l) const;
  int page_size() const { return page_size_; }
  int num_pages() const { return pages_; }
  int scratch_row() const { return pages_ * page_size_; }
  static size_t bytes_per_page(int num_layers, int page_size, int kv_cols, DType dtype) {
    return size_t(num_layers) * 2 * size_t(page_size) * size_t(kv_cols) * dtype_size(dtype);
  }

 private:
  int layers_, pages_, page_size_, kv_cols_;
  DType dtype_;
  Buffer buf_;
};

}  // namespace qrt
