// Scalar number formats used by checkpoints and caches, as plain host functions.
// The CUDA kernels must reproduce these bit for bit; tests/test_numeric.cpp pins them.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>

namespace k3 {

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// ---- bfloat16: the top 16 bits of an IEEE float, rounded to nearest even. ----
inline float bf16_to_float(uint16_t h) {
  return bits_to_float(static_cast<uint32_t>(h) << 16);
}
inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float round_bf16(float f) {
  return bf16_to_float(float_to_bf16(f));
}
inline void round_bf16(std::span<float> v) {
  for (float& x : v) x = round_bf16(x);
}

// ---- IEEE half. ----
float f16_to_float(uint16_t h);
uint16_t float_to_f16(float f);  // round to nearest even, saturates to inf

// ---- FP8 E4M3 (OCP "fn": no inf, max 448, NaN = 0x7f/0xff). ----
float e4m3_to_float(uint8_t v);
uint8_t float_to_e4m3(float f);  // round to nearest even, saturating to +-448
constexpr float kE4M3Max = 448.0f;

// ---- E8M0 scale: value 2^(s-127); s = 255 is NaN. ----
inline float e8m0_to_float(uint8_t s) {
  if (s == 255) return NAN;
  if (s == 0) return bits_to_float(0x00400000u);  // 2^-127 is subnormal in fp32
  return bits_to_float(static_cast<uint32_t>(s) << 23);
}

// ---- FP4 E2M1: nibble = sign<<3 | magnitude index into {0,.5,1,1.5,2,3,4,6}. ----
inline float e2m1_to_float(uint8_t nibble) {
  static constexpr float kMag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float m = kMag[nibble & 7];
  return (nibble & 8) ? -m : m;
}
// Nearest E2M1 value (ties to the even code), saturating at +-6.
uint8_t float_to_e2m1(float f);

}  // namespace k3
