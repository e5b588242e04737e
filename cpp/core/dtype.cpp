#include "core/dtype.h"

#include <cmath>

#include "core/error.h"

namespace qrt {

DType parse_dtype(const std::string& n) {
  if (n == "F32" || n == "float32") return DType::F32;
  if (n == "F16" || n == "float16") return DType::F16;
  if (n == "BF16" || n == "bfloat16") return DType::BF16;
  if (n == "F8_E4M3" || n == "float8_e4m3") return DType::F8E4M3;
  if (n == "I32" || n == "int32") return DType::I32;
  throw std::invalid_argument("unsupported dtype '" + n + "'");
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal
      int e = -1;
      do { man <<= 1; ++e; } while (!(man & 0x400));
      u = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | man << 13;
  } else {
    u = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_f16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000;
  uint32_t a = u & 0x7fffffff;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00);
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00);  // overflow to inf
  if (a < 0x38800000u) {  // subnormal or zero in f16
    float af;
    std::memcpy(&af, &a, 4);
    return uint16_t(sign | uint32_t(std::nearbyint(af * 16777216.0f)));
  }
  uint32_t r = a + 0xfff + ((a >> 13) & 1) - 0x38000000u;
  return uint16_t(sign | (r >> 13));
}

float f8e4m3_to_f32(uint8_t v) {
  uint32_t sign = v >> 7, exp = (v >> 3) & 0xf, man = v & 7;
  float r;
  if (exp == 15 && man == 7) return NAN;
  if (exp == 0) r = std::ldexp(float(man), -9);
  else r = std::ldexp(float(8 + man), int(exp) - 10);
  return sign ? -r : r;
}

uint8_t f32_to_f8e4m3(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint8_t sign = uint8_t((u >> 24) & 0x80);
  float a = std::fabs(f);
  if (std::isnan(f)) return uint8_t(sign | 0x7f);
  if (a > 448.0f) a = 448.0f;
  if (a < 0.015625f)  // below 2^-6: subnormal steps of 2^-9 (a count of 8 is the smallest normal's code)
    return uint8_t(sign | uint8_t(std::nearbyint(a * 512.0f)));
  std::memcpy(&u, &a, 4);
  u += 0x7ffffu + ((u >> 20) & 1u);  // round the mantissa to 3 bits, to nearest even
  const int e = int(u >> 23) - 127;
  return uint8_t(sign | uint8_t((e + 7) << 3) | uint8_t((u >> 20) & 7u));
}

static inline float load_f32(const void* p, DType t, size_t i) {
  switch (t) {
    case DType::F32: return static_cast<const float*>(p)[i];
    case DType::F16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::F8E4M3: return f8e4m3_to_f32(static_cast<const uint8_t*>(p)[i]);
    default: throw std::runtime_error("convert_host: not a float dtype");
  }
}

void convert_host(const void* src, DType st, void* dst, DType dt, size_t n) {
  if (st == dt) {
    std::memcpy(dst, src, n * dtype_size(st));
    return;
  }
  switch (dt) {
    case DType::F32:
      for (size_t i = 0; i < n; ++i) static_cast<float*>(dst)[i] = load_f32(src, st, i);
      return;
    case DType::BF16:
      for (size_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = f32_to_bf16(load_f32(src, st, i));
      return;
    case DType::F16:
      for (size_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = f32_to_f16(load_f32(src, st, i));
      return;
    case DType::F8E4M3:
      for (size_t i = 0; i < n; ++i) static_cast<uint8_t*>(dst)[i] = f32_to_f8e4m3(load_f32(src, st, i));
      return;
    default:
      throw std::runtime_error(str_cat("convert_host: cannot convert to ", dtype_name(dt)));
  }
}

}  // namespace qrt
