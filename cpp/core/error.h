// Error checks. Bad input from the user throws std::invalid_argument (ValueError in Python);
// everything else throws std::runtime_error (RuntimeError).
#pragma once
#include <cstdio>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace qrt {

// Message building without iostreams (their locale state is not safe to use from the dlopen'ed
// CUDA plugin, where formatting a number through an ostream crashed).
inline void str_append(std::string& s, const std::string& v) { s += v; }
inline void str_append(std::string& s, const char* v) { s += v ? v : "(null)"; }
inline void str_append(std::string& s, char v) { s += v; }
inline void str_append(std::string& s, bool v) { s += v ? "true" : "false"; }
template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
void str_append(std::string& s, T v) {
  if constexpr (std::is_floating_point_v<T>) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g", double(v));
    s += buf;
  } else {
    s += std::to_string(v);
  }
}

template <typename... Args>
std::string str_cat(const Args&... args) {
  std::string s;
  (str_append(s, args), ...);
  return s;
}

}  // namespace qrt

#define QRT_CHECK(cond, ...) \
  do { if (!(cond)) throw std::runtime_error(::qrt::str_cat(__VA_ARGS__)); } while (0)
#define QRT_CHECK_ARG(cond, ...) \
  do { if (!(cond)) throw std::invalid_argument(::qrt::str_cat(__VA_ARGS__)); } while (0)
