// The CPU backend's worker threads, in place of OpenMP. An OpenMP runtime is shared with the host process
// (torch loads libgomp), and libgomp sleeps its threads at every barrier once the process holds more OpenMP
// threads than cores: after one torch matmul in the same process, a batch-1 decode of the bench model ran
// 76-94 instead of 130 tok/s on 2 cores (threads idle half the time). These workers spin for a while after
// a loop (the next one comes microseconds later during a step), yielding now and then (more threads than
// free cores must not starve a worker), then sleep until the next.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace qrt::cpu {

// Cores this process may run on (its CPU affinity).
int available_cores();

class ThreadPool {
 public:
  explicit ThreadPool(int threads);  // the calling thread plus threads - 1 workers (threads >= 1)
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return int(workers_.size()) + 1; }

  // fn(t, T) for t = 0 .. T - 1 with T = size() when parallel (t = 0 on the calling thread), else fn(0, 1)
  // alone. Returns when every call has returned, then rethrows the first exception one threw (the calling
  // thread's first). One caller at a time. Workers run fn under the caller's floating-point control (csr_).
  void run(bool parallel, const std::function<void(int, int)>& fn);

  // body(i) for i in [0, n): thread t takes the t-th of size() contiguous ranges (OpenMP's static schedule).
  template <typename F>
  void for_static(int64_t n, bool parallel, F&& body) {
    run(parallel && n > 1, [&](int t, int T) {
      const auto [b, e] = static_range(n, t, T);
      for (int64_t i = b; i < e; ++i) body(i);
    });
  }

  // body(i, t) for i in [0, n), each i taken by the next free thread t (work of uneven size).
  template <typename F>
  void for_dynamic(int64_t n, bool parallel, F&& body) {
    std::atomic<int64_t> next{0};
    run(parallel && n > 1, [&](int t, int) {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) body(i, t);
    });
  }

  // [begin, end) of thread t of T over n items: contiguous, sizes differing by at most one.
  static std::pair<int64_t, int64_t> static_range(int64_t n, int t, int T) {
    const int64_t q = n / T, r = n % T;
    const int64_t b = t * q + std::min<int64_t>(t, r);
    return {b, b + q + (t < r ? 1 : 0)};
  }

 private:
  void work(int t);
  void shut_down();  // stops and joins the workers

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::atomic<uint64_t> epoch_{0};  // one more per job
  std::atomic<int> busy_{0};        // workers still in the current job
  std::atomic<bool> stop_{false};
  const std::function<void(int, int)>* job_ = nullptr;
  // The caller's floating-point control (x86 MXCSR: rounding, flush-to-zero, denormals-are-zero), which each worker
  // takes for the job: a host that flushes denormals (torch.set_flush_denormal) gets the same bits from every thread.
  uint32_t csr_ = 0;
  std::mutex err_mu_;
  std::exception_ptr worker_err_;  // the first exception a worker's call threw in the current job
};

}  // namespace qrt::cpu
