#pragma once
// Condition-variable waits bounded in seconds. std::chrono cannot hold every double: a bound converted to the
// clock's nanoseconds overflows past ~292 years (inf included), and the wait then returns at once. Here a bound
// of kNoLimitSeconds or more (inf included) waits without a limit; NaN or a negative bound does not wait.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <mutex>

namespace qrt {

constexpr double kNoLimitSeconds = 1e9;  // ~31 years

// Waits until pred() holds or timeout_s seconds pass; returns pred().
template <class Pred>
bool wait_seconds(std::condition_variable& cv, std::unique_lock<std::mutex>& lk, double timeout_s, Pred pred) {
  if (timeout_s >= kNoLimitSeconds) {
    cv.wait(lk, pred);
    return true;
  }
  const double s = std::isnan(timeout_s) ? 0.0 : std::max(0.0, timeout_s);
  return cv.wait_for(lk, std::chrono::duration<double>(s), pred);
}

}  // namespace qrt
