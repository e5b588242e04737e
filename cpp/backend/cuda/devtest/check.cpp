// Temporary development check: CUDA backend vs CPU backend (not part of the build).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>
#include <string>
#include <tuple>

#include "backend/cuda/plugin.h"
#include "backend/ops.h"
#include "core/dtype.h"

using namespace qrt;
static std::mt19937 rng(1234);
static int fails = 0;

std::vector<float> randv(size_t n, float lo = -1, float hi = 1) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}
std::vector<float> round_to(const std::vector<float>& v, DType t) {
  std::vector<uint16_t> h(v.size());
  std::vector<float> r(v.size());
  if (t == DType::F32) return v;
  convert_host(v.data(), DType::F32, h.data(), t, v.size());
  convert_host(h.data(), t, r.data(), DType::F32, v.size());
  return r;
}
struct Buf { Backend* be; void* p; Tensor t; };
Tensor put(Backend& be, DType t, const std::vector<float>& v, int64_t rows, int64_t cols, int64_t stride = -1) {
  if (stride < 0) stride = cols;
  std::vector<float> full(size_t(rows * stride), 0.f);
  for (int64_t r = 0; r < rows; ++r) for (int64_t c = 0; c < cols; ++c) full[r * stride + c] = v[r * cols + c];
  std::vector<char> bytes(full.size() * dtype_size(t) + 16);
  convert_host(full.data(), DType::F32, bytes.data(), t, full.size());
  void* p = be.alloc(std::max<size_t>(full.size() * dtype_size(t), 16));
  be.upload(p, bytes.data(), full.size() * dtype_size(t));
  return Tensor(p, t, rows, cols, stride);
}
std::vector<float> get(Backend& be, const Tensor& t) {
  std::vector<char> bytes(size_t(t.rows * t.stride) * dtype_size(t.dtype));
  be.download(bytes.data(), t.data, size_t((t.rows - 1) * t.stride + t.cols) * dtype_size(t.dtype));
  std::vector<float> full(size_t(t.rows * t.stride)), out(size_t(t.rows * t.cols));
  convert_host(bytes.data(), t.dtype, full.data(), DType::F32, full.size());
  for (int64_t r = 0; r < t.rows; ++r) for (int64_t c = 0; c < t.cols; ++c) out[r * t.cols + c] = full[r * t.stride + c];
  return out;
}
void* put_i(Backend& be, const std::vector<int32_t>& v) {
  void* p = be.alloc(std::max<size_t>(v.size() * 4, 16));
  if (!v.empty()) be.upload(p, v.data(), v.size() * 4);
  return p;
}
double rel(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) { double d = double(a[i]) - b[i]; num += d * d; den += double(b[i]) * b[i]; }
  if (!(num == num)) return 1e9;
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}
void expect(const char* what, double r, double tol) {
  bool ok = r <= tol;
  if (!ok) ++fails;
  std::printf("%s %-60s rel=%.3g (tol %.1g)\n", ok ? "ok  " : "FAIL", what, r, tol);
}

struct Env { Backend* cpu; Backend* gpu; DType t; double tol; };

void test_fill(Env& e) {
  for (DType t : {DType::F32, DType::BF16, DType::F16})
    for (auto [r, c] : std::vector<std::pair<int, int>>{{1, 1}, {3, 17}, {257, 1000}}) {
      for (auto [sc, off] : std::vector<std::pair<float, float>>{{0.02f, 0.f}, {0.1f, 1.0f}, {3.3f, -0.7f}}) {
        size_t n = size_t(r) * c * dtype_size(t);
        std::vector<char> a(n), b(n);
        Tensor tc(a.data(), t, r, c);
        e.cpu->fill_random(tc, 77, sc, off);
        void* p = e.gpu->alloc(n);
        Tensor tg(p, t, r, c);
        e.gpu->fill_random(tg, 77, sc, off);
        e.gpu->download(b.data(), p, n);
        e.gpu->release(p);
        char w[128];
        std::snprintf(w, sizeof w, "fill_random %s %dx%d scale %g off %g", dtype_name(t), r, c, sc, off);
        expect(w, std::memcmp(a.data(), b.data(), n) == 0 ? 0 : 1, 0);
      }
    }
}

void test_norms(Env& e) {
  for (int rows : {1, 3, 17, 257})
    for (int cols : {7, 64, 1000, 4096}) {
      auto x = round_to(randv(size_t(rows) * cols, -2, 2), e.t), res = round_to(randv(size_t(rows) * cols), e.t);
      auto w = round_to(randv(cols, 0.5, 1.5), e.t);
      for (bool zc : {false, true}) {
        Tensor xc(x.data(), DType::F32, rows, cols), wc(w.data(), DType::F32, 1, cols);
        std::vector<float> oc(size_t(rows) * cols);
        Tensor otc(oc.data(), DType::F32, rows, cols);
        e.cpu->rms_norm(xc, wc, 1e-6f, zc, otc);
        Tensor xg = put(*e.gpu, e.t, x, rows, cols, cols + 3), wg = put(*e.gpu, e.t, w, 1, cols);
        Tensor og = put(*e.gpu, e.t, std::vector<float>(size_t(rows) * cols), rows, cols);
        e.gpu->rms_norm(xg, wg, 1e-6f, zc, og);
        char nm[128];
        std::snprintf(nm, sizeof nm, "rms_norm %dx%d zc=%d", rows, cols, zc);
        expect(nm, rel(get(*e.gpu, og), oc), e.tol);
        // add_rms_norm
        std::vector<float> rc = res;
        Tensor rtc(rc.data(), DType::F32, rows, cols);
        e.cpu->add_rms_norm(rtc, xc, wc, 1e-6f, zc, otc);
        Tensor rg = put(*e.gpu, e.t, res, rows, cols);
        e.gpu->add_rms_norm(rg, xg, wg, 1e-6f, zc, og);
        std::snprintf(nm, sizeof nm, "add_rms_norm %dx%d zc=%d (out)", rows, cols, zc);
        expect(nm, rel(get(*e.gpu, og), oc), e.tol);
        std::snprintf(nm, sizeof nm, "add_rms_norm %dx%d zc=%d (residual)", rows, cols, zc);
        expect(nm, rel(get(*e.gpu, rg), rc), e.tol);
        for (Tensor* t : {&xg, &wg, &og, &rg}) e.gpu->release(t->data);
      }
    }
  // head_rms_norm on a column slice, rope
  for (int hd : {64, 128, 256})
    for (int rows : {1, 5, 33}) {
      int heads = 3, total = (heads + 2) * hd;
      auto x = round_to(randv(size_t(rows) * total, -2, 2), e.t);
      auto w = round_to(randv(hd, 0.5, 1.5), e.t);
      std::vector<float> xc = x;
      Tensor full(xc.data(), DType::F32, rows, total);
      Tensor sl = full.col_slice(hd, heads * hd);
      Tensor wc(w.data(), DType::F32, 1, hd);
      e.cpu->head_rms_norm(sl, hd, wc, 1e-6f, true);
      Tensor xg = put(*e.gpu, e.t, x, rows, total), wg = put(*e.gpu, e.t, w, 1, hd);
      Tensor slg = xg.col_slice(hd, heads * hd);
      e.gpu->head_rms_norm(slg, hd, wg, 1e-6f, true);
      char nm[128];
      std::snprintf(nm, sizeof nm, "head_rms_norm hd=%d rows=%d", hd, rows);
      expect(nm, rel(get(*e.gpu, xg), xc), e.tol);
      // rope with partial rotary
      for (int rot : {hd, hd / 4}) {
        int P = 50;
        std::vector<float> cs(size_t(P) * rot);
        for (int p = 0; p < P; ++p)
          for (int i = 0; i < rot / 2; ++i) {
            float f = p * std::pow(10000.f, -2.f * i / rot);
            cs[p * rot + i] = std::cos(f);
            cs[p * rot + rot / 2 + i] = std::sin(f);
          }
        std::vector<int32_t> pos(rows);
        for (auto& q : pos) q = int(rng() % P);
        std::vector<float> xr = x;
        Tensor fr(xr.data(), DType::F32, rows, total);
        Tensor slr = fr.col_slice(0, heads * hd);
        RopeTable tc{cs.data(), rot, P};
        e.cpu->rope(slr, hd, pos.data(), tc);
        Tensor xg2 = put(*e.gpu, e.t, x, rows, total);
        Tensor csg = put(*e.gpu, DType::F32, cs, P, rot);
        void* posg = put_i(*e.gpu, pos);
        RopeTable tg{csg.ptr<float>(), rot, P};
        Tensor slg2 = xg2.col_slice(0, heads * hd);
        e.gpu->rope(slg2, hd, static_cast<int32_t*>(posg), tg);
        std::snprintf(nm, sizeof nm, "rope hd=%d rot=%d rows=%d", hd, rot, rows);
        expect(nm, rel(get(*e.gpu, xg2), xr), e.tol);
        e.gpu->release(xg2.data); e.gpu->release(csg.data); e.gpu->release(posg);
      }
      e.gpu->release(xg.data); e.gpu->release(wg.data);
    }
  // silu_mul, add, embedding, gather, convert
  for (int rows : {1, 3, 17, 257})
    for (int I : {5, 64, 1000}) {
      auto gu = round_to(randv(size_t(rows) * 2 * I, -4, 4), e.t);
      std::vector<float> oc(size_t(rows) * I);
      Tensor gc(gu.data(), DType::F32, rows, 2 * I), otc(oc.data(), DType::F32, rows, I);
      e.cpu->silu_mul(gc, otc);
      Tensor gg = put(*e.gpu, e.t, gu, rows, 2 * I), og = put(*e.gpu, e.t, std::vector<float>(size_t(rows) * I), rows, I);
      e.gpu->silu_mul(gg, og);
      char nm[128];
      std::snprintf(nm, sizeof nm, "silu_mul %dx%d", rows, I);
      expect(nm, rel(get(*e.gpu, og), oc), e.tol);
      auto y = round_to(randv(size_t(rows) * I), e.t);
      auto xx = round_to(randv(size_t(rows) * I), e.t);
      std::vector<float> xc = xx;
      Tensor xct(xc.data(), DType::F32, rows, I), yct(y.data(), DType::F32, rows, I);
      e.cpu->add(xct, yct);
      Tensor xg = put(*e.gpu, e.t, xx, rows, I), yg = put(*e.gpu, e.t, y, rows, I);
      e.gpu->add(xg, yg);
      std::snprintf(nm, sizeof nm, "add %dx%d", rows, I);
      expect(nm, rel(get(*e.gpu, xg), xc), e.tol);
      // embedding from a bf16 table
      auto tab = round_to(randv(size_t(50) * I), DType::BF16);
      std::vector<int32_t> ids(rows);
      for (auto& q : ids) q = int(rng() % 50);
      std::vector<uint16_t> tb(tab.size());
      convert_host(tab.data(), DType::F32, tb.data(), DType::BF16, tab.size());
      Tensor tcb(tb.data(), DType::BF16, 50, I);
      std::vector<float> ec(size_t(rows) * I);
      Tensor ect(ec.data(), DType::F32, rows, I);
      e.cpu->embedding(ids.data(), tcb, ect);
      Tensor tgb = put(*e.gpu, DType::BF16, tab, 50, I);
      void* idg = put_i(*e.gpu, ids);
      Tensor eg = put(*e.gpu, e.t, std::vector<float>(size_t(rows) * I), rows, I);
      e.gpu->embedding(static_cast<int32_t*>(idg), tgb, eg);
      std::snprintf(nm, sizeof nm, "embedding %dx%d", rows, I);
      expect(nm, rel(get(*e.gpu, eg), ec), e.tol);
      // gather rows of xg
      std::vector<int32_t> gr(rows);
      for (auto& q : gr) q = int(rng() % rows);
      void* grg = put_i(*e.gpu, gr);
      Tensor gout = put(*e.gpu, e.t, std::vector<float>(size_t(rows) * I), rows, I);
      e.gpu->gather_rows(xg, static_cast<int32_t*>(grg), gout);
      auto xgv = get(*e.gpu, xg);
      std::vector<float> gref(size_t(rows) * I);
      for (int r = 0; r < rows; ++r) std::copy_n(&xgv[size_t(gr[r]) * I], I, &gref[size_t(r) * I]);
      std::snprintf(nm, sizeof nm, "gather_rows %dx%d", rows, I);
      expect(nm, rel(get(*e.gpu, gout), gref), 0);
      for (void* p : {gg.data, og.data, xg.data, yg.data, tgb.data, idg, eg.data, grg, gout.data}) e.gpu->release(p);
    }
}

void test_linear(Env& e) {
  for (int M : {1, 3, 17, 257})
    for (int N : {5, 64, 1000})
      for (int K : {8, 64, 333, 1024})
        for (DType wt : {e.t, DType::BF16})
          for (bool bias : {false, true}) {
            if (e.t != DType::F32 && wt != e.t) continue;
            if (wt == DType::BF16 && e.t == DType::F32 && (K == 333)) {}
            auto x = round_to(randv(size_t(M) * K), e.t);
            auto w = round_to(randv(size_t(N) * K), wt);
            auto b = round_to(randv(N), wt);
            std::vector<float> oc(size_t(M) * N);
            Tensor xc(x.data(), DType::F32, M, K), wc(w.data(), DType::F32, N, K), bc(b.data(), DType::F32, 1, N);
            Tensor otc(oc.data(), DType::F32, M, N);
            Linear lc{wc, {}};
            e.cpu->linear(xc, lc, bias ? &bc : nullptr, otc);
            Tensor xg = put(*e.gpu, e.t, x, M, K), wg = put(*e.gpu, wt, w, N, K), bg = put(*e.gpu, wt, b, 1, N);
            // strided output: columns [8, 8 + N) of a wider buffer
            Tensor big = put(*e.gpu, e.t, std::vector<float>(size_t(M) * (N + 16)), M, N + 16);
            Tensor og = big.col_slice(8, N);
            Linear lg{wg, {}};
            e.gpu->linear(xg, lg, bias ? &bg : nullptr, og);
            char nm[128];
            std::snprintf(nm, sizeof nm, "linear M=%d N=%d K=%d w=%s bias=%d", M, N, K, dtype_name(wt), bias);
            expect(nm, rel(get(*e.gpu, og), oc), e.t == DType::F32 ? 1e-5 : e.tol);
            for (void* p : {xg.data, wg.data, bg.data, big.data}) e.gpu->release(p);
          }
}

struct AttnCase { std::vector<int> q_len, ctx; int qh, kvh, hd, ps; };

void run_attn(Env& e, const AttnCase& c, bool graph = false) {
  const int S = int(c.q_len.size());
  int T = 0, max_q = 0, max_ctx = 0, max_pages = 0;
  for (int s = 0; s < S; ++s) { T += c.q_len[s]; max_q = std::max(max_q, c.q_len[s]); max_ctx = std::max(max_ctx, c.ctx[s]); max_pages = std::max(max_pages, (c.ctx[s] + c.ps - 1) / c.ps); }
  int total_pages = 0;
  for (int s = 0; s < S; ++s) total_pages += (c.ctx[s] + c.ps - 1) / c.ps;
  total_pages += 3;
  std::vector<int> perm(total_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> pt(size_t(S) * max_pages, 0), q_start(S + 1, 0), kv_rows;
  int pi = 0;
  for (int s = 0; s < S; ++s) {
    for (int p = 0; p < (c.ctx[s] + c.ps - 1) / c.ps; ++p) pt[size_t(s) * max_pages + p] = perm[pi++];
    q_start[s + 1] = q_start[s] + c.q_len[s];
    for (int i = 0; i < c.q_len[s]; ++i) {
      int pos = c.ctx[s] - c.q_len[s] + i;
      kv_rows.push_back(pt[size_t(s) * max_pages + pos / c.ps] * c.ps + pos % c.ps);
    }
  }
  const int kvc = c.kvh * c.hd, qc = c.qh * c.hd;
  const int64_t slots = int64_t(total_pages) * c.ps;
  auto kcache = round_to(randv(size_t(slots) * kvc), e.t), vcache = round_to(randv(size_t(slots) * kvc), e.t);
  // fused qkv buffer as the model has it
  const int fused = qc + 2 * kvc;
  auto qkv = round_to(randv(size_t(T) * fused, -2, 2), e.t);
  std::vector<float> q(size_t(T) * qc), k(size_t(T) * kvc), v(size_t(T) * kvc);
  for (int r = 0; r < T; ++r) {
    std::copy_n(&qkv[size_t(r) * fused], qc, &q[size_t(r) * qc]);
    std::copy_n(&qkv[size_t(r) * fused + qc], kvc, &k[size_t(r) * kvc]);
    std::copy_n(&qkv[size_t(r) * fused + qc + kvc], kvc, &v[size_t(r) * kvc]);
  }
  AttnShape sh{c.qh, c.kvh, c.hd, 1.0f / std::sqrt(float(c.hd))};
  // CPU
  std::vector<float> kc = kcache, vc = vcache, oc(size_t(T) * qc);
  AttnBatch bc{S, T, q_start.data(), c.ctx.data(), pt.data(), kv_rows.data(), max_pages, c.ps, max_q, max_ctx};
  KvLayer lc{kc.data(), vc.data(), DType::F32};
  Tensor qct(q.data(), DType::F32, T, qc), kct(k.data(), DType::F32, T, kvc), vct(v.data(), DType::F32, T, kvc);
  Tensor oct(oc.data(), DType::F32, T, qc);
  e.cpu->write_kv(kct, vct, bc, lc);
  e.cpu->attention(qct, lc, bc, sh, oct);
  // GPU
  Tensor kg = put(*e.gpu, e.t, kcache, slots, kvc), vg = put(*e.gpu, e.t, vcache, slots, kvc);
  Tensor qkvg = put(*e.gpu, e.t, qkv, T, fused);
  Tensor og = put(*e.gpu, e.t, std::vector<float>(size_t(T) * qc), T, qc);
  void* d_qs = put_i(*e.gpu, q_start); void* d_ctx = put_i(*e.gpu, c.ctx); void* d_pt = put_i(*e.gpu, pt); void* d_kr = put_i(*e.gpu, kv_rows);
  AttnBatch bg{S, T, (int32_t*)d_qs, (int32_t*)d_ctx, (int32_t*)d_pt, (int32_t*)d_kr, max_pages, c.ps, max_q, max_ctx};
  KvLayer lg{kg.data, vg.data, e.t};
  Tensor qg = qkvg.col_slice(0, qc), kgs = qkvg.col_slice(qc, kvc), vgs = qkvg.col_slice(qc + kvc, kvc);
  if (graph) {
    e.gpu->begin_capture();
    e.gpu->write_kv(kgs, vgs, bg, lg);
    e.gpu->attention(qg, lg, bg, sh, og);
    int gid = e.gpu->end_capture();
    e.gpu->replay(gid);
  } else {
    e.gpu->write_kv(kgs, vgs, bg, lg);
    e.gpu->attention(qg, lg, bg, sh, og);
  }
  char nm[160];
  std::snprintf(nm, sizeof nm, "attention S=%d T=%d maxq=%d maxctx=%d qh=%d kvh=%d hd=%d ps=%d%s", S, T, max_q, max_ctx, c.qh, c.kvh, c.hd, c.ps, graph ? " graph" : "");
  expect(nm, rel(get(*e.gpu, og), oc), e.t == DType::F32 ? 1e-5 : e.tol);
  std::snprintf(nm, sizeof nm, "  k cache after write_kv");
  expect(nm, rel(get(*e.gpu, kg), kc), 0);
  for (void* p : {kg.data, vg.data, qkvg.data, og.data, d_qs, d_ctx, d_pt, d_kr}) e.gpu->release(p);
}

void test_attention(Env& e) {
  std::vector<AttnCase> cases = {
      {{1}, {1}, 4, 4, 64, 16},
      {{1, 1, 1}, {17, 100, 3000}, 32, 8, 128, 16},
      {{1, 1}, {33, 700}, 8, 1, 128, 64},
      {{1}, {5000}, 24, 4, 256, 16},
      {{1, 1, 1, 1}, {1, 2, 15, 16}, 16, 8, 64, 8},
      {{37}, {37}, 8, 8, 64, 16},
      {{100}, {100}, 32, 8, 128, 16},
      {{64, 3}, {64 + 50, 3}, 16, 4, 128, 64},
      {{1, 50, 1, 7}, {300, 80, 1, 7}, 8, 2, 128, 16},
      {{129, 1}, {1000, 2000}, 24, 4, 256, 16},
      {{257}, {257}, 12, 2, 64, 128},
      {{300, 20}, {2048, 20}, 32, 4, 128, 32},
      {{17, 1, 5}, {17, 40, 60}, 64, 8, 128, 16},
      {{1000}, {3000}, 8, 8, 128, 16},
  };
  for (auto& c : cases) run_attn(e, c);
  run_attn(e, cases[1], true);
  run_attn(e, cases[8], true);
}

void test_sample(Env& e) {
  for (int V : {10, 1000, 151936}) {
    int R = V > 1000 ? 64 : 9;
    auto logits = randv(size_t(R) * V, -5, 5);
    if (V == 10) for (int i = 0; i < 10; ++i) logits[i] = float(i % 3);  // ties
    std::vector<SampleRow> rows(R);
    for (int r = 0; r < R; ++r) {
      SampleRow& p = rows[r];
      p.seed = 1000 + r; p.draw = r * 7;
      switch (r % 9) {
        case 0: p.temperature = 0; break;
        case 1: p.temperature = 1.0f; break;
        case 2: p.temperature = 0.7f; p.top_p = 0.9f; break;
        case 3: p.temperature = 1.3f; p.top_k = 5; break;
        case 4: p.temperature = 0.8f; p.top_k = 40; p.top_p = 0.5f; p.min_p = 0.05f; break;
        case 5: p.temperature = 0; p.repetition_penalty = 1.3f; p.seen_tokens = {1, 2, 3, 5, 8}; p.banned_tokens = {0, 4}; break;
        case 6: p.temperature = 1.0f; p.presence_penalty = 0.5f; p.frequency_penalty = 0.3f; p.output_tokens = {2, 7}; p.output_counts = {3, 1}; p.num_logprobs = 5; break;
        case 7: p.temperature = 1.0f; p.top_k = 1; p.num_logprobs = 3; break;
        case 8: p.temperature = 0.5f; p.min_p = 0.2f; p.top_p = 0.99f; break;
      }
    }
    SampleResult rc, rg;
    Tensor lc(logits.data(), DType::F32, R, V);
    e.cpu->sample(lc, rows, rc);
    Tensor lg = put(*e.gpu, DType::F32, logits, R, V);
    e.gpu->sample(lg, rows, rg);
    int mism = 0; double lpd = 0;
    for (int r = 0; r < R; ++r) {
      if (rc.tokens[r] != rg.tokens[r]) { ++mism; std::printf("   row %d (case %d): cpu %d gpu %d\n", r, r % 9, rc.tokens[r], rg.tokens[r]); }
      lpd = std::max(lpd, double(std::fabs(rc.logprobs[r] - rg.logprobs[r])));
    }
    int topm = 0;
    for (size_t i = 0; i < rc.top_ids.size(); ++i) topm += rc.top_ids[i] != rg.top_ids[i] || std::fabs(rc.top_logprobs[i] - rg.top_logprobs[i]) > 1e-4;
    char nm[128];
    std::snprintf(nm, sizeof nm, "sample V=%d R=%d token mismatches", V, R);
    expect(nm, mism, 0);
    std::snprintf(nm, sizeof nm, "sample V=%d logprob max diff", V);
    expect(nm, lpd, 1e-4);
    std::snprintf(nm, sizeof nm, "sample V=%d top-n mismatches (max_n %d)", V, rg.max_n);
    expect(nm, topm, 0);
    e.gpu->release(lg.data);
  }
}


#include <chrono>
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

void bench_attn(Backend& g, DType t, std::vector<int> q_lens, std::vector<int> ctx, int qh, int kvh, int hd, int ps, const char* label) {
  const int S = int(q_lens.size());
  int T = 0, max_q = 0, max_ctx = 0, max_pages = 0, total_pages = 0;
  for (int s = 0; s < S; ++s) { T += q_lens[s]; max_q = std::max(max_q, q_lens[s]); max_ctx = std::max(max_ctx, ctx[s]); int np = (ctx[s] + ps - 1) / ps; max_pages = std::max(max_pages, np); total_pages += np; }
  std::vector<int> perm(total_pages); std::iota(perm.begin(), perm.end(), 0); std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> pt(size_t(S) * max_pages, 0), q_start(S + 1, 0), kv_rows;
  int pi = 0;
  for (int s = 0; s < S; ++s) {
    for (int p = 0; p < (ctx[s] + ps - 1) / ps; ++p) pt[size_t(s) * max_pages + p] = perm[pi++];
    q_start[s + 1] = q_start[s] + q_lens[s];
  }
  const int kvc = kvh * hd, qc = qh * hd;
  const int64_t slots = int64_t(total_pages) * ps;
  const size_t es = dtype_size(t);
  void* kc = g.alloc(slots * kvc * es); void* vc = g.alloc(slots * kvc * es);
  Tensor kt(kc, t, slots, kvc), vt(vc, t, slots, kvc);
  g.fill_random(kt, 1, 1.f, 0.f); g.fill_random(vt, 2, 1.f, 0.f);
  void* q = g.alloc(size_t(T) * qc * es); void* o = g.alloc(size_t(T) * qc * es);
  Tensor qt(q, t, T, qc), ot(o, t, T, qc);
  g.fill_random(qt, 3, 1.f, 0.f);
  void* d_qs = put_i(g, q_start); void* d_ctx = put_i(g, ctx); void* d_pt = put_i(g, pt);
  AttnBatch b{S, T, (int32_t*)d_qs, (int32_t*)d_ctx, (int32_t*)d_pt, nullptr, max_pages, ps, max_q, max_ctx};
  KvLayer l{kc, vc, t};
  AttnShape sh{qh, kvh, hd, 1.0f / std::sqrt(float(hd))};
  for (int i = 0; i < 3; ++i) g.attention(qt, l, b, sh, ot);
  g.synchronize();
  int iters = 20;
  double t0 = now();
  for (int i = 0; i < iters; ++i) g.attention(qt, l, b, sh, ot);
  g.synchronize();
  double dt = (now() - t0) / iters;
  double kv_bytes = 0, flops = 0;
  for (int s = 0; s < S; ++s) {
    kv_bytes += 2.0 * ctx[s] * kvc * es;
    for (int i = 0; i < q_lens[s]; ++i) flops += 4.0 * (ctx[s] - q_lens[s] + i + 1) * hd * qh;
  }
  std::printf("bench %-28s %s: %.3f ms  KV %.1f GB/s  %.1f TFLOP/s\n", label, dtype_name(t), dt * 1e3, kv_bytes / dt / 1e9, flops / dt / 1e12);
  for (void* p : {kc, vc, q, o, d_qs, d_ctx, d_pt}) g.release(p);
}

void bench(Backend& g) {
  DType t = g.act_dtype();
  bench_attn(g, t, {1}, {32768}, 32, 8, 128, 16, "decode b1 ctx32k 8B");
  bench_attn(g, t, {1}, {8192}, 32, 8, 128, 16, "decode b1 ctx8k 8B");
  bench_attn(g, t, std::vector<int>(64, 1), std::vector<int>(64, 2048), 32, 8, 128, 16, "decode b64 ctx2k 8B");
  bench_attn(g, t, std::vector<int>(16, 1), std::vector<int>(16, 8192), 24, 4, 256, 16, "decode b16 ctx8k d256");
  bench_attn(g, t, {8192}, {8192}, 32, 8, 128, 16, "prefill 8k 8B");
  bench_attn(g, t, {2048}, {2048}, 32, 8, 128, 16, "prefill 2k 8B");
  bench_attn(g, t, {4096}, {4096}, 24, 4, 256, 16, "prefill 4k d256");
  bench_attn(g, t, {512}, {16384}, 32, 8, 128, 16, "chunk 512 over 16k");
  // linear
  for (auto [M, N, K] : std::vector<std::tuple<int,int,int>>{{1, 4096, 4096}, {64, 12288, 4096}, {8192, 4096, 4096}, {8192, 24576, 4096}}) {
    size_t es = dtype_size(t);
    void* x = g.alloc(size_t(M) * K * es); void* w = g.alloc(size_t(N) * K * es); void* o = g.alloc(size_t(M) * N * es);
    Tensor xt(x, t, M, K), wt(w, t, N, K), ot(o, t, M, N);
    g.fill_random(xt, 1, 1, 0); g.fill_random(wt, 2, 0.02f, 0);
    Linear lw{wt, {}};
    for (int i = 0; i < 3; ++i) g.linear(xt, lw, nullptr, ot);
    g.synchronize();
    double t0 = now();
    for (int i = 0; i < 20; ++i) g.linear(xt, lw, nullptr, ot);
    g.synchronize();
    double dt = (now() - t0) / 20;
    std::printf("bench linear %dx%dx%d %s: %.3f ms %.1f TFLOP/s %.0f GB/s(w)\n", M, N, K, dtype_name(t), dt * 1e3, 2.0 * M * N * K / dt / 1e12, double(N) * K * es / dt / 1e9);
    for (void* p : {x, w, o}) g.release(p);
  }
  // sampling
  if (t == DType::BF16) {
    for (int V : {151936, 248320}) {
      int R = 64;
      void* l = g.alloc(size_t(R) * V * 4);
      Tensor lt(l, DType::F32, R, V);
      g.fill_random(lt, 5, 5.f, 0.f);
      for (int mode = 0; mode < 3; ++mode) {
        std::vector<SampleRow> rows(R);
        for (int r = 0; r < R; ++r) { rows[r].temperature = mode == 0 ? 0.f : 0.8f; rows[r].top_p = mode == 2 ? 0.9f : 1.f; rows[r].top_k = mode == 2 ? 50 : 0; rows[r].seed = r; }
        SampleResult res;
        g.sample(lt, rows, res);
        double t0 = now();
        for (int i = 0; i < 10; ++i) g.sample(lt, rows, res);
        double dt = (now() - t0) / 10;
        std::printf("bench sample V=%d R=%d %s: %.3f ms\n", V, R, mode == 0 ? "greedy" : mode == 1 ? "temp" : "top_k50+top_p0.9", dt * 1e3);
      }
      g.release(l);
    }
  }
}

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "bench") {
    char err[256];
    for (DType t : {DType::BF16, DType::F32}) { Backend* g = qrt_cuda_make_backend(0, int(t), err, sizeof err); bench(*g); delete g; }
    return 0;
  }
  auto cpu = make_cpu_backend(0);
  std::printf("devices: %d\n", qrt_cuda_device_count());
  char err[256];
  Backend* bad = qrt_cuda_make_backend(5, 0, err, sizeof err);
  std::printf("bad device -> %p '%s'\n", (void*)bad, err);
  for (DType t : {DType::F32, DType::BF16, DType::F16}) {
    Backend* g = qrt_cuda_make_backend(0, int(t), err, sizeof err);
    if (!g) { std::printf("make_backend: %s\n", err); return 1; }
    std::printf("===== %s act %s\n", g->name().c_str(), dtype_name(t));
    Env e{cpu.get(), g, t, t == DType::F32 ? 1e-5 : (t == DType::BF16 ? 2e-2 : 4e-3)};
    try {
      if (t == DType::F32) test_fill(e);
      test_norms(e);
      test_linear(e);
      test_attention(e);
      if (t == DType::F32) test_sample(e);
    } catch (const std::exception& ex) {
      std::printf("EXCEPTION: %s\n", ex.what());
      ++fails;
    }
    delete g;
  }
  std::printf("FAILS: %d\n", fails);
  return fails ? 1 : 0;
}
