#include "kv/state_cache.h"

namespace qrt {

StateCache::StateCache(Backend& be, int num_layers, int num_slots, const DeltaNetShape& shape, DType conv_dtype)
    : layers_(num_layers), slots_(num_slots), shape_(shape), conv_dtype_(conv_dtype),
      conv_(&be, conv_bytes(shape, conv_dtype) * size_t(num_slots + 1) * size_t(num_layers), Buffer::Zeroed{}),
      recurrent_(&be, recurrent_bytes(shape) * size_t(num_slots + 1) * size_t(num_layers), Buffer::Zeroed{}) {}

StateLayer StateCache::layer(int i) const {
  const size_t slots = size_t(slots_ + 1);
  return StateLayer{conv_.as<char>() + size_t(i) * slots * conv_bytes(shape_, conv_dtype_),
                    reinterpret_cast<float*>(recurrent_.as<char>() + size_t(i) * slots * recurrent_bytes(shape_)),
                    conv_dtype_};
}

}  // namespace qrt
