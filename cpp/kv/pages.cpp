#include "kv/pages.h"

#include "core/error.h"

namespace qrt {

PagePool::PagePool(int n) : total_(n), in_use_(size_t(n), 0) {
  free_.reserve(n);
  for (int i = n - 1; i >= 0; --i) free_.push_back(i);
}

int PagePool::alloc() {
  if (free_.empty()) return -1;
  const int p = free_.back();
  free_.pop_back();
  in_use_[p] = 1;
  return p;
}

void PagePool::release(int page) {
  QRT_CHECK(page >= 0 && page < total_ && in_use_[page], "page ", page, " released but not in use");
  in_use_[page] = 0;
  free_.push_back(page);
}

int SlotTable::free_count() const {
  int n = 0;
  for (const auto& s : slots_) n += !s.used;
  return n;
}

int SlotTable::acquire() {
  for (int i = 0; i < int(slots_.size()); ++i)
    if (!slots_[i].used) {
      slots_[i] = Slot{};
      slots_[i].used = true;
      return i;
    }
  return -1;
}

void SlotTable::release(int i, PagePool& pool) {
  Slot& s = slots_[i];
  for (auto it = s.pages.rbegin(); it != s.pages.rend(); ++it) pool.release(*it);
  s = Slot{};
}

}  // namespace qrt
