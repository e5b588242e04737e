#include "kv/pages.h"

#include "core/error.h"

namespace qrt {

PagePool::PagePool(int n, int page_size) : total_(n), page_size_(page_size), pages_(size_t(n)) {
  free_.reserve(n);
  for (int i = n - 1; i >= 0; --i) free_.push_back(i);
}

size_t PagePool::NameHash::operator()(const Name& n) const {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
  mix(uint64_t(uint32_t(n.parent)));
  mix(n.parent_gen);
  for (int32_t t : n.tokens) mix(uint64_t(uint32_t(t)));
  return size_t(h ^ (h >> 29));
}

PagePool::Name PagePool::make_name(int parent, const int32_t* tokens) const {
  return Name{parent, parent >= 0 ? pages_[size_t(parent)].gen : 0u,
              std::vector<int32_t>(tokens, tokens + page_size_)};
}

void PagePool::drop_name(Page& p) {
  if (!p.named) return;
  named_.erase(p.name);
  p.named = false;
  p.name = Name{};
  ++p.gen;  // names that follow this page (children) no longer match anything
}

int PagePool::alloc() {
  int id;
  if (!free_.empty()) {
    id = free_.back();
    free_.pop_back();
  } else if (!lru_.empty()) {
    id = lru_.front();
    lru_.pop_front();
    drop_name(pages_[size_t(id)]);
    if (track_drops_) dropped_.push_back(id);
  } else {
    return -1;
  }
  pages_[size_t(id)].holders = 1;
  ++pages_[size_t(id)].gen;  // new content (drop_name has bumped a cached page's already: no matter)
  return id;
}

void PagePool::retain(int page) {
  QRT_CHECK(page >= 0 && page < total_, "page ", page, " outside the pool");
  Page& p = pages_[size_t(page)];
  QRT_CHECK(p.holders > 0 || p.named, "page ", page, " retained but neither held nor cached");
  if (p.holders == 0) lru_.erase(p.lru);
  ++p.holders;
}

void PagePool::release(int page) {
  QRT_CHECK(page >= 0 && page < total_ && pages_[size_t(page)].holders > 0, "page ", page,
            " released but not held");
  Page& p = pages_[size_t(page)];
  if (--p.holders > 0) return;
  if (p.named) {
    p.lru = lru_.insert(lru_.end(), page);
  } else {
    free_.push_back(page);
    if (track_drops_) dropped_.push_back(page);
  }
}

int PagePool::name(int page, int parent, uint32_t parent_gen, const int32_t* tokens) {
  Page& p = pages_[size_t(page)];
  QRT_CHECK(p.holders > 0, "page ", page, " named but not held");
  if (parent >= 0 && pages_[size_t(parent)].gen != parent_gen) return -1;
  Name n = make_name(parent, tokens);
  if (p.named) {
    QRT_CHECK(p.name == n, "page ", page, " named twice, with different contents");
    return page;
  }
  auto it = named_.find(n);
  if (it != named_.end()) return it->second;
  named_.emplace(n, page);
  p.name = std::move(n);
  p.named = true;
  return page;
}

int PagePool::lookup(int parent, const int32_t* tokens) const {
  auto it = named_.find(make_name(parent, tokens));
  return it == named_.end() ? -1 : it->second;
}

int SnapshotTable::find(int page, uint32_t gen) {
  for (size_t i = 0; i < entries_.size(); ++i)
    if (entries_[i].page == page && entries_[i].gen == gen && !entries_[i].taken) {
      entries_[i].used = ++clock_;
      return int(i);
    }
  return -1;
}

void SnapshotTable::ready() {
  for (Entry& e : entries_) e.taken = false;
}

int SnapshotTable::take(int page, uint32_t gen) {
  QRT_CHECK(!entries_.empty(), "a state snapshot taken with no room for one");
  size_t lru = 0;
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (entries_[i].page == page && entries_[i].gen == gen) {
      lru = i;  // retaken at the same place (a recomputing request): one entry per name
      break;
    }
    if (entries_[i].used < entries_[lru].used) lru = i;
  }
  entries_[lru] = Entry{page, gen, ++clock_, true};
  return int(lru);
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
  // Last page first: the cache then drops a prefix's tail before its head (a head without its tail still hits).
  for (auto it = s.pages.rbegin(); it != s.pages.rend(); ++it) pool.release(*it);
  s = Slot{};
}

}  // namespace qrt
