// PagePool: which pages are free (host bookkeeping, shared by all ranks).
// SlotTable: each slot's page list and cached length.
// KvCache: one rank's storage for every page of every attention layer.
#pragma once
#include <cstdint>
#include <vector>

#include "core/buffer.h"

namespace qrt {

class PagePool {
 public:
  explicit PagePool(int num_pages);
  int total() const { return total_; }
  int free_count() const { return int(free_.size()); }
  int alloc();           // a page id, or -1 when none is free
  void release(int page);

 private:
  int total_;
  std::vector<int> free_;     // stack: most recently freed first
  std::vector<char> in_use_;  // per page: handed out and not yet released (a second release is a bug: it throws)
};

struct Slot {
  bool used = false;
  std::vector<int> pages;
  int length = 0;  // tokens whose K/V are in the pages
};

class SlotTable {
 public:
  explicit SlotTable(int num_slots) : slots_(num_slots) {}
  int size() const { return int(slots_.size()); }
  int free_count() const;
  int acquire();                       // a free slot index, or -1
  void release(int slot, PagePool& pool);  // returns its pages to the pool
  Slot& operator[](int i) { return slots_[i]; }
  const Slot& operator[](int i) const { return slots_[i]; }

 private:
  std::vector<Slot> slots_;
};

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
