#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <vector>

#include "core/error.h"
#include "core/wait.h"
#include "dist/comm.h"

namespace qrt {
namespace {

class SingleComm final : public Comm {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_reduce_sum(Tensor&) override {}
  void all_gather_rows(const Tensor& send, Tensor& recv) override {
    if (recv.data != send.data) std::memcpy(recv.data, send.data, send.nbytes());
  }
};

}  // namespace

class ThreadGroup {
 public:
  ThreadGroup(int size, double timeout_s) : size_(size), timeout_(timeout_s), ptrs_(size) {}
  int size() const { return size_; }
  // Waits until every rank arrives; throws after the timeout (a rank died or hangs) or an abort.
  void barrier() {
    std::unique_lock<std::mutex> lock(m_);
    QRT_CHECK(!aborted_, "tensor-parallel group aborted after an earlier failure");
    const uint64_t gen = gen_;
    if (++count_ == size_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    const bool ok = wait_seconds(cv_, lock, timeout_, [&] { return gen_ != gen || aborted_; });
    QRT_CHECK(!aborted_, "tensor-parallel group aborted after an earlier failure");
    QRT_CHECK(ok, "tensor-parallel rank timed out after ", timeout_, " s waiting for the other ranks");
  }
  void abort() {
    std::lock_guard<std::mutex> lock(m_);
    aborted_ = true;
    cv_.notify_all();
  }
  std::vector<const void*>& ptrs() { return ptrs_; }

 private:
  int size_;
  double timeout_;
  std::mutex m_;
  std::condition_variable cv_;
  int count_ = 0;
  uint64_t gen_ = 0;
  bool aborted_ = false;
  std::vector<const void*> ptrs_;
};

namespace {

class ThreadComm final : public Comm {
 public:
  ThreadComm(std::shared_ptr<ThreadGroup> g, int rank) : g_(std::move(g)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_->size(); }

  void all_reduce_sum(Tensor& x) override {
    QRT_CHECK(x.dtype == DType::F32 && x.contiguous(), "thread all_reduce: contiguous float32 only");
    const size_t n = size_t(x.numel());
    g_->ptrs()[rank_] = x.data;
    g_->barrier();
    tmp_.assign(n, 0.f);
    for (int r = 0; r < g_->size(); ++r) {  // same order on every rank: identical results
      const float* p = static_cast<const float*>(g_->ptrs()[r]);
      for (size_t i = 0; i < n; ++i) tmp_[i] += p[i];
    }
    g_->barrier();
    std::memcpy(x.data, tmp_.data(), n * 4);
  }

  void all_gather_rows(const Tensor& send, Tensor& recv) override {
    QRT_CHECK(send.contiguous() && recv.contiguous(), "thread all_gather: contiguous tensors only");
    const size_t bytes = send.nbytes();
    g_->ptrs()[rank_] = send.data;
    g_->barrier();
    for (int r = 0; r < g_->size(); ++r) {  // send may already be this rank's block of recv (in place)
      char* dst = static_cast<char*>(recv.data) + r * bytes;
      if (dst != g_->ptrs()[r]) std::memcpy(dst, g_->ptrs()[r], bytes);
    }
    g_->barrier();
  }
  void abort() override { g_->abort(); }

 private:
  std::shared_ptr<ThreadGroup> g_;
  int rank_;
  std::vector<float> tmp_;
};

}  // namespace

std::unique_ptr<Comm> make_single_comm() { return std::make_unique<SingleComm>(); }
std::shared_ptr<ThreadGroup> make_thread_group(int size, double timeout_s) {
  return std::make_shared<ThreadGroup>(size, timeout_s);
}
std::unique_ptr<Comm> make_thread_comm(std::shared_ptr<ThreadGroup> g, int rank) {
  return std::make_unique<ThreadComm>(std::move(g), rank);
}

}  // namespace qrt
