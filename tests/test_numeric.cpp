#include <gtest/gtest.h>

#include <cmath>

#include "core/numeric.h"
#include "core/rng.h"

namespace k3 {
namespace {

TEST(Numeric, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
  Rng rng(1);
  for (int i = 0; i < 10000; ++i) {
    const float x = rng.normal() * 100.0f;
    const float r = round_bf16(x);
    EXPECT_LE(std::fabs(r - x), std::fabs(x) * std::ldexp(1.0f, -8));
  }
}

TEST(Numeric, F16RoundTripsEveryHalf) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t v = static_cast<uint16_t>(h);
    const float f = f16_to_float(v);
    if (std::isnan(f)) continue;
    EXPECT_EQ(float_to_f16(f), v) << "half bits " << h;
  }
}

TEST(Numeric, E4M3RoundTripsEveryCode) {
  for (int c = 0; c < 256; ++c) {
    const float f = e4m3_to_float(static_cast<uint8_t>(c));
    if (std::isnan(f)) continue;
    const uint8_t back = float_to_e4m3(f);
    // +0 and -0 both decode to zero; all other codes are unique.
    if (f == 0.0f) {
      EXPECT_EQ(e4m3_to_float(back), 0.0f);
    } else {
      EXPECT_EQ(back, c) << "code " << c << " value " << f;
    }
  }
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(float_to_e4m3(1e6f), 0x7e);  // saturates
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(0.3f)), 0.3125f);
}

TEST(Numeric, E4M3IsNearestOnRandomValues) {
  Rng rng(7);
  for (int i = 0; i < 20000; ++i) {
    const float x = rng.normal() * 50.0f;
    const float q = e4m3_to_float(float_to_e4m3(x));
    float best = INFINITY;
    for (int c = 0; c < 256; ++c) {
      const float f = e4m3_to_float(static_cast<uint8_t>(c));
      if (!std::isnan(f)) best = std::fmin(best, std::fabs(f - x));
    }
    EXPECT_EQ(std::fabs(q - x), best) << x;
  }
}

TEST(Numeric, E2M1AndE8M0) {
  const float mags[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (uint8_t n = 0; n < 16; ++n) {
    EXPECT_EQ(e2m1_to_float(n), (n & 8 ? -1.0f : 1.0f) * mags[n & 7]);
    if (n != 8) {
      EXPECT_EQ(float_to_e2m1(e2m1_to_float(n)), n);
    }
  }
  EXPECT_EQ(float_to_e2m1(100.0f), 7);
  EXPECT_EQ(float_to_e2m1(-5.0f), 8 | 6);  // tie between 4 and 6 goes to the even code (4)
  EXPECT_EQ(e8m0_to_float(127), 1.0f);
  EXPECT_EQ(e8m0_to_float(130), 8.0f);
  EXPECT_EQ(e8m0_to_float(120), std::ldexp(1.0f, -7));
  EXPECT_TRUE(std::isnan(e8m0_to_float(255)));
}

}  // namespace
}  // namespace k3
