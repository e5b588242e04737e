// KvCache: one rank's storage for every page of every attention layer, in two tiers (kv/tiers.h: which frame holds
// which page; kv/pages.h: which pages hold what).
#pragma once
#include <array>
#include <cstdint>
#include <vector>

#include "core/buffer.h"
#include "kv/pages.h"
#include "kv/tiers.h"

namespace qrt {

// What a page holds on one rank: every attention layer's K and V rows of page_size tokens (FP8: with a scale per
// row and kv head, ops.h KvLayer) and, for sparse decode, two summary rows of K.
struct KvFormat {
  int layers = 0;
  int page_size = 0;
  int kv_heads = 0;  // this rank's
  int head_dim = 0;
  DType dtype = DType::F32;
  bool summaries = false;
  DType summary_dtype = DType::F32;
  // dtype F8E4M3 keeps its summaries in the activations' dtype, others in their own.
  static DType summary_dtype_for(DType kv, DType act) { return kv == DType::F8E4M3 ? act : kv; }
  bool fp8() const { return dtype == DType::F8E4M3; }
  int64_t kv_cols() const { return int64_t(kv_heads) * head_dim; }
  size_t row_bytes() const { return size_t(kv_cols()) * dtype_size(dtype); }
  size_t scale_row_bytes() const { return fp8() ? size_t(kv_heads) * 4 : 0; }
  // A page's K and V (with their scales) in one tier; its summary rows (on the device, for a frame of either tier);
  // a device frame's whole size.
  size_t host_page_bytes() const { return size_t(layers) * 2 * size_t(page_size) * (row_bytes() + scale_row_bytes()); }
  size_t summary_page_bytes() const {
    return summaries ? size_t(layers) * 2 * size_t(kv_cols()) * dtype_size(summary_dtype) : 0;
  }
  size_t page_bytes() const { return host_page_bytes() + summary_page_bytes(); }
};

// Frames (kv/tiers.h): device frames [0, device_pages), the scratch frame device_pages (padded rows of a
// graph-replayed step write there), staging frames [device_pages + 1, host0()) (ops.h KvStaging), host frames from
// host0() on. Device memory: for layer l, K rows then V rows, each [host0() * page_size, kv_cols] of dtype; FP8:
// then for layer l the K scales and the V scales, each [host0() * page_size, kv_heads] fp32. With summaries (sparse
// decode), then for layer l the summaries of every frame, [2 * (host0() + host_pages), kv_cols] (ops.h
// KvLayer::summary). With staging, then its map, slots, clocks and counts (ops.h KvStaging). Host tier
// (host_pages > 0, Backend::alloc_host_tier): the same K, V (and scale) arrays of host_pages * page_size rows.
class KvCache {
 public:
  // staging_slots: frames of the staging area (0: none; needs summaries and a host tier).
  KvCache(Backend& be, const KvFormat& format, int device_pages, int host_pages, int staging_slots = 0);
  // Device bytes of the staging area's map, slots, clocks and counts (its frames are device frames).
  static size_t staging_bytes(const KvFormat& format, int host_pages, int staging_slots);
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;
  KvLayer layer(int l) const;
  const KvFormat& format() const { return f_; }
  int page_size() const { return f_.page_size; }
  int num_pages() const { return pages_; }  // device frames
  int scratch_row() const { return pages_ * f_.page_size; }
  int host0() const { return pages_ + 1 + staging_; }  // the first host frame
  bool summaries() const { return f_.summaries; }
  // Copies frames' rows (every layer's K, V, scale and summary rows): moves.out, then moves.in (Backend::move_pages:
  // beside the step before where moves.beside says they may). Called before every step (also without moves).
  void move(const PageMoves& moves);
  // Benchmarks (synthetic prefill): every device frame's K and V rows random (uniform in [-1, 1); FP8: the e4m3
  // values of that, scale 1), and their summaries to match; host frame h a copy of device frame h % device frames.
  void fill_random(uint64_t seed);
  // The staging area's running counts over every layer and kv head (ops.h KvStaging::counts): entries read from
  // a slot, pages copied into slots, entries read in place. As of the last step the host has waited for.
  std::array<int64_t, 3> staging_counts() const;

 private:
  // Layer l's array `what` (0 K, 1 V, 2 K scales, 3 V scales) from `frame`'s first row, in the frame's tier.
  char* rows(int l, int what, int frame) const;
  char* summary_rows(int l, int frame) const;
  void summarize_device_frames();  // every device frame's summary rows from its K rows
  void fill_host_from_device();    // K, V, scale and summary rows of host frame h: device frame h % pages_'s

  struct StagingLayout {
    size_t map, slot_page, used, clock, zeros, end;
  };
  static StagingLayout staging_layout(const KvFormat& format, int host_pages, int staging_slots);
  size_t staging_offset() const;  // in buf_

  Backend& be_;
  KvFormat f_;
  int pages_, host_pages_, staging_;
  Buffer buf_;
  void* host_ = nullptr;
  int64_t* counts_host_ = nullptr;  // staging counts, [layers][kv_heads][3]
};

}  // namespace qrt
