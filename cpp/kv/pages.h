// PagePool: who holds each page, and the prefix cache (host bookkeeping, shared by all ranks).
// SlotTable: each slot's page list and cached length.
// Host-only: the scheduler and its simulation test (tests/scheduler_sim.cpp) build them without a backend.
#pragma once
#include <cstddef>
#include <cstdint>
#include <list>
#include <unordered_map>
#include <utility>
#include <vector>

namespace qrt {

// A page is free, held (by one or more slots), or cached: held by none, but its K/V are those of a known prefix,
// so a request that starts with that prefix can take it back instead of computing it again. alloc() reuses
// free pages first, then cached ones, least recently released first.
//
// A cached page is named by its content: the page before it in the prefix (its id and generation: the
// generation changes whenever a page's content is dropped, so a name never outlives what it names) and its
// own page_size tokens. Names are exact (no hash is trusted alone), so a hit always has the right K/V.
class PagePool {
 public:
  PagePool(int num_pages, int page_size);
  int total() const { return total_; }
  int free_count() const { return int(free_.size() + lru_.size()); }  // pages alloc() can hand out
  int cached_count() const { return int(lru_.size()); }
  // A page with one holder, or -1 when none is free or cached. Its generation changes: a (page, generation) pair
  // stands for one content, from the page's allocation until its name (if any) is dropped.
  int alloc();
  void retain(int page);    // one more holder of a page that lookup() found (held or cached)
  void release(int page);   // one holder fewer; with none left it is cached if it has a name, else free
  int holders(int page) const { return pages_[size_t(page)].holders; }
  // After track_drops(): the pages whose K/V content was dropped (freed, or a cached page taken for new content)
  // since the last call (kv/tiers.h frees their frames).
  void track_drops() { track_drops_ = true; }
  std::vector<int> take_dropped() { return std::exchange(dropped_, {}); }

  // Names page (held, full, its K/V written or being written by a launched step) as the one after `parent`
  // (-1: the first of a prefix) holding tokens[0, page_size), where parent_gen is the parent's generation
  // when it was found. Returns the page that bears the name: this one, or another page that bore it already
  // (same content: this one stays unnamed; the prefix goes on from that one). -1 when the parent's content
  // went since (its generation changed): nothing after it can be named.
  int name(int page, int parent, uint32_t parent_gen, const int32_t* tokens);
  uint32_t generation(int page) const { return pages_[size_t(page)].gen; }
  // The page named as following `parent` with these tokens, or -1.
  int lookup(int parent, const int32_t* tokens) const;

 private:
  struct Name {
    int parent;
    uint32_t parent_gen;
    std::vector<int32_t> tokens;
    bool operator==(const Name& o) const {
      return parent == o.parent && parent_gen == o.parent_gen && tokens == o.tokens;
    }
  };
  struct NameHash {
    size_t operator()(const Name& n) const;
  };
  struct Page {
    int holders = 0;
    uint32_t gen = 0;
    bool named = false;
    Name name;
    std::list<int>::iterator lru;  // valid while cached
  };
  Name make_name(int parent, const int32_t* tokens) const;
  void drop_name(Page& p);

  int total_, page_size_;
  std::vector<Page> pages_;
  std::vector<int> free_;  // stack: most recently freed first
  std::list<int> lru_;     // cached pages, least recently released first
  std::unordered_map<Name, int, NameHash> named_;
  bool track_drops_ = false;
  std::vector<int> dropped_;
};

struct Slot {
  bool used = false;
  std::vector<int> pages;
  // Prefix cache: the content of pages [0, named) is named in the pool, the last of it under named_tail (pages[named
  // - 1], or a page of the same content that another request filled first) of generation named_tail_gen.
  int named = 0;
  int named_tail = -1;
  uint32_t named_tail_gen = 0;
  bool naming_stopped = false;  // named_tail's content went before the next page could be named
};

// Which snapshot holds a DeltaNet state, and where it was taken (host bookkeeping; the states are in StateCache).
// A snapshot is the state of a request after the tokens up to the end of one of its pages, named by that page and
// the page's generation when taken: while the generation holds, the page still holds that request's tokens, so a
// request whose prefix hit ends with that page may resume from the snapshot. The least recently used one is retaken.
class SnapshotTable {
 public:
  explicit SnapshotTable(int capacity) : entries_(size_t(capacity)) {}
  int capacity() const { return int(entries_.size()); }
  int find(int page, uint32_t gen);  // the snapshot taken at the end of (page, gen), or -1; marks it used
  // The snapshot to write the state at the end of (page, gen) into; find() sees it once ready() is called (the
  // next step's plan: the copy into it runs after the step that takes it).
  int take(int page, uint32_t gen);
  void ready();

 private:
  struct Entry {
    int page = -1;
    uint32_t gen = 0;
    uint64_t used = 0;
    bool taken = false;  // being written by the step being planned
  };
  std::vector<Entry> entries_;
  uint64_t clock_ = 0;
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
