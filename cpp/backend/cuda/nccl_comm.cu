// NcclComm: the Comm of one rank over NCCL, stream-ordered on its CudaBackend's compute stream.
#include <nccl.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>

#include "backend/cuda/cuda_backend.h"
#include "dist/comm.h"

namespace qrt::cuda {
namespace {

void nccl_check(ncclResult_t r, const char* op) {
  if (r != ncclSuccess) throw std::runtime_error(str_cat("nccl ", op, ": ", ncclGetErrorString(r)));
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::F32: return ncclFloat;
    case DType::F16: return ncclHalf;
    case DType::BF16: return ncclBfloat16;
    case DType::I32: return ncclInt32;
    default: throw std::runtime_error(str_cat("nccl: unsupported dtype ", dtype_name(t)));
  }
}

class NcclComm final : public Comm {
 public:
  NcclComm(CudaBackend& be, const ncclUniqueId& id, int rank, int size) : be_(be), rank_(rank), size_(size) {
    be_.set_device();
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    nccl_check(ncclCommInitRankConfig(&comm_, size, id, rank, &cfg), "ncclCommInitRankConfig");
  }
  ~NcclComm() override {
    if (comm_ && !aborted_) {
      cudaSetDevice(be_.device());
      cudaStreamSynchronize(be_.stream());
      ncclCommDestroy(comm_);
    }
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  // Called from the engine's thread while this rank's thread may be about to enqueue: the flag goes up before
  // the communicator goes, so a rank that resumes late mostly finds it down. (This narrows the window between
  // a collective's check and its enqueue; it does not close it.)
  void abort() override {
    std::lock_guard<std::mutex> lk(abort_mu_);
    if (aborted_.exchange(true)) return;
    ncclCommAbort(comm_);  // ends the collectives in flight; the stream's kernels return
  }

  void all_reduce_sum(Tensor& x) override {
    QRT_CHECK(x.contiguous() || x.rows <= 1, "nccl all_reduce_sum: tensor must be contiguous");
    QRT_CHECK(!aborted_, "nccl: the communicator was aborted after an earlier failure");
    be_.set_device();
    if (x.numel() == 0) return;
    nccl_check(ncclAllReduce(x.data, x.data, size_t(x.numel()), nccl_type(x.dtype), ncclSum, comm_, be_.stream()),
               "all_reduce");
  }

  void all_gather_rows(const Tensor& send, Tensor& recv) override {
    QRT_CHECK(send.contiguous() || send.rows <= 1, "nccl all_gather_rows: send must be contiguous");
    QRT_CHECK(recv.contiguous(), "nccl all_gather_rows: recv must be contiguous");
    QRT_CHECK(recv.rows == send.rows * size_ && recv.cols == send.cols && recv.dtype == send.dtype,
              "nccl all_gather_rows: recv is [", recv.rows, ",", recv.cols, "], want [", send.rows * size_, ",",
              send.cols, "]");
    QRT_CHECK(!aborted_, "nccl: the communicator was aborted after an earlier failure");
    be_.set_device();
    if (send.numel() == 0) return;
    nccl_check(ncclAllGather(send.data, recv.data, size_t(send.numel()), nccl_type(send.dtype), comm_, be_.stream()),
               "all_gather");
  }

 private:
  CudaBackend& be_;
  int rank_, size_;
  ncclComm_t comm_ = nullptr;  // freed by abort(), else by the destructor
  std::atomic<bool> aborted_{false};
  std::mutex abort_mu_;
};

void write_err(char* err, size_t len, const char* msg) {
  if (err && len) std::snprintf(err, len, "%s", msg);
}

}  // namespace
}  // namespace qrt::cuda

#pragma GCC visibility push(default)
#include "backend/cuda/plugin.h"

extern "C" int qrt_cuda_nccl_unique_id(void* out128, char* err, size_t err_len) {
  static_assert(sizeof(ncclUniqueId) == 128, "ncclUniqueId is 128 bytes");
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) {
    qrt::cuda::write_err(err, err_len, ncclGetErrorString(r));
    return -1;
  }
  std::memcpy(out128, &id, sizeof(id));
  return 0;
}

extern "C" qrt::Comm* qrt_cuda_make_nccl_comm(qrt::Backend* backend, const void* unique_id, int rank, int size,
                                              char* err, size_t err_len) {
  try {
    auto* be = dynamic_cast<qrt::cuda::CudaBackend*>(backend);
    if (!be) {
      qrt::cuda::write_err(err, err_len, "NCCL communicators need a CUDA backend");
      return nullptr;
    }
    if (size < 1 || rank < 0 || rank >= size) {
      qrt::cuda::write_err(err, err_len, qrt::str_cat("bad rank ", rank, " of ", size).c_str());
      return nullptr;
    }
    ncclUniqueId id;
    std::memcpy(&id, unique_id, sizeof(id));
    return new qrt::cuda::NcclComm(*be, id, rank, size);
  } catch (const std::exception& e) {
    qrt::cuda::write_err(err, err_len, e.what());
  } catch (...) {
    qrt::cuda::write_err(err, err_len, "nccl: unknown error");
  }
  return nullptr;
}
#pragma GCC visibility pop
