#include "kv/kv_cache.h"

#include "core/error.h"

namespace qrt {

KvCache::KvCache(Backend& be, int layers, int pages, int page_size, int kv_cols, DType dtype)
    : layers_(layers), pages_(pages), page_size_(page_size), kv_cols_(kv_cols), dtype_(dtype),
      buf_(&be, bytes_per_page(layers, page_size, kv_cols, dtype) * size_t(pages + 1), Buffer::Zeroed{}) {}

KvLayer KvCache::layer(int l) const {
  const size_t half = size_t(pages_ + 1) * page_size_ * kv_cols_ * dtype_size(dtype_);
  char* base = buf_.as<char>() + size_t(l) * 2 * half;
  return KvLayer{base, base + half, dtype_};
}

}  // namespace qrt
