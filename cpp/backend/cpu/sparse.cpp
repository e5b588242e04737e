// Sparse decode on the CPU (ops.h SparseAttention): page summaries, page scores and the per-head page lists.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "backend/cpu/cpu_kernels.h"

namespace qrt::cpu {

void summarize_pages(const KvLayer& cache, const AttnBatch& b, int64_t kv_cols, ThreadPool& pool) {
  const Tensor kc(cache.k, cache.dtype, 0, kv_cols);
  Tensor sum(cache.summary, cache.summary_dtype, 0, kv_cols);
  const int ps = b.page_size, T = b.num_tokens;
  pool.for_static(T, T > 16, [&](int64_t t) {
    const int row = b.kv_rows[t];
    if (row < 0) return;
    const int page = row / ps;
    // The step's last row in this page does it (the rows of a page belong to one sequence, in order).
    if (t + 1 < T && b.kv_rows[t + 1] >= 0 && b.kv_rows[t + 1] / ps == page) return;
    const size_t cols = size_t(kv_cols);
    std::vector<float> k_row(cols), mins(cols, INFINITY), maxs(cols, -INFINITY);
    for (int r = page * ps; r <= row; ++r) {
      if (cache.fp8())  // the keys as attention reads them
        dequantize_kv_row(static_cast<const uint8_t*>(cache.k) + int64_t(r) * kv_cols, cache.k_scale + int64_t(r) *
                          cache.kv_heads, kv_cols, cache.kv_heads, k_row.data());
      else
        load_row_f32(kc, r, k_row.data());
      for (size_t c = 0; c < cols; ++c) {
        mins[c] = std::min(mins[c], k_row[c]);
        maxs[c] = std::max(maxs[c], k_row[c]);
      }
    }
    // Exact: the summary's dtype holds the keys' values (the KV dtype, or fp32 for an fp8 cache).
    store_row_f32(mins.data(), sum, 2 * int64_t(page));
    store_row_f32(maxs.data(), sum, 2 * int64_t(page) + 1);
  });
}

void select_pages(const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& sh,
                  const SparseAttention& sp, float* scores, int32_t* pages, int32_t* keys, ThreadPool& pool) {
  const int ps = b.page_size, Hkv = sh.kv_heads, G = sh.q_heads / sh.kv_heads, D = sh.head_dim, P = b.max_pages;
  const int64_t kv_cols = int64_t(Hkv) * D;
  const Tensor sum(cache.summary, cache.summary_dtype, 0, kv_cols);
  pool.for_static(int64_t(b.num_seqs) * Hkv, b.num_seqs * Hkv > 1, [&](int64_t task) {
    const int s = int(task / Hkv), h = int(task % Hkv);
    const int ctx = b.ctx_len[s], q_len = b.q_start[s + 1] - b.q_start[s], n = (ctx + ps - 1) / ps;
    const int32_t* src = b.page_table + int64_t(s) * P;
    int32_t* dst = pages + task * P;
    if (!sp.selects(ctx, q_len, ps)) {
      std::copy(src, src + P, dst);
      keys[task] = ctx;
      return;
    }
    // Candidates: the pages between the sink and the window.
    const int first = sp.sink_pages, end = n - sp.window_pages, k = sp.budget_pages - sp.sink_pages - sp.window_pages;
    float* sc = scores + task * P;
    const float* qh = q.ptr<float>() + int64_t(b.q_start[s]) * q.stride + int64_t(h) * G * D;
    std::vector<float> mins(static_cast<size_t>(D)), maxs(static_cast<size_t>(D));
    for (int c = first; c < end; ++c) {
      const int64_t pg = src[c];
      for (int d = 0; d < D; ++d) {
        mins[size_t(d)] = load_f32(sum, 2 * pg, int64_t(h) * D + d);
        maxs[size_t(d)] = load_f32(sum, 2 * pg + 1, int64_t(h) * D + d);
      }
      float best = -INFINITY;
      for (int g = 0; g < G; ++g) {
        float acc = 0.f;
        for (int d = 0; d < D; ++d)
          acc += std::max(qh[g * D + d] * mins[size_t(d)], qh[g * D + d] * maxs[size_t(d)]);
        best = std::max(best, acc);  // a NaN score counts as -inf
      }
      sc[c] = best;
    }
    std::vector<int> order(size_t(end - first));
    std::iota(order.begin(), order.end(), first);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int x, int y) { return sc[x] > sc[y] || (sc[x] == sc[y] && x < y); });
    std::sort(order.begin(), order.begin() + k);
    int m = 0;
    for (int c = 0; c < first; ++c) dst[m++] = src[c];
    for (int i = 0; i < k; ++i) dst[m++] = src[order[size_t(i)]];
    for (int c = end; c < n; ++c) dst[m++] = src[c];
    keys[task] = (m - 1) * ps + (ctx - (n - 1) * ps);
  });
  if (cache.staging.slots > 0)
    pool.for_static(Hkv, Hkv > 1, [&](int64_t h) { stage_pages(cache, b, sh, sp, pages, keys, int(h)); });
}

void stage_pages(const KvLayer& c, const AttnBatch& b, const AttnShape& sh, const SparseAttention& sp,
                 int32_t* pages, const int32_t* keys, int h) {
  const KvStaging& st = c.staging;
  const int S = st.slots, H = sh.kv_heads, D = sh.head_dim, ps = b.page_size, host0 = c.host_page0;
  int32_t* slot_page = st.slot_page + int64_t(h) * S;
  uint32_t* used = st.used + int64_t(h) * S;
  uint32_t* clock = st.clock + 2 * h;
  auto map = [&](int f) -> int32_t& { return st.map[int64_t(f - host0) * st.map_stride + st.map_col + h]; };
  // Each selecting list of head h: fn(list, entries).
  auto lists = [&](auto&& fn) {
    for (int s = 0; s < b.num_seqs; ++s) {
      if (!sp.selects(b.ctx_len[s], b.q_start[s + 1] - b.q_start[s], ps)) continue;
      const int64_t list = int64_t(s) * H + h;
      fn(pages + list * b.max_pages, (keys[list] + ps - 1) / ps);
    }
  };
  const uint32_t call = ++clock[1];
  lists([&](int32_t* list, int m) {  // slots holding a chosen page are read this call
    for (int e = 0; e < m; ++e)
      if (list[e] >= host0 && map(list[e]) > 0) used[map(list[e]) - 1] = call;
  });
  // Head h's columns of a page's rows, host frame f to staging frame `to` (K, V and fp8 scales).
  const size_t eb = dtype_size(c.dtype), kv_cols = size_t(H) * D;
  auto copy_page = [&](int f, int to) {
    for (int r = 0; r < ps; ++r) {
      const size_t src = size_t(f - host0) * ps + r, dst = size_t(to) * ps + r;
      for (int kv = 0; kv < 2; ++kv) {
        const char* from = static_cast<const char*>(kv ? c.host_v : c.host_k);
        char* into = static_cast<char*>(kv ? c.v : c.k);
        std::memcpy(into + (dst * kv_cols + size_t(h) * D) * eb, from + (src * kv_cols + size_t(h) * D) * eb,
                    size_t(D) * eb);
      }
      if (c.fp8()) {
        c.k_scale[dst * H + h] = c.host_k_scale[src * H + h];
        c.v_scale[dst * H + h] = c.host_v_scale[src * H + h];
      }
    }
  };
  uint32_t hand = clock[0];
  int64_t copies = 0;
  bool full = false;  // every slot is read this call: the rest are read in place
  lists([&](int32_t* list, int m) {  // pages no slot holds: the next slot the hand reaches that is not read
    for (int e = 0; e < m && !full; ++e) {
      const int f = list[e];
      if (f < host0 || map(f) > 0) continue;
      int slot = -1;
      for (int i = 0; i < S && slot < 0; ++i)
        if (used[(hand + i) % S] != call) slot = int((hand + i) % S);
      full = slot < 0;
      if (full) return;
      hand = uint32_t(slot + 1) % S;
      const int old = slot_page[slot] - 1;
      if (old >= 0 && map(host0 + old) == slot + 1) map(host0 + old) = 0;
      slot_page[slot] = f - host0 + 1;
      map(f) = slot + 1;
      used[slot] = call;
      copy_page(f, st.first + slot);
      ++copies;
    }
  });
  clock[0] = hand;
  int64_t staged = 0, in_place = 0;
  lists([&](int32_t* list, int m) {
    for (int e = 0; e < m; ++e) {
      if (list[e] < host0) continue;
      const int slot = map(list[e]) - 1;
      if (slot >= 0) list[e] = st.first + slot, ++staged;
      else ++in_place;
    }
  });
  int64_t* n = st.counts + 3 * h;
  n[0] += staged, n[1] += copies, n[2] += in_place;
  for (int j = 0; j < 3; ++j) st.counts_host[3 * h + j] = n[j];
}

}  // namespace qrt::cpu
