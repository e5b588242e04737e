// StateCache: one rank's Gated DeltaNet state (ops.h StateLayer) for every slot of every DeltaNet layer.
// Slot ids are the scheduler's slots; one more, the scratch slot, takes what padded graph rows write; then the
// snapshots (the states a prefix hit resumes from, engine/scheduler.h), which no step reads or writes directly;
// then the kept states of speculative verification (ops.h AttnBatch::keep: rows' states to roll back to).
// Nothing ever reads the scratch slot: padded rows start fresh (position 0) and may all write it at once.
#pragma once
#include <cstddef>

#include "core/buffer.h"

namespace qrt {

class StateCache {
 public:
  // num_layers: the model's DeltaNet layers; shape: this rank's share of their heads.
  StateCache(Backend& be, int num_layers, int num_slots, int num_snapshots, int num_kept, const DeltaNetShape& shape,
             DType conv_dtype);
  StateLayer layer(int i) const;  // i counts DeltaNet layers only
  int scratch_slot() const { return slots_; }
  int snapshot_slot(int snapshot) const { return slots_ + 1 + snapshot; }
  int kept_slot(int i) const { return slots_ + 1 + snapshots_ + i; }
  // Copies slot `from`'s state of every layer over slot `to`'s (stream-ordered).
  void copy_slot(int from, int to);
  void zero_slot(int slot);  // every layer's state of the slot set to zeros (stream-ordered)
  static size_t bytes_per_slot(int num_layers, const DeltaNetShape& shape, DType conv_dtype) {
    return size_t(num_layers) * (conv_bytes(shape, conv_dtype) + recurrent_bytes(shape));
  }

 private:
  static size_t conv_bytes(const DeltaNetShape& s, DType t) {
    return size_t(s.conv_kernel - 1) * size_t(s.conv_cols()) * dtype_size(t);
  }
  static size_t recurrent_bytes(const DeltaNetShape& s) { return size_t(s.v_heads) * s.k_dim * s.v_dim * 4; }

  Backend& be_;
  int layers_, slots_, snapshots_, total_;  // total_: slots, the scratch slot, the snapshots, the kept states
  DeltaNetShape shape_;
  DType conv_dtype_;
  Buffer conv_, recurrent_;
};

}  // namespace qrt
