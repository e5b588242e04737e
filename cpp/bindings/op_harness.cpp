// OpHarness: runs single backend ops on numpy inputs, for the op tests (CPU vs numpy, CUDA vs CPU).
// Inputs are float32 (ids int32); activations are converted to the backend's activation dtype,
// weights to w_dtype; outputs come back as float32.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <optional>

#include "backend/ops.h"
#include "core/buffer.h"
#include "core/error.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace qrt {
namespace {

using F32In = nb::ndarray<const float, nb::c_contig, nb::device::cpu>;
using I32In = nb::ndarray<const int32_t, nb::c_contig, nb::device::cpu>;
using F32Out = nb::ndarray<nb::numpy, float, nb::ndim<2>>;

struct Dev {
  Buffer buf;
  Tensor t;
};

class OpHarness {
 public:
  OpHarness(const std::string& device, const std::string& act) {
    const DType a = parse_dtype(act);
    if (device == "cpu") {
      QRT_CHECK_ARG(a == DType::F32, "the CPU backend computes in float32");
      be_ = make_cpu_backend(0);
    } else {
      QRT_CHECK_ARG(device.rfind("cuda", 0) == 0, "unknown device ", device);
      const int idx = device.size() > 5 ? std::stoi(device.substr(5)) : 0;
      be_ = make_cuda_backend(idx, a);
    }
  }

  static std::pair<int64_t, int64_t> shape2(const F32In& a) {
    if (a.ndim() == 1) return {1, int64_t(a.shape(0))};
    QRT_CHECK_ARG(a.ndim() == 2, "expected a 1-D or 2-D array");
    return {int64_t(a.shape(0)), int64_t(a.shape(1))};
  }

  Dev up(const F32In& a, DType dt) {
    auto [r, c] = shape2(a);
    Dev d{Buffer(be_.get(), size_t(r * c) * dtype_size(dt) + 16), {}};
    d.t = d.buf.tensor(dt, r, c);
    std::vector<char> host(size_t(r * c) * dtype_size(dt));
    convert_host(a.data(), DType::F32, host.data(), dt, size_t(r * c));
    be_->upload(d.t.data, host.data(), host.size());
    return d;
  }
  Dev empty(int64_t r, int64_t c, DType dt) {
    Dev d{Buffer(be_.get(), size_t(r * c) * dtype_size(dt) + 16), {}};
    d.t = d.buf.tensor(dt, r, c);
    return d;
  }
  Dev up_ids(const I32In& a) {
    const size_t n = a.size();
    Dev d{Buffer(be_.get(), n * 4 + 16), {}};
    d.t = d.buf.tensor(DType::I32, 1, int64_t(n));
    be_->upload(d.t.data, a.data(), n * 4);
    return d;
  }
  F32Out down(const Tensor& t) {
    be_->synchronize();
    std::vector<char> host(t.nbytes());
    be_->download(host.data(), t.data, host.size());
    float* out = new float[size_t(t.numel())];
    convert_host(host.data(), t.dtype, out, DType::F32, size_t(t.numel()));
    nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<float*>(p); });
    return F32Out(out, {size_t(t.rows), size_t(t.cols)}, owner);
  }
  // An int32 tensor back as an int32 array.
  nb::ndarray<nb::numpy, int32_t, nb::ndim<2>> down_ids(const Tensor& t) {
    be_->synchronize();
    int32_t* out = new int32_t[size_t(t.numel())];
    be_->download(out, t.data, t.nbytes());
    nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<int32_t*>(p); });
    return nb::ndarray<nb::numpy, int32_t, nb::ndim<2>>(out, {size_t(t.rows), size_t(t.cols)}, owner);
  }
  DType act() const { return be_->act_dtype(); }
  // A KV cache's dtype: the given one, or the activations' when empty.
  DType kv(const std::string& kv_dtype) const { return kv_dtype.empty() ? act() : parse_dtype(kv_dtype); }
  // An attention layer's K/V cache on the device holding the rows kc and vc (fp32): converted to kvt, or (fp8) each
  // row quantized by write_kv from the activations' dtype, with its scales.
  struct Cache {
    Dev k, v, k_scale, v_scale;
    KvLayer layer;
  };
  Cache cache(const F32In& kc, const F32In& vc, DType kvt, int kv_heads) {
    if (kvt != DType::F8E4M3) {
      Cache c{up(kc, kvt), up(vc, kvt), {}, {}, {}};
      c.layer = KvLayer{c.k.t.data, c.v.t.data, kvt};
      return c;
    }
    auto [rows, cols] = shape2(kc);
    Cache c{empty(rows, cols, kvt), empty(rows, cols, kvt), empty(rows, kv_heads, DType::F32),
            empty(rows, kv_heads, DType::F32), {}};
    c.layer = KvLayer{c.k.t.data, c.v.t.data, kvt};
    c.layer.kv_heads = kv_heads;
    c.layer.k_scale = c.k_scale.t.ptr<float>();
    c.layer.v_scale = c.v_scale.t.ptr<float>();
    if (rows == 0) return c;
    Dev k = up(kc, act()), v = up(vc, act());
    std::vector<int32_t> all(static_cast<size_t>(rows));
    for (int64_t i = 0; i < rows; ++i) all[size_t(i)] = int32_t(i);
    Dev idx = empty(1, rows, DType::I32);
    be_->upload(idx.t.data, all.data(), all.size() * 4);
    AttnBatch b;
    b.num_tokens = int(rows);
    b.kv_rows = idx.t.ptr<int32_t>();
    be_->write_kv(k.t, v.t, b, c.layer);
    be_->synchronize();
    return c;
  }
  // K (or V) rows of a cache as attention reads them, fp32: fp8 values times their scales.
  F32Out down_kv(const Dev& rows, const Dev& scales) {
    if (rows.t.dtype != DType::F8E4M3) return down(rows.t);
    F32Out q = down(rows.t), s = down(scales.t);
    const int64_t R = rows.t.rows, C = rows.t.cols, H = scales.t.cols;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) q.data()[r * C + c] *= s.data()[r * H + c / (C / H)];
    return q;
  }
  // A norm's gain on the device: w, or ones when w is absent (a unit gain).
  Dev norm_gain(const std::optional<F32In>& w, int64_t cols) {
    if (w) return up(*w, DType::F32);
    const std::vector<float> ones(size_t(cols), 1.0f);
    Dev d = empty(1, cols, DType::F32);
    be_->upload(d.t.data, ones.data(), ones.size() * 4);
    return d;
  }

  // A ragged batch of num_tokens query rows on the device, with its host-side maxima.
  struct Batch {
    Dev q_start, ctx_len, page_table, kv_rows;
    AttnBatch b;
  };
  Batch batch(const I32In& q_start, const I32In& ctx_len, const I32In& page_table, const I32In& kv_rows,
              int page_size, int64_t num_tokens) {
    Batch d{up_ids(q_start), up_ids(ctx_len), up_ids(page_table), up_ids(kv_rows), {}};
    AttnBatch& b = d.b;
    b.num_seqs = int(ctx_len.size());
    b.num_tokens = int(num_tokens);
    b.q_start = d.q_start.t.ptr<int32_t>();
    b.ctx_len = d.ctx_len.t.ptr<int32_t>();
    b.page_table = d.page_table.t.ptr<int32_t>();
    b.kv_rows = d.kv_rows.t.ptr<int32_t>();
    b.max_pages = b.num_seqs ? int(page_table.size()) / b.num_seqs : 0;
    b.page_size = page_size;
    for (int s = 0; s < b.num_seqs; ++s) {
      b.max_q_len = std::max(b.max_q_len, q_start.data()[s + 1] - q_start.data()[s]);
      b.max_ctx_len = std::max(b.max_ctx_len, ctx_len.data()[s]);
    }
    return d;
  }

  // A batch as the DeltaNet ops see it: q_start, ctx_len and each sequence's state slot.
  struct StateBatch {
    Dev q_start, ctx_len, slots;
    AttnBatch b;
  };
  StateBatch state_batch(const I32In& q_start, const I32In& ctx_len, const I32In& slots, int64_t num_tokens) {
    StateBatch d{up_ids(q_start), up_ids(ctx_len), up_ids(slots), {}};
    d.b.num_seqs = int(ctx_len.size());
    d.b.num_tokens = int(num_tokens);
    d.b.q_start = d.q_start.t.ptr<int32_t>();
    d.b.ctx_len = d.ctx_len.t.ptr<int32_t>();
    d.b.slots = d.slots.t.ptr<int32_t>();
    for (int s = 0; s < d.b.num_seqs; ++s)
      d.b.max_q_len = std::max(d.b.max_q_len, q_start.data()[s + 1] - q_start.data()[s]);
    return d;
  }

  Backend& be() { return *be_; }

 private:
  std::unique_ptr<Backend> be_;
};

}  // namespace

void bind_op_harness(nb::module_& m) {
  nb::class_<OpHarness>(m, "OpHarness")
      .def(nb::init<const std::string&, const std::string&>(), "device"_a, "act_dtype"_a = "float32")
      .def("embedding",
           [](OpHarness& h, I32In ids, F32In table, const std::string& wd) {
             Dev i = h.up_ids(ids), t = h.up(table, parse_dtype(wd));
             Dev o = h.empty(int64_t(ids.size()), t.t.cols, h.act());
             h.be().embedding(i.t.ptr<int32_t>(), t.t, o.t);
             return h.down(o.t);
           })
      .def("rms_norm",
           [](OpHarness& h, F32In x, F32In w, float eps, bool zc, const std::string& wd) {
             Dev xd = h.up(x, h.act()), wdv = h.up(w, parse_dtype(wd));
             Dev o = h.empty(xd.t.rows, xd.t.cols, h.act());
             h.be().rms_norm(xd.t, wdv.t, eps, zc, o.t);
             return h.down(o.t);
           })
      .def("add_rms_norm",
           [](OpHarness& h, F32In res, F32In x, F32In w, float eps, bool zc, const std::string& wd) {
             Dev rd = h.up(res, h.act()), xd = h.up(x, h.act()), wdv = h.up(w, parse_dtype(wd));
             Dev o = h.empty(xd.t.rows, xd.t.cols, h.act());
             h.be().add_rms_norm(rd.t, xd.t, wdv.t, eps, zc, o.t);
             return std::make_pair(h.down(rd.t), h.down(o.t));
           })
      .def("head_rms_norm",
           [](OpHarness& h, F32In x, int hd, F32In w, float eps, bool zc, const std::string& wd) {
             Dev xd = h.up(x, h.act()), wdv = h.up(w, parse_dtype(wd));
             h.be().head_rms_norm(xd.t, hd, wdv.t, eps, zc);
             return h.down(xd.t);
           })
      .def("rope",
           [](OpHarness& h, F32In x, int hd, I32In pos, F32In cs) {
             Dev xd = h.up(x, h.act()), pd = h.up_ids(pos), cd = h.up(cs, DType::F32);
             RopeTable tab{cd.t.ptr<float>(), int(cd.t.cols), int(cd.t.rows)};
             h.be().rope(xd.t, hd, pd.t.ptr<int32_t>(), tab);
             return h.down(xd.t);
           })
      .def("linear",
           [](OpHarness& h, F32In x, F32In w, std::optional<F32In> bias, const std::string& wd) {
             Dev xd = h.up(x, h.act()), wdv = h.up(w, parse_dtype(wd));
             std::optional<Dev> bd;
             if (bias) bd = h.up(*bias, DType::F32);
             Dev o = h.empty(xd.t.rows, wdv.t.rows, h.act());
             Linear lin;
             lin.w = wdv.t;
             h.be().linear(xd.t, lin, bd ? &bd->t : nullptr, o.t);
             return h.down(o.t);
           }, "x"_a, "w"_a, "bias"_a.none(), "w_dtype"_a)
      .def("linear_add",
           [](OpHarness& h, F32In x, F32In w, F32In out, const std::string& wd) {
             Dev xd = h.up(x, h.act()), wdv = h.up(w, parse_dtype(wd)), o = h.up(out, h.act());
             Linear lin;
             lin.w = wdv.t;
             h.be().linear_add(xd.t, lin, o.t);
             return h.down(o.t);
           }, "x"_a, "w"_a, "out"_a, "w_dtype"_a)
      // Seconds per call of linear (x [m, k] times w [n, k]^T, no bias) on random device data: weights "fp8"
      // (block-128 e4m3 from random values) or the activation dtype; after one call, `repeats` calls timed together
      // (the bench's GEMM-alone figure; every kernel the linear launches is counted).
      .def("time_linear",
           [](OpHarness& h, int64_t m, int64_t n, int64_t k, const std::string& weights, int repeats) {
             QRT_CHECK_ARG(m > 0 && n > 0 && k > 0 && repeats > 0, "time_linear: sizes and repeats must be positive");
             QRT_CHECK_ARG(weights == "fp8" || weights == "act", "time_linear: weights are fp8 or act, not ", weights);
             const int64_t B = kFp8Block;
             Dev x = h.empty(m, k, h.act()), w = h.empty(n, k, h.act()), o = h.empty(m, n, h.act());
             h.be().fill_random(x.t, 1, 1.0f, 0.f, 0, 0);
             h.be().fill_random(w.t, 2, 0.05f, 0.f, 0, 0);
             Linear lin{w.t, {}, 7};
             std::optional<Dev> q, sc;
             if (weights == "fp8") {
               q = h.empty(n, k, DType::F8E4M3);
               sc = h.empty((n + B - 1) / B, (k + B - 1) / B, DType::F32);
               h.be().quantize_fp8(w.t, q->t, sc->t);
               lin = Linear{q->t, sc->t, 7};
             }
             h.be().linear(x.t, lin, nullptr, o.t);
             h.be().synchronize();
             const auto t0 = std::chrono::steady_clock::now();
             for (int i = 0; i < repeats; ++i) h.be().linear(x.t, lin, nullptr, o.t);
             h.be().synchronize();
             return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / repeats;
           }, "m"_a, "n"_a, "k"_a, "weights"_a = "act", "repeats"_a = 20)
      // An FP8 linear (w: values exactly representable in e4m3, scale fp32 [ceil(N / 2^row_shift), ceil(K / 128)])
      // through op: linear, linear_add (onto res), norm_linear (norm_w None: a unit gain), linear_silu_mul or
      // norm_linear_silu_mul.
      .def("fp8_linear",
           [](OpHarness& h, const std::string& op, F32In x, F32In w, F32In scale, int shift,
              std::optional<F32In> bias, std::optional<F32In> res, std::optional<F32In> norm_w, float eps,
              bool f32_out) {
             Dev xd = h.up(x, h.act()), wdv = h.up(w, DType::F8E4M3), sd = h.up(scale, DType::F32);
             Linear lin{wdv.t, sd.t, shift};
             std::optional<Dev> bd;
             if (bias) bd = h.up(*bias, DType::F32);
             const Tensor* bp = bd ? &bd->t : nullptr;
             const int64_t M = xd.t.rows, N = wdv.t.rows;
             const DType od = f32_out ? DType::F32 : h.act();
             Dev nw = h.norm_gain(norm_w, xd.t.cols), hd = h.empty(M, xd.t.cols, h.act());
             const RmsNorm norm{nw.t, eps, false, !norm_w};
             if (op == "linear" || op == "norm_linear") {
               Dev o = h.empty(M, N, od);
               if (op == "linear") h.be().linear(xd.t, lin, bp, o.t);
               else h.be().norm_linear(xd.t, norm, lin, bp, hd.t, o.t);
               return h.down(o.t);
             }
             if (op == "linear_add") {
               QRT_CHECK_ARG(res.has_value(), "linear_add needs res");
               Dev o = h.up(*res, h.act());
               h.be().linear_add(xd.t, lin, o.t);
               return h.down(o.t);
             }
             QRT_CHECK_ARG(op == "linear_silu_mul" || op == "norm_linear_silu_mul", "unknown op ", op);
             Dev gu = h.empty(M, N, h.act()), o = h.empty(M, N / 2, h.act());
             if (op == "linear_silu_mul") h.be().linear_silu_mul(xd.t, lin, gu.t, o.t);
             else h.be().norm_linear_silu_mul(xd.t, norm, lin, hd.t, gu.t, o.t);
             return h.down(o.t);
           }, "op"_a, "x"_a, "w"_a, "scale"_a, "row_shift"_a = 7, "bias"_a.none() = nb::none(),
           "res"_a.none() = nb::none(), "norm_w"_a.none() = nb::none(), "eps"_a = 1e-6f, "f32_out"_a = false)
      // Backend::quantize_fp8 of src (uploaded as src_dtype): (the e4m3 values as float32, the scales).
      .def("quantize_fp8",
           [](OpHarness& h, F32In src, const std::string& src_dtype) {
             Dev sd = h.up(src, parse_dtype(src_dtype));
             const int64_t R = sd.t.rows, C = sd.t.cols, B = kFp8Block;
             Dev q = h.empty(R, C, DType::F8E4M3), sc = h.empty((R + B - 1) / B, (C + B - 1) / B, DType::F32);
             h.be().quantize_fp8(sd.t, q.t, sc.t);
             return std::make_pair(h.down(q.t), h.down(sc.t));
           }, "src"_a, "src_dtype"_a = "float32")
      .def("scale_columns",
           [](OpHarness& h, F32In w, F32In gain, bool zc) {
             Dev wdv = h.up(w, h.act()), g = h.up(gain, DType::F32);
             h.be().scale_columns(wdv.t, g.t, zc);
             return h.down(wdv.t);
           }, "w"_a, "gain"_a, "zero_centred"_a = false)
      // norm_w None: a unit gain (RmsNorm::unit_gain, as after folding the gain into w).
      .def("norm_linear",
           [](OpHarness& h, F32In x, std::optional<F32In> norm_w, float eps, F32In w, std::optional<F32In> bias,
              bool f32_out) {
             Dev xd = h.up(x, h.act()), nw = h.norm_gain(norm_w, xd.t.cols), wdv = h.up(w, h.act());
             std::optional<Dev> bd;
             if (bias) bd = h.up(*bias, DType::F32);
             Dev hd = h.empty(xd.t.rows, xd.t.cols, h.act());
             Dev o = h.empty(xd.t.rows, wdv.t.rows, f32_out ? DType::F32 : h.act());
             Linear lin;
             lin.w = wdv.t;
             h.be().norm_linear(xd.t, RmsNorm{nw.t, eps, false, !norm_w}, lin, bd ? &bd->t : nullptr, hd.t, o.t);
             return h.down(o.t);
           }, "x"_a, "norm_w"_a.none(), "eps"_a, "w"_a, "bias"_a.none(), "f32_out"_a = false)
      .def("norm_linear_silu_mul",
           [](OpHarness& h, F32In x, std::optional<F32In> norm_w, float eps, F32In w) {
             Dev xd = h.up(x, h.act()), nw = h.norm_gain(norm_w, xd.t.cols), wdv = h.up(w, h.act());
             Dev hd = h.empty(xd.t.rows, xd.t.cols, h.act());
             Dev gu = h.empty(xd.t.rows, wdv.t.rows, h.act());
             Dev o = h.empty(xd.t.rows, wdv.t.rows / 2, h.act());
             Linear lin;
             lin.w = wdv.t;
             h.be().norm_linear_silu_mul(xd.t, RmsNorm{nw.t, eps, false, !norm_w}, lin, hd.t, gu.t, o.t);
             return h.down(o.t);
           }, "x"_a, "norm_w"_a.none(), "eps"_a, "gate_up"_a)
      .def("linear_silu_mul",
           [](OpHarness& h, F32In x, F32In w) {
             Dev xd = h.up(x, h.act()), wdv = h.up(w, h.act());
             Dev gu = h.empty(xd.t.rows, wdv.t.rows, h.act());
             Dev o = h.empty(xd.t.rows, wdv.t.rows / 2, h.act());
             Linear lin;
             lin.w = wdv.t;
             h.be().linear_silu_mul(xd.t, lin, gu.t, o.t);
             return h.down(o.t);
           }, "x"_a, "gate_up"_a)
      .def("silu_mul",
           [](OpHarness& h, F32In gu) {
             Dev g = h.up(gu, h.act());
             Dev o = h.empty(g.t.rows, g.t.cols / 2, h.act());
             h.be().silu_mul(g.t, o.t);
             return h.down(o.t);
           })
      .def("attention",
           [](OpHarness& h, F32In q, F32In k, F32In v, F32In kc, F32In vc, I32In q_start, I32In ctx_len,
              I32In page_table, I32In kv_rows, int page_size, int hq, int hkv, int hd, float scale,
              const std::string& kv_dtype) {
             Dev qd = h.up(q, h.act()), kd = h.up(k, h.act()), vd = h.up(v, h.act());
             OpHarness::Cache c = h.cache(kc, vc, h.kv(kv_dtype), hkv);
             const auto batch = h.batch(q_start, ctx_len, page_table, kv_rows, page_size, qd.t.rows);
             const AttnBatch& b = batch.b;
             h.be().write_kv(kd.t, vd.t, b, c.layer);
             Dev o = h.empty(qd.t.rows, qd.t.cols, h.act());
             AttnShape sh{hq, hkv, hd, scale};
             h.be().attention(qd.t, c.layer, b, sh, o.t);
             return std::make_tuple(h.down(o.t), h.down_kv(c.k, c.k_scale), h.down_kv(c.v, c.v_scale));
           }, "q"_a, "k"_a, "v"_a, "k_cache"_a, "v_cache"_a, "q_start"_a, "ctx_len"_a, "page_table"_a, "kv_rows"_a,
           "page_size"_a, "q_heads"_a, "kv_heads"_a, "head_dim"_a, "scale"_a, "kv_dtype"_a = "")
      .def("sparse_attention",
           [](OpHarness& h, F32In q, F32In kc, F32In vc, I32In q_start, I32In ctx_len, I32In page_table,
              int page_size, int hq, int hkv, int hd, float scale, int budget_pages, int sink_pages,
              int window_pages, const std::string& kv_dtype) {
             // Summaries of every page the sequences hold (a batch writing all of their rows), then the lists
             // and the attention over them. Returns (out, pages [S * hkv, max_pages], keys [1, S * hkv],
             // summary [2 * cache pages, hkv * hd]).
             Dev qd = h.up(q, h.act());
             OpHarness::Cache c = h.cache(kc, vc, h.kv(kv_dtype), hkv);
             const int64_t kv_cols = int64_t(hkv) * hd, cache_rows = c.k.t.rows;
             QRT_CHECK_ARG(cache_rows % page_size == 0, "cache rows must be whole pages");
             KvLayer cache = c.layer;
             cache.summary_dtype = c.layer.fp8() ? h.act() : c.layer.dtype;
             Dev sum = h.empty(2 * (cache_rows / page_size), kv_cols, cache.summary_dtype);
             cache.summary = sum.t.data;
             const int S = int(ctx_len.size()), P = S ? int(page_table.size()) / S : 0;
             std::vector<int32_t> rows;
             for (int si = 0; si < S; ++si)
               for (int j = 0; j < ctx_len.data()[si]; ++j)
                 rows.push_back(page_table.data()[size_t(si) * P + j / page_size] * page_size + j % page_size);
             Dev rows_d = h.empty(1, std::max<int64_t>(1, int64_t(rows.size())), DType::I32);
             if (!rows.empty()) h.be().upload(rows_d.t.data, rows.data(), rows.size() * 4);
             AttnBatch all;
             all.num_tokens = int(rows.size());
             all.kv_rows = rows_d.t.ptr<int32_t>();
             all.page_size = page_size;
             h.be().summarize_pages(cache, all, int(kv_cols));
             const auto batch = h.batch(q_start, ctx_len, page_table, page_table, page_size, qd.t.rows);
             Dev scores = h.empty(int64_t(S) * hkv, std::max(P, 1), DType::F32);
             Dev pages = h.empty(int64_t(S) * hkv, std::max(P, 1), DType::I32);
             Dev keys = h.empty(1, std::max<int64_t>(1, int64_t(S) * hkv), DType::I32);
             AttnShape sh{hq, hkv, hd, scale};
             SparseAttention rule{budget_pages, sink_pages, window_pages};
             h.be().select_pages(qd.t, cache, batch.b, sh, rule, scores.t.ptr<float>(), pages.t.ptr<int32_t>(),
                                 keys.t.ptr<int32_t>());
             AttnBatch b = batch.b;
             b.page_table = pages.t.ptr<int32_t>();
             b.ctx_len = keys.t.ptr<int32_t>();
             b.head_tables = true;
             Dev o = h.empty(qd.t.rows, qd.t.cols, h.act());
             h.be().attention(qd.t, cache, b, sh, o.t);
             return std::make_tuple(h.down(o.t), h.down_ids(pages.t), h.down_ids(keys.t), h.down(sum.t));
           }, "q"_a, "k_cache"_a, "v_cache"_a, "q_start"_a, "ctx_len"_a, "page_table"_a, "page_size"_a,
           "q_heads"_a, "kv_heads"_a, "head_dim"_a, "scale"_a, "budget_pages"_a, "sink_pages"_a, "window_pages"_a,
           "kv_dtype"_a = "")
      .def("finish_qkv",
           [](OpHarness& h, F32In qkv, F32In kc, F32In vc, I32In kv_rows, I32In positions, F32In cs, int hq, int hkv,
              int hd, std::optional<F32In> q_norm, std::optional<F32In> k_norm, float eps) {
             Dev x = h.up(qkv, h.act()), kcd = h.up(kc, h.act()), vcd = h.up(vc, h.act());
             Dev kr = h.up_ids(kv_rows), pd = h.up_ids(positions), cd = h.up(cs, DType::F32);
             std::optional<Dev> qn, kn;
             if (q_norm) qn = h.up(*q_norm, DType::F32);
             if (k_norm) kn = h.up(*k_norm, DType::F32);
             AttnBatch b;
             b.num_tokens = int(x.t.rows);
             b.kv_rows = kr.t.ptr<int32_t>();
             AttnShape sh{hq, hkv, hd, 1.0f};
             RopeTable tab{cd.t.ptr<float>(), int(cd.t.cols), int(cd.t.rows)};
             KvLayer cache{kcd.t.data, vcd.t.data, h.act()};
             h.be().finish_qkv(x.t, sh, qn ? &qn->t : nullptr, kn ? &kn->t : nullptr, eps, false, pd.t.ptr<int32_t>(),
                               tab, b, cache);
             return std::make_tuple(h.down(x.t), h.down(kcd.t), h.down(vcd.t));
           }, "qkv"_a, "k_cache"_a, "v_cache"_a, "kv_rows"_a, "positions"_a, "cos_sin"_a, "q_heads"_a, "kv_heads"_a,
           "head_dim"_a, "q_norm"_a.none(), "k_norm"_a.none(), "eps"_a)
      .def("qkv_attention",
           [](OpHarness& h, F32In qkv, F32In kc, F32In vc, I32In q_start, I32In ctx_len, I32In page_table,
              I32In kv_rows, int page_size, I32In positions, F32In cs, int hq, int hkv, int hd, float scale,
              std::optional<F32In> q_norm, std::optional<F32In> k_norm, float eps, const std::string& kv_dtype) {
             Dev x = h.up(qkv, h.act());
             OpHarness::Cache c = h.cache(kc, vc, h.kv(kv_dtype), hkv);
             const auto batch = h.batch(q_start, ctx_len, page_table, kv_rows, page_size, x.t.rows);
             const AttnBatch& b = batch.b;
             Dev pd = h.up_ids(positions), cd = h.up(cs, DType::F32);
             std::optional<Dev> qn, kn;
             if (q_norm) qn = h.up(*q_norm, DType::F32);
             if (k_norm) kn = h.up(*k_norm, DType::F32);
             AttnShape sh{hq, hkv, hd, scale};
             RopeTable tab{cd.t.ptr<float>(), int(cd.t.cols), int(cd.t.rows)};
             Dev o = h.empty(x.t.rows, int64_t(hq) * hd, h.act());
             h.be().qkv_attention(x.t, sh, qn ? &qn->t : nullptr, kn ? &kn->t : nullptr, eps, false,
                                  pd.t.ptr<int32_t>(), tab, b, c.layer, o.t);
             return std::make_tuple(h.down(o.t), h.down_kv(c.k, c.k_scale), h.down_kv(c.v, c.v_scale));
           }, "qkv"_a, "k_cache"_a, "v_cache"_a, "q_start"_a, "ctx_len"_a, "page_table"_a, "kv_rows"_a,
           "page_size"_a, "positions"_a, "cos_sin"_a, "q_heads"_a, "kv_heads"_a, "head_dim"_a, "scale"_a,
           "q_norm"_a.none(), "k_norm"_a.none(), "eps"_a, "kv_dtype"_a = "")
      .def("sigmoid_mul",
           [](OpHarness& h, F32In x, F32In gate) {
             Dev xd = h.up(x, h.act()), g = h.up(gate, h.act());
             h.be().sigmoid_mul(xd.t, g.t);
             return h.down(xd.t);
           })
      .def("gated_rms_norm",
           [](OpHarness& h, F32In x, F32In z, F32In w, float eps, int hd) {
             Dev xd = h.up(x, h.act()), zd = h.up(z, h.act()), wd = h.up(w, DType::F32);
             h.be().gated_rms_norm(xd.t, zd.t, wd.t, eps, hd);
             return h.down(xd.t);
           })
      // conv_state [slots, (kernel - 1) * conv_cols] in the activation dtype; returns (out, conv_state after).
      .def("causal_conv1d",
           [](OpHarness& h, F32In x, F32In w, F32In conv_state, I32In q_start, I32In ctx_len, I32In slots,
              int k_heads, int v_heads, int k_dim, int v_dim, int kernel) {
             Dev xd = h.up(x, h.act()), wd = h.up(w, h.act()), cs = h.up(conv_state, h.act());
             const auto batch = h.state_batch(q_start, ctx_len, slots, xd.t.rows);
             DeltaNetShape sh{k_heads, v_heads, k_dim, v_dim, kernel};
             StateLayer st{cs.t.data, nullptr, h.act()};
             Dev o = h.empty(xd.t.rows, xd.t.cols, h.act());
             h.be().causal_conv1d(xd.t, wd.t, batch.b, sh, st, o.t);
             return std::make_pair(h.down(o.t), h.down(cs.t));
           }, "x"_a, "w"_a, "conv_state"_a, "q_start"_a, "ctx_len"_a, "slots"_a, "k_heads"_a, "v_heads"_a,
           "k_dim"_a, "v_dim"_a, "kernel"_a)
      // state [slots, v_heads * k_dim * v_dim] fp32; returns (out, state after).
      .def("gated_delta_rule",
           [](OpHarness& h, F32In qkv, F32In a, F32In b, F32In a_log, F32In dt_bias, F32In state, I32In q_start,
              I32In ctx_len, I32In slots, int k_heads, int v_heads, int k_dim, int v_dim) {
             Dev xd = h.up(qkv, h.act()), ad = h.up(a, h.act()), bd = h.up(b, h.act());
             Dev al = h.up(a_log, DType::F32), dt = h.up(dt_bias, DType::F32), sd = h.up(state, DType::F32);
             const auto batch = h.state_batch(q_start, ctx_len, slots, xd.t.rows);
             DeltaNetShape sh{k_heads, v_heads, k_dim, v_dim, 0};
             StateLayer st{nullptr, sd.t.ptr<float>(), h.act()};
             Dev o = h.empty(xd.t.rows, sh.v_cols(), h.act());
             h.be().gated_delta_rule(xd.t, ad.t, bd.t, al.t, dt.t, batch.b, sh, st, o.t);
             return std::make_pair(h.down(o.t), h.down(sd.t));
           }, "qkv"_a, "a"_a, "b"_a, "a_log"_a, "dt_bias"_a, "state"_a, "q_start"_a, "ctx_len"_a, "slots"_a,
           "k_heads"_a, "v_heads"_a, "k_dim"_a, "v_dim"_a)
      .def("gather_rows",
           [](OpHarness& h, F32In x, I32In rows) {
             Dev xd = h.up(x, h.act()), rd = h.up_ids(rows);
             Dev o = h.empty(int64_t(rows.size()), xd.t.cols, h.act());
             h.be().gather_rows(xd.t, rd.t.ptr<int32_t>(), o.t);
             return h.down(o.t);
           })
      .def("add",
           [](OpHarness& h, F32In x, F32In y) {
             Dev xd = h.up(x, h.act()), yd = h.up(y, h.act());
             h.be().add(xd.t, yd.t);
             return h.down(xd.t);
           })
      .def("fill_random",
           [](OpHarness& h, int64_t rows, int64_t cols, uint64_t seed, float scale, float offset, const std::string& dt) {
             Dev o = h.empty(rows, cols, parse_dtype(dt));
             h.be().fill_random(o.t, seed, scale, offset, 0, 0);
             return h.down(o.t);
           })
      .def("sample", [](OpHarness& h, F32In logits, nb::list rows) {
        Dev l = h.up(logits, DType::F32);
        std::vector<SampleRow> rs;
        for (nb::handle item : rows) {
          nb::dict d = nb::cast<nb::dict>(item);
          SampleRow r;
          auto get = [&](const char* k) -> nb::object { return d.contains(k) ? nb::object(d[k]) : nb::object(); };
          if (auto o = get("temperature"); o.is_valid()) r.temperature = nb::cast<float>(o);
          if (auto o = get("top_k"); o.is_valid()) r.top_k = nb::cast<int>(o);
          if (auto o = get("top_p"); o.is_valid()) r.top_p = nb::cast<float>(o);
          if (auto o = get("min_p"); o.is_valid()) r.min_p = nb::cast<float>(o);
          if (auto o = get("repetition_penalty"); o.is_valid()) r.repetition_penalty = nb::cast<float>(o);
          if (auto o = get("presence_penalty"); o.is_valid()) r.presence_penalty = nb::cast<float>(o);
          if (auto o = get("frequency_penalty"); o.is_valid()) r.frequency_penalty = nb::cast<float>(o);
          if (auto o = get("seed"); o.is_valid()) r.seed = nb::cast<uint64_t>(o);
          if (auto o = get("draw"); o.is_valid()) r.draw = nb::cast<int64_t>(o);
          if (auto o = get("num_logprobs"); o.is_valid()) r.num_logprobs = nb::cast<int>(o);
          if (auto o = get("seen_tokens"); o.is_valid()) r.seen_tokens = nb::cast<std::vector<int32_t>>(o);
          if (auto o = get("output_tokens"); o.is_valid()) r.output_tokens = nb::cast<std::vector<int32_t>>(o);
          if (auto o = get("output_counts"); o.is_valid()) r.output_counts = nb::cast<std::vector<int32_t>>(o);
          if (auto o = get("banned_tokens"); o.is_valid()) r.banned_tokens = nb::cast<std::vector<int32_t>>(o);
          rs.push_back(std::move(r));
        }
        SampleResult res;
        h.be().sample(l.t, rs, res);
        nb::dict out;
        const size_t R = res.tokens.size(), n = size_t(res.max_n);
        out["tokens"] = nb::cast(res.tokens);
        out["logprobs"] = nb::cast(res.logprobs);
        nb::list ids, lps;
        for (size_t r = 0; r < R; ++r) {
          ids.append(nb::cast(std::vector<int32_t>(res.top_ids.begin() + r * n, res.top_ids.begin() + (r + 1) * n)));
          lps.append(nb::cast(std::vector<float>(res.top_logprobs.begin() + r * n, res.top_logprobs.begin() + (r + 1) * n)));
        }
        out["top_ids"] = ids;
        out["top_logprobs"] = lps;
        return out;
      });
}

}  // namespace qrt
