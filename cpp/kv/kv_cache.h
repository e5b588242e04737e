// KvCache: one rank's storage for every page of every attention layer, in two tiers (kv/tiers.h: which frame holds
// which page; kv/pages.h: which pages hold what).
#pragma once
#include <cstdint>
#include <vector>

#include "core/buffer.h"
#include "kv/pages.h"
#include "kv/tiers.h"

namespace qrt {

// Device tier: for layer l, K rows then V rows, each [(device_pages + 1) * page_size, kv_cols] of dtype; the extra
// frame is scratch (padded rows of a graph-replayed step write there). With summaries (sparse decode), then for
// layer l the summaries of every frame of both tiers, [2 * (device_pages + 1 + host_pages), kv_cols] (ops.h
// KvLayer::summary). Host tier (host_pages > 0, Backend::alloc_host_tier): for layer l, K rows then V rows, each
// [host_pages * page_size, kv_cols].
class KvCache {
 public:
  KvCache(Backend& be, int num_layers, int device_pages, int host_pages, int page_size, int kv_cols, DType dtype,
          bool summaries);
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;
  KvLayer layer(int l) const;
  int page_size() const { return page_size_; }
  int num_pages() const { return pages_; }  // device frames
  int scratch_row() const { return pages_ * page_size_; }
  bool summaries() const { return summaries_; }
  // Copies frames' rows (every layer's K, V and summary rows): moves.out, then moves.in (stream-ordered).
  void move(const PageMoves& moves);
  // Benchmarks (synthetic prefill): every device frame's K and V rows random (uniform in [-1, 1)), and their
  // summaries to match.
  void fill_random(uint64_t seed);
  // Bytes of one device frame (with its summary rows), of one host frame, and of a host frame's summary rows (on
  // the device).
  static size_t bytes_per_page(int num_layers, int page_size, int kv_cols, DType dtype, bool summaries) {
    return size_t(num_layers) * 2 * size_t(page_size + (summaries ? 1 : 0)) * size_t(kv_cols) * dtype_size(dtype);
  }
  static size_t host_bytes_per_page(int num_layers, int page_size, int kv_cols, DType dtype) {
    return bytes_per_page(num_layers, page_size, kv_cols, dtype, false);
  }
  static size_t summary_bytes_per_page(int num_layers, int kv_cols, DType dtype, bool summaries) {
    return summaries ? size_t(num_layers) * 2 * size_t(kv_cols) * dtype_size(dtype) : 0;
  }

 private:
  size_t row_bytes() const { return size_t(kv_cols_) * dtype_size(dtype_); }
  char* k_rows(int l, int frame) const;  // the frame's first K row of layer l (either tier)
  char* v_rows(int l, int frame) const;
  char* summary_rows(int l, int frame) const;

  Backend& be_;
  int layers_, pages_, host_pages_, page_size_, kv_cols_;
  DType dtype_;
  bool summaries_;
  Buffer buf_;
  void* host_ = nullptr;
};

}  // namespace qrt
