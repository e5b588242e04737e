// ThreadPool under exceptions (built and run by test_thread_pool.py): a call that throws on a worker or on the
// calling thread is rethrown by run() once every call has returned, and the pool keeps working after it.
#include <atomic>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "backend/cpu/thread_pool.h"

using qrt::cpu::ThreadPool;

static int fail(const char* what) {
  std::printf("FAIL: %s\n", what);
  return 1;
}

int main() {
  ThreadPool pool(4);
  for (int round = 0; round < 200; ++round) {
    const int thrower = round % 4;  // 0: the calling thread; 1-3: a worker
    std::atomic<int> ran{0};
    std::string caught;
    try {
      pool.run(true, [&](int t, int) {
        ran.fetch_add(1);
        if (t == thrower) throw std::runtime_error("thread " + std::to_string(t));
      });
    } catch (const std::runtime_error& e) {
      caught = e.what();
    }
    if (caught != "thread " + std::to_string(thrower)) return fail("the exception was not rethrown by run()");
    if (ran.load() != 4) return fail("run() returned before every call had returned");
    std::atomic<int> sum{0};  // the next job runs whole, with no exception left over
    pool.for_static(1000, true, [&](int64_t i) { sum.fetch_add(int(i)); });
    if (sum.load() != 999 * 1000 / 2) return fail("the pool did not work after an exception");
  }
  std::printf("ok\n");
  return 0;
}
