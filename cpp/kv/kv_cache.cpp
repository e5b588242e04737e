#include "kv/kv_cache.h"

#include "core/error.h"

namespace qrt {

KvCache::KvCache(Backend& be, int layers, int pages, int host_pages, int page_size, int kv_cols, DType dtype,
                 bool summaries)
    : be_(be), layers_(layers), pages_(pages), host_pages_(host_pages), page_size_(page_size), kv_cols_(kv_cols),
      dtype_(dtype), summaries_(summaries),
      buf_(&be, bytes_per_page(layers, page_size, kv_cols, dtype, false) * size_t(pages + 1) +
                    summary_bytes_per_page(layers, kv_cols, dtype, summaries) * size_t(pages + 1 + host_pages),
           Buffer::Zeroed{}) {
  if (host_pages > 0) host_ = be.alloc_host_tier(host_bytes_per_page(layers, page_size, kv_cols, dtype) * host_pages);
}

KvCache::~KvCache() {
  if (host_) be_.release_host_tier(host_);
}

char* KvCache::k_rows(int l, int frame) const {
  if (frame > pages_) {  // the host tier
    const size_t half = size_t(host_pages_) * page_size_ * row_bytes();
    return static_cast<char*>(host_) + size_t(l) * 2 * half + size_t(frame - pages_ - 1) * page_size_ * row_bytes();
  }
  const size_t half = size_t(pages_ + 1) * page_size_ * row_bytes();
  return buf_.as<char>() + size_t(l) * 2 * half + size_t(frame) * page_size_ * row_bytes();
}

char* KvCache::v_rows(int l, int frame) const {
  const int tier_frames = frame > pages_ ? host_pages_ : pages_ + 1;
  return k_rows(l, frame) + size_t(tier_frames) * page_size_ * row_bytes();
}

char* KvCache::summary_rows(int l, int frame) const {
  const size_t kv = size_t(layers_) * 2 * size_t(pages_ + 1) * page_size_ * row_bytes();
  return buf_.as<char>() + kv + (size_t(l) * (pages_ + 1 + host_pages_) + frame) * 2 * row_bytes();
}

KvLayer KvCache::layer(int l) const {
  KvLayer k{k_rows(l, 0), v_rows(l, 0), dtype_};
  if (summaries_) k.summary = summary_rows(l, 0);
  if (host_pages_ > 0) {
    k.host_k = k_rows(l, pages_ + 1);
    k.host_v = v_rows(l, pages_ + 1);
    k.host_page0 = pages_ + 1;
  }
  return k;
}

void KvCache::fill_random(uint64_t seed) {
  const int64_t rows = int64_t(pages_) * page_size_;
  for (int l = 0; l < layers_; ++l) {
    Tensor k(k_rows(l, 0), dtype_, rows, kv_cols_), v(v_rows(l, 0), dtype_, rows, kv_cols_);
    be_.fill_random(k, seed, 1.0f, 0.0f, int64_t(2 * l) * rows, 0);
    be_.fill_random(v, seed, 1.0f, 0.0f, int64_t(2 * l + 1) * rows, 0);
  }
  if (!summaries_) return;
  // Every row in order, a chunk of pages at a time: each page's last row summarizes it.
  const int64_t chunk = std::min<int64_t>(rows, int64_t(1) << 16) / page_size_ * page_size_;
  Buffer idx(&be_, size_t(chunk) * 4);
  std::vector<int32_t> host(static_cast<size_t>(chunk));
  for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const int64_t n = std::min(chunk, rows - r0);
    for (int64_t i = 0; i < n; ++i) host[size_t(i)] = int32_t(r0 + i);
    be_.upload(idx.as<char>(), host.data(), size_t(n) * 4);
    AttnBatch b;
    b.num_tokens = int(n);
    b.kv_rows = idx.as<int32_t>();
    b.page_size = page_size_;
    for (int l = 0; l < layers_; ++l) be_.summarize_pages(layer(l), b, kv_cols_);
  }
  be_.synchronize();
}

void KvCache::move(const PageMoves& moves) {
  const size_t page = size_t(page_size_) * row_bytes();
  auto copy_all = [&](const std::vector<std::pair<int, int>>& list) {
    std::vector<CopySegment> segs;
    for (const auto& [from, to] : list)
      for (int l = 0; l < layers_; ++l) {
        segs.push_back({k_rows(l, to), k_rows(l, from), page});
        segs.push_back({v_rows(l, to), v_rows(l, from), page});
        if (summaries_) segs.push_back({summary_rows(l, to), summary_rows(l, from), 2 * row_bytes()});
      }
    if (!segs.empty()) be_.copy_segments(segs);
  };
  copy_all(moves.out);
  copy_all(moves.in);
}

}  // namespace qrt
