#include "kv/state_cache.h"

namespace qrt {

StateCache::StateCache(Backend& be, int num_layers, int num_slots, int num_snapshots, int num_kept,
                       const DeltaNetShape& shape, DType conv_dtype)
    : be_(be), layers_(num_layers), slots_(num_slots), snapshots_(num_snapshots),
      total_(num_slots + 1 + num_snapshots + num_kept), shape_(shape),
      conv_dtype_(conv_dtype),
      conv_(&be, conv_bytes(shape, conv_dtype) * size_t(total_) * size_t(num_layers), Buffer::Zeroed{}),
      recurrent_(&be, recurrent_bytes(shape) * size_t(total_) * size_t(num_layers), Buffer::Zeroed{}) {}

void StateCache::copy_slot(int from, int to) {
  const size_t cb = conv_bytes(shape_, conv_dtype_), rb = recurrent_bytes(shape_);
  for (int l = 0; l < layers_; ++l) {
    const StateLayer s = layer(l);
    char* conv = static_cast<char*>(s.conv);
    char* rec = reinterpret_cast<char*>(s.recurrent);
    be_.copy(conv + size_t(to) * cb, conv + size_t(from) * cb, cb);
    be_.copy(rec + size_t(to) * rb, rec + size_t(from) * rb, rb);
  }
}

void StateCache::zero_slot(int slot) {
  const size_t cb = conv_bytes(shape_, conv_dtype_), rb = recurrent_bytes(shape_);
  for (int l = 0; l < layers_; ++l) {
    const StateLayer s = layer(l);
    be_.fill_zero(static_cast<char*>(s.conv) + size_t(slot) * cb, cb);
    be_.fill_zero(reinterpret_cast<char*>(s.recurrent) + size_t(slot) * rb, rb);
  }
}

StateLayer StateCache::layer(int i) const {
  const size_t slots = size_t(total_);
  return StateLayer{conv_.as<char>() + size_t(i) * slots * conv_bytes(shape_, conv_dtype_),
                    reinterpret_cast<float*>(recurrent_.as<char>() + size_t(i) * slots * recurrent_bytes(shape_)),
                    conv_dtype_};
}

}  // namespace qrt
