// TierMap: where each page's K/V live, a frame of the device tier or of the host tier (host bookkeeping, shared by
// all ranks; KvCache holds the frames). Pages are the scheduler's ids; a page moves between tiers, its id stays.
// Frames are numbered as the kernels read them (ops.h KvLayer, kv/kv_cache.h): device frames [0, device), the
// scratch frame `device`, the staging area's frames (ops.h KvStaging; not this map's), host frames from
// device + 1 + staging on.
//
// Before each step, every page the step writes gets a device frame: the least recently written device pages that
// the step does not write move to free host frames (their rows are copied out), then pages written again from the
// host are copied in. Other pages are read where they are: attention reads host frames directly. The pool holds at
// most device + host - reserve pages, reserve >= the pages one step writes, so both moves always find a frame.
// Stand-in pages (benchmarks' synthetic prefill: KvCache::fill_random filled every frame of both tiers): a page that
// a step reads before any step wrote it takes a free frame as it is, a device frame while one is free, then a host
// frame, from the sequence's last page back; no copy.
#pragma once
#include <cstdint>
#include <set>
#include <utility>
#include <vector>

#include "kv/pages.h"
#include "model/step.h"

namespace qrt {

// Frame copies before a step: every `out` first (device -> host), then every `in` (host -> device).
struct PageMoves {
  std::vector<std::pair<int, int>> out, in;  // (from frame, to frame)
  // Whether the copies may run beside the work prepared just before them (the step before, which may still be
  // running; everything earlier is done or ordered before them): no copy writes a frame freed by this prepare
  // (that step may still read or write its page) and no copy reads a page that step writes.
  bool beside = false;
  // The step's pages (every sequence's, whole or partly filled) in each tier once moved: what its attention reads
  // from device frames and, in place, from host memory (sparse decode then reads a selection of them).
  int64_t reads_device = 0, reads_host = 0;
};

class TierMap {
 public:
  TierMap(int device_frames, int host_frames, int num_pages, bool stand_in = false, int staging_frames = 0);
  // Frees the frames of pages whose content is gone (PagePool::take_dropped), gives each page the step writes a
  // device frame, and rewrites the step's kv_rows and page table from pages to frames (page_size rows each).
  PageMoves prepare(StepInput& step, const std::vector<int>& dropped, int page_size);
  int on_device() const { return device_ - int(device_free_.size()); }  // pages with content, by tier
  int on_host() const { return host_ - int(host_free_.size()); }
  int frame(int page) const { return pages_[size_t(page)].frame; }

 private:
  struct Page {
    int frame = -1;        // -1: no content
    uint64_t written = 0;  // the step that last wrote it
  };
  bool on_host_frame(int f) const { return f >= host0_; }
  void free_frame(int f);
  int take_frame(std::vector<int>& free_list);

  int device_, host_, host0_;
  bool stand_in_;
  uint64_t step_ = 0;
  std::vector<Page> pages_;
  std::vector<int> device_free_, host_free_;  // stacks
  std::vector<int> frame_page_;               // frame -> its page, or -1
  std::set<std::pair<uint64_t, int>> device_lru_;  // (written, page) of the pages on device frames
};

}  // namespace qrt
