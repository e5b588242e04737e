// Element types and host-side conversions.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace qrt {

enum class DType : uint8_t { F32, F16, BF16, F8E4M3, I32 };

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: return 2;
    case DType::F8E4M3: return 1;
  }
  return 0;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "float32";
    case DType::F16: return "float16";
    case DType::BF16: return "bfloat16";
    case DType::F8E4M3: return "float8_e4m3";
    case DType::I32: return "int32";
  }
  return "?";
}

// Parses safetensors dtype names ("F32", "BF16", ...) and our own names ("float32", ...).
DType parse_dtype(const std::string& name);

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);
float f8e4m3_to_f32(uint8_t v);
// To float8 e4m3fn (OCP FP8: max 448, no inf), rounded to nearest even; beyond +-448 saturates, NaN stays NaN.
uint8_t f32_to_f8e4m3(float f);

// Converts n elements between any two float types on the host.
void convert_host(const void* src, DType src_t, void* dst, DType dst_t, size_t n);

}  // namespace qrt
