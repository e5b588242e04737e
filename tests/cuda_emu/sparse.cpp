// sparse.cu's page lists and staging kernels (cut out by cut.py) on the host emulator. select_kernel (its plain and
// its warp-aggregated histogram): on random scores with many ties, NaNs and infinities, each selecting list holds its
// sink, the budget's best candidates by (score, earlier page) in page order and its window, as a sort picks them;
// other lists are their page tables.
// stage_kernel against cpu/sparse.cpp's stage_pages, the rule both must follow (ops.h KvStaging): the same lists,
// map, slots, clocks, counts and staged K/V bytes after each of a series of calls. Cases: 1-3 kv heads, staging
// areas from 1 slot (most pages read in place) to more than the block's threads, lists longer than the block's
// threads, lists that share pages across sequences, a sequence that does not select, e4m3 caches with scales and
// 16-bit ones, and between calls pages moved into host frames (their map rows cleared, their bytes new).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "emu.h"
#include "backend/ops.h"

namespace qrt {
#include "sparse.inc"
}  // namespace qrt

using namespace qrt;

// One layer's cache and staging state, as KvCache lays them out (device frames, scratch, staging, host).
struct Cache {
  int D, H, ps, device, slots, host, eb, layers = 2, layer = 1;
  std::vector<unsigned char> k, v, hk, hv;
  std::vector<float> ks, vs, hks, hvs;
  std::vector<int32_t> map, slot_page;
  std::vector<uint32_t> used, clock;
  std::vector<int64_t> counts, counts_host;
  int host0() const { return device + 1 + slots; }
  KvLayer layer_view() {
    KvLayer c;
    c.k = k.data(), c.v = v.data(), c.dtype = eb == 1 ? DType::F8E4M3 : DType::BF16;
    c.host_k = hk.data(), c.host_v = hv.data(), c.host_page0 = host0();
    if (eb == 1) {
      c.kv_heads = H;
      c.k_scale = ks.data(), c.v_scale = vs.data(), c.host_k_scale = hks.data(), c.host_v_scale = hvs.data();
    }
    KvStaging& st = c.staging;
    st.first = device + 1, st.slots = slots;
    st.map = map.data(), st.map_stride = layers * H, st.map_col = layer * H;
    st.slot_page = slot_page.data(), st.used = used.data(), st.clock = clock.data();
    st.counts = counts.data(), st.counts_host = counts_host.data();
    return c;
  }
  bool operator==(const Cache& o) const {
    return k == o.k && v == o.v && ks == o.ks && vs == o.vs && map == o.map && slot_page == o.slot_page &&
           used == o.used && clock == o.clock && counts == o.counts && counts_host == o.counts_host;
  }
};

Cache make_cache(int D, int H, int ps, int device, int slots, int host, int eb, std::mt19937& rng) {
  Cache c{D, H, ps, device, slots, host, eb};
  const size_t dev_rows = size_t(c.host0()) * ps, host_rows = size_t(host) * ps, row = size_t(H) * D * eb;
  std::uniform_int_distribution<int> byte(0, 255);
  auto fill = [&](std::vector<unsigned char>& x, size_t n) {
    x.resize(n);
    for (auto& b : x) b = (unsigned char)byte(rng);
  };
  fill(c.k, dev_rows * row), fill(c.v, dev_rows * row), fill(c.hk, host_rows * row), fill(c.hv, host_rows * row);
  std::uniform_real_distribution<float> u(0.1f, 2.f);
  auto fills = [&](std::vector<float>& x, size_t n) {
    x.resize(n);
    for (auto& f : x) f = u(rng);
  };
  if (eb == 1) {
    fills(c.ks, dev_rows * H), fills(c.vs, dev_rows * H);
    fills(c.hks, host_rows * H), fills(c.hvs, host_rows * H);
  }
  c.map.assign(size_t(host) * c.layers * H, 0);
  c.slot_page.assign(size_t(H) * slots, 0);
  c.used.assign(size_t(H) * slots, 0);
  c.clock.assign(size_t(H) * 2, 0);
  c.counts.assign(size_t(H) * 3, 0);
  c.counts_host.assign(size_t(H) * 3, 0);
  return c;
}

// A call's batch: each sequence decodes one token; all but (sometimes) the last select budget pages per head, their
// lists mixing device and host frames, and sequences 0 and 1 sharing some pages.
struct Lists {
  std::vector<int32_t> q_start, ctx_len, pages, keys;
  int max_pages;
};

Lists make_lists(const Cache& c, int seqs, const SparseAttention& rule, std::mt19937& rng) {
  Lists l;
  l.max_pages = rule.budget_pages + 4;
  std::uniform_int_distribution<int> dev(0, c.device - 1), host(c.host0(), c.host0() + c.host - 1), coin(0, 3);
  for (int s = 0; s <= seqs; ++s) l.q_start.push_back(s);
  l.pages.assign(size_t(seqs) * c.H * l.max_pages, -7);
  l.keys.assign(size_t(seqs) * c.H, 0);
  for (int s = 0; s < seqs; ++s) {
    const bool selects = s + 1 < seqs || coin(rng) != 0;
    const int n = selects ? rule.budget_pages + 3 : rule.budget_pages - 1;  // pages the sequence holds
    l.ctx_len.push_back((n - 1) * c.ps + 1 + int(rng() % unsigned(c.ps)));
    const int m = selects ? rule.budget_pages : n;
    for (int h = 0; h < c.H; ++h) {
      int32_t* list = l.pages.data() + (size_t(s) * c.H + h) * l.max_pages;
      for (int e = 0; e < m; ++e) {
        int f;
        do {  // distinct within the list; sequence 1 often takes sequence 0's page
          f = s == 1 && coin(rng) < 2 ? l.pages[size_t(h) * l.max_pages + e] : coin(rng) == 0 ? dev(rng) : host(rng);
        } while (std::find(list, list + e, f) != list + e);
        list[e] = f;
      }
      l.keys[size_t(s) * c.H + h] = (m - 1) * c.ps + (l.ctx_len.back() - (n - 1) * c.ps);
    }
  }
  return l;
}

int run_case(int D, int H, int slots, int eb, int seqs, std::mt19937& rng, int budget = 12, int host = 90) {
  const int ps = 4, device = 6;
  SparseAttention rule;
  rule.budget_pages = budget, rule.sink_pages = 2, rule.window_pages = 2;
  Cache gpu = make_cache(D, H, ps, device, slots, host, eb, rng), cpu = gpu;
  for (int call = 0; call < 8; ++call) {
    if (call % 3 == 2) {  // pages moved into some host frames: new bytes, map rows cleared (as KvCache::move)
      std::uniform_int_distribution<int> pick(0, host - 1);
      for (int i = 0; i < 10; ++i) {
        const int f = pick(rng);
        const size_t row = size_t(H) * D * eb;
        for (int r = 0; r < ps; ++r) {
          for (size_t b = 0; b < row; ++b) gpu.hk[(size_t(f) * ps + r) * row + b] = (unsigned char)rng();
          for (size_t b = 0; b < row; ++b) gpu.hv[(size_t(f) * ps + r) * row + b] = (unsigned char)rng();
          if (eb == 1)
            for (int h = 0; h < H; ++h) {
              gpu.hks[(size_t(f) * ps + r) * H + h] = float(rng() % 64) / 16.f;
              gpu.hvs[(size_t(f) * ps + r) * H + h] = float(rng() % 64) / 16.f;
            }
        }
        for (size_t j = 0; j < size_t(gpu.layers) * H; ++j) gpu.map[size_t(f) * gpu.layers * H + j] = 0;
      }
      cpu.hk = gpu.hk, cpu.hv = gpu.hv, cpu.hks = gpu.hks, cpu.hvs = gpu.hvs, cpu.map = gpu.map;
    }
    Lists l = make_lists(gpu, seqs, rule, rng);
    std::vector<int32_t> gl = l.pages, cl = l.pages;
    AttnBatch b;
    b.num_seqs = seqs, b.num_tokens = seqs, b.q_start = l.q_start.data(), b.ctx_len = l.ctx_len.data();
    b.max_pages = l.max_pages, b.page_size = ps, b.head_tables = true;
    AttnShape sh;
    sh.q_heads = 2 * H, sh.kv_heads = H, sh.head_dim = D;
    const KvLayer gc = gpu.layer_view(), cc = cpu.layer_view();
    cuda::StageArgs a{gc.staging, static_cast<const char*>(gc.host_k), static_cast<const char*>(gc.host_v),
                      static_cast<char*>(gc.k), static_cast<char*>(gc.v), gc.host_k_scale, gc.host_v_scale,
                      gc.fp8() ? gc.k_scale : nullptr, gc.v_scale, eb, gc.host_page0, H, D, ps, l.max_pages, seqs,
                      b.q_start, b.ctx_len, l.keys.data(), gl.data(), rule};
    launch_chained(cuda::stage_kernel, unsigned(H), cuda::kStageThreads, 0, nullptr, a);
    for (int h = 0; h < H; ++h) cpu::stage_pages(cc, b, sh, rule, cl.data(), l.keys.data(), h);
    if (gl != cl || !(gpu == cpu)) {
      std::printf("D %d H %d slots %d eb %d seqs %d call %d: the kernel and stage_pages differ (lists %d)\n", D, H,
                  slots, eb, seqs, call, int(gl != cl));
      return 1;
    }
  }
  int64_t reads = 0, copies = 0, in_place = 0;
  for (int h = 0; h < H; ++h)
    reads += gpu.counts[3 * h], copies += gpu.counts[3 * h + 1], in_place += gpu.counts[3 * h + 2];
  std::printf("D %3d H %d slots %3d eb %d seqs %d: staged reads %4lld, copies %4lld, in place %4lld\n", D, H, slots,
              eb, seqs, (long long)reads, (long long)copies, (long long)in_place);
  // Enough slots for every chosen host page: none read in place; one slot: most are.
  if (slots >= budget * seqs && in_place != 0) return 1;
  if (slots == 1 && in_place <= reads) return 1;
  return copies > 0 && reads >= copies ? 0 : 1;
}

// select_kernel over `pages` pages per sequence (sink 3, window 2 pages, budget 40), scores from a small set.
int select_case(int seqs, int heads, int pages, bool aggregate, std::mt19937& rng) {
  SparseAttention rule;
  rule.budget_pages = 40, rule.sink_pages = 3, rule.window_pages = 2;
  const int ps = 16, P = pages + 8;
  std::vector<int32_t> q_start(size_t(seqs) + 1), ctx(static_cast<size_t>(seqs)), table(size_t(seqs) * P);
  for (int s = 0; s <= seqs; ++s) q_start[size_t(s)] = s;
  for (int s = 0; s < seqs; ++s) {
    const int n = s == seqs - 1 ? rule.budget_pages - 5 : pages - 3 * s;  // the last sequence does not select
    ctx[size_t(s)] = (n - 1) * ps + 1 + int(rng() % ps);
    for (int c = 0; c < P; ++c) table[size_t(s) * P + c] = int32_t(rng() % 100000);
  }
  const float levels[] = {-2.f, -0.5f, 0.f, 0.25f, 1.f, 3.5f, 1e30f, -INFINITY, INFINITY, NAN};
  std::vector<float> scores(size_t(seqs) * heads * P);
  for (auto& x : scores) x = rng() % 3 ? levels[rng() % 10] : float(int(rng() % 2000) - 1000) / 64.f;
  std::vector<int32_t> lists(scores.size(), -9), keys(size_t(seqs) * heads, -9);
  cuda::SelectArgs a{};
  a.q_start = q_start.data(), a.ctx_len = ctx.data(), a.page_table = table.data(), a.max_pages = P;
  a.page_size = ps, a.kv_heads = heads, a.rule = rule, a.scores = scores.data(), a.pages = lists.data();
  a.keys = keys.data(), a.aggregate = aggregate;
  launch_chained(cuda::select_kernel, dim3(unsigned(heads), unsigned(seqs)), cuda::kSelectThreads, 0, nullptr, a);
  for (int s = 0; s < seqs; ++s)
    for (int h = 0; h < heads; ++h) {
      const int64_t list = int64_t(s) * heads + h;
      const int n = (ctx[size_t(s)] + ps - 1) / ps;
      const int32_t* src = table.data() + size_t(s) * P;
      std::vector<int32_t> want(src, src + n);
      int want_key = ctx[size_t(s)];
      if (n > rule.budget_pages) {  // candidates [3, n - 2): the k best by (score, NaN lowest; earlier page)
        const float* sc = scores.data() + list * P;
        auto rank = [](float f) { return std::isnan(f) ? -INFINITY : f; };
        std::vector<int> order(size_t(n - 5));
        std::iota(order.begin(), order.end(), 3);
        std::stable_sort(order.begin(), order.end(), [&](int x, int y) {
          if (std::isnan(sc[x]) != std::isnan(sc[y])) return std::isnan(sc[y]);
          return rank(sc[x]) > rank(sc[y]);
        });
        order.resize(size_t(rule.budget_pages - 5));
        std::sort(order.begin(), order.end());
        want.assign(src, src + 3);
        for (int c : order) want.push_back(src[c]);
        want.insert(want.end(), src + n - 2, src + n);
        want_key = (rule.budget_pages - 1) * ps + (ctx[size_t(s)] - (n - 1) * ps);
      }
      const int32_t* got = lists.data() + list * P;
      if (!std::equal(want.begin(), want.end(), got) || keys[size_t(list)] != want_key) {
        std::printf("select: sequence %d head %d of %d pages: the lists differ\n", s, h, n);
        return 1;
      }
    }
  std::printf("select: %d sequences x %d heads, %d pages, aggregate %d: ok\n", seqs, heads, pages, int(aggregate));
  return 0;
}

int main() {
  std::mt19937 rng(7);
  int fails = 0;
  for (bool aggregate : {false, true}) {
    fails += select_case(3, 2, 300, aggregate, rng);
    fails += select_case(2, 1, 2500, aggregate, rng);  // more candidates than the block's threads
  }
  fails += run_case(64, 1, 1, 2, 2, rng);
  fails += run_case(128, 2, 9, 1, 3, rng);
  fails += run_case(256, 3, 40, 2, 3, rng);
  fails += run_case(64, 2, 700, 1, 4, rng);  // more slots than the block's threads
  fails += run_case(64, 1, 900, 2, 2, rng, 600, 1500);  // lists longer than the block's threads
  fails += run_case(128, 1, 24, 2, 1, rng);
  std::printf(fails ? "FAILED\n" : "ok\n");
  return fails ? 1 : 0;
}
