#include "kv/kv_cache.h"

#include "core/error.h"

namespace qrt {

KvCache::KvCache(Backend& be, int layers, int pages, int page_size, int kv_cols, DType dtype, bool summaries)
    : layers_(layers), pages_(pages), page_size_(page_size), kv_cols_(kv_cols), dtype_(dtype), summaries_(summaries),
      buf_(&be, bytes_per_page(layers, page_size, kv_cols, dtype, summaries) * size_t(pages + 1), Buffer::Zeroed{}) {}

KvLayer KvCache::layer(int l) const {
  const size_t row = size_t(kv_cols_) * dtype_size(dtype_), half = size_t(pages_ + 1) * page_size_ * row;
  char* base = buf_.as<char>() + size_t(l) * 2 * half;
  KvLayer k{base, base + half, dtype_};
  if (summaries_) k.summary = buf_.as<char>() + size_t(layers_) * 2 * half + size_t(l) * 2 * size_t(pages_ + 1) * row;
  return k;
}

}  // namespace qrt
