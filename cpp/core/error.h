// Error checks. Bad input from the user throws std::invalid_argument (ValueError in Python);
// everything else throws std::runtime_error (RuntimeError).
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace qrt {

template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

}  // namespace qrt

#define QRT_CHECK(cond, ...) \
  do { if (!(cond)) throw std::runtime_error(::qrt::str_cat(__VA_ARGS__)); } while (0)
#define QRT_CHECK_ARG(cond, ...) \
  do { if (!(cond)) throw std::invalid_argument(::qrt::str_cat(__VA_ARGS__)); } while (0)
