#include "core/numeric.h"

namespace k3 {

float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    const float mag = std::ldexp(static_cast<float>(man), -24);
    return sign ? -mag : mag;
  }
  if (exp == 31) return bits_to_float(sign | 0x7f800000u | (man << 13));
  return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}

uint16_t float_to_f16(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const float a = std::fabs(f);
  if (std::isnan(f)) return static_cast<uint16_t>(sign | 0x7e00u);
  if (a >= 65520.0f) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (a < 6.103515625e-05f) {                         // subnormal half: multiples of 2^-24
    const float q = std::nearbyint(a * 16777216.0f);  // ties-to-even in default rounding mode
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(q));
  }
  uint32_t b = float_to_bits(a);
  b += 0xfffu + ((b >> 13) & 1u);  // round mantissa to 10 bits, nearest even
  const uint32_t exp = (b >> 23) - 112u;
  return static_cast<uint16_t>(sign | (exp << 10) | ((b >> 13) & 0x3ffu));
}

float e4m3_to_float(uint8_t v) {
  const bool neg = v & 0x80;
  const int exp = (v >> 3) & 0xf;
  const int man = v & 7;
  float mag;
  if (exp == 15 && man == 7) return NAN;
  if (exp == 0)
    mag = std::ldexp(static_cast<float>(man), -9);  // subnormal: man/8 * 2^-6
  else
    mag = std::ldexp(1.0f + man / 8.0f, exp - 7);
  return neg ? -mag : mag;
}

uint8_t float_to_e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  float a = std::fabs(f);
  if (a >= kE4M3Max) return static_cast<uint8_t>(sign | 0x7e);  // saturate to 448
  if (a < std::ldexp(1.0f, -6)) {                               // subnormal: multiples of 2^-9
    const float q = std::nearbyint(a * 512.0f);
    return static_cast<uint8_t>(sign | static_cast<uint8_t>(q));  // q == 8 is the first normal
  }
  int e;
  const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  // mantissa with 3 fraction bits: a = (1 + k/8) * 2^(e-1)
  float scaled = std::nearbyint(m * 16.0f);  // in [8, 16]
  int exp = e - 1 + 7;
  if (scaled >= 16.0f) {
    scaled = 8.0f;
    exp += 1;
  }
  if (exp > 15 || (exp == 15 && scaled - 8.0f > 6.0f)) return static_cast<uint8_t>(sign | 0x7e);
  return static_cast<uint8_t>(sign | (exp << 3) | static_cast<int>(scaled - 8.0f));
}

uint8_t float_to_e2m1(float f) {
  static constexpr float kMag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const uint8_t sign = std::signbit(f) ? 8 : 0;
  const float a = std::fabs(f);
  if (!(a == a)) return 0;  // NaN quantizes to zero: checkpoints never carry NaN
  uint8_t best = 0;
  for (uint8_t i = 1; i < 8; ++i) {
    const float d_best = std::fabs(a - kMag[best]);
    const float d_i = std::fabs(a - kMag[i]);
    if (d_i < d_best || (d_i == d_best && (i % 2 == 0))) best = i;
  }
  return static_cast<uint8_t>(sign | best);
}

}  // namespace k3
