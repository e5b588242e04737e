#include "backend/cpu/thread_pool.h"

#include <sched.h>

#include <chrono>
#include <exception>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace qrt::cpu {
namespace {

// How long a worker spins for the next job before it sleeps.
constexpr auto kSpin = std::chrono::microseconds(300);

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#else
  std::this_thread::yield();
#endif
}

}  // namespace

int available_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

ThreadPool::ThreadPool(int threads) {
  try {
    for (int t = 1; t < std::max(1, threads); ++t) workers_.emplace_back([this, t] { work(t); });
  } catch (...) {
    shut_down();
    throw;
  }
}

ThreadPool::~ThreadPool() { shut_down(); }

void ThreadPool::shut_down() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_.store(true);
    epoch_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  for (auto& w : workers_) w.join();
  workers_.clear();
}

void ThreadPool::work(int t) {
  uint64_t seen = 0;
  for (;;) {
    uint64_t e = epoch_.load(std::memory_order_acquire);
    if (e == seen) {
      const auto until = std::chrono::steady_clock::now() + kSpin;
      for (int i = 1; (e = epoch_.load(std::memory_order_acquire)) == seen; ++i) {
        relax();
        if (i % 64 == 0) {
          if (std::chrono::steady_clock::now() > until) break;
          std::this_thread::yield();  // more threads than free cores: let the others run
        }
      }
      if (e == seen) {
        std::unique_lock<std::mutex> lk(mu_);
        wake_.wait(lk, [&] { return epoch_.load(std::memory_order_acquire) != seen; });
        e = epoch_.load(std::memory_order_acquire);
      }
    }
    seen = e;
    if (stop_.load()) return;
#if defined(__x86_64__) || defined(__i386__)
    if (_mm_getcsr() != csr_) _mm_setcsr(csr_);
#endif
    try {
      (*job_)(t, size());
    } catch (...) {  // (out of memory in a row's buffers) handed to the caller, not std::terminate
      std::lock_guard<std::mutex> lk(err_mu_);
      if (!worker_err_) worker_err_ = std::current_exception();
    }
    busy_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::run(bool parallel, const std::function<void(int, int)>& fn) {
  if (!parallel || workers_.empty()) {
    fn(0, 1);
    return;
  }
  job_ = &fn;
#if defined(__x86_64__) || defined(__i386__)
  csr_ = _mm_getcsr();
#endif
  busy_.store(int(workers_.size()), std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lk(mu_);  // a worker about to sleep either sees the new epoch or is woken
    epoch_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  std::exception_ptr err;
  try {
    fn(0, size());
  } catch (...) {
    err = std::current_exception();
  }
  for (int i = 1; busy_.load(std::memory_order_acquire) != 0; ++i) {
    relax();
    if (i % 1024 == 0) std::this_thread::yield();  // a worker may be waiting for a core
  }
  {
    std::lock_guard<std::mutex> lk(err_mu_);
    if (!err) err = worker_err_;
    worker_err_ = nullptr;
  }
  if (err) std::rethrow_exception(err);
}

}  // namespace qrt::cpu
