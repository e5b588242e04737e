// KvCache: one rank's storage for every page of every attention layer (kv/pages.h: which pages hold what).
#pragma once
#include <cstdint>
#include <vector>

#include "core/buffer.h"
#include "kv/pages.h"

namespace qrt {

// Layout: for layer l, K rows then V rows, each [(num_pages + 1) * page_size, kv_cols] of dtype; with summaries
// (sparse decode), then for layer l the page summaries [2 * (num_pages + 1), kv_cols] (ops.h KvLayer::summary).
// The extra page is scratch: padded rows of a graph-replayed step write there.
class KvCache {
 public:
  KvCache(Backend& be, int num_layers, int num_pages, int page_size, int kv_cols, DType dtype, bool summaries);
  KvLayer layer(int l) const;
  int page_size() const { return page_size_; }
  int num_pages() const { return pages_; }
  int scratch_row() const { return pages_ * page_size_; }
  bool summaries() const { return summaries_; }
  static size_t bytes_per_page(int num_layers, int page_size, int kv_cols, DType dtype, bool summaries) {
    return size_t(num_layers) * 2 * size_t(page_size + (summaries ? 1 : 0)) * size_t(kv_cols) * dtype_size(dtype);
  }

 private:
  int layers_, pages_, page_size_, kv_cols_;
  DType dtype_;
  bool summaries_;
  Buffer buf_;
};

}  // namespace qrt
