// PagePool: which pages are free (host bookkeeping, shared by all ranks).
// SlotTable: each slot's page list and cached length.
// Host-only: the scheduler and its simulation test (tests/scheduler_sim.cpp) build them without a backend.
#pragma once
#include <vector>

namespace qrt {

class PagePool {
 public:
  explicit PagePool(int num_pages);
  int total() const { return total_; }
  int free_count() const { return int(free_.size()); }
  int alloc();           // a page id, or -1 when none is free
  void release(int page);

 private:
  int total_;
  std::vector<int> free_;     // stack: most recently freed first
  std::vector<char> in_use_;  // per page: handed out and not yet released (a second release is a bug: it throws)
};

struct Slot {
  bool used = false;
  std::vector<int> pages;
  int length = 0;  // tokens whose K/V are in the pages
};

class SlotTable {
 public:
  explicit SlotTable(int num_slots) : slots_(num_slots) {}
  int size() const { return int(slots_.size()); }
  int free_count() const;
  int acquire();                       // a free slot index, or -1
  void release(int slot, PagePool& pool);  // returns its pages to the pool
  Slot& operator[](int i) { return slots_[i]; }
  const Slot& operator[](int i) const { return slots_[i]; }

 private:
  std::vector<Slot> slots_;
};

}  // namespace qrt
