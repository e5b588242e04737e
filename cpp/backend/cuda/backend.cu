// CudaBackend: memory, transfers, graphs and op dispatch; the plugin's backend entry points.
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/fp8.cuh"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

namespace qrt::cuda {

bool chained_launch_supported() {
  static const bool allowed = [] {
    const char* e = std::getenv("QWEN_RT_PDL");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  thread_local int dev = -1;
  thread_local bool ok = false;
  int cur = 0;
  if (!allowed || cudaGetDevice(&cur) != cudaSuccess) return false;
  if (cur != dev) {
    int major = 0;
    ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, cur) == cudaSuccess && major >= 9;
    dev = cur;
  }
  return ok;
}

void CudaBackend::set_device() const { check(cudaSetDevice(dev_), "cudaSetDevice"); }

CudaBackend::CudaBackend(int device, DType act) : dev_(device), act_(act) {
  QRT_CHECK(act == DType::F32 || act == DType::F16 || act == DType::BF16,
            "cuda: unsupported activation dtype ", dtype_name(act));
  set_device();
  try {
    check(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, dev_), "device attributes");
    int major = 0, minor = 0;
    check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev_), "device attributes");
    check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev_), "device attributes");
    sm90_ = major == 9 && minor == 0;
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    check(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    gemm_.init(size_t(32) << 20);
    for (int i = 0; i < 2; ++i) {
      check(cudaMallocHost(&stage_[i], kStage), "cudaMallocHost (staging)");
      check(cudaEventCreateWithFlags(&stage_ev_[i], cudaEventDisableTiming), "cudaEventCreate");
      check(cudaEventCreateWithFlags(&sample_io_[i].sampled, cudaEventDisableTiming), "cudaEventCreate");
      check(cudaEventCreateWithFlags(&sample_io_[i].done, cudaEventDisableTiming), "cudaEventCreate");
    }
  } catch (...) {
    cleanup();  // gemm_ frees itself during unwinding
    throw;
  }
}

CudaBackend::~CudaBackend() { cleanup(); }

void CudaBackend::cleanup() noexcept {
  cudaSetDevice(dev_);
  if (stream_) cudaStreamSynchronize(stream_);
  if (copy_stream_) cudaStreamSynchronize(copy_stream_);
  if (move_stream_) cudaStreamSynchronize(move_stream_);
  drop_graphs();
  for (Scratch* s : {&w_conv_, &x_conv_, &fp8_x_, &attn_ws_, &sample_in_, &sample_stats_, &sample_x_,
                     &sample_io_[0].dev_out, &sample_io_[1].dev_out, &segments_, &move_segments_, &delta_chunks_}) {
    if (s->p) cudaFree(s->p);
    s->p = nullptr;
    s->bytes = 0;
  }
  for (void* p : retired_) cudaFree(p);
  retired_.clear();
  for (int i = 0; i < 2; ++i) {
    if (stage_[i]) cudaFreeHost(stage_[i]);
    if (stage_ev_[i]) cudaEventDestroy(stage_ev_[i]);
    stage_[i] = nullptr;
    stage_ev_[i] = nullptr;
    SampleIo& io = sample_io_[i];
    if (io.host) cudaFreeHost(io.host);
    if (io.sampled) cudaEventDestroy(io.sampled);
    if (io.done) cudaEventDestroy(io.done);
    io = SampleIo{};
  }
  if (move_table_host_) cudaFreeHost(move_table_host_);
  move_table_host_ = nullptr;
  move_table_bytes_ = 0;
  for (cudaEvent_t* e : {&step_begin_, &moves_done_}) {
    if (*e) cudaEventDestroy(*e);
    *e = nullptr;
  }
  if (move_stream_) cudaStreamDestroy(move_stream_);
  if (stream_) cudaStreamDestroy(stream_);
  if (copy_stream_) cudaStreamDestroy(copy_stream_);
  stream_ = copy_stream_ = move_stream_ = nullptr;
  // gemm_ (handle, workspace) is destroyed after this body, on the same device.
}

void CudaBackend::drop_graphs() noexcept {
  if (cudaSetDevice(dev_) != cudaSuccess) cudaGetLastError();
  for (auto g : graphs_) cudaGraphExecDestroy(g);  // a graph still running is freed when it completes
  graphs_.clear();
}

void CudaBackend::no_capture(const char* op) const {
  QRT_CHECK(!capturing_, "cuda ", op, ": not allowed while a graph is being captured");
}

void* CudaBackend::alloc(size_t bytes) {
  set_device();
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
  if (e != cudaSuccess) {
    cudaGetLastError();
    // Only an allocation failure is out of memory: after a kernel fault every call fails, and says so.
    if (e != cudaErrorMemoryAllocation)
      throw std::runtime_error(str_cat("cuda:", dev_, ": allocating ", bytes, " bytes failed: ", cudaGetErrorString(e)));
    size_t fr = 0, tot = 0;
    cudaMemGetInfo(&fr, &tot);
    throw std::runtime_error(str_cat("cuda:", dev_, ": out of memory allocating ", bytes, " bytes (",
                                     fr, " of ", tot, " bytes free): ", cudaGetErrorString(e)));
  }
  return p;
}

void CudaBackend::release(void* p) noexcept {
  if (!p) return;
  // After a device fault every call fails; the error is cleared so no later check names the wrong op.
  if (cudaSetDevice(dev_) != cudaSuccess || cudaFree(p) != cudaSuccess) cudaGetLastError();
}

void* CudaBackend::scratch(Scratch& s, size_t bytes, const char* what) {
  if (s.bytes >= bytes) return s.p;
  const size_t want = std::max(bytes, s.bytes * 2);
  if (s.p) {
    if (graphs_.empty() && !capturing_) {
      check(cudaStreamSynchronize(stream_), what);
      check(cudaStreamSynchronize(copy_stream_), what);
      if (move_stream_) check(cudaStreamSynchronize(move_stream_), what);
      check(cudaFree(s.p), what);
    } else {
      retired_.push_back(s.p);
    }
    s.p = nullptr;
    s.bytes = 0;
  }
  try {
    s.p = alloc(want);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(str_cat(e.what(), " (for the ", what, ")"));
  }
  s.bytes = want;
  return s.p;
}

void* CudaBackend::pinned_io(SampleIo& io, size_t bytes) {
  if (io.bytes >= bytes) return io.host;
  if (io.host) check(cudaFreeHost(io.host), "cudaFreeHost");
  io.host = nullptr;
  io.bytes = 0;
  const size_t want = std::max<size_t>(bytes, 1 << 16);
  check(cudaMallocHost(&io.host, want), "cudaMallocHost (sampling)");
  io.bytes = want;
  return io.host;
}

void CudaBackend::upload(void* dst, const void* host_src, size_t bytes) {
  set_device();
  no_capture("upload");
  // Through the two pinned staging buffers in turn; no wait beyond the copy that last used a buffer, so a
  // step's metadata goes up while the step before still runs.
  const char* src = static_cast<const char*>(host_src);
  char* d = static_cast<char*>(dst);
  for (size_t off = 0; off < bytes; off += kStage) {
    const int b = next_stage_;
    next_stage_ ^= 1;
    const size_t n = std::min(kStage, bytes - off);
    check(cudaEventSynchronize(stage_ev_[b]), "upload");
    std::memcpy(stage_[b], src + off, n);
    check(cudaMemcpyAsync(d + off, stage_[b], n, cudaMemcpyHostToDevice, stream_), "upload");
    check(cudaEventRecord(stage_ev_[b], stream_), "upload");
  }
}

void CudaBackend::download(void* host_dst, const void* src, size_t bytes) {
  set_device();
  no_capture("download");
  char* dst = static_cast<char*>(host_dst);
  const char* s = static_cast<const char*>(src);
  const size_t chunks = (bytes + kStage - 1) / kStage;
  for (size_t i = 0; i <= chunks; ++i) {
    if (i < chunks) {  // start chunk i (after the uploads that used the buffer)
      const size_t off = i * kStage, n = std::min(kStage, bytes - off);
      check(cudaEventSynchronize(stage_ev_[i & 1]), "download");
      check(cudaMemcpyAsync(stage_[i & 1], s + off, n, cudaMemcpyDeviceToHost, stream_), "download");
      check(cudaEventRecord(stage_ev_[i & 1], stream_), "download");
    }
    if (i > 0) {  // finish chunk i - 1
      const size_t j = i - 1, off = j * kStage, n = std::min(kStage, bytes - off);
      check(cudaEventSynchronize(stage_ev_[j & 1]), "download");
      std::memcpy(dst + off, stage_[j & 1], n);
    }
  }
}

void CudaBackend::fill_zero(void* p, size_t bytes) {
  set_device();
  if (bytes) check(cudaMemsetAsync(p, 0, bytes, stream_), "fill_zero");
}

void CudaBackend::copy(void* dst, const void* src, size_t bytes) {
  set_device();
  // Default: either end may be the host tier (mapped host memory).
  if (bytes) check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_), "copy");
}

void CudaBackend::copy_segments(const std::vector<CopySegment>& segs) {
  set_device();
  // One kernel for the list (a KV page move is a segment per layer and array: one cudaMemcpyAsync each cost more
  // in calls than in bytes); either end may be the host tier, read or written in place over the bus.
  if (segs.size() < 4) return Backend::copy_segments(segs);
  no_capture("copy_segments");
  const size_t bytes = segs.size() * sizeof(CopySegment);
  void* table = scratch(segments_, bytes, "copy_segments");
  upload(table, segs.data(), bytes);
  launch_copy_segments(static_cast<const CopySegment*>(table), int(segs.size()), stream_);
}

void CudaBackend::move_pages(const std::vector<CopySegment>& out, const std::vector<CopySegment>& in, bool beside) {
  set_device();
  no_capture("move_pages");
  // Beside the step before (the moves' own stream) only with QWEN_RT_MOVE_STREAM=1: not yet the default (its tests
  // pass on an H100; no long-context run has measured it). Read at every call (the tests set it).
  const char* own = std::getenv("QWEN_RT_MOVE_STREAM");
  beside = beside && own && std::strcmp(own, "1") == 0;
  if (!step_begin_) {
    check(cudaStreamCreateWithFlags(&move_stream_, cudaStreamNonBlocking), "cudaStreamCreate (page moves)");
    check(cudaEventCreateWithFlags(&step_begin_, cudaEventDisableTiming), "cudaEventCreate");
    check(cudaEventCreateWithFlags(&moves_done_, cudaEventDisableTiming), "cudaEventCreate");
  }
  if (!out.empty() || !in.empty()) {
    if (beside) {
      // After everything before the step in flight (and after the moves before these, on whichever stream).
      if (step_begin_recorded_) check(cudaStreamWaitEvent(move_stream_, step_begin_, 0), "move_pages");
      if (moves_recorded_) check(cudaStreamWaitEvent(move_stream_, moves_done_, 0), "move_pages");
      // One table for both lists: the previous beside moves have read theirs (its upload is done) before it is
      // written again.
      const size_t bytes = (out.size() + in.size()) * sizeof(CopySegment);
      if (moves_recorded_) check(cudaEventSynchronize(moves_done_), "move_pages");
      if (move_table_bytes_ < bytes) {
        if (move_table_host_) check(cudaFreeHost(move_table_host_), "move_pages");
        move_table_host_ = nullptr;
        check(cudaMallocHost(&move_table_host_, bytes), "cudaMallocHost (page moves)");
        move_table_bytes_ = bytes;
      }
      std::memcpy(move_table_host_, out.data(), out.size() * sizeof(CopySegment));
      std::memcpy(static_cast<char*>(move_table_host_) + out.size() * sizeof(CopySegment), in.data(),
                  in.size() * sizeof(CopySegment));
      void* table = scratch(move_segments_, bytes, "move_pages");
      check(cudaMemcpyAsync(table, move_table_host_, bytes, cudaMemcpyHostToDevice, move_stream_), "move_pages");
      const auto* t = static_cast<const CopySegment*>(table);
      if (!out.empty()) launch_copy_segments(t, int(out.size()), move_stream_);
      if (!in.empty()) launch_copy_segments(t + out.size(), int(in.size()), move_stream_);
      check(cudaEventRecord(moves_done_, move_stream_), "move_pages");
      check(cudaStreamWaitEvent(stream_, moves_done_, 0), "move_pages");  // the step's work after them
    } else {
      if (!out.empty()) copy_segments(out);
      if (!in.empty()) copy_segments(in);
      check(cudaEventRecord(moves_done_, stream_), "move_pages");
    }
    moves_recorded_ = true;
  }
  check(cudaEventRecord(step_begin_, stream_), "move_pages");  // the step's work begins here
  step_begin_recorded_ = true;
}

void* CudaBackend::alloc_host_tier(size_t bytes) {
  set_device();
  void* p = nullptr;
  const cudaError_t e = cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocMapped | cudaHostAllocPortable);
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw std::invalid_argument(str_cat("kv_offload_memory: pinning ", bytes, " bytes of host memory failed (",
                                        cudaGetErrorString(e), "); ask for less"));
  }
  std::memset(p, 0, bytes);
  return p;
}

void CudaBackend::release_host_tier(void* p) noexcept {
  if (p && cudaFreeHost(p) != cudaSuccess) cudaGetLastError();
}

void CudaBackend::synchronize() {
  set_device();
  check(cudaStreamSynchronize(stream_), "synchronize");
  check(cudaStreamSynchronize(copy_stream_), "synchronize");
  if (move_stream_) check(cudaStreamSynchronize(move_stream_), "synchronize");
}

void CudaBackend::memory_info(size_t* free_bytes, size_t* total_bytes) {
  set_device();
  check(cudaMemGetInfo(free_bytes, total_bytes), "cudaMemGetInfo");
}

void CudaBackend::fill_random(Tensor& t, uint64_t seed, float scale, float offset, int64_t row0, int64_t col0) {
  set_device();
  launch_fill_random(t, seed, scale, offset, row0, col0, stream_);
}

void CudaBackend::convert(const Tensor& src, Tensor& dst) {
  set_device();
  launch_convert(src, dst, stream_);
}

bool CudaBackend::folds_norm_gains() const { return gemv_folds_norms(); }

void CudaBackend::scale_columns(Tensor& w, const Tensor& gain, bool zero_centred) {
  set_device();
  launch_scale_columns(w, gain, zero_centred, stream_);
}

void CudaBackend::embedding(const int32_t* ids, const Tensor& table, Tensor& out) {
  set_device();
  launch_embedding(ids, table, out, stream_);
}

void CudaBackend::rms_norm(const Tensor& x, const Tensor& w, float eps, bool zc, Tensor& out) {
  set_device();
  launch_rms_norm(nullptr, x, w, eps, zc, nullptr, out, stream_);
}

void CudaBackend::add_rms_norm(Tensor& residual, const Tensor& x, const Tensor& w, float eps, bool zc,
                               Tensor& out) {
  set_device();
  launch_rms_norm(&residual, x, w, eps, zc, &residual, out, stream_);
}

void CudaBackend::head_rms_norm(Tensor& x, int head_dim, const Tensor& w, float eps, bool zc) {
  set_device();
  launch_head_rms_norm(x, head_dim, w, eps, zc, stream_);
}

void CudaBackend::rope(Tensor& x, int head_dim, const int32_t* positions, const RopeTable& table) {
  set_device();
  launch_rope(x, head_dim, positions, table, stream_);
}

void CudaBackend::linear(const Tensor& x, const Linear& lw, const Tensor* bias, Tensor& out) {
  matmul(x, lw, bias, out, false);
}

void CudaBackend::linear_add(const Tensor& x, const Linear& lw, Tensor& out) {
  QRT_CHECK(out.dtype == x.dtype, "cuda linear_add: out dtype ", dtype_name(out.dtype), " differs from x's ",
            dtype_name(x.dtype));
  matmul(x, lw, nullptr, out, true);
}

void CudaBackend::matmul(const Tensor& x, const Linear& lw, const Tensor* bias, Tensor& out, bool accumulate) {
  set_device();
  const Tensor& w = lw.w;
  QRT_CHECK(lw.fp8() || w.dtype != DType::F8E4M3, "cuda linear: float8_e4m3 weights without scales");
  if (lw.fp8()) {
    matmul_fp8(x, lw, bias, out, accumulate);
    return;
  }
  QRT_CHECK(x.dtype == DType::F32 || x.dtype == DType::F16 || x.dtype == DType::BF16,
            "cuda linear: unsupported activation dtype ", dtype_name(x.dtype));
  QRT_CHECK(out.dtype == x.dtype || out.dtype == DType::F32, "cuda linear: out dtype ", dtype_name(out.dtype),
            " is neither x's (", dtype_name(x.dtype), ") nor float32");
  QRT_CHECK(x.cols == w.cols && out.cols == w.rows && out.rows == x.rows, "cuda linear: shapes x [", x.rows, ",",
            x.cols, "] w [", w.rows, ",", w.cols, "] out [", out.rows, ",", out.cols, "]");
  if (bias) QRT_CHECK(bias->cols >= w.rows, "cuda linear: bias has ", bias->cols, " columns for ", w.rows, " outputs");
  const int64_t M = x.rows, N = w.rows, K = w.cols;
  if (M == 0 || N == 0) return;
  const DType t = x.dtype;
  // Decode: a memory-bound GEMV.
  if (w.dtype == t && launch_gemv(x, w, bias, out, accumulate ? GemvEpilogue::Add : GemvEpilogue::Store, nullptr,
                                  num_sms_, stream_))
    return;
  if (w.dtype == t) {
    if (!gemm_.run(t, M, N, K, x.data, x.stride, w.data, w.stride, out.data, out.stride, bias ? bias->data : nullptr,
                   bias ? bias->dtype : t, stream_, out.dtype, accumulate))
      launch_add_bias(out, *bias, stream_);
    return;
  }
  QRT_CHECK(!(t == DType::F16 && w.dtype == DType::BF16),
            "cuda linear: bfloat16 weights with float16 activations are not supported (use bfloat16)");
  if (t == DType::F32 && w.dtype == DType::BF16) {
    // The ops.h contract: bf16 weights multiply bf16 activations (x rounded), fp32 accumulation.
    void* xb = scratch(x_conv_, size_t(M * K * 2), "linear activation conversion");
    Tensor xs(xb, w.dtype, M, K);
    launch_convert(x, xs, stream_);
    if (!gemm_.run(w.dtype, M, N, K, xb, K, w.data, w.stride, out.data, out.stride, bias ? bias->data : nullptr,
                   bias ? bias->dtype : t, stream_, out.dtype, accumulate))
      launch_add_bias(out, *bias, stream_);
    return;
  }
  // Weights of another dtype: converted row blocks.
  gemm_row_blocks(x, N, bias, out, accumulate, "linear weight conversion", [&](int64_t n0, Tensor& dst) {
    launch_convert(w.row_slice(n0, dst.rows), dst, stream_);
  });
}

template <typename Fill>
void CudaBackend::gemm_row_blocks(const Tensor& x, int64_t N, const Tensor* bias, Tensor& out, bool accumulate,
                                  const char* what, Fill&& fill) {
  const DType t = x.dtype;
  const int64_t M = x.rows, K = x.cols, es = int64_t(dtype_size(t)), bes = bias ? int64_t(dtype_size(bias->dtype)) : 0;
  int64_t rows_per = std::max<int64_t>(64, (int64_t(64) << 20) / std::max<int64_t>(1, K * es) / 64 * 64);
  rows_per = std::min(rows_per, N);
  void* buf = scratch(w_conv_, size_t(rows_per * K * es), what);
  for (int64_t n0 = 0; n0 < N; n0 += rows_per) {
    const int64_t nc = std::min(rows_per, N - n0);
    Tensor dst(buf, t, nc, K);
    fill(n0, dst);
    Tensor o = out.col_slice(n0, nc);
    const void* bp = bias ? static_cast<const char*>(bias->data) + n0 * bes : nullptr;
    if (!gemm_.run(t, M, nc, K, x.data, x.stride, buf, K, o.data, o.stride, bp, bias ? bias->dtype : t, stream_,
                   out.dtype, accumulate)) {
      Tensor bs(const_cast<void*>(bp), bias->dtype, 1, nc);
      launch_add_bias(o, bs, stream_);
    }
  }
}

void CudaBackend::matmul_fp8(const Tensor& x, const Linear& lw, const Tensor* bias, Tensor& out, bool accumulate) {
  const Tensor& w = lw.w;
  check_fp8_linear(lw);
  check_act(x, "linear");
  QRT_CHECK(out.dtype == x.dtype || out.dtype == DType::F32, "cuda linear: out dtype ", dtype_name(out.dtype),
            " is neither x's (", dtype_name(x.dtype), ") nor float32");
  QRT_CHECK(x.cols == w.cols && out.cols == w.rows && out.rows == x.rows, "cuda linear: shapes x [", x.rows, ",",
            x.cols, "] w [", w.rows, ",", w.cols, "] out [", out.rows, ",", out.cols, "]");
  const int64_t M = x.rows, N = w.rows, K = w.cols;
  if (M == 0 || N == 0) return;
  // Decode: the weight-only GEMV, dequantizing in registers.
  if (launch_gemv_fp8(x, lw, bias, out, accumulate ? GemvEpilogue::Add : GemvEpilogue::Store, fp8_gemv_rows(x, lw),
                      stream_))
    return;
  // Larger batches of 16-bit activations on Hopper: W8A8, the activations quantized per row and 128 columns (the
  // dynamic scheme Qwen's FP8 checkpoints name), CUTLASS's blockwise-scaled GEMM (fp8_gemm_sm90.cu; 1.38x / 1.13x
  // the dequantizing path's Qwen3.8-27B prefill at 2k / 8k tokens on the H100), the activations' scales rows-fastest
  // per 128-column group, M4 = M rounded up to 4 apart (TMA loads them: 16-byte aligned), the weights' block scales
  // transposed (N blocks fastest). QWEN_RT_FP8_GEMM=dequant keeps the weight-only product.
  if (fp8_w8a8(x, lw) && out.dtype == x.dtype && aligned16(out.data, out.stride * int64_t(dtype_size(out.dtype)))) {
    const int64_t groups = K / kFp8Block, nb = N / kFp8Block, m4 = (M + 3) / 4 * 4;
    const size_t x_bytes = size_t(M * K + 15) / 16 * 16, s_bytes = size_t(groups * m4 * 4);
    const size_t w_bytes = size_t(nb * groups * 4 + 15) / 16 * 16, ws_bytes = size_t(4) << 20;
    char* buf = static_cast<char*>(scratch(fp8_x_, x_bytes + s_bytes + w_bytes + ws_bytes, "fp8 activations"));
    float* x_scale = reinterpret_cast<float*>(buf + x_bytes);
    float* w_t = reinterpret_cast<float*>(buf + x_bytes + s_bytes);
    launch_quantize_rows_fp8(x, reinterpret_cast<uint8_t*>(buf), x_scale, 1, m4, stream_);
    launch_transpose_scales(lw.scale, w_t, stream_);
    if (launch_fp8_block_gemm(M, N, K, buf, x_scale, m4, w.data, w.stride, w_t, out.data, out.stride, out.dtype,
                              accumulate, buf + x_bytes + s_bytes + w_bytes, ws_bytes, stream_)) {
      if (bias) launch_add_bias(out, *bias, stream_);
      return;
    }
  }
  // Otherwise: row blocks dequantized into x's dtype.
  gemm_row_blocks(x, N, bias, out, accumulate, "linear weight dequantization",
                  [&](int64_t n0, Tensor& dst) { launch_dequantize_fp8(lw, n0, dst, stream_); });
}

int CudaBackend::fp8_gemv_rows(const Tensor& x, const Linear& lw) const {
  return gemv_fp8_rows(x, lw, fp8_w8a8(x, lw));
}

bool CudaBackend::fp8_w8a8(const Tensor& x, const Linear& lw) const {
  const char* e = std::getenv("QWEN_RT_FP8_GEMM");  // read at every call, so the op tests can set it
  if (e && std::strcmp(e, "dequant") == 0) return false;
  const int64_t K = lw.w.cols, N = lw.w.rows;
  return sm90_ && x.dtype != DType::F32 && lw.scale_row_shift == 7 && K % kFp8Block == 0 && N % kFp8Block == 0 &&
         lw.scale.stride == K / kFp8Block && aligned16(lw.w.data, lw.w.stride);
}

void CudaBackend::quantize_fp8(const Tensor& src, Tensor& q, Tensor& scale) {
  set_device();
  launch_quantize_fp8(src, q, scale, stream_);
}

void CudaBackend::silu_mul(const Tensor& gate_up, Tensor& out) {
  set_device();
  launch_silu_mul(gate_up, out, stream_);
}

void CudaBackend::linear_silu_mul(const Tensor& x, const Linear& gate_up, Tensor& gate_up_out, Tensor& out) {
  // Decode: one gated GEMV (silu_mul in its epilogue); otherwise the composition.
  set_device();
  if (gate_up.fp8() ? launch_gemv_fp8(x, gate_up, nullptr, out, GemvEpilogue::SiluMul, fp8_gemv_rows(x, gate_up),
                                      stream_)
                    : launch_gemv(x, gate_up.w, nullptr, out, GemvEpilogue::SiluMul, nullptr, num_sms_, stream_))
    return;
  Backend::linear_silu_mul(x, gate_up, gate_up_out, out);
}

void CudaBackend::norm_linear(const Tensor& x, const RmsNorm& norm, const Linear& lw, const Tensor* bias, Tensor& h,
                              Tensor& out) {
  // Decode with a folded gain: the GEMV normalizes its input rows itself; otherwise the composition.
  set_device();
  if (lw.scale.empty() && launch_gemv(x, lw.w, bias, out, GemvEpilogue::Store, &norm, num_sms_, stream_)) return;
  Backend::norm_linear(x, norm, lw, bias, h, out);
}

void CudaBackend::norm_linear_silu_mul(const Tensor& x, const RmsNorm& norm, const Linear& gate_up, Tensor& h,
                                       Tensor& gate_up_out, Tensor& out) {
  set_device();
  if (gate_up.scale.empty() && launch_gemv(x, gate_up.w, nullptr, out, GemvEpilogue::SiluMul, &norm, num_sms_, stream_))
    return;
  Backend::norm_linear_silu_mul(x, norm, gate_up, h, gate_up_out, out);
}

void CudaBackend::finish_qkv(Tensor& qkv, const AttnShape& s, const Tensor* qn, const Tensor* kn, float eps, bool zc,
                             const int32_t* positions, const RopeTable& table, const AttnBatch& b, KvLayer& cache) {
  set_device();
  QRT_CHECK(qkv.cols == int64_t(s.q_heads + 2 * s.kv_heads) * s.head_dim, "cuda finish_qkv: qkv has ", qkv.cols,
            " columns for ", s.q_heads, " + 2 x ", s.kv_heads, " heads of ", s.head_dim);
  QRT_CHECK(b.kv_rows && qkv.rows <= b.num_tokens, "cuda finish_qkv: ", qkv.rows, " rows for a batch of ",
            b.num_tokens, " tokens");
  if (!launch_finish_qkv(qkv, s, qn, kn, eps, zc, positions, table, b, cache, stream_))
    Backend::finish_qkv(qkv, s, qn, kn, eps, zc, positions, table, b, cache);
}

void CudaBackend::write_kv(const Tensor& k, const Tensor& v, const AttnBatch& b, KvLayer& cache) {
  set_device();
  QRT_CHECK(k.rows == v.rows && k.cols == v.cols, "cuda write_kv: k and v differ in shape");
  QRT_CHECK(k.rows <= b.num_tokens || b.num_tokens == 0, "cuda write_kv: ", k.rows, " rows for ", b.num_tokens,
            " tokens");
  if (cache.fp8()) return launch_write_kv_fp8(k, v, b, cache, stream_);
  launch_copy_rows(k.data, k.dtype, k.stride, nullptr, cache.k, cache.dtype, k.cols, b.kv_rows, k.rows, k.cols,
                   stream_);
  launch_copy_rows(v.data, v.dtype, v.stride, nullptr, cache.v, cache.dtype, v.cols, b.kv_rows, v.rows, v.cols,
                   stream_);
}

AttnWorkspace CudaBackend::attn_workspace(const AttnBatch& b, const AttnShape& sh) {
  AttnWorkspace ws;
  ws.bytes = attn_workspace_bytes(b, sh, num_sms_);
  if (ws.bytes) ws.partial = static_cast<float*>(scratch(attn_ws_, ws.bytes, "attention workspace"));
  return ws;
}

void CudaBackend::qkv_attention(Tensor& qkv, const AttnShape& s, const Tensor* qn, const Tensor* kn, float eps,
                                bool zc, const int32_t* positions, const RopeTable& table, const AttnBatch& b,
                                KvLayer& cache, Tensor& out) {
  set_device();
  const QkvFinish fin{qn, kn, eps, zc, positions, &table};
  if (!launch_qkv_attention(qkv, fin, cache, b, s, out, attn_workspace(b, s), num_sms_, stream_))
    Backend::qkv_attention(qkv, s, qn, kn, eps, zc, positions, table, b, cache, out);
}

void CudaBackend::attention(const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& sh,
                            Tensor& out) {
  set_device();
  launch_attention(q, cache, b, sh, out, attn_workspace(b, sh), num_sms_, stream_);
}

void CudaBackend::sigmoid_mul(Tensor& x, const Tensor& gate) {
  set_device();
  launch_sigmoid_mul(x, gate, stream_);
}
void CudaBackend::causal_conv1d(const Tensor& x, const Tensor& w, const AttnBatch& b, const DeltaNetShape& s,
                                StateLayer& st, Tensor& out) {
  set_device();
  launch_causal_conv1d(x, w, b, s, st, out, stream_);
}
void CudaBackend::gated_delta_rule(const Tensor& qkv, const Tensor& a, const Tensor& bt, const Tensor& a_log,
                                   const Tensor& dt_bias, const AttnBatch& b, const DeltaNetShape& s, StateLayer& st,
                                   Tensor& out) {
  set_device();
  const DeltaRulePlan plan = plan_delta_rule(qkv, b, s, out);
  void* chunks = plan.scratch_bytes ? scratch(delta_chunks_, plan.scratch_bytes, "delta rule chunks") : nullptr;
  launch_gated_delta_rule(qkv, a, bt, a_log, dt_bias, b, s, st, out, plan, chunks, stream_);
}
void CudaBackend::summarize_pages(const KvLayer& cache, const AttnBatch& b, int kv_cols) {
  set_device();
  launch_summarize_pages(cache, b, kv_cols, stream_);
}
void CudaBackend::select_pages(const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& sh,
                               const SparseAttention& sp, float* scores, int32_t* pages, int32_t* keys) {
  set_device();
  launch_select_pages(q, cache, b, sh, sp, scores, pages, keys, stream_);
}
void CudaBackend::gated_rms_norm(Tensor& x, const Tensor& z, const Tensor& w, float eps, int head_dim) {
  set_device();
  launch_gated_rms_norm(x, z, w, eps, head_dim, stream_);
}
void CudaBackend::gather_rows(const Tensor& x, const int32_t* rows, Tensor& out) {
  set_device();
  QRT_CHECK(x.cols == out.cols, "cuda gather_rows: column mismatch");
  launch_copy_rows(x.data, x.dtype, x.stride, rows, out.data, out.dtype, out.stride, nullptr, out.rows, out.cols,
                   stream_);
}

void CudaBackend::add(Tensor& x, const Tensor& y) {
  set_device();
  launch_add(x, y, stream_);
}

void CudaBackend::fill_tokens(int32_t* ids, const int32_t* src_index, const int32_t* src, int n) {
  set_device();
  launch_fill_tokens(ids, src_index, src, n, stream_);
}

void CudaBackend::sample(const Tensor& logits, const std::vector<SampleRow>& rows, SampleResult& out) {
  // sample_finish takes the oldest started sampling: with one in flight, this call's result would not be it.
  QRT_CHECK(samples_started_ == samples_finished_, "cuda sample: called while a sample_start is unfinished");
  sample_start(logits, rows);
  sample_finish(out, 1e30);
}

void CudaBackend::reserve_sampling(int rows, int vocab) {
  set_device();
  scratch(sample_x_, size_t(rows) * size_t(vocab) * 4, "sampling scratch");
  scratch(sample_stats_, std::max<size_t>(sample_stats_bytes(rows, vocab), 16), "sampling scratch");
}

void CudaBackend::sample_start(const Tensor& logits, const std::vector<SampleRow>& rows) {
  set_device();
  no_capture("sample");
  QRT_CHECK(samples_started_ - samples_finished_ < 2, "cuda sample: two samplings are already in flight");
  QRT_CHECK(logits.dtype == DType::F32, "cuda sample: logits must be float32");
  const int64_t R = logits.rows, V = logits.cols;
  QRT_CHECK(int64_t(rows.size()) == R, "cuda sample: ", rows.size(), " parameter rows for ", R, " logit rows");
  QRT_CHECK(V > 0 && V < (int64_t(1) << 31), "cuda sample: bad vocabulary size ", V);
  int max_n = 0;
  for (auto& r : rows) max_n = std::max(max_n, r.num_logprobs);

  std::vector<SampleParamsDev> prm(R);
  std::vector<int32_t> lists;
  bool any_lists = false;
  for (int64_t i = 0; i < R; ++i) {
    const SampleRow& r = rows[i];
    QRT_CHECK(r.output_counts.size() == r.output_tokens.size(), "cuda sample: output_counts and output_tokens differ");
    SampleParamsDev& p = prm[i];
    p.inv_temperature = r.temperature == 0.0f ? 0.0f : 1.0f / r.temperature;
    p.top_p = r.top_p;
    p.min_p = r.min_p;
    p.repetition_penalty = r.repetition_penalty;
    p.presence_penalty = r.presence_penalty;
    p.frequency_penalty = r.frequency_penalty;
    p.top_k = r.top_k;
    p.num_logprobs = int(std::min<int64_t>(r.num_logprobs, V));
    p.seed = r.seed;
    p.draw = r.draw;
    p.banned_off = int(lists.size());
    p.banned_n = int(r.banned_tokens.size());
    lists.insert(lists.end(), r.banned_tokens.begin(), r.banned_tokens.end());
    const bool rep = r.repetition_penalty != 1.0f;
    p.seen_off = int(lists.size());
    p.seen_n = rep ? int(r.seen_tokens.size()) : 0;
    if (rep) lists.insert(lists.end(), r.seen_tokens.begin(), r.seen_tokens.end());
    const bool pf = r.presence_penalty != 0.0f || r.frequency_penalty != 0.0f;
    p.out_off = int(lists.size());
    p.out_n = pf ? int(r.output_tokens.size()) : 0;
    if (pf) {
      lists.insert(lists.end(), r.output_tokens.begin(), r.output_tokens.end());
      lists.insert(lists.end(), r.output_counts.begin(), r.output_counts.end());
    }
    p.has_lists = (p.banned_n || p.seen_n || p.out_n) ? 1 : 0;
    any_lists = any_lists || p.has_lists;
  }
  auto round16 = [](size_t n) { return (n + 15) / 16 * 16; };
  const size_t prm_bytes = round16(prm.size() * sizeof(SampleParamsDev));
  const size_t in_bytes = prm_bytes + round16(std::max<size_t>(lists.size(), 1) * 4);
  const size_t nn = size_t(R) * size_t(max_n);
  const size_t out_bytes = round16(size_t(std::max<int64_t>(R, 1)) * 4) * 2 + round16(nn * 4) * 2;
  SampleIo& io = sample_io_[samples_started_ & 1];
  char* host = static_cast<char*>(pinned_io(io, in_bytes + out_bytes));
  io.rows = R;
  io.max_n = max_n;
  io.out_off = in_bytes;
  io.lp_off = round16(size_t(std::max<int64_t>(R, 1)) * 4);
  io.ids_off = 2 * io.lp_off;
  io.tlp_off = io.ids_off + round16(nn * 4);
  std::memcpy(host, prm.data(), prm.size() * sizeof(SampleParamsDev));
  if (!lists.empty()) std::memcpy(host + prm_bytes, lists.data(), lists.size() * 4);
  char* din = static_cast<char*>(scratch(sample_in_, in_bytes, "sample"));
  // The results land in this parity's device buffer once its previous copy to the host is done.
  check(cudaStreamWaitEvent(stream_, io.done, 0), "sample");
  char* dout = static_cast<char*>(scratch(io.dev_out, out_bytes, "sample"));
  float* x = any_lists ? static_cast<float*>(scratch(sample_x_, size_t(R) * size_t(V) * 4, "sample")) : nullptr;
  void* stats = scratch(sample_stats_, std::max<size_t>(sample_stats_bytes(R, V), 16), "sample");
  if (R > 0) {
    check(cudaMemcpyAsync(din, host, in_bytes, cudaMemcpyHostToDevice, stream_), "sample upload");
    launch_sample(logits.ptr<float>(), R, V, logits.stride, reinterpret_cast<const SampleParamsDev*>(din),
                  reinterpret_cast<const int32_t*>(din + prm_bytes), stats, x, max_n, reinterpret_cast<int32_t*>(dout),
                  reinterpret_cast<float*>(dout + io.lp_off), reinterpret_cast<int32_t*>(dout + io.ids_off),
                  reinterpret_cast<float*>(dout + io.tlp_off), stream_);
  }
  // Test hook: QWEN_RT_TEST_STALL_MS=<ms> holds every sampling's completion back that long on the device
  // (a stand-in for a hung collective, for the bounded-wait tests).
  static const double stall_ms = [] {
    const char* e = std::getenv("QWEN_RT_TEST_STALL_MS");
    return e ? std::atof(e) : 0.0;
  }();
  if (stall_ms > 0) launch_stall(stall_ms, stream_);
  check(cudaEventRecord(io.sampled, stream_), "sample");
  check(cudaStreamWaitEvent(copy_stream_, io.sampled, 0), "sample");
  if (R > 0)
    check(cudaMemcpyAsync(host + in_bytes, dout, out_bytes, cudaMemcpyDeviceToHost, copy_stream_), "sample download");
  check(cudaEventRecord(io.done, copy_stream_), "sample");
  sampled_ = reinterpret_cast<const int32_t*>(dout);
  samples_started_++;
}

void CudaBackend::sample_finish(SampleResult& out, double timeout_s) {
  set_device();
  QRT_CHECK(samples_finished_ < samples_started_, "cuda sample_finish: no sampling in flight");
  SampleIo& io = sample_io_[samples_finished_ & 1];
  // Polled, so that a device that never finishes (a hung collective) becomes an error, not a hang.
  const auto t0 = std::chrono::steady_clock::now();
  for (int spins = 0;; ++spins) {
    const cudaError_t e = cudaEventQuery(io.done);
    if (e == cudaSuccess) break;
    // A fault in any kernel of the step (its forward or its sampling) surfaces here.
    if (e != cudaErrorNotReady) check(e, "step (a kernel of its forward or sampling)");
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (waited > timeout_s)
      throw std::runtime_error(str_cat(name(), ": a step did not finish within ", timeout_s,
                                       " s (a hung kernel or collective)"));
    if (spins < 2000) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  samples_finished_++;
  const int64_t R = io.rows;
  const size_t nn = size_t(R) * size_t(io.max_n);
  const char* h = static_cast<const char*>(io.host) + io.out_off;
  out.max_n = io.max_n;
  out.tokens.assign(reinterpret_cast<const int32_t*>(h), reinterpret_cast<const int32_t*>(h) + R);
  out.logprobs.assign(reinterpret_cast<const float*>(h + io.lp_off), reinterpret_cast<const float*>(h + io.lp_off) + R);
  out.top_ids.assign(reinterpret_cast<const int32_t*>(h + io.ids_off),
                     reinterpret_cast<const int32_t*>(h + io.ids_off) + nn);
  out.top_logprobs.assign(reinterpret_cast<const float*>(h + io.tlp_off),
                          reinterpret_cast<const float*>(h + io.tlp_off) + nn);
}

void CudaBackend::begin_capture() {
  set_device();
  no_capture("begin_capture");
  check(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed), "cudaStreamBeginCapture");
  capturing_ = true;
}

int CudaBackend::end_capture() {
  set_device();
  QRT_CHECK(capturing_, "cuda end_capture: no capture in progress");
  capturing_ = false;
  cudaGraph_t g = nullptr;
  check(cudaStreamEndCapture(stream_, &g), "cudaStreamEndCapture");
  cudaGraphExec_t exec = nullptr;
  const cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
  cudaGraphDestroy(g);
  check(e, "cudaGraphInstantiate");
  graphs_.push_back(exec);
  return int(graphs_.size()) - 1;
}

void CudaBackend::abort_capture() noexcept {
  if (!capturing_) return;
  capturing_ = false;
  cudaSetDevice(dev_);
  cudaGraph_t g = nullptr;
  if (cudaStreamEndCapture(stream_, &g) == cudaSuccess && g) cudaGraphDestroy(g);
  cudaGetLastError();  // an invalidated capture's error: the body's own error is the one reported
}

void CudaBackend::replay(int graph) {
  set_device();
  QRT_CHECK(graph >= 0 && graph < int(graphs_.size()), "cuda replay: no graph ", graph);
  check(cudaGraphLaunch(graphs_[graph], stream_), "cudaGraphLaunch");
}

}  // namespace qrt::cuda

// ---- plugin entry points ------------------------------------------------------------------------
namespace {
void write_err(char* err, size_t len, const char* msg) {
  if (err && len) std::snprintf(err, len, "%s", msg);
}
}  // namespace

#pragma GCC visibility push(default)
#include "backend/cuda/plugin.h"

extern "C" int qrt_cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

extern "C" int qrt_cuda_device_error(char* err, size_t err_len) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    write_err(err, err_len, qrt::str_cat(cudaGetErrorName(e), ": ", cudaGetErrorString(e)).c_str());
    return -1;
  }
  if (n == 0) {
    write_err(err, err_len, "no CUDA device");
    return -1;
  }
  return 0;
}

extern "C" qrt::Backend* qrt_cuda_make_backend(int device, int act_dtype, char* err, size_t err_len) {
  try {
    const int n = qrt_cuda_device_count();
    if (device < 0 || device >= n) {
      write_err(err, err_len, qrt::str_cat("cuda:", device, " does not exist (", n, " devices)").c_str());
      return nullptr;
    }
    const qrt::DType t = qrt::DType(act_dtype);
    if (t != qrt::DType::F32 && t != qrt::DType::F16 && t != qrt::DType::BF16) {
      write_err(err, err_len, qrt::str_cat("cuda: unsupported activation dtype code ", act_dtype).c_str());
      return nullptr;
    }
    return new qrt::cuda::CudaBackend(device, t);
  } catch (const std::exception& e) {
    write_err(err, err_len, e.what());
  } catch (...) {
    write_err(err, err_len, "cuda: unknown error creating the backend");
  }
  return nullptr;
}
#pragma GCC visibility pop
