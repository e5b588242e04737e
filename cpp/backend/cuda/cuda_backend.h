// CudaBackend: the Backend of one CUDA device. Ops are ordered on its compute stream; a copy stream
// takes each sampling's results to the host (the next step's kernels do not queue behind that copy).
// Internal to cpp/backend/cuda/; the engine reaches it only through plugin.h.
#pragma once
#include <cuda_runtime.h>

#include <vector>

#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/gemm.cuh"
#include "backend/ops.h"

namespace qrt::cuda {

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, DType act_dtype);
  ~CudaBackend() override;

  std::string name() const override { return "cuda:" + std::to_string(dev_); }
  DType act_dtype() const override { return act_; }
  int device() const { return dev_; }
  cudaStream_t stream() const { return stream_; }
  void set_device() const;

  void* alloc(size_t bytes) override;
  void release(void* p) noexcept override;
  void* alloc_host_tier(size_t bytes) override;
  void release_host_tier(void* p) noexcept override;
  void upload(void* dst, const void* host_src, size_t bytes) override;
  void download(void* host_dst, const void* src, size_t bytes) override;
  void fill_zero(void* p, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void copy_segments(const std::vector<CopySegment>& segs) override;
  void move_pages(const std::vector<CopySegment>& out, const std::vector<CopySegment>& in, bool beside) override;
  void synchronize() override;
  void memory_info(size_t* free_bytes, size_t* total_bytes) override;

  bool supports_head_dim(int d) const override { return d == 64 || d == 128 || d == 256; }
  // gdn.cu builds conv widths 2 to 4 and key head dims 16 to 256 in powers of two.
  bool supports_delta_net(const DeltaNetShape& s) const override {
    return s.conv_kernel >= 2 && s.conv_kernel <= 4 && (s.k_dim == 16 || s.k_dim == 32 || s.k_dim == 64 ||
                                                       s.k_dim == 128 || s.k_dim == 256);
  }
  void fill_random(Tensor& t, uint64_t seed, float scale, float offset, int64_t row0, int64_t col0) override;
  void convert(const Tensor& src, Tensor& dst) override;
  bool folds_norm_gains() const override;
  void scale_columns(Tensor& w, const Tensor& gain, bool zero_centred) override;
  void embedding(const int32_t* ids, const Tensor& table, Tensor& out) override;
  void rms_norm(const Tensor& x, const Tensor& w, float eps, bool zero_centred, Tensor& out) override;
  void add_rms_norm(Tensor& residual, const Tensor& x, const Tensor& w, float eps, bool zero_centred,
                    Tensor& out) override;
  void head_rms_norm(Tensor& x, int head_dim, const Tensor& w, float eps, bool zero_centred) override;
  void rope(Tensor& x, int head_dim, const int32_t* positions, const RopeTable& table) override;
  void linear(const Tensor& x, const Linear& w, const Tensor* bias, Tensor& out) override;
  void quantize_fp8(const Tensor& src, Tensor& q, Tensor& scale) override;
  void silu_mul(const Tensor& gate_up, Tensor& out) override;
  void linear_add(const Tensor& x, const Linear& w, Tensor& out) override;
  void linear_silu_mul(const Tensor& x, const Linear& gate_up, Tensor& gate_up_out, Tensor& out) override;
  void norm_linear(const Tensor& x, const RmsNorm& norm, const Linear& w, const Tensor* bias, Tensor& h,
                   Tensor& out) override;
  void norm_linear_silu_mul(const Tensor& x, const RmsNorm& norm, const Linear& gate_up, Tensor& h,
                            Tensor& gate_up_out, Tensor& out) override;
  void write_kv(const Tensor& k, const Tensor& v, const AttnBatch& batch, KvLayer& cache) override;
  void finish_qkv(Tensor& qkv, const AttnShape& s, const Tensor* q_norm, const Tensor* k_norm, float eps,
                  bool zero_centred, const int32_t* positions, const RopeTable& table, const AttnBatch& batch,
                  KvLayer& cache) override;
  void qkv_attention(Tensor& qkv, const AttnShape& s, const Tensor* q_norm, const Tensor* k_norm, float eps,
                     bool zero_centred, const int32_t* positions, const RopeTable& table, const AttnBatch& batch,
                     KvLayer& cache, Tensor& out) override;
  void attention(const Tensor& q, const KvLayer& cache, const AttnBatch& batch, const AttnShape& shape,
                 Tensor& out) override;
  void summarize_pages(const KvLayer& cache, const AttnBatch& batch, int kv_cols) override;
  void select_pages(const Tensor& q, const KvLayer& cache, const AttnBatch& batch, const AttnShape& shape,
                    const SparseAttention& sparse, float* scores, int32_t* pages, int32_t* keys) override;
  void sigmoid_mul(Tensor& x, const Tensor& gate) override;
  void causal_conv1d(const Tensor& x, const Tensor& w, const AttnBatch& batch, const DeltaNetShape& s,
                     StateLayer& state, Tensor& out) override;
  void gated_delta_rule(const Tensor& qkv, const Tensor& a, const Tensor& b, const Tensor& a_log,
                        const Tensor& dt_bias, const AttnBatch& batch, const DeltaNetShape& s, StateLayer& state,
                        Tensor& out) override;
  void gated_rms_norm(Tensor& x, const Tensor& z, const Tensor& w, float eps, int head_dim) override;
  void gather_rows(const Tensor& x, const int32_t* rows, Tensor& out) override;
  void add(Tensor& x, const Tensor& y) override;
  void fill_tokens(int32_t* ids, const int32_t* src_index, const int32_t* src, int n) override;
  void sample(const Tensor& logits, const std::vector<SampleRow>& rows, SampleResult& out) override;
  void sample_start(const Tensor& logits, const std::vector<SampleRow>& rows) override;
  void sample_finish(SampleResult& out, double timeout_s) override;
  const int32_t* sampled_tokens() const override { return sampled_; }
  void reserve_sampling(int rows, int vocab) override;

  bool supports_graphs() const override { return true; }
  void begin_capture() override;
  int end_capture() override;
  void replay(int graph) override;
  void drop_graphs() noexcept override;
  void abort_capture() noexcept override;

 private:
  // Device scratch that only grows. A buffer replaced while graphs may refer to it is kept until
  // destruction (captured graphs hold its address).
  struct Scratch {
    void* p = nullptr;
    size_t bytes = 0;
  };
  void* scratch(Scratch& s, size_t bytes, const char* what);
  Scratch segments_;  // copy_segments' table
  // move_pages beside the step before: their own stream, their segment tables (device, and pinned for the upload),
  // the event that marks where the last step's work began (recorded by every move_pages) and the moves' end.
  cudaStream_t move_stream_ = nullptr;
  Scratch move_segments_;
  void* move_table_host_ = nullptr;
  size_t move_table_bytes_ = 0;
  cudaEvent_t step_begin_ = nullptr, moves_done_ = nullptr;
  bool step_begin_recorded_ = false, moves_recorded_ = false;
  AttnWorkspace attn_workspace(const AttnBatch& b, const AttnShape& sh);  // the split workspace, grown to fit
  // linear (accumulate: linear_add).
  void matmul(const Tensor& x, const Linear& w, const Tensor* bias, Tensor& out, bool accumulate);
  void matmul_fp8(const Tensor& x, const Linear& w, const Tensor* bias, Tensor& out, bool accumulate);
  // out (+)= x @ w^T (+ bias) for weights not in x's dtype: fill(n0, dst) makes rows [n0, n0 + dst.rows) of w in x's
  // dtype in scratch (what: its name), at most 64 MiB at a time, one cuBLASLt GEMM each (backend.cu).
  template <typename Fill>
  void gemm_row_blocks(const Tensor& x, int64_t N, const Tensor* bias, Tensor& out, bool accumulate, const char* what,
                       Fill&& fill);
  // Whether matmul_fp8 tries the W8A8 GEMM for x (Hopper, 16-bit x, 128 x 128 scale blocks; not
  // QWEN_RT_FP8_GEMM=dequant).
  bool fp8_w8a8(const Tensor& x, const Linear& w) const;
  // The most x rows the FP8 GEMV takes for w (fewer where the W8A8 GEMM takes the rest).
  int fp8_gemv_rows(const Tensor& x, const Linear& w) const;
  // A sampling in flight: its pinned parameters and results, where the results lie in them, and its
  // device results (one set per parity: sampling N + 1 runs while N's results are still being copied).
  struct SampleIo {
    void* host = nullptr;  // pinned
    size_t bytes = 0;
    Scratch dev_out;
    cudaEvent_t sampled = nullptr;  // compute stream: the results are on the device
    cudaEvent_t done = nullptr;     // copy stream: the results are on the host
    int64_t rows = 0;
    int max_n = 0;
    size_t out_off = 0, lp_off = 0, ids_off = 0, tlp_off = 0;
  };
  void* pinned_io(SampleIo& io, size_t bytes);
  void no_capture(const char* op) const;
  void cleanup() noexcept;

  int dev_;
  DType act_;
  int num_sms_ = 0;
  bool sm90_ = false;  // Hopper (sm_90): the block-scaled FP8 GEMM
  cudaStream_t stream_ = nullptr;
  cudaStream_t copy_stream_ = nullptr;
  LtGemm gemm_;
  static constexpr size_t kStage = size_t(8) << 20;  // bytes of each of the two pinned staging buffers
  void* stage_[2] = {nullptr, nullptr};
  cudaEvent_t stage_ev_[2] = {nullptr, nullptr};
  int next_stage_ = 0;
  SampleIo sample_io_[2];
  uint64_t samples_started_ = 0, samples_finished_ = 0;
  const int32_t* sampled_ = nullptr;  // device tokens of the last started sampling
  Scratch w_conv_, x_conv_, fp8_x_, attn_ws_, sample_in_, sample_stats_, sample_x_;
  Scratch delta_chunks_;  // the chunked delta rule's records (gdn.cu)
  std::vector<void*> retired_;
  std::vector<cudaGraphExec_t> graphs_;
  bool capturing_ = false;
};

}  // namespace qrt::cuda
