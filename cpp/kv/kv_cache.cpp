#include "kv/kv_cache.h"

#include <algorithm>

#include "core/error.h"

namespace qrt {

namespace {
size_t align256(size_t n) { return (n + 255) / 256 * 256; }
}  // namespace

KvCache::KvCache(Backend& be, const KvFormat& f, int pages, int host_pages, int staging_slots)
    : be_(be), f_(f), pages_(pages), host_pages_(host_pages), staging_(staging_slots),
      buf_(&be, staging_offset() + staging_bytes(f, host_pages, staging_slots), Buffer::Zeroed{}) {
  QRT_CHECK(staging_ == 0 || (staging_ > 0 && f.summaries && host_pages > 0),
            "KV staging needs summaries and a host tier");
  if (host_pages > 0) host_ = be.alloc_host_tier(f.host_page_bytes() * host_pages);
  if (staging_ > 0) {
    try {
      counts_host_ = static_cast<int64_t*>(be.alloc_host_tier(size_t(f.layers) * f.kv_heads * 3 * 8));
    } catch (...) {
      be.release_host_tier(host_);
      throw;
    }
  }
}

KvCache::~KvCache() {
  if (host_) be_.release_host_tier(host_);
  if (counts_host_) be_.release_host_tier(counts_host_);
}

size_t KvCache::staging_offset() const {
  return align256(f_.host_page_bytes() * size_t(host0()) + f_.summary_page_bytes() * size_t(host0() + host_pages_));
}

// The staging area's arrays, byte offsets from its start (L layers, H kv heads, S slots): counts [L H 3] int64, map
// [host_pages][L H] int32, slot_page [L H S] int32, used [L H S] uint32, clock [L H 2] uint32, zeros [L H] int32
// (the source that clears a map row), then its end.
KvCache::StagingLayout KvCache::staging_layout(const KvFormat& f, int host_pages, int slots) {
  const size_t lh = size_t(f.layers) * f.kv_heads;
  StagingLayout o;
  o.map = lh * 3 * 8;
  o.slot_page = o.map + size_t(host_pages) * lh * 4;
  o.used = o.slot_page + lh * size_t(slots) * 4;
  o.clock = o.used + lh * size_t(slots) * 4;
  o.zeros = o.clock + lh * 2 * 4;
  o.end = o.zeros + lh * 4;
  return o;
}

size_t KvCache::staging_bytes(const KvFormat& f, int host_pages, int slots) {
  return slots > 0 ? staging_layout(f, host_pages, slots).end : 0;
}

std::array<int64_t, 3> KvCache::staging_counts() const {
  std::array<int64_t, 3> c{0, 0, 0};
  if (!counts_host_) return c;
  const volatile int64_t* h = counts_host_;  // written by the device as steps run
  for (size_t i = 0; i < size_t(f_.layers) * f_.kv_heads; ++i)
    for (int j = 0; j < 3; ++j) c[size_t(j)] += h[i * 3 + size_t(j)];
  return c;
}

char* KvCache::rows(int l, int what, int frame) const {
  const bool host = frame >= host0();
  const size_t tier_rows = size_t(host ? host_pages_ : host0()) * f_.page_size;
  const size_t row = size_t(host ? frame - host0() : frame) * f_.page_size;
  char* base = host ? static_cast<char*>(host_) : buf_.as<char>();
  const size_t rb = f_.row_bytes(), sb = f_.scale_row_bytes();
  if (what < 2) return base + (size_t(l) * 2 + what) * tier_rows * rb + row * rb;
  return base + size_t(f_.layers) * 2 * tier_rows * rb + (size_t(l) * 2 + what - 2) * tier_rows * sb + row * sb;
}

char* KvCache::summary_rows(int l, int frame) const {
  const size_t kv = f_.host_page_bytes() * size_t(host0());
  const size_t row = size_t(f_.kv_cols()) * dtype_size(f_.summary_dtype);
  return buf_.as<char>() + kv + (size_t(l) * (host0() + host_pages_) + frame) * 2 * row;
}

KvLayer KvCache::layer(int l) const {
  KvLayer k{rows(l, 0, 0), rows(l, 1, 0), f_.dtype};
  if (f_.summaries) {
    k.summary = summary_rows(l, 0);
    k.summary_dtype = f_.summary_dtype;
  }
  const int host0 = this->host0();
  if (staging_ > 0) {  // layer l's rows of each array (the map: every layer's, its column l * kv_heads on)
    const size_t H = size_t(f_.kv_heads), S = size_t(staging_);
    const StagingLayout o = staging_layout(f_, host_pages_, staging_);
    char* base = buf_.as<char>() + staging_offset();
    KvStaging& st = k.staging;
    st.first = pages_ + 1;
    st.slots = staging_;
    st.counts = reinterpret_cast<int64_t*>(base) + size_t(l) * H * 3;
    st.counts_host = counts_host_ + size_t(l) * H * 3;
    st.map = reinterpret_cast<int32_t*>(base + o.map);
    st.map_stride = f_.layers * f_.kv_heads;
    st.map_col = l * f_.kv_heads;
    st.slot_page = reinterpret_cast<int32_t*>(base + o.slot_page) + size_t(l) * H * S;
    st.used = reinterpret_cast<uint32_t*>(base + o.used) + size_t(l) * H * S;
    st.clock = reinterpret_cast<uint32_t*>(base + o.clock) + size_t(l) * H * 2;
  }
  if (host_pages_ > 0) {
    k.host_k = rows(l, 0, host0);
    k.host_v = rows(l, 1, host0);
    k.host_page0 = host0;
  }
  if (f_.fp8()) {
    k.kv_heads = f_.kv_heads;
    k.k_scale = reinterpret_cast<float*>(rows(l, 2, 0));
    k.v_scale = reinterpret_cast<float*>(rows(l, 3, 0));
    if (host_pages_ > 0) {
      k.host_k_scale = reinterpret_cast<float*>(rows(l, 2, host0));
      k.host_v_scale = reinterpret_cast<float*>(rows(l, 3, host0));
    }
  }
  return k;
}

void KvCache::fill_random(uint64_t seed) {
  const int64_t rows_n = int64_t(pages_) * f_.page_size;
  for (int l = 0; l < f_.layers; ++l) {
    for (int what = 0; what < 2; ++what) {
      Tensor t(rows(l, what, 0), f_.dtype, rows_n, f_.kv_cols());
      be_.fill_random(t, seed, 1.0f, 0.0f, int64_t(2 * l + what) * rows_n, 0);
    }
    if (f_.fp8()) {  // scale 1: the stored e4m3 values are the keys
      for (int what = 2; what < 4; ++what) {
        Tensor t(rows(l, what, 0), DType::F32, rows_n, f_.kv_heads);
        be_.fill_random(t, seed, 0.0f, 1.0f, 0, 0);
      }
    }
  }
  if (f_.summaries) summarize_device_frames();
  fill_host_from_device();
  be_.synchronize();
}

void KvCache::summarize_device_frames() {
  const int64_t rows_n = int64_t(pages_) * f_.page_size;
  // Every row in order, a chunk of pages at a time: each page's last row summarizes it.
  const int64_t chunk = std::min<int64_t>(rows_n, int64_t(1) << 16) / f_.page_size * f_.page_size;
  Buffer idx(&be_, size_t(chunk) * 4);
  std::vector<int32_t> host(static_cast<size_t>(chunk));
  for (int64_t r0 = 0; r0 < rows_n; r0 += chunk) {
    const int64_t n = std::min(chunk, rows_n - r0);
    for (int64_t i = 0; i < n; ++i) host[size_t(i)] = int32_t(r0 + i);
    be_.upload(idx.as<char>(), host.data(), size_t(n) * 4);
    AttnBatch b;
    b.num_tokens = int(n);
    b.kv_rows = idx.as<int32_t>();
    b.page_size = f_.page_size;
    for (int l = 0; l < f_.layers; ++l) be_.summarize_pages(layer(l), b, int(f_.kv_cols()));
  }
  be_.synchronize();  // (before idx is freed)
}

void KvCache::fill_host_from_device() {
  const size_t rb = size_t(f_.page_size) * f_.row_bytes(), sb = size_t(f_.page_size) * f_.scale_row_bytes();
  const size_t summary = 2 * size_t(f_.kv_cols()) * dtype_size(f_.summary_dtype);
  for (int l = 0; l < f_.layers; ++l)
    for (int h = 0; h < host_pages_; h += pages_) {  // frames [h, h + n) of the host tier from device frames [0, n)
      const int n = std::min(pages_, host_pages_ - h);
      for (int what = 0; what < (f_.fp8() ? 4 : 2); ++what)
        be_.copy(rows(l, what, host0() + h), rows(l, what, 0), size_t(n) * (what < 2 ? rb : sb));
      if (f_.summaries) be_.copy(summary_rows(l, host0() + h), summary_rows(l, 0), size_t(n) * summary);
    }
}

void KvCache::move(const PageMoves& moves) {
  const size_t page = size_t(f_.page_size) * f_.row_bytes(), scales = size_t(f_.page_size) * f_.scale_row_bytes();
  const size_t summary = 2 * size_t(f_.kv_cols()) * dtype_size(f_.summary_dtype);
  auto segments = [&](const std::vector<std::pair<int, int>>& list) {
    std::vector<CopySegment> segs;
    for (const auto& [from, to] : list)
      for (int l = 0; l < f_.layers; ++l) {
        for (int what = 0; what < 2; ++what) segs.push_back({rows(l, what, to), rows(l, what, from), page});
        if (f_.fp8())
          for (int what = 2; what < 4; ++what) segs.push_back({rows(l, what, to), rows(l, what, from), scales});
        if (f_.summaries) segs.push_back({summary_rows(l, to), summary_rows(l, from), summary});
      }
    return segs;
  };
  std::vector<CopySegment> out = segments(moves.out);
  if (staging_ > 0) {  // a host frame's new page is no slot's: its map row to zeros
    const size_t row = size_t(f_.layers) * f_.kv_heads * 4;
    const StagingLayout o = staging_layout(f_, host_pages_, staging_);
    char* base = buf_.as<char>() + staging_offset();
    for (const auto& [from, to] : moves.out)
      out.push_back({base + o.map + size_t(to - host0()) * row, base + o.zeros, row});
  }
  be_.move_pages(out, segments(moves.in), moves.beside);
}

}  // namespace qrt
