#include "kv/tiers.h"

#include <algorithm>

#include "core/error.h"

namespace qrt {

TierMap::TierMap(int device_frames, int host_frames, int num_pages, bool stand_in, int staging_frames)
    : device_(device_frames), host_(host_frames), host0_(device_frames + 1 + staging_frames), stand_in_(stand_in),
      pages_(size_t(num_pages)), frame_page_(size_t(host0_) + size_t(host_frames), -1) {
  QRT_CHECK(num_pages <= device_frames + host_frames, "more pages than frames");
  for (int f = device_frames - 1; f >= 0; --f) device_free_.push_back(f);
  for (int f = host0_ + host_frames - 1; f >= host0_; --f) host_free_.push_back(f);
}

void TierMap::free_frame(int f) {
  const int page = frame_page_[size_t(f)];
  if (page < 0) return;
  frame_page_[size_t(f)] = -1;
  if (on_host_frame(f)) {
    host_free_.push_back(f);
  } else {
    device_lru_.erase({pages_[size_t(page)].written, page});
    device_free_.push_back(f);
  }
  pages_[size_t(page)].frame = -1;
}

int TierMap::take_frame(std::vector<int>& free_list) {
  QRT_CHECK(!free_list.empty(), "no free frame in a KV tier");
  const int f = free_list.back();
  free_list.pop_back();
  return f;
}

PageMoves TierMap::prepare(StepInput& s, const std::vector<int>& dropped, int ps) {
  ++step_;
  std::vector<int> freed;  // frames freed by this prepare: the step before may still use their pages
  for (int page : dropped) {
    const int f = pages_[size_t(page)].frame;
    if (f >= 0) free_frame(f), freed.push_back(f);
  }
  // The pages this step writes, in order.
  std::vector<int> written;
  for (int32_t row : s.kv_rows) {
    const int page = row / ps;
    if (written.empty() || written.back() != page) written.push_back(page);
  }
  std::sort(written.begin(), written.end());
  written.erase(std::unique(written.begin(), written.end()), written.end());
  // Those without a device frame: the device frames they take, freeing the least recently written others.
  int need = 0;
  for (int page : written) need += pages_[size_t(page)].frame < 0 || on_host_frame(pages_[size_t(page)].frame);
  PageMoves moves;
  moves.beside = true;
  auto is_written = [&](int page) { return std::binary_search(written.begin(), written.end(), page); };
  for (auto it = device_lru_.begin(); int(device_free_.size()) < need;) {
    QRT_CHECK(it != device_lru_.end(), "a step writes more pages than the device tier holds");
    const int page = it->second;
    if (is_written(page)) {
      ++it;
      continue;
    }
    const int from = pages_[size_t(page)].frame, to = take_frame(host_free_);
    moves.beside = moves.beside && pages_[size_t(page)].written + 1 < step_;  // not written by the step before
    freed.push_back(from);
    it = device_lru_.erase(it);
    frame_page_[size_t(from)] = -1;
    device_free_.push_back(from);
    frame_page_[size_t(to)] = page;
    pages_[size_t(page)].frame = to;
    moves.out.emplace_back(from, to);
  }
  std::vector<int> host_vacated;  // free once the moves in are done (not a destination of this step's outs)
  for (int page : written) {
    Page& p = pages_[size_t(page)];
    if (p.frame >= 0 && !on_host_frame(p.frame)) {
      device_lru_.erase({p.written, page});
    } else {
      const int to = take_frame(device_free_);
      if (p.frame >= 0) {  // content on the host: the step writes after it
        moves.in.emplace_back(p.frame, to);
        frame_page_[size_t(p.frame)] = -1;
        host_vacated.push_back(p.frame);
      }
      p.frame = to;
      frame_page_[size_t(to)] = page;
    }
    p.written = step_;
    device_lru_.insert({step_, page});
  }
  host_free_.insert(host_free_.end(), host_vacated.begin(), host_vacated.end());
  if (stand_in_) {  // the step's pages without a frame take one as it is (written 0: the first to move out), the
    // latest first (as a prefill leaves the context's end on the device)
    for (int q = 0; q < s.num_seqs(); ++q)
      for (int c = (s.ctx_len[size_t(q)] + ps - 1) / ps - 1; c >= 0; --c) {
        const int page = s.page_table[size_t(q) * size_t(s.max_pages) + size_t(c)];
        Page& p = pages_[size_t(page)];
        if (p.frame >= 0) continue;
        p.frame = take_frame(device_free_.empty() ? host_free_ : device_free_);
        frame_page_[size_t(p.frame)] = page;
        p.written = 0;
        if (!on_host_frame(p.frame)) device_lru_.insert({0, page});
      }
  }
  std::sort(freed.begin(), freed.end());
  for (const auto* list : {&moves.out, &moves.in})
    for (const auto& [from, to] : *list)
      moves.beside = moves.beside && !std::binary_search(freed.begin(), freed.end(), to);
  // Pages to frames.
  for (int32_t& row : s.kv_rows) row = pages_[size_t(row / ps)].frame * ps + row % ps;
  for (int32_t& page : s.page_table) {
    const int f = pages_[size_t(page)].frame;
    page = f >= 0 ? f : 0;  // columns past a sequence's pages hold page ids that are never read
  }
  for (int q = 0; q < s.num_seqs(); ++q)
    for (int c = 0; c < (s.ctx_len[size_t(q)] + ps - 1) / ps; ++c)
      (on_host_frame(s.page_table[size_t(q) * size_t(s.max_pages) + size_t(c)]) ? moves.reads_host
                                                                                 : moves.reads_device)++;
  return moves;
}

}  // namespace qrt
